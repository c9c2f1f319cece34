"""Per-rank entry points that tests, benchmarks and examples launch with ``run_ranks``."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megatron_muon.testing.gpt import (TinyGPTConfig, build_gpt, full_named_params, global_param_name, init_parallel,
                  layout_ranks, train_step)

__all__ = ["train_megatron", "train_variants", "make_optimizer_config", "constant_scheduler"]


def constant_scheduler(optimizer, ocfg):
    """Megatron's OptimizerParamScheduler at a constant lr (applies lr_mult / wd_mult)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=ocfg.lr, max_lr=ocfg.lr, min_lr=ocfg.lr,
                                   lr_warmup_steps=0, lr_decay_steps=10**6,
                                   lr_decay_style="constant", start_wd=ocfg.weight_decay,
                                   end_wd=ocfg.weight_decay, wd_incr_steps=10**6,
                                   wd_incr_style="constant")


def make_optimizer_config(optimizer: str, **overrides):
    """A DMuonOptimizerConfig; with optimizer='adam'/'sgd' it is plain Megatron."""
    from megatron_muon.megatron.config import DMuonOptimizerConfig

    base = dict(lr=1e-3, min_lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                adam_eps=1e-8, clip_grad=0.0, use_distributed_optimizer=True, bf16=False)
    base.update(overrides)
    return DMuonOptimizerConfig(optimizer=optimizer, **base)


def _poison_grads(model):
    from megatron_muon.megatron.zero3 import zero3_of

    def hook():
        for chunk in model:
            z = zero3_of(chunk)
            for t in ([zb.gshard for zb in z.buckets] if z is not None else
                      [buf.grad_data for buf in chunk.buffers]):
                t.fill_(float("inf"))
    return hook


def _zero3_gathers(model) -> int:
    """ZeRO-3 bucket gathers so far on this rank (0 without ZeRO-3)."""
    from megatron_muon.megatron.zero3 import zero3s

    return sum(z.stats["gathers"] for z in zero3s(model))


