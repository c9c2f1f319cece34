"""DMuon's real owner plan and exchange at any scale, in one process, on a fake process group.

    python tools/bench_scale.py --preset llama3-70b --tp 8 --pp 2 --dp 64 --rank 0
    python tools/bench_scale.py --preset llama3-8b --dp 1024 --all-ranks
    python tools/bench_scale.py --preset qwen3-30b-a3b --ep 8 --dp 64 --all-ranks
    python tools/bench_scale.py --preset llama3-8b --num-layers 4 --dp 16 --all-ranks --out /tmp/s.json

What runs is DMuon's own code on the geometry Megatron would build, without building the
model: the parameter list of the stage (``geometry.gpt_param_specs``, Megatron-Core's GPT
with the local spec, via ``cost_model_lib.megatron_params``), Megatron's DDP buffer layout
and DP shards (``geometry.dmuon_part``), every rank's ``ShardedMatrix`` list
(``geometry.stage_matrices``, the function ``dmuon.sharded_matrices`` calls after its
all-gather), the owner plan (``dmuon.plan_matrices``, the planner DMuon runs) and, per
measured rank, the ``OwnerCentricNS`` executor (``dmuon.engine_for``) built on torch's fake
process group (``FakeStore``, backend ``"fake"``: that rank of a group of the stage's size,
nothing is sent; ``check_exchange=False``, the counts check being an all-to-all).

Per rank it reports the executor's construction time, the host memory construction adds
(peak RSS over the RSS before, reset per rank through ``/proc/self/clear_refs``; with
``--tracemalloc`` also Python's traced peak), the exchange tables' bytes
(``index_bytes``), the elements and fp32 bytes the rank sends and receives per step (gather
+ scatter, from the tables' ``send_counts`` / ``recv_counts``) and the NS flops of the units
it owns; per stage the max and mean of each and the plan's imbalance.  The NS flops of every
rank come from the plan (cheap: the plan is global), also when only some ranks' executors
are built.  Next to it: the cost model's prediction for the same layout
(``tools/cost_model_lib.py``, which takes its DMuon plan and exchange from the same geometry
and planner), for stage 0.

Experts (MoE with ``--ep`` > 1): DMuon's expert optimizer plans over the expert-DP group of
one EP rank; every EP rank's group has the same geometry, so one group is measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import tracemalloc
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import cost_model as cli  # noqa: E402  (model presets and flags, formatting)
import cost_model_lib as cm  # noqa: E402

ELEM_BYTES = 4  # the exchange moves fp32 momentum / update pieces


# ------------------------------------------------------------------------------ memory
def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _reset_peak_rss() -> bool:
    """Set the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss_kib() -> int:
    hwm = _status_kib("VmHWM")
    if hwm >= 0:
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ------------------------------------------------------------------------------ one part
def _dmuon_config(a):
    from megatron_muon.megatron.config import DMuonOptimizerConfig

    return DMuonOptimizerConfig(
        optimizer="dmuon", lr=1e-3, use_distributed_optimizer=True, bf16=True,
        muon_num_ns_steps=a.ns_steps, muon_split_qkv=not a.no_split_qkv,
        dmuon_split_fc1=a.split_fc1, dmuon_locality_slack=a.locality_slack,
        dmuon_log_plan=False, **({"dmuon_split": a.split} if a.split else {}),
        **({"dmuon_split_parts": a.split_parts} if a.split_parts else {}))


