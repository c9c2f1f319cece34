"""Per-rank entry points that tests, benchmarks and examples launch with ``run_ranks``.

``make_optimizer_config`` comes from the library (``megatron_muon.megatron.config``) and is
re-exported here."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megatron_muon.megatron.config import make_optimizer_config
from megatron_muon.testing.gpt import (TinyGPTConfig, build_gpt, full_named_params, global_param_name, init_parallel,
                  layout_ranks, train_step)

__all__ = ["train_megatron", "train_variants", "make_optimizer_config", "constant_scheduler",
           "BENCH_VARIANTS", "build_bench_variant"]

# The benchmarks' variants (tools/bench_optimizer.py, tools/bench_memory.py):
# name -> (optimizer, dmuon_placement, dmuon_zero3, other settings).  'recon_zero3' is the
# reconstruction baseline: ZeRO-3 on Megatron's even shards, every matrix gathered on every
# rank in the step; '*_sync': ZeRO-3 without prefetch (each bucket gathered at its use).
_SYNC = {"dmuon_zero3_prefetch": False}
BENCH_VARIANTS = {
    "adam": ("adam", "dmuon", False, {}),
    "muon_naive": ("muon_naive", "dmuon", False, {}),
    "dmuon": ("dmuon", "dmuon", False, {}),
    "dmuon_noov": ("dmuon", "dmuon", False, {}),
    "dmuon_matrix": ("dmuon", "matrix", False, {}),
    "dmuon_zero3": ("dmuon", "matrix", True, {}),
    "dmuon_zero3_sync": ("dmuon", "matrix", True, _SYNC),
    "recon_zero3": ("muon_naive", "dmuon", True, {}),
    "recon_zero3_sync": ("muon_naive", "dmuon", True, _SYNC),
}


def build_bench_variant(name: str, gcfg, zero3_bucket_size: int, **settings):
    """(model chunks, optimizer) of one of ``BENCH_VARIANTS`` on the GPT ``gcfg``: fp32
    gradient reduction, Megatron's distributed optimizer, ZeRO-3 variants with buckets of
    ``zero3_bucket_size`` elements (their gather unit); ``settings`` go to the config."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_muon.megatron.factory import get_megatron_optimizer

    optimizer, placement, zero3, extra = BENCH_VARIANTS[name]
    ocfg = make_optimizer_config(optimizer, dmuon_log_plan=False, dmuon_placement=placement,
                                 dmuon_zero3=zero3, **extra, **settings)
    layout = None
    if placement == "matrix":
        from megatron_muon.megatron.matrix_placement import matrix_placement_for

        layout = matrix_placement_for(ocfg, log=False)
    ddp = dict(overlap_grad_reduce=True, bucket_size=zero3_bucket_size) if zero3 else {}
    model = build_gpt(gcfg, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, **ddp), placement=layout)
    return model, get_megatron_optimizer(ocfg, model)