def train_megatron(cfg: dict, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, ep: int = 1,
                   optimizer: str = "adam", opt: Optional[dict] = None, steps: int = 3,
                   ddp: Optional[dict] = None, return_params: bool = True,
                   checkpoint: Optional[dict] = None, inf_at_step: Optional[int] = None,
                   params_each_step: bool = False, clip_at_steps: tuple = (),
                   trace_dir: Optional[str] = None, record_muon_collectives: bool = False,
                   matrix_placement: bool = True, recheck_max_logit: bool = False,
                   overlap_gate: Optional[dict] = None) -> dict:
    """Train the tiny GPT for ``steps`` steps; return losses and (TP-gathered) parameters.

    ``inf_at_step`` writes an Inf into every rank's reduced gradient buffer at that step
    (the optimizer must detect it and skip the step); ``params_each_step`` also returns the
    parameters after every step; ``record_muon_collectives`` returns every collective the
    Muon step (and its speculative overlap work) issued; ``clip_at_steps`` sets a tiny ``clip_grad`` (1e-4) in
    those steps so that clipping certainly happens; ``trace_dir`` writes Chrome traces;
    ``matrix_placement=False`` builds the DDP buffers without the matrix layout that
    ``dmuon_placement='matrix'`` asks for (to test the error).  With ``qk_clip`` in
    ``cfg['extra']`` the model is QK-clipped after every step (``max_logits``: the max logit
    of each step); ``recheck_max_logit`` then runs the last step's batch forward once more
    and returns the max logit of the clipped weights (``max_logit_after``).
    ``overlap_gate`` replaces the 'auto' overlap's ``SpeculationGate`` by one built from
    these arguments, its ``verdict`` set (``verdict=True``: as after a window that measured
    speculation faster), to test the back-off without a timing-dependent verdict.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_muon.megatron.checkpoint import sync_params
    from megatron_muon.megatron.factory import get_megatron_optimizer

    gcfg = TinyGPTConfig(**cfg)
    init_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep, seed=gcfg.seed)
    ddp_kwargs = dict(use_distributed_optimizer=True, overlap_grad_reduce=False,
                      grad_reduce_in_fp32=True)
    ddp_kwargs.update(ddp or {})
    ocfg = make_optimizer_config(optimizer, **{"bf16": gcfg.bf16, "fp16": gcfg.fp16, **(opt or {})})
    placement = None
    if getattr(ocfg, "dmuon_placement", "dmuon") == "matrix" and matrix_placement:
        from megatron_muon.megatron.matrix_placement import matrix_placement_for

        placement = matrix_placement_for(ocfg)
    model = build_gpt(gcfg, ddp_config=DistributedDataParallelConfig(**ddp_kwargs),
                      placement=placement)
    optim = get_megatron_optimizer(ocfg, model)
    sched = constant_scheduler(optim, ocfg)
    if overlap_gate is not None:
        from megatron_muon.megatron.overlap import SpeculationGate

        gate_kw = dict(overlap_gate)
        verdict = gate_kw.pop("verdict", False)
        for sub in getattr(optim, "chained_optimizers", [optim]):
            ov = getattr(getattr(sub, "optimizer", None), "overlap", None)
            if ov is not None and ov.gate is not None:
                ov.gate = SpeculationGate(**gate_kw)
                ov.gate.verdict = verdict
    # what a complete speculation holds when the step takes it (overlap memory, in elements)
    spec_held = []
    for sub in getattr(optim, "chained_optimizers", [optim]):
        ov = getattr(getattr(sub, "optimizer", None), "overlap", None)
        if ov is not None:
            def take(*args, ov=ov, inner=ov.take, **kwargs):
                spec = ov.spec
                if spec is not None and spec.complete:
                    spec_held.append(dict(
                        flat=spec.flat.numel(), shard=ov.step_opt.numel,
                        owned=None if spec.owned is None else spec.owned.numel(),
                        owned_numel=ov.engine.owned_numel, out=spec.out is not None))
                return inner(*args, **kwargs)
            ov.take = take
    recorder = None
    if record_muon_collectives:
        from megatron_muon.testing.collectives import CollectiveRecorder

        recorder = CollectiveRecorder().install()
        for sub in getattr(optim, "chained_optimizers", [optim]):
            inner = getattr(sub, "optimizer", None)
            if hasattr(inner, "engine"):  # DMuon's ShardedMuonStep
                recorder.watch(inner, "step")
                if inner.overlap is not None:
                    for m in ("_process", "_finish_backward", "flush"):
                        recorder.watch(inner.overlap, m)
    if trace_dir:
        from megatron_muon.megatron.tracing import enable_tracing

        enable_tracing(model, optim)
    lr = layout_ranks()
    losses, norms = [], []
    # ZeRO-3: buckets gathered while saving / loading (each owner writes / reads its own)
    gathers_in_save = gathers_in_load = None
    start = 0
    if checkpoint and checkpoint.get("load"):
        from megatron_muon.megatron.checkpoint import load_checkpoint

        before = _zero3_gathers(model)
        start = load_checkpoint(checkpoint["load"], model, optim, sched)
        gathers_in_load = _zero3_gathers(model) - before
    history, updated, max_logits = [], [], []
    base_clip = ocfg.clip_grad
    for step in range(start, steps):
        sched.step(1)
        for sub in {id(o): o for o in [optim, *getattr(optim, "chained_optimizers", [])]}.values():
            sub.config.clip_grad = 1e-4 if step in clip_at_steps else base_clip
        out = train_step(model, optim, gcfg, step, lr["dp"], lr["dp_size"],
                         grad_hook=_poison_grads(model) if step == inf_at_step else None)
        if gcfg.extra.get("qk_clip"):  # Megatron's order: optimizer.step(), then clip_qk
            from megatron_muon.megatron.qk_clip import clip_qk

            out["max_logit"] = clip_qk(model, optim)
        max_logits.append(out.get("max_logit"))
        losses.append(out.get("loss"))
        norms.append(out.get("grad_norm"))
        updated.append(out.get("update_successful"))
        if params_each_step:
            sync_params(model)
            history.append(full_named_params(model))
        if checkpoint and checkpoint.get("save") and step + 1 == checkpoint.get("save_at"):
            from megatron_muon.megatron.checkpoint import SHARDING_TYPE, save_checkpoint

            before = _zero3_gathers(model)
            save_checkpoint(checkpoint["save"], model, optim, step + 1, sched,
                            optim_sharding_type=checkpoint.get("sharding", SHARDING_TYPE))
            gathers_in_save = _zero3_gathers(model) - before
    max_logit_after = None
    if recheck_max_logit:
        from megatron_muon.megatron.qk_clip import clip_qk

        train_step(model, None, gcfg, steps - 1, lr["dp"], lr["dp_size"], forward_only=True)
        max_logit_after = clip_qk(model, optim, log_max_only=True)
    if trace_dir:
        from megatron_muon.megatron.tracing import save_trace

        save_trace(trace_dir)
    if recorder is not None:
        recorder.uninstall()
    result = dict(layout=lr, losses=losses, grad_norms=norms, rank=dist.get_rank(),
                  spec_held=spec_held,
                  updated=updated, history=history, max_logits=max_logits,
                  max_logit_after=max_logit_after,
                  muon_collectives=recorder.records if recorder is not None else None)
    from megatron_muon.megatron.zero3 import zero3_memory, zero3_of, zero3s

    zs = zero3s(model)
    if zs:  # what this rank holds between steps
        held, freed = [], 0
        for chunk in model:
            z = zero3_of(chunk)
            for name, p in chunk.module.named_parameters():
                if z.owns(p):
                    held.append(global_param_name(chunk, name))
                else:
                    freed += p.untyped_storage().size()
        result["zero3"] = dict(memory=zero3_memory(model), owned=held,
                               bytes_of_others=freed, stats=[z.stats for z in zs],
                               gathers_in_save=gathers_in_save,
                               gathers_in_load=gathers_in_load)
    if return_params:
        sync_params(model)
        result["params"] = full_named_params(model)
    for sub in getattr(optim, "chained_optimizers", [optim]):
        if hasattr(sub, "dmuon_stats"):
            result["dmuon_stats"] = sub.dmuon_stats()
    return result


def train_variants(variants: list, **common) -> list:
    """``train_megatron(**common, **v)`` for each v, in one process (saves a launch each)."""
    out = []
    for v in variants:
        kw = dict(common)
        for k, val in v.items():
            kw[k] = {**kw.get(k, {}), **val} if isinstance(val, dict) else val
        out.append(train_megatron(**kw))
    return out


def stall(seconds: float = 60.0) -> None:
    """A rank that never finishes in time (used to test that launches time out)."""
    import time

    time.sleep(seconds)
