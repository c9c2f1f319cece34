"""Per-rank entry points that tests, benchmarks and examples launch with ``run_ranks``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist

from .gpt import TinyGPTConfig, build_gpt, full_named_params, init_parallel, layout_ranks, train_step

__all__ = ["train_megatron", "make_optimizer_config"]


def make_optimizer_config(optimizer: str, **overrides):
    """An OptimizerConfig (adam/sgd) or DMuonOptimizerConfig (dmuon/muon_naive)."""
    from megatron.core.optimizer import OptimizerConfig

    base = dict(lr=1e-3, min_lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                adam_eps=1e-8, clip_grad=0.0, use_distributed_optimizer=True, bf16=False)
    base.update(overrides)
    if optimizer in ("adam", "sgd"):
        return OptimizerConfig(optimizer=optimizer, **base)
    from megatron_muon.megatron.config import DMuonOptimizerConfig

    return DMuonOptimizerConfig(optimizer=optimizer, **base)


def train_megatron(cfg: dict, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                   optimizer: str = "adam", opt: Optional[dict] = None, steps: int = 3,
                   ddp: Optional[dict] = None, return_params: bool = True,
                   checkpoint: Optional[dict] = None) -> dict:
    """Train the tiny GPT for ``steps`` steps; return losses and (TP-gathered) parameters."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_muon.megatron.factory import get_megatron_optimizer

    gcfg = TinyGPTConfig(**cfg)
    init_parallel(tp=tp, pp=pp, vpp=vpp, seed=gcfg.seed)
    ddp_kwargs = dict(use_distributed_optimizer=True, overlap_grad_reduce=False,
                      grad_reduce_in_fp32=True)
    ddp_kwargs.update(ddp or {})
    model = build_gpt(gcfg, ddp_config=DistributedDataParallelConfig(**ddp_kwargs))
    ocfg = make_optimizer_config(optimizer, bf16=gcfg.bf16, **(opt or {}))
    optim = get_megatron_optimizer(ocfg, model)
    lr = layout_ranks()
    losses, norms = [], []
    start = 0
    if checkpoint and checkpoint.get("load"):
        from megatron_muon.megatron.checkpoint import load_checkpoint

        start = load_checkpoint(checkpoint["load"], model, optim)
    for step in range(start, steps):
        out = train_step(model, optim, gcfg, step, lr["dp"], lr["dp_size"])
        losses.append(out.get("loss"))
        norms.append(out.get("grad_norm"))
        if checkpoint and checkpoint.get("save") and step + 1 == checkpoint.get("save_at"):
            from megatron_muon.megatron.checkpoint import save_checkpoint

            save_checkpoint(checkpoint["save"], model, optim, step + 1)
    result = dict(layout=lr, losses=losses, grad_norms=norms, rank=dist.get_rank())
    if return_params:
        result["params"] = full_named_params(model)
    stats = getattr(optim, "dmuon_stats", None)
    if callable(stats):
        result["dmuon_stats"] = stats()
    return result