def constant_scheduler(optimizer, ocfg):
    """Megatron's OptimizerParamScheduler at a constant lr (applies lr_mult / wd_mult)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=ocfg.lr, max_lr=ocfg.lr, min_lr=ocfg.lr,
                                   lr_warmup_steps=0, lr_decay_steps=10**6,
                                   lr_decay_style="constant", start_wd=ocfg.weight_decay,
                                   end_wd=ocfg.weight_decay, wd_incr_steps=10**6,
                                   wd_incr_style="constant")


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
                   etp: Optional[int] = None,
                   optimizer: str = "adam", opt: Optional[dict] = None, steps: int = 3,
                   ddp: Optional[dict] = None, return_params: bool = True,
                   checkpoint: Optional[dict] = None, inf_at_step: Optional[int] = None,
                   params_each_step: bool = False, clip_at_steps: tuple = (),
                   trace_dir: Optional[str] = None, record_muon_collectives: bool = False,
                   matrix_placement: bool = True, recheck_max_logit: bool = False,
                   overlap_gate: Optional[dict] = None,
                   exchange_geometry: bool = False) -> dict:
    """Train the tiny GPT for ``steps`` steps; return losses and (TP-gathered) parameters
    (``etp``: expert TP, default ``tp``).

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
    ``exchange_geometry`` also returns DMuon's exchange geometry (``exchange``: this rank's
    rank in the exchange group, and per Muon matrix its units, its pieces -- which group
    rank holds which flat range of which TP shard -- and each unit's owner), from which a
    test can count the elements every exchange must move.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_muon.megatron.checkpoint import sync_params
    from megatron_muon.megatron.factory import get_megatron_optimizer

    gcfg = TinyGPTConfig(**cfg)
    init_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, seed=gcfg.seed)
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
        # {rank: (speculating period, plain period)}: this rank's clock advances by these
        # (a rank that measures differently from its peers; the group's max must decide)
        periods = {int(k): v for k, v in gate_kw.pop("periods", {}).items()}
        for sub in getattr(optim, "chained_optimizers", [optim]):
            ov = getattr(getattr(sub, "optimizer", None), "overlap", None)
            if ov is not None and ov.gate is not None:
                ov.gate = SpeculationGate(**gate_kw)
                ov.gate.verdict = verdict
                if periods:
                    ov.gate.clock = _fake_clock(ov.gate, periods[dist.get_rank()])
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

    def save_if_due(done: int) -> None:  # save_at=0: before the first step
        nonlocal gathers_in_save
        if checkpoint and checkpoint.get("save") and done == checkpoint.get("save_at"):
            from megatron_muon.megatron.checkpoint import SHARDING_TYPE, save_checkpoint

            before = _zero3_gathers(model)
            save_checkpoint(checkpoint["save"], model, optim, done, sched,
                            optim_sharding_type=checkpoint.get("sharding", SHARDING_TYPE))
            gathers_in_save = _zero3_gathers(model) - before

    if start == 0:
        save_if_due(0)
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
        save_if_due(step + 1)
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
            gate = getattr(getattr(sub.optimizer, "overlap", None), "gate", None)
            if gate is not None:
                result["gate_decisions"] = [list(d) for d in gate.decisions]
            if exchange_geometry:
                eng = sub.optimizer.engine
                result["exchange"] = dict(rank=eng.rank, world=eng.world, matrices=[dict(
                    key=m.key, shape=tuple(m.shape), tp_dim=m.tp_dim, tp_size=m.tp_size,
                    bucket=repr(m.bucket), units=[(u.dim, tuple(u.blocks)) for u in m.units],
                    owners=[sub.plan.owners[m.unit_key(i)] for i in range(len(m.units))],
                    pieces=[(q.rank, q.tp_rank, q.start, q.end, q.source) for q in m.pieces])
                    for m in eng.matrices])
    return result


def _fake_clock(gate, periods):
    """A clock for ``gate`` that advances by ``periods[0]`` over an iteration the gate made
    speculate and by ``periods[1]`` over a plain one (the gate reads it in ``end_step``, at
    the end of iteration ``gate.steps``)."""
    now = [0.0]

    def clock():
        now[0] += periods[0] if gate.forced(gate.steps) else periods[1]
        return now[0]
    return clock


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


# ---------------------------------------------------------------- faults and teardown
def _tiny_training(cfg: dict, optimizer: str, opt: Optional[dict], ddp: Optional[dict],
                   tp: int = 1, init: bool = True) -> tuple:
    """(gcfg, ocfg, model): the tiny GPT under Megatron DDP, as ``train_megatron`` builds it
    (matrix placement when ``opt`` asks for it); ``init=False`` keeps the parallel state."""
    from megatron.core.distributed import DistributedDataParallelConfig

    gcfg = TinyGPTConfig(**cfg)
    if init:
        init_parallel(tp=tp, seed=gcfg.seed)
    ocfg = make_optimizer_config(optimizer, **{"bf16": gcfg.bf16, "fp16": gcfg.fp16, **(opt or {})})
    placement = None
    if getattr(ocfg, "dmuon_placement", "dmuon") == "matrix":
        from megatron_muon.megatron.matrix_placement import matrix_placement_for

        placement = matrix_placement_for(ocfg)
    ddp_kwargs = {**dict(use_distributed_optimizer=True, overlap_grad_reduce=False,
                         grad_reduce_in_fp32=True), **(ddp or {})}
    model = build_gpt(gcfg, ddp_config=DistributedDataParallelConfig(**ddp_kwargs),
                      placement=placement)
    return gcfg, ocfg, model


