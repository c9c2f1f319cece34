"""Per-rank entry points for the LoRA tests (launched with ``run_ranks``)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist

from megatron_muon.testing.gpt import TinyGPTConfig, build_gpt, full_named_params, global_batch, init_parallel, \
    layout_ranks, train_step, wire_ddp_hooks

__all__ = ["lora_train", "lora_tp1_checks", "lora_resume_chain"]

LORA = dict(rank=4, alpha=8.0, targets=["qkv", "proj", "fc1", "fc2"], seed=3)
OPT = dict(lr=0.01, momentum=0.9, extra_scale_factor=0.2, weight_decay=0.01)


def _wrap_ddp(chunks: list, cfg) -> list:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False,
                                               overlap_grad_reduce=False, bucket_size=None,
                                               grad_reduce_in_fp32=True)
    tcfg = chunks[0].config
    model = [DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=m)
             for m in chunks]
    wire_ddp_hooks(tcfg, model, ddp_config)
    return model


@torch.no_grad()
def token_losses(model: list, cfg: TinyGPTConfig, index: int = 999) -> torch.Tensor:
    """Per-token losses of a fixed batch (full over TP): the model's outputs, compared."""
    batch = global_batch(cfg, 10_000, index)
    for m in model:
        m.eval()
    out = model[0](batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    for m in model:
        m.train()
    return out.detach().float().cpu().clone()


def _base_params(model: list) -> dict:
    return {k: v for k, v in full_named_params(model).items() if ".lora." not in k}


@contextmanager
def _sp_torch_norm():
    """Let Megatron's torch LayerNorm wrapper take sequence_parallel=True (test only).

    Megatron asserts that sequence parallelism needs apex/TE norms, because a torch norm's
    weight gradient is then a partial sum that nothing marks for the TP all-reduce.  The
    norm itself is exact on a sequence shard; we mark its parameters ``sequence_parallel``
    (so ``finalize_model_grads`` would all-reduce them) -- and LoRA freezes them anyway.
    """
    import copy

    from megatron.core.transformer import torch_norm

    from megatron_muon.megatron.compat import megatron_attr

    original = torch_norm.WrappedTorchNorm.__new__

    def patched(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        cfg = copy.copy(config)
        cfg.sequence_parallel = False
        norm = original(cls, cfg, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    with megatron_attr(torch_norm.WrappedTorchNorm, "__new__", patched):
        yield


def _build(cfg: TinyGPTConfig, lora: dict):
    from megatron_muon.peft.lora import LoRAConfig, apply_lora

    with _sp_torch_norm():
        chunks = build_gpt(cfg, wrap_ddp=False)
    apply_lora(chunks, LoRAConfig(**lora))
    return _wrap_ddp(chunks, cfg)


def _train(model, cfg, optimizer: str, steps: int, opt: dict, **okw):
    from megatron_muon.peft.lora_optimizer import LoRAOptimizer

    optim = LoRAOptimizer(model, optimizer, **{**OPT, **opt}, **okw)
    lay = layout_ranks()
    losses = []
    grads, pre_factors = {}, {}
    for step in range(steps):
        if step == steps - 1:  # the factors the last step's gradients are taken at
            pre = [(A.cpu().clone(), B.cpu().clone()) for A, B in optim.masters]
        out = train_step(model, optim, cfg, step, lay["dp"], lay["dp_size"])
        losses.append(out.get("loss"))
        if step == steps - 1:  # full, canonical gradients of the last step (A and B nonzero)
            grads = {ad.global_name: (A.grad.cpu().clone(), B.grad.cpu().clone())
                     for ad, (A, B) in zip(optim.adapters, optim.masters)}
            pre_factors = {ad.global_name: p for ad, p in zip(optim.adapters, pre)}
    return optim, losses, grads, pre_factors


def lora_train(cfg: dict, tp: int = 1, pp: int = 1, steps: int = 4, runs: Optional[dict] = None,
               save: Optional[str] = None, lora: Optional[dict] = None) -> dict:
    """Train LoRA adapters on the tiny GPT for each entry of ``runs`` (name: dict(optimizer,
    opt, okw, cfg_extra)); return losses, full adapters, outputs and base-weight checks.
    ``grads``: per adapter ``(G_A, G_B)`` of the last step, ``pre_factors`` the full ``(A, B)``
    they were taken at.

    ``save``: after the first run, write ``save/adapter.pt`` (save_lora) and, with PP 1, a
    full-model dist_checkpointing checkpoint ``save/full`` (base + adapters).
    """
    from megatron_muon.peft.lora import full_lora_factors, save_lora

    lora = {**LORA, **(lora or {})}
    init_parallel(tp=tp, pp=pp, seed=TinyGPTConfig().seed)
    runs = runs or {"smuon": {}}
    result = {"layout": layout_ranks(), "runs": {}}
    for name, spec in runs.items():
        gcfg = TinyGPTConfig(**{**cfg, "extra": {**cfg.get("extra", {}),
                                                   **spec.get("cfg_extra", {})}})
        model = _build(gcfg, lora)
        before = _base_params(model)
        optim, losses, grads, pre_factors = _train(
            model, gcfg, spec.get("optimizer", "smuon"), steps, spec.get("opt", {}),
            **spec.get("okw", {}))
        after = _base_params(model)
        result["runs"][name] = dict(
            losses=losses, grads=grads, pre_factors=pre_factors,
            factors=full_lora_factors(model),
            outputs=token_losses(model, gcfg) if pp == 1 else None,
            base_unchanged=all(torch.equal(before[k], after[k]) for k in before),
            n_base=len(before), timing=optim.last_timing,
            inner_state={k: {n: t.cpu().clone() for n, t in v.items()}
                         for k, v in optim.inner.state_dict()["state"].items()},
            attrs=_attributes(model))
        if save and name == next(iter(runs)):
            save_lora(os.path.join(save, "adapter.pt"), model, metadata={"tp": tp})
            result["saved_outputs"] = result["runs"][name]["outputs"]
            if pp == 1:
                from megatron.core import dist_checkpointing

                full = os.path.join(save, "full")
                if dist.get_rank() == 0:
                    os.makedirs(full, exist_ok=True)
                dist.barrier()
                dist_checkpointing.save({"model": model[0].module.sharded_state_dict()}, full)
    return result


def _attributes(model) -> dict:
    from megatron_muon.peft.lora import lora_adapters

    out = {}
    for ad in lora_adapters(model):
        out[ad.global_name] = {
            f: dict(tp=bool(getattr(p, "tensor_model_parallel", False)),
                    dim=int(getattr(p, "partition_dim", -1)),
                    sp=bool(getattr(p, "sequence_parallel", False)),
                    allreduce=bool(getattr(p, "allreduce", True)), shape=tuple(p.shape),
                    requires_grad=p.requires_grad)
            for f, p in (("A", ad.A), ("B", ad.B))}
    return out


def _error(fn) -> Optional[str]:
    try:
        fn()
    except (ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def lora_tp1_checks(cfg: dict, tp2_checkpoint: str, steps: int = 4,
                    runs: Optional[dict] = None, pp2_checkpoint: Optional[str] = None) -> dict:
    """TP1: B = 0 equals base, merge/unmerge, reference training, TP2 checkpoint -> TP1, errors,
    MoE experts."""
    from megatron_muon.peft.lora import (LoRAConfig, apply_lora,
                                             lora_disabled, load_lora, merge_lora,
                                             read_lora_config, unmerge_lora)

    out = lora_train(cfg, tp=1, steps=steps, runs=runs)
    gcfg = TinyGPTConfig(**cfg)

    # --- B = 0: the adapted model is the base model; merge/unmerge round trip
    chunks = build_gpt(gcfg, wrap_ddp=False)
    base_out = token_losses(chunks, gcfg)
    base_w = _base_params(chunks)
    adapters = apply_lora(chunks, LoRAConfig(**LORA))
    out["b0_max_diff"] = float((token_losses(chunks, gcfg) - base_out).abs().max())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for ad in adapters:
            ad.B.copy_(torch.randn(ad.B.shape, generator=g) * 0.05)
    lora_out = token_losses(chunks, gcfg)
    with lora_disabled(chunks):
        out["disabled_max_diff"] = float((token_losses(chunks, gcfg) - base_out).abs().max())
    out["lora_vs_base_diff"] = float((lora_out - base_out).abs().max())
    out["merged_count"] = merge_lora(chunks)
    out["merge_again"] = merge_lora(chunks)
    merged_w = _base_params(chunks)
    out["merged_weight_change"] = max(float((merged_w[k] - base_w[k]).abs().max())
                                      for k in base_w)
    out["merged_max_diff"] = float((token_losses(chunks, gcfg) - lora_out).abs().max())
    out["load_while_merged"] = _error(lambda: adapters[0].load_full(
        *adapters[0].gather_full()))
    out["unmerged_count"] = unmerge_lora(chunks)
    w = _base_params(chunks)
    out["unmerge_weight_diff"] = max(float((w[k] - base_w[k]).abs().max()) for k in base_w)
    out["unmerged_max_diff"] = float((token_losses(chunks, gcfg) - lora_out).abs().max())

    # --- the TP2 adapter checkpoint on a TP1 model
    chunks = build_gpt(gcfg, wrap_ddp=False)
    apply_lora(chunks, read_lora_config(os.path.join(tp2_checkpoint, "adapter.pt")))
    out["ckpt_loaded"] = load_lora(os.path.join(tp2_checkpoint, "adapter.pt"), chunks)
    out["ckpt_outputs"] = token_losses(chunks, gcfg)

    # --- the TP2 full-model dist_checkpointing checkpoint (base + sharded adapters) at TP1
    from megatron.core import dist_checkpointing

    from megatron_muon.peft.lora import full_lora_factors

    chunks = build_gpt(gcfg, wrap_ddp=False)
    apply_lora(chunks, LoRAConfig(**LORA))
    state = dist_checkpointing.load({"model": chunks[0].sharded_state_dict()},
                                    os.path.join(tp2_checkpoint, "full"))
    chunks[0].load_state_dict(state["model"])
    out["full_ckpt_factors"] = full_lora_factors(chunks)
    out["full_ckpt_outputs"] = token_losses(chunks, gcfg)

    # --- an adapter checkpoint written by a PP2 run
    if pp2_checkpoint:
        chunks = build_gpt(gcfg, wrap_ddp=False)
        apply_lora(chunks, LoRAConfig(**LORA))
        out["pp2_ckpt_loaded"] = load_lora(os.path.join(pp2_checkpoint, "adapter.pt"), chunks)
        out["pp2_ckpt_outputs"] = token_losses(chunks, gcfg)

    # --- bad input
    def fresh():
        return build_gpt(gcfg, wrap_ddp=False)

    errors = {
        "unknown_target": lambda: apply_lora(fresh(), targets=["qkv", "attention_out"]),
        "not_linear": lambda: apply_lora(fresh(), targets=["input_layernorm"]),
        "not_linear_core": lambda: apply_lora(fresh(), targets=["core_attention"]),
        "rank0": lambda: apply_lora(fresh(), rank=0),
        "rank_too_big": lambda: apply_lora(fresh(), rank=gcfg.hidden_size + 1),
        "alpha": lambda: apply_lora(fresh(), alpha=float("nan")),
        "experts_dense": lambda: apply_lora(fresh(), targets=["experts"]),
        "twice": lambda: apply_lora(chunks, targets=["qkv"]),
        "after_ddp": lambda: apply_lora(_wrap_ddp(fresh(), gcfg)),
        "bad_optimizer": lambda: __import__(
            "megatron_muon.peft.lora_optimizer", fromlist=["x"]).LoRAOptimizer(
                chunks, "sgd", lr=0.1),
        "load_missing": lambda: load_lora(os.path.join(tp2_checkpoint, "nope.pt"), chunks),
    }
    out["qkv_plus_experts_dense"] = len(apply_lora(fresh(), targets=["qkv", "experts"]))
    out["errors"] = {}
    for k, fn in errors.items():
        try:
            msg = _error(fn)
        except FileNotFoundError as err:
            msg = f"FileNotFoundError: {err}"
        out["errors"][k] = msg

    # --- MoE: LoRA on every local expert's fc1 / fc2 (SequentialMLP)
    mcfg = TinyGPTConfig(**{**cfg, "num_layers": 2, "num_moe_experts": 2})
    chunks = build_gpt(mcfg, wrap_ddp=False)
    base_moe = token_losses(chunks, mcfg)
    ads = apply_lora(chunks, targets=["experts"], rank=2, alpha=2.0)
    out["moe_names"] = [a.global_name for a in ads]
    out["moe_b0_diff"] = float((token_losses(chunks, mcfg) - base_moe).abs().max())
    return out


def lora_resume_chain(cfg: dict, directory: str, tp: int = 1, optimizers=("smuon", "adam"),
                      steps: int = 6, saves=(2, 4)) -> dict:
    """Per LoRA optimizer: ``steps`` uninterrupted steps, and the same steps in segments that
    each start from a fresh model and optimizer, load the adapters (``load_lora``) and the
    optimizer state file written by the previous segment, and write their own.  Returns both
    runs' losses and final adapters, and per resume whether ``state_dict()`` right after
    ``load_state_dict`` equals the loaded state exactly (``reloaded_equal``).  (The frozen
    base is re-created identically: its weights are seeded by their global names.)"""
    from megatron_muon.peft.lora import full_lora_factors, load_lora, save_lora
    from megatron_muon.peft.lora_optimizer import LoRAOptimizer

    init_parallel(tp=tp, seed=TinyGPTConfig().seed)
    gcfg = TinyGPTConfig(**cfg)
    lay = layout_ranks()
    rank = dist.get_rank()

    def fresh(name):
        model = _build(gcfg, LORA)
        return model, LoRAOptimizer(model, name, **OPT)

    def run(model, optim, first, last):
        return [train_step(model, optim, gcfg, s, lay["dp"], lay["dp_size"]).get("loss")
                for s in range(first, last)]

    out = {}
    for name in optimizers:
        model, optim = fresh(name)
        whole = run(model, optim, 0, steps)
        whole_factors = full_lora_factors(model)
        bounds = [0, *saves, steps]
        adapters = os.path.join(directory, f"{name}_adapters.pt")
        state = os.path.join(directory, f"{name}_optimizer_rank{rank}.pt")
        segs, reloaded = [], []
        for first, last in zip(bounds[:-1], bounds[1:]):
            model, optim = fresh(name)
            if first:
                load_lora(adapters, model)
                loaded = torch.load(state, weights_only=False)
                optim.load_state_dict(loaded)
                reloaded.append(_same_state(optim.state_dict(), loaded))
            segs += run(model, optim, first, last)
            if last < steps:
                dist.barrier()  # everyone has read the previous files
                save_lora(adapters, model)
                torch.save(optim.state_dict(), state)
                dist.barrier()
        out[name] = dict(whole=whole, chain=segs, whole_factors=whole_factors,
                         chain_factors=full_lora_factors(model), reloaded_equal=reloaded)
    return out


def _same_state(a, b) -> bool:
    """Exact equality of two (nested) state dicts: same keys, types, values, tensors bit for
    bit (same dtype and shape)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _same_state(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.cpu(), b.cpu())
    return type(a) is type(b) and a == b
