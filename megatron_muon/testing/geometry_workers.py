"""Per-rank entry point of ``tests/test_geometry.py``: the shard geometry a real Megatron-Core
DDP model and DMuon optimizer build, for ``megatron_muon.megatron.geometry`` to be checked
against."""

from __future__ import annotations

from typing import Optional


def dmuon_geometry(variants: list) -> list:
    """For each variant (``cfg``: ``TinyGPTConfig`` fields, ``tp``, ``pp``, ``ep``, ``ddp``:
    ``DistributedDataParallelConfig`` fields, ``opt``: DMuon settings), build the tiny GPT
    under Megatron DDP and DMuon on it, and return this rank's layout, every model chunk's
    parameters as DDP registered them, the bucket size DDP resolved, and per DMuon optimizer
    (dense, expert) its exchange group rank and size, flat buffer size, ``ShardedMatrix``
    list and plan digest.  Nothing is trained."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_muon.megatron.factory import close_optimizer, get_megatron_optimizer
    from megatron_muon.testing.gpt import TinyGPTConfig, build_gpt, init_parallel, layout_ranks
    from megatron_muon.testing.workers import make_optimizer_config

    out = []
    for v in variants:
        gcfg = TinyGPTConfig(**v.get("cfg", {}))
        init_parallel(tp=v.get("tp", 1), pp=v.get("pp", 1), ep=v.get("ep", 1), seed=gcfg.seed)
        ddp = dict(use_distributed_optimizer=True, overlap_grad_reduce=False,
                   grad_reduce_in_fp32=True)
        ddp.update(v.get("ddp", {}))
        model = build_gpt(gcfg, ddp_config=DistributedDataParallelConfig(**ddp))
        optim = get_megatron_optimizer(make_optimizer_config("dmuon", **v.get("opt", {})), model)
        layout = layout_ranks()
        layout.update(ep=ps.get_expert_model_parallel_rank(),
                      edp=_expert_dp_rank(ps) if gcfg.num_moe_experts else None)
        params = [[(name, tuple(p.shape),
                    int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None,
                    bool(getattr(p, "allreduce", True)), bool(getattr(p, "shared_embedding", False)))
                   for name, p in chunk.named_parameters()] for chunk in model]
        parts = []
        for sub in getattr(optim, "chained_optimizers", [optim]):
            if not hasattr(sub, "dmuon_stats") or sub.is_stub_optimizer:
                continue
            eng = sub.optimizer.engine
            parts.append(dict(expert=sub.expert, world=eng.world, rank=eng.rank,
                              local_numel=eng.local_numel, matrices=list(eng.matrices),
                              digest=sub.plan.digest))
        out.append(dict(layout=layout, params=params, parts=parts,
                        bucket_sizes=[c.bucket_size for c in model],
                        ddp_bucket_size=model[0].ddp_config.bucket_size))
        close_optimizer(optim)
        del optim, model
    return out


def _expert_dp_rank(ps) -> Optional[int]:
    try:
        return ps.get_expert_data_parallel_rank()
    except (AssertionError, RuntimeError):
        return None