def _dmuon_subs(optim) -> list:
    return [s for s in getattr(optim, "chained_optimizers", [optim]) if hasattr(s, "dmuon_stats")]


def check_finite_one_rank(cfg: dict, opt: dict, poison_rank: int = 1, poison_step: int = 1,
                          steps: int = 3, ddp: Optional[dict] = None) -> dict:
    """Train with ``dmuon_check_finite`` and, before step ``poison_step``, write a NaN into one
    momentum element of rank ``poison_rank``'s DMuon shard only: that rank's U is non-finite,
    the others' are not.  Returns the error each rank raised (None: none) and the steps taken."""
    gcfg, ocfg, model = _tiny_training(cfg, "dmuon", dict(opt, dmuon_check_finite=True), ddp)
    from megatron_muon.megatron.factory import get_megatron_optimizer

    optim = get_megatron_optimizer(ocfg, model)
    sched = constant_scheduler(optim, ocfg)
    lr = layout_ranks()
    error, taken = None, 0
    for step in range(steps):
        if step == poison_step and dist.get_rank() == poison_rank:
            inner = _dmuon_subs(optim)[0].optimizer
            buf = next(st["momentum_buffer"] for st in inner.state.values()
                       if "momentum_buffer" in st and st["momentum_buffer"].numel())
            buf.view(-1)[0] = float("nan")
        sched.step(1)
        try:
            train_step(model, optim, gcfg, step, lr["dp"], lr["dp_size"])
        except FloatingPointError as err:
            error = str(err)
            break
        taken += 1
    return dict(rank=dist.get_rank(), error=error, steps=taken)


def _exchange_matrices(world: int, bucket_of_w1=1, shorten: int = 0) -> list:
    """Three 8 x 16 matrices row-split over ``world`` ranks (rank r holds rows r*8/world...),
    in buckets 0, ``bucket_of_w1``, 1; ``shorten``: this rank's own piece of w1 is that many
    elements shorter (a view of the geometry that its peers do not share)."""
    from megatron_muon.core.units import whole_units
    from megatron_muon.distributed.owner_centric import Piece, ShardedMatrix

    me, (m, n) = dist.get_rank(), (8, 16)
    per = m * n // world
    mats = []
    for k, bucket in enumerate((0, bucket_of_w1, 1)):
        pieces = []
        for r in range(world):
            end = (r + 1) * per - (shorten if (k == 1 and r == me) else 0)
            pieces.append(Piece(rank=r, tp_rank=0, start=r * per, end=end, local_offset=k * per))
        mats.append(ShardedMatrix(f"w{k}", (m, n), tuple(whole_units((m, n))), 0, 1,
                                  tuple(pieces), bucket=bucket))
    return mats