def build_part(specs, *, expert: bool, layout, a, cfg, model) -> dict:
    """The geometry, matrices and owner plan of DMuon's dense or expert optimizer."""
    from megatron_muon.megatron.dmuon import _unit_cost, ns_dtype, plan_matrices
    from megatron_muon.megatron.geometry import ddp_bucket_size, dmuon_part, stage_matrices

    t0 = time.perf_counter()
    dp = layout.edp if expert else layout.dp
    tsize = 1 if expert else layout.tp
    bucket = ddp_bucket_size(a.bucket_size, layout.dp,
                             overlap_grad_reduce=not a.no_overlap_grad_reduce)
    geo = dmuon_part([specs], dp_size=dp, bucket_size=bucket, expert=expert, pp_rank=a.stage)
    mats = stage_matrices(geo, tp_size=tsize, model_config=cm.model_namespace(model), cfg=cfg,
                          expert=expert, real_tp_size=layout.tp)
    t1 = time.perf_counter()
    world = dp * tsize
    cost = _unit_cost(cfg, [u.shape for m in mats for u in m.units], None)
    plan = plan_matrices(mats, world, cfg, cost)
    t2 = time.perf_counter()
    # per rank, from the plan (every rank): NS flops (its whole units' and split parts'; the
    # planner's load less the split all-reduces' price), units and parts it runs, and the
    # bytes of its split units' Gram all-reduces per step
    comm = getattr(plan, "comm", None) or [0.0] * world
    flops = [load - c for load, c in zip(plan.load, comm)]
    units = [len(plan.units_of(r)) for r in range(world)]
    splits = getattr(plan, "splits", None) or {}
    group = cm.Group(world, 1, layout.gpus_per_node)
    import torch

    _, _, allreduce = cm.split_allreduce(plan, group, cm.HARDWARE["H100"], a.ns_steps,
                                         torch.finfo(ns_dtype(cfg)).bits // 8)
    ex = cm.matrix_exchange(mats, plan, group)  # what the cost model counts, every rank
    model_ex = dict(gather_send=ex.gather_sent, gather_recv=ex.gather_recv,
                    scatter_send=ex.scatter_sent, scatter_recv=ex.scatter_recv)
    return dict(kind="expert" if expert else "dense", expert=expert, geo=geo, mats=mats,
                plan=plan, cost=cost, world=world, tsize=tsize,
                bucket_size=bucket if a.stage == 0 else None, flops=flops,
                units=units, allreduce=allreduce, model_exchange=model_ex,
                geometry_s=t1 - t0, plan_s=t2 - t1,
                buckets=len({m.bucket for m in mats}),
                pieces=sum(len(m.pieces) for m in mats),
                num_units=sum(len(m.units) for m in mats), split_units=len(splits),
                split_parts=sum(len(v.ranks) for v in splits.values()))


def measure_rank(part: dict, grank: int, cfg, traced: bool) -> dict:
    """Build this group rank's ``OwnerCentricNS`` on the fake process group and read it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_muon.megatron.dmuon import engine_for

    mats, plan, world = part["mats"], part["plan"], part["world"]
    local = part["geo"].local_numel[grank // part["tsize"]]
    dist.init_process_group("fake", store=FakeStore(), rank=grank, world_size=world)
    try:
        group = dist.group.WORLD
        if traced:
            gc.collect()
        rss0 = _status_kib("VmRSS")
        reset = _reset_peak_rss()
        t0 = time.perf_counter()
        eng = engine_for(mats, plan, group, cfg, local_numel=local, check_exchange=False)
        seconds = time.perf_counter() - t0
        peak = _peak_rss_kib()
        row = dict(rank=grank, build_s=seconds,
                   peak_rss_added_mib=(peak - rss0) / 1024 if reset and rss0 >= 0 else None)
        if traced:  # a second build under tracemalloc (it slows Python allocation down)
            del eng
            gc.collect()
            tracemalloc.start()
            eng = engine_for(mats, plan, group, cfg, local_numel=local, check_exchange=False)
            cur, tpeak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            row.update(traced_peak_mib=tpeak / 2**20, traced_kept_mib=cur / 2**20)
        ex = {}
        for kind, tables in (("gather", eng.gather_tables), ("scatter", eng.scatter_tables)):
            ex[f"{kind}_send"] = sum(sum(t.send_counts) for t in tables.values())
            ex[f"{kind}_recv"] = sum(sum(t.recv_counts) for t in tables.values())
            ex[f"{kind}_local"] = sum(h * w for t in tables.values() for _, _, h, w, _, _ in t.local)
        row.update(ex, send_elems=ex["gather_send"] + ex["scatter_send"],
                   recv_elems=ex["gather_recv"] + ex["scatter_recv"],
                   index_bytes=eng.index_bytes(), owned_units=len(eng.unit_offset),
                   owned_numel=eng.owned_numel, owned_flops=part["flops"][grank],
                   allreduce_bytes=part["allreduce"][grank], local_numel=eng.local_numel,
                   blocks=sum(t.blocks() for t in eng.gather_tables.values())
                   + sum(t.blocks() for t in eng.scatter_tables.values()))
        row["send_bytes"] = ELEM_BYTES * row["send_elems"]
        row["recv_bytes"] = ELEM_BYTES * row["recv_elems"]
        del eng
    finally:
        dist.destroy_process_group()
    return row


def _ranks_to_measure(a, world: int, expert: bool, layout) -> list:
    if a.all_ranks:
        ranks = list(range(world))
        if a.sample and a.sample < world:  # evenly spread, first and last included
            ranks = sorted({round(i * (world - 1) / (a.sample - 1)) for i in range(a.sample)}) \
                if a.sample > 1 else [0]
        return ranks
    ranks = [int(r) for r in str(a.rank).split(",")]
    stage = layout.tp * layout.dp
    if any(not 0 <= r < stage for r in ranks):
        raise SystemExit(f"--rank {a.rank}: the stage's DP x TP group has ranks 0..{stage - 1}")
    if expert:  # a stage rank's expert-DP rank (Megatron's expert order: ETP=1, EP, EDP)
        ranks = sorted({r // layout.ep for r in ranks})
    return ranks


def _stats(values: list) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return dict(max=None, mean=None)
    mean = sum(vals) / len(vals)
    return dict(max=max(vals), mean=mean, max_over_mean=max(vals) / mean if mean else None)


METRICS = ("build_s", "peak_rss_added_mib", "traced_peak_mib", "index_bytes", "send_elems",
           "recv_elems", "send_bytes", "recv_bytes", "owned_flops", "owned_units",
           "allreduce_bytes")


def run_part(part: dict, a, cfg, layout) -> dict:
    ranks = _ranks_to_measure(a, part["world"], part["expert"], layout)
    traced = a.tracemalloc if a.tracemalloc is not None else len(ranks) <= 16
    rows, t0, last = [], time.perf_counter(), time.perf_counter()
    for k, r in enumerate(ranks):
        rows.append(measure_rank(part, r, cfg, traced))
        now = time.perf_counter()
        if a.progress and (now - last >= a.progress or k + 1 == len(ranks)) and len(ranks) > 1:
            eta = (now - t0) / (k + 1) * (len(ranks) - k - 1)
            print(f"# {part['kind']}: {k + 1}/{len(ranks)} ranks built, {now - t0:.1f} s, "
                  f"eta {eta:.0f} s", file=sys.stderr, flush=True)
            last = now
    plan = part["plan"]
    summary = {m: _stats([row.get(m) for row in rows]) for m in METRICS}
    summary["plan_owned_flops"] = _stats(part["flops"])  # every rank, from the plan
    summary["plan_owned_units"] = _stats(part["units"])
    summary["plan_allreduce_bytes"] = _stats(part["allreduce"])
    return dict(
        kind=part["kind"], world=part["world"], tp_size=part["tsize"],
        bucket_size=part["bucket_size"], buckets=part["buckets"], matrices=len(part["mats"]),
        units=part["num_units"], split_units=part["split_units"],
        split_parts=part["split_parts"], pieces=part["pieces"], geometry_s=part["geometry_s"],
        plan_s=part["plan_s"], plan_imbalance=plan.imbalance, plan_digest=plan.digest,
        measured_ranks=len(rows), all_ranks_measured=len(rows) == part["world"], ranks=rows,
        summary=summary, plan_owned_flops=part["flops"], plan_owned_units=part["units"],
        plan_allreduce_bytes=part["allreduce"], cost_model_exchange=part["model_exchange"],
        plan_compute_imbalance=getattr(plan, "compute_imbalance", plan.imbalance))


# ------------------------------------------------------------------------------ output
def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.2f}"


def print_part(p: dict, verbose_rows: int) -> None:
    split = (f" ({p['split_units']} split into {p['split_parts']} parts)"
             if p["split_units"] else "")
    print(f"## {p['kind']}: group of {p['world']} ranks (TP x DP {p['tp_size']} x "
          f"{p['world'] // p['tp_size']}), {p['matrices']} matrices, {p['units']} units{split}, "
          f"{p['pieces']} pieces, {p['buckets']} buckets (bucket size {p['bucket_size']}); "
          f"geometry {p['geometry_s']:.2f} s, plan {p['plan_s']:.2f} s")
    rows = p["ranks"]
    print(f"{'rank':>5} {'build s':>8} {'+RSS MiB':>9} {'traced MiB':>10} {'tables KiB':>10} "
          f"{'blocks':>7} {'send MiB':>9} {'recv MiB':>9} {'units':>5} {'NS GFLOP':>10}")
    shown = rows if len(rows) <= verbose_rows else rows[:verbose_rows // 2] + [None] + \
        rows[-verbose_rows // 2:]
    for r in shown:
        if r is None:
            print(f"{'...':>5}")
            continue
        rss = "-" if r["peak_rss_added_mib"] is None else f"{r['peak_rss_added_mib']:.1f}"
        tr = "-" if r.get("traced_peak_mib") is None else f"{r['traced_peak_mib']:.2f}"
        print(f"{r['rank']:>5} {r['build_s']:>8.3f} {rss:>9} {tr:>10} "
              f"{r['index_bytes'] / 1024:>10.1f} {r['blocks']:>7} {_mib(r['send_bytes']):>9} "
              f"{_mib(r['recv_bytes']):>9} {r['owned_units']:>5} {r['owned_flops'] / 1e9:>10.1f}")
    s = p["summary"]
    which = "all" if p["all_ranks_measured"] else f"{p['measured_ranks']} measured"

    def mm(key, scale=1.0, fmt="{:.3f}"):
        st = s[key]
        if st["max"] is None:
            return "-"
        return f"max {fmt.format(st['max'] * scale)} / mean {fmt.format(st['mean'] * scale)}"

    print(f"# over {which} ranks: build s {mm('build_s')}; +RSS MiB "
          f"{mm('peak_rss_added_mib', fmt='{:.1f}')}; traced MiB "
          f"{mm('traced_peak_mib', fmt='{:.2f}')}; tables KiB "
          f"{mm('index_bytes', 1 / 1024, '{:.1f}')}")
    print(f"# over {which} ranks: send MiB {mm('send_bytes', 2**-20, '{:.2f}')}; recv MiB "
          f"{mm('recv_bytes', 2**-20, '{:.2f}')}")
    pf = s["plan_owned_flops"]
    print(f"# owned NS flops over all {p['world']} ranks (the plan): max {pf['max'] / 1e9:.1f} / "
          f"mean {pf['mean'] / 1e9:.1f} GFLOP = {pf['max_over_mean']:.2f}x; plan imbalance "
          f"{100 * p['plan_imbalance']:.1f}% (max/mean - 1 of the planner's load); ranks "
          f"owning nothing: {sum(1 for u in p['plan_owned_units'] if u == 0)}")
    if p["split_units"]:
        ar = s["plan_allreduce_bytes"]
        print(f"# split units' Gram all-reduces per step (the plan, every rank): max "
              f"{ar['max'] / 2**20:.2f} / mean {ar['mean'] / 2**20:.2f} MiB per rank; NS "
              f"imbalance without their price {100 * p['plan_compute_imbalance']:.1f}%")


def cost_model_prediction(model, layout, run, hw) -> dict:
    dm = cm.predict(model, layout, hw, "dmuon", run)
    ad = cm.predict(model, layout, hw, "adamw", run)
    return dict(hardware=hw.name, imbalance=dm.imbalance, muon_recv_bytes=dm.muon_recv_bytes,
                muon_sent_bytes=dm.muon_sent_bytes, ns_s=dm.breakdown["ns"],
                muon_comm_s=dm.breakdown["muon_comm"], opt_s=dm.opt_s, exposed_s=dm.exposed_s,
                step_s=dm.step_s, adamw_step_s=ad.step_s,
                overhead_vs_adamw=dm.step_s / ad.step_s - 1, notes=dm.notes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (Megatron flag names override the preset)")
    g.add_argument("--preset", dest="model", default="llama3-8b", choices=sorted(cm.MODELS))
    for flag in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads",
                 "num-query-groups", "kv-channels", "num-experts", "moe-ffn-hidden-size",
                 "vocab-size"):
        g.add_argument(f"--{flag}", type=int, default=None)
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=None)
    g = p.add_argument_group("layout")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--dp", type=int, default=1)
    g.add_argument("--ep", type=int, default=1, help="expert parallel (expert TP is 1)")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--stage", type=int, default=0, help="pipeline stage (default 0)")
    g = p.add_argument_group("which ranks (of the stage's DP x TP group)")
    g.add_argument("--rank", default="0", help="group rank(s), comma list (default 0)")
    g.add_argument("--all-ranks", action="store_true", help="every rank of the stage")
    g.add_argument("--sample", type=int, default=None,
                   help="with --all-ranks: build only this many executors, evenly spread (the "
                        "plan's statistics still cover every rank)")
    g = p.add_argument_group("DDP and DMuon settings")
    g.add_argument("--bucket-size", type=int, default=None,
                   help="DDP bucket_size (default Megatron's max(40M, 1M x DP))")
    g.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="overlap_grad_reduce=False: one bucket per buffer")
    g.add_argument("--ns-steps", type=int, default=5)
    g.add_argument("--no-split-qkv", action="store_true")
    g.add_argument("--split-fc1", action="store_true")
    g.add_argument("--locality-slack", type=float, default=0.03)
    g.add_argument("--split", choices=("auto", "off"), default=None,
                   help="dmuon_split: the planner splits units' NS where it pays (default: "
                        "DMuon's default)")
    g.add_argument("--split-parts", type=int, default=None,
                   help="dmuon_split_parts: split every unit into this many parts (tests); the "
                        "cost model is then not compared")
    g = p.add_argument_group("cost model and output")
    g.add_argument("--hardware", default="H100", help="cost model preset (H100, H200, A100, A800)")
    g.add_argument("--global-batch", type=int, default=1024)
    g.add_argument("--tracemalloc", action=argparse.BooleanOptionalAction, default=None,
                   help="also build each executor under tracemalloc (default: when at most 16 "
                        "ranks are built)")
    g.add_argument("--progress", type=float, default=10.0,
                   help="seconds between progress lines on stderr (0: none)")
    g.add_argument("--rows", type=int, default=16, help="per-rank rows to print")
    g.add_argument("--out", default=None, help="write everything as JSON here")
    a = p.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t_start = time.perf_counter()
    model = cli.model_from_args(a)
    layout = cm.Layout(tp=a.tp, pp=a.pp, dp=a.dp, ep=a.ep, gpus_per_node=a.gpus_per_node)
    layout.check()
    if not 0 <= a.stage < a.pp:
        raise SystemExit(f"--stage must be in [0, {a.pp})")
    run = cm.RunConfig(global_batch=a.global_batch, ns_steps=a.ns_steps,
                       split_qkv=not a.no_split_qkv, split_fc1=a.split_fc1,
                       bucket_elems=a.bucket_size, locality_slack=a.locality_slack,
                       overlap_grad_reduce=not a.no_overlap_grad_reduce,
                       dmuon_split=a.split or "auto")
    cfg = _dmuon_config(a)
    specs = cm.megatron_params(model, layout, run, pp_rank=a.stage)
    kinds = [False] + ([True] if model.num_experts and a.ep > 1 else [])
    load = os.getloadavg()
    print(f"# bench_scale: {model.name} stage {a.stage} of TP{a.tp} x PP{a.pp} x DP{a.dp}"
          f"{f' (EP{a.ep})' if a.ep > 1 else ''} = {layout.world} GPUs; {len(specs)} parameters "
          f"in the stage, {sum(s.numel for s in specs if s.muon) / 1e6:.1f} M elements in Muon "
          f"matrices (TP-local); fake process group, nothing sent")
    print(f"# machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f} at the start")
    built = [build_part(specs, expert=expert, layout=layout, a=a, cfg=cfg, model=model)
             for expert in kinds]
    # Everything allocated so far (torch, Megatron, the matrices, the plans) is long-lived:
    # out of the garbage collector's scans, whose full passes over that heap would otherwise
    # dominate the construction times measured below (~0.2 s each on this machine).
    gc.collect()
    gc.freeze()
    parts = []
    try:
        for part in built:
            res = run_part(part, a, cfg, layout)
            print_part(res, a.rows)
            parts.append(res)
    finally:
        gc.unfreeze()
    pred = None
    if a.stage == 0 and not a.split_parts:
        pred = cost_model_prediction(model, layout, run, cm.HARDWARE[a.hardware.upper()])
        # the busiest rank of each part, exchange + split all-reduces (as the cost model adds)
        measured_recv = sum(max((r["recv_bytes"] + r["allreduce_bytes"] for r in p["ranks"]),
                                default=0) for p in parts)
        every = all(p["all_ranks_measured"] for p in parts)
        print(f"# cost model ({pred['hardware']}, stage 0): imbalance "
              f"{100 * pred['imbalance']:.1f}% (measured plan "
              f"{100 * max(p['plan_imbalance'] for p in parts):.1f}%); busiest rank receives "
              f"{pred['muon_recv_bytes'] / 2**20:.2f} MiB (measured "
              f"{measured_recv / 2**20:.2f} MiB over {'all' if every else 'the measured'} ranks)"
              f"; NS {1e3 * pred['ns_s']:.1f} ms, exchange {1e3 * pred['muon_comm_s']:.1f} ms, "
              f"exposed {1e3 * pred['exposed_s']:.1f} ms, step {pred['step_s']:.2f} s = "
              f"{100 * pred['overhead_vs_adamw']:+.2f}% vs AdamW")
    else:
        print("# cost model: not compared (it models stage 0, without forced split parts)")
    total = time.perf_counter() - t_start
    print(f"# total {total:.1f} s")
    if a.out:
        out = dict(command="python tools/bench_scale.py " + " ".join(sys.argv[1:] if argv is None
                                                                       else argv),
                   model=asdict(model), layout=dict(tp=a.tp, pp=a.pp, dp=a.dp, ep=a.ep,
                                                       stage=a.stage, world=layout.world),
                   machine=dict(cpus=os.cpu_count(), loadavg_start=load,
                                loadavg_end=os.getloadavg(), python=platform.python_version()),
                   parts=parts, cost_model=pred, total_s=total)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
