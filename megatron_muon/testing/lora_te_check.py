"""GPU check: LoRA on Megatron-Core's real Transformer Engine layers (run by tools/gpu_check.sh).

    python -m megatron_muon.testing.lora_te_check

Without CUDA or without Transformer Engine it prints one line saying what it skipped and
exits 0.  Otherwise, in one process on one GPU (TP1, fp32), for two tiny GPTs built with
Megatron-Core's TE layer spec (``get_gpt_layer_with_transformer_engine_spec``):

* dense, 2 layers, SwiGLU: ``TELayerNormColumnParallelLinear`` (qkv, fc1) and
  ``TERowParallelLinear`` (proj, fc2), targets qkv, proj, fc1, fc2;
* MoE, 1 layer, 4 experts with ``TEGroupedMLP`` (``TEColumnParallelGroupedLinear`` /
  ``TERowParallelGroupedLinear``) and a shared expert (``TEColumnParallelLinear`` /
  ``TERowParallelLinear``), targets experts, fc1, fc2 (attention is left alone, so the
  router sees bitwise the same input in every run below and routes identically);

it checks that

1. the adapter kinds are the TE ones listed above (so the TE paths of
   ``megatron_muon/peft/lora.py`` ran, not the local ones);
2. with random ``B`` the adapted model's logits equal those of the merged model
   (``W0 + gamma B A`` inside TE's own GEMMs, the branch skipped): max |adapted - merged| is
   at most 1% of max |adapted - base|, the change LoRA makes.  A branch that multiplied the
   pre-layernorm input (the embeddings, ~0.02 in size, against a layernorm output ~1) would be
   off by about the whole change;
3. one backward and one AdamW step move only the adapters: every parameter that requires a
   gradient is an adapter factor, every kind got a nonzero finite gradient, the base
   weights are bitwise unchanged and the adapters changed.

It prints one line per check and exits 1 if any failed.  The TP2 and sequence-parallel paths
of the same code are tested on CPU with stand-ins of these classes (tests/test_lora_te.py).
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import sys

import torch

TE_KINDS = {
    "dense": {"TELayerNormColumnParallelLinear", "TERowParallelLinear"},
    "moe": {"TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear",
            "TEColumnParallelLinear", "TERowParallelLinear"},
}


def skip_reason() -> str | None:
    """Why the check cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed"
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception as err:  # a broken TE install: report it, do not fail the GPU run
        return f"megatron.core.extensions.transformer_engine does not import ({err})"
    if not HAVE_TE:
        return "transformer_engine does not import"
    return None


def _init_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(0)
    dist.init_process_group(backend="nccl", rank=0, world_size=1)


def _build(kind: str):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec)

    from megatron_muon.megatron.models import TinyGPTConfig, build_gpt, init_parallel

    init_parallel(tp=1)
    common = dict(hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                  num_query_groups=2, vocab_size=256, seq_length=64, micro_batch_size=2,
                  swiglu=True)
    if kind == "dense":
        cfg = TinyGPTConfig(num_layers=2, **common)
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        cfg = TinyGPTConfig(num_layers=1, num_moe_experts=4, **common,
                            extra=dict(moe_grouped_gemm=True,
                                       moe_shared_expert_intermediate_size=128))
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=4,
                                                          moe_grouped_gemm=True)
    model = build_gpt(cfg, wrap_ddp=False, layer_spec=spec)[0]
    model.cuda(torch.cuda.current_device())
    return model, cfg


def _logits(model, tokens, positions) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, positions, None).float().clone()


def check(kind: str, log=print) -> bool:
    """The three checks on one model; True when all pass."""
    from megatron_muon.peft.lora import (LoRAConfig, apply_lora, lora_adapters, merge_lora,
                                         unmerge_lora)

    model, cfg = _build(kind)
    g = torch.Generator(device="cuda").manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_length),
                           device="cuda", generator=g)
    positions = torch.arange(cfg.seq_length, device="cuda")[None].expand_as(tokens)
    labels = torch.randint(0, cfg.vocab_size, tokens.shape, device="cuda", generator=g)
    base = _logits(model, tokens, positions)
    targets = ["qkv", "proj", "fc1", "fc2"] if kind == "dense" else ["experts", "fc1", "fc2"]
    adapters = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=targets))
    kinds = {type(m).__name__ for m in model.modules() if hasattr(m, "lora")}
    ok_kinds = kinds == TE_KINDS[kind]
    log(f"{'ok  ' if ok_kinds else 'FAIL'} {kind}: {len(adapters)} adapters on {sorted(kinds)}"
        f" (want {sorted(TE_KINDS[kind])})")
    with torch.no_grad():
        for ad in adapters:
            ad.B.copy_(torch.randn(ad.B.shape, device=ad.B.device, generator=g) * 0.05)
    adapted = _logits(model, tokens, positions)
    merge_lora(model)
    merged = _logits(model, tokens, positions)
    unmerge_lora(model)
    change = float((adapted - base).abs().max())
    err = float((adapted - merged).abs().max())
    ok_fwd = change > 0 and err <= 1e-2 * change
    log(f"{'ok  ' if ok_fwd else 'FAIL'} {kind}: adapted vs merged logits max |diff| {err:.3e},"
        f" LoRA change {change:.3e} (need diff <= 1% of the change)")

    base_params = {n: p.detach().clone() for n, p in model.named_parameters()
                   if ".lora." not in n}
    lora_params = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora." in n}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    model.train()
    loss = model(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    grads = {}
    for ad in lora_adapters(model):
        for p in (ad.A, ad.B):
            grads.setdefault(ad.kind + (" expert" if ad.is_expert else ""), []).append(
                None if p.grad is None else float(p.grad.abs().max()))
    base_grads = [n for n, p in model.named_parameters()
                  if ".lora." not in n and p.grad is not None]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt.step()
    moved = sum(not torch.equal(p, lora_params[n]) for n, p in model.named_parameters()
                if n in lora_params)
    unchanged = all(torch.equal(p, base_params[n]) for n, p in model.named_parameters()
                    if n in base_params)
    peak = {k: max((v for v in vs if v is not None), default=0.0) for k, vs in grads.items()}
    every_kind = all(math.isfinite(v) and v > 0 for v in peak.values())
    none_missing = all(v is not None for vals in grads.values() for v in vals)
    all_lora = bool(trainable) and all(".lora." in n for n in trainable)
    ok_bwd = (all_lora and not base_grads and every_kind and none_missing and unchanged
              and moved == len(lora_params))
    per_kind = ", ".join(f"{k} {v:.2e}" for k, v in peak.items())
    log(f"{'ok  ' if ok_bwd else 'FAIL'} {kind}: backward + AdamW step: {len(trainable)} "
        f"trainable (all adapters {all_lora}), base weights with a gradient {len(base_grads)}, "
        f"max |grad| per adapter kind ({per_kind}), every factor has a gradient "
        f"{none_missing}, base unchanged {unchanged}, adapters moved "
        f"{moved}/{len(lora_params)}")
    return ok_kinds and ok_fwd and ok_bwd


def main() -> int:
    reason = skip_reason()
    if reason is not None:
        print(f"LoRA on Transformer Engine layers: skipped ({reason})")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _init_distributed()
    ok = True
    for kind in ("dense", "moe"):
        try:
            ok &= check(kind)
        except Exception as err:  # one line, then the other model
            first = str(err).splitlines()[0] if str(err) else ""
            print(f"FAIL {kind}: {type(err).__name__}: {first}")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
