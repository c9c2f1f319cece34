"""Per-rank entry point for the ReLoRA tests (launched with ``run_ranks``, tests/test_relora.py)."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_muon.testing.gpt import (TinyGPTConfig, build_gpt, full_named_params, init_parallel,
                                       layout_ranks, train_step)
from megatron_muon.testing.lora_workers import _wrap_ddp, token_losses

__all__ = ["relora_run"]

LORA = dict(rank=4, alpha=8.0, targets=["qkv", "proj", "fc1", "fc2"], seed=3)
OPT = dict(lr=0.01, momentum=0.9, extra_scale_factor=0.2, weight_decay=0.01, clip_grad=1.0)


class _Both:
    """The adapters' optimizer and the full-rank AdamW as one (``train_step`` calls step())."""

    def __init__(self, opts: dict):
        self.opts = opts

    def zero_grad(self):
        for o in self.opts.values():
            o.zero_grad()

    def step(self):
        results = [o.step() for o in self.opts.values()]
        return all(r[0] for r in results), results[0][1], None


def _build(cfg: TinyGPTConfig, spec: dict):
    """Tiny GPT + LoRA (+ trainable embeddings / norms / output with ``spec['dense']``), the
    adapter optimizer, the full-rank AdamW and the ReLoRA scheduler."""
    from megatron_muon.peft.lora import LoRAConfig, apply_lora
    from megatron_muon.peft.lora_optimizer import LoRAOptimizer
    from megatron_muon.peft.relora import ReLoRA, TrainableAdamW

    chunks = build_gpt(cfg, wrap_ddp=False)
    apply_lora(chunks, LoRAConfig(**LORA))
    if spec.get("dense"):  # ReLoRA trains these at full rank; the targeted linears stay frozen
        for name, p in chunks[0].named_parameters():
            if "lora" not in name and ("embedding" in name or "norm" in name
                                       or "output_layer" in name):
                p.requires_grad_(True)
    model = _wrap_ddp(chunks, cfg)
    opts = {"lora": LoRAOptimizer(model, spec["optimizer"], **{**OPT, **spec.get("opt", {})})}
    if spec.get("dense"):
        opts["dense"] = TrainableAdamW(model, lr=3e-3, weight_decay=0.01, clip_grad=1.0)
    relora = ReLoRA(model, opts["lora"], restart_every=spec["restart_every"],
                    reset=spec.get("reset", "zero"), prune_ratio=spec.get("prune_ratio", 0.5))
    return model, opts, relora


def _state_copy(opt) -> dict:
    """{global name: {factor: {key: tensor}}} of the adapter optimizer's inner state."""
    out = {}
    for ad, (A, B) in zip(opt.adapters, opt.masters):
        out[ad.global_name] = {f: {k: v.clone() for k, v in opt.inner.state.get(p, {}).items()
                                   if torch.is_tensor(v)}
                               for f, p in (("A", A), ("B", B))}
    return out


def relora_run(cfg: dict, tp: int = 1, steps: int = 3, runs: Optional[dict] = None,
               directory: Optional[str] = None, save_at: int = 1) -> dict:
    """For each run (name: dict(optimizer, restart_every, reset, prune_ratio, opt, dense)):
    ``steps`` steps with restarts; around the first restart the full parameters, adapters,
    optimizer state and outputs before and after it; the final full parameters.  With
    ``directory``: the training state saved after ``save_at`` steps is loaded into a fresh
    model and optimizers, which run the remaining steps (their losses and parameters)."""
    from megatron_muon.peft.lora import full_lora_factors
    from megatron_muon.peft.relora import load_training_state, save_training_state

    init_parallel(tp=tp, seed=TinyGPTConfig().seed)
    gcfg = TinyGPTConfig(**cfg)
    lay = layout_ranks()
    out = {"layout": lay, "runs": {}}
    for name, spec in (runs or {}).items():
        model, opts, relora = _build(gcfg, spec)
        both = _Both(opts)
        rec = {"losses": []}
        path = os.path.join(directory, name) if directory else None
        for s in range(steps):
            res = train_step(model, both, gcfg, s, lay["dp"], lay["dp_size"])
            rec["losses"].append(res["loss"])
            if relora.due(s + 1):
                first = relora.restarts == 0
                if first:
                    rec["pre"] = dict(params=full_named_params(model),
                                      factors=full_lora_factors(model),
                                      state=_state_copy(opts["lora"]),
                                      outputs=token_losses(model, gcfg))
                relora.restart()
                if first:
                    rec["post"] = dict(params=full_named_params(model),
                                       factors=full_lora_factors(model),
                                       state=_state_copy(opts["lora"]),
                                       state_len=len(opts["lora"].inner.state),
                                       outputs=token_losses(model, gcfg))
            if path and s + 1 == save_at:
                save_training_state(path, model, opts, relora, s + 1, meta={"run": name})
        rec["restarts"] = relora.restarts
        rec["final"] = full_named_params(model)
        if path:
            model, opts, relora = _build(gcfg, spec)
            both = _Both(opts)
            start = load_training_state(path, model, opts, relora, meta={"run": name})
            rec["resumed_from"] = start
            rec["resumed_losses"] = []
            for s in range(start, steps):
                res = train_step(model, both, gcfg, s, lay["dp"], lay["dp_size"])
                rec["resumed_losses"].append(res["loss"])
                if relora.due(s + 1):
                    relora.restart()
            rec["resumed_final"] = full_named_params(model)
            rec["resumed_restarts"] = relora.restarts
            try:
                load_training_state(path, model, opts, relora, meta={"run": "other"})
                rec["meta_error"] = None
            except ValueError as err:
                rec["meta_error"] = str(err)
        out["runs"][name] = rec
        dist.barrier()
    return out