def exchange_mismatch(kind: Optional[str] = None) -> dict:
    """Build an ``OwnerCentricNS`` over the world where one rank alone (``bad_rank``: the last
    rank that does not own w1) sees another geometry: ``kind='bucket'`` puts w1 in another
    bucket, ``'count'`` shortens its piece of w1 (so it sends w1's owner fewer elements than
    the owner expects); None: no mismatch.  Returns the construction error (None: built)
    and, when built, one step's result."""
    import torch

    from megatron_muon.core.plan import UnitTask, plan_owners
    from megatron_muon.distributed.owner_centric import OwnerCentricNS

    world, me = dist.get_world_size(), dist.get_rank()
    mats = _exchange_matrices(world)
    plan = plan_owners([UnitTask(m.unit_key(0), m.shape, 1.0) for m in mats], world)
    owner = plan.owners[mats[1].unit_key(0)]
    bad_rank = max(r for r in range(world) if r != owner)
    if me == bad_rank and kind == "bucket":
        mats = _exchange_matrices(world, bucket_of_w1=7)
    elif me == bad_rank and kind == "count":
        mats = _exchange_matrices(world, shorten=4)
    try:
        engine = OwnerCentricNS(mats, plan, dist.group.WORLD, ns_steps=5, coefficients="quintic",
                                scale_mode="spectral", extra_scale_factor=1.0,
                                ns_dtype=torch.float32, device=torch.device("cpu"),
                                local_numel=3 * 8 * 16 // world)
    except RuntimeError as err:
        return dict(rank=me, error=str(err), owner_of_w1=owner, bad_rank=bad_rank)
    x = torch.randn(engine.local_numel, generator=torch.Generator().manual_seed(me))
    return dict(rank=me, error=None, out=engine.run(x), owner_of_w1=owner, bad_rank=bad_rank)


def tuner_plans(opt: dict, skew: float = 1000.0, cache: Optional[str] = None) -> dict:
    """``build_engine`` with ``dmuon_plan_cost='tuner'`` on matrices of four shapes, each rank's
    kernel timings skewed its own way (rank r times an m x n unit as (m n)^(+-1) x skew^r:
    the order of the costs is reversed from one rank to the next, so plans made from local
    timings differ).  Returns the plan's owners and digest, or the construction error, and
    the shapes this rank's tuners measured."""
    from megatron_muon.core.units import whole_units
    from megatron_muon.distributed.owner_centric import Piece, ShardedMatrix
    from megatron_muon.kernels import tuner as tuner_mod
    from megatron_muon.megatron.dmuon import build_engine

    me, world = dist.get_rank(), dist.get_world_size()
    measured = []

    def fake_measure(fn, x, coeffs, eps, dtype, warmup, iters):
        m, n = x.shape[-2:]
        measured.append((m, n))
        return float((m * n) ** (1 if me % 2 == 0 else -1)) * skew ** me

    tuner_mod._measure = fake_measure  # this rank's process only
    shapes = [(8, 8), (8, 16), (16, 16), (16, 32), (8, 8), (16, 32)]
    mats, off = [], 0
    for k, (m, n) in enumerate(shapes):
        per = m * n // world
        pieces = tuple(Piece(rank=r, tp_rank=0, start=r * per, end=(r + 1) * per,
                             local_offset=off) for r in range(world))
        mats.append(ShardedMatrix(f"w{k}", (m, n), tuple(whole_units((m, n))), 0, 1, pieces,
                                  bucket=0))
        off += per
    ocfg = make_optimizer_config("dmuon", dmuon_plan_cost="tuner", dmuon_tuner_cache=cache,
                                 dmuon_ns_backend="torch", **opt)
    try:
        engine, plan = build_engine(mats, dist.group.WORLD, ocfg, local_numel=off)
    except RuntimeError as err:
        return dict(rank=me, error=str(err), measured=measured)
    return dict(rank=me, error=None, owners=dict(plan.owners), digest=plan.digest,
                measured=measured, owned=engine.owned_numel)


def _hook_census(model, optim) -> dict:
    """What is hooked into this model and optimizer now: callbacks registered with
    ``megatron_muon.megatron.hooks`` per object kind, forward pre-hooks on the core
    attentions (QK-clip's recorders) and the timeline's registrations."""
    from megatron.core.pipeline_parallel import schedules

    from megatron_muon.megatron import hooks, tracing
    from megatron_muon.megatron.qk_clip import attention_layers

    def callbacks(obj) -> int:
        h = hooks._REGISTRY.get(obj) if obj is not None else None
        if h is None:
            return 0
        return sum(len(s.before) + len(s.after) + len(s.observers) for s in h.slots.values())

    bgs = [bg for chunk in model for bg in chunk.bucket_groups]
    return dict(bucket_groups=sum(map(callbacks, bgs)), chunks=sum(map(callbacks, model)),
                optimizer=callbacks(optim), schedules=callbacks(schedules),
                recorders=sum(len(a.core_attention._forward_pre_hooks)
                              for a in attention_layers(model)),
                tracing=len(tracing._REGISTRATIONS))


def _train_steps(model, optim, ocfg, gcfg, steps: int) -> None:
    sched = constant_scheduler(optim, ocfg)
    lr = layout_ranks()
    for step in range(steps):
        sched.step(1)
        train_step(model, optim, gcfg, step, lr["dp"], lr["dp_size"])
        if gcfg.extra.get("qk_clip"):
            from megatron_muon.megatron.qk_clip import clip_qk

            clip_qk(model, optim)


def teardown_rebuild(variants: list, cfg: dict, steps: int = 2,
                     trace_dir: Optional[str] = None) -> list:
    """Per variant (``dict(opt=..., ddp=...)``): build DMuon on a tiny GPT, count what it
    hooked, close it, count again, build a second DMuon on the same DDP model and train
    ``steps`` steps; then the same steps with a fresh model and optimizer.  Returns the
    counts, the first optimizer's overlap stats after the second one trained (its hooks must
    not have fired), whether the trace was written at close, and both runs' parameters."""
    import os

    from megatron_muon.megatron.factory import close_optimizer, get_megatron_optimizer

    out = []
    for i, v in enumerate(variants):
        opt = dict(v.get("opt", {}))
        if trace_dir:
            opt["dmuon_trace_dir"] = f"{trace_dir}/v{i}"
        gcfg, ocfg, model = _tiny_training(cfg, "dmuon", opt, v.get("ddp"), init=i == 0)
        census0 = _hook_census(model, None)
        first = get_megatron_optimizer(ocfg, model)
        overlaps = [s.optimizer.overlap for s in _dmuon_subs(first)
                    if s.optimizer.overlap is not None]
        built = _hook_census(model, first)
        close_optimizer(first)
        closed = _hook_census(model, first)
        written = bool(trace_dir) and \
            os.path.exists(f"{trace_dir}/v{i}/trace_rank{dist.get_rank()}.json")
        second = get_megatron_optimizer(ocfg, model)
        _train_steps(model, second, ocfg, gcfg, steps)
        rebuilt = full_named_params(model)
        stats = [ov.stats.as_dict() for ov in overlaps]
        second.close()
        _, _, fresh_model = _tiny_training(cfg, "dmuon", opt, v.get("ddp"), init=False)
        module_hooks = _module_hooks(fresh_model)
        fresh = get_megatron_optimizer(ocfg, fresh_model)
        _train_steps(fresh_model, fresh, ocfg, gcfg, steps)
        result = dict(census=dict(before=census0, built=built, closed=closed),
                      first_overlap_stats=stats, trace_written=written,
                      rebuilt=rebuilt, fresh=full_named_params(fresh_model))
        close_optimizer(fresh)
        result["zero3_close"] = _close_zero3(fresh_model, module_hooks)
        out.append(result)
    return out


def _module_hooks(model) -> int:
    """Forward (pre-)hooks on every module of the model (Megatron DDP's own included)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
               for chunk in model for m in chunk.modules())


def _close_zero3(model, module_hooks: int) -> Optional[dict]:
    """``MatrixZeRO3.close()`` on a model whose optimizer is closed: what is still hooked
    before and after (methods dispatched by ``hooks``, module hooks beyond ``module_hooks``,
    the count before the build).  None without ZeRO-3."""
    from megatron_muon.megatron import hooks
    from megatron_muon.megatron.zero3 import zero3s

    zs = zero3s(model)
    if not zs:
        return None

    def state() -> dict:
        objs = [bg for chunk in model for bg in chunk.bucket_groups] + \
            [buf for chunk in model for buf in chunk.buffers] + [c.module for c in model]
        return dict(methods=sorted({n for o in objs for n in hooks.installed(o)}),
                    module_hooks=_module_hooks(model) - module_hooks)

    before = state()
    for z in zs:
        z.close()
    return dict(before=before, after=state())
