"""Replay a Megatron-LM LoRA fine-tuning in one process, with this package's own pieces.

    python -m megatron_muon.testing.lora_replay --adapters CK_FT --batches PREFIX --out OUT.json

``CK_FT`` is a checkpoint that Megatron-LM's loop wrote with ``--lora-rank`` (its saved args
give the model, the LoRA and optimizer settings, and the base checkpoint it started from);
``PREFIX`` names the per-rank microbatches that ``mlm_gpt.py`` recorded during that run
(``PREFIX.rank<R>.pt``, ``spec["record_batches"]``).  The replay

* builds the GPT with Megatron-Core's ``GPTModel`` (local spec) from the saved args at TP1 /
  PP1 / DP1, loads the base weights (dist-checkpointing), adds the adapters
  (``peft.lora.apply_lora``, seeded as the run was: the initialisation does not depend on
  the layout),
* and trains them with ``LoRAOptimizer`` directly: no Megatron-LM loop, no DDP, no
  distributed gradient reduction, no scheduler.  Each iteration's global batch is every
  data-parallel rank's microbatches concatenated, the loss is the token mean over it, and
  the settings are mapped from the saved args here, written out independently of
  ``megatron.peft_adapter.get_lora_optimizer`` (the code it checks): a wrong mapping,
  gradient scaling, scheduler or frozen-weight leak in the Megatron-LM path shows as a
  different trajectory.

It writes ``{"losses": [...], "adapters": {global name: [A, B] max-abs}}`` and the final
full factors next to it (``OUT.pt``).  Supported: ``--lr-decay-style constant`` without
warmup (the lr the replay uses is ``args.lr`` throughout) and fp32.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch


def _settings(args) -> dict:
    if getattr(args, "lr_decay_style", "constant") != "constant" or \
            (getattr(args, "lr_warmup_iters", 0) or 0) or (getattr(args, "lr_warmup_fraction", 0) or 0):
        raise SystemExit("lora_replay: needs --lr-decay-style constant without warmup")
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        raise SystemExit("lora_replay: fp32 runs only")
    return dict(lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad or 0.0,
                momentum=args.muon_momentum, nesterov=args.muon_nesterov,
                ns_steps=args.muon_num_ns_steps, coefficient_type=args.muon_coefficient_type,
                scale_mode=args.muon_scale_mode, extra_scale_factor=args.muon_extra_scale_factor,
                damping=args.smuon_damping, adam_betas=(args.adam_beta1, args.adam_beta2),
                adam_eps=args.adam_eps)


def _model(args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args

    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.data_parallel_size, args.world_size = 1, 1
    config = core_transformer_config_from_args(args)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type)


def replay(adapters: str, batches: str, out: str) -> dict:
    from megatron.core import dist_checkpointing

    from megatron_muon.megatron.models import init_parallel
    from megatron_muon.megatron.peft_adapter import load_base_weights
    from megatron_muon.peft.lora import LoRAConfig, apply_lora, full_lora_factors
    from megatron_muon.peft.lora_optimizer import LoRAOptimizer
    from megatron_muon.peft.merge import iteration_dir

    args = dist_checkpointing.load_common_state_dict(iteration_dir(adapters)).get("args")
    if args is None or not getattr(args, "lora_rank", None) or args.optimizer != "smuon":
        raise SystemExit(f"lora_replay: {adapters} is not a --lora-rank --optimizer smuon run")
    settings = _settings(args)
    files = sorted(glob.glob(f"{batches}.rank*.pt"), key=lambda f: int(f.rsplit("rank", 1)[1][:-3]))
    per_rank = [torch.load(f) for f in files]
    if not per_rank or len({len(b) for b in per_rank}) != 1:
        raise SystemExit(f"lora_replay: no or uneven batch files {batches}.rank*.pt")
    init_parallel(seed=args.seed)
    model = _model(args)
    apply_lora(model, LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha,
                                 targets=list(args.lora_target_modules), seed=args.seed))
    load_base_weights([model], args.lora_base_checkpoint)
    optim = LoRAOptimizer(model, "smuon", **settings)
    micro = len(per_rank[0]) // args.train_iters  # microbatches per rank and iteration
    losses = []
    for it in range(args.train_iters):
        mbs = [b for r in per_rank for b in r[it * micro:(it + 1) * micro]]
        batch = {k: torch.cat([b[k] for b in mbs]) for k in ("tokens", "labels", "loss_mask",
                                                            "position_ids")}
        optim.zero_grad()
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"].float()
        loss = (per_token.float() * mask).sum() / mask.sum()
        loss.backward()
        losses.append(((per_token.detach().double() * mask).sum() / mask.sum()).item())
        optim.step()
    factors = full_lora_factors([model])
    torch.save(factors, os.path.splitext(out)[0] + ".pt")
    result = {"losses": losses, "micro_per_rank": micro, "ranks": len(per_rank)}
    with open(out, "w") as fh:
        json.dump(result, fh)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_muon.testing.lora_replay")
    p.add_argument("--adapters", required=True)
    p.add_argument("--batches", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from megatron_muon.megatron.cpu_run import alias_typing_override

    alias_typing_override()
    from megatron_muon.distributed.launch import single_process_group
    from megatron_muon.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    with single_process_group():
        replay(a.adapters, a.batches, a.out)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.exit(main())
