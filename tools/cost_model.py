"""Cluster cost model CLI: predict, calibrate on this CPU, validate, compare with the papers.

Predict a sweep (one table row per GPU count and mode):

    python tools/cost_model.py --model llama3-8b --hardware H100 --gpus 8-4096
    python tools/cost_model.py --model qwen3-30b-a3b --ep 8 --modes adamw,mcore_layerwise,dmuon

Calibrate the 'cpu' profile (NS matmul rate, gloo all_to_all / all_gather bandwidth and
latency, elementwise costs), measured with the same number of 1-thread ranks as the bench:

    python tools/cost_model.py --calibrate-cpu --nproc 4

Predict the measured CPU benchmark and print predicted vs measured side by side.  Without
--bench-json it calibrates and runs ``tools/bench_optimizer.py`` back to back (~1 min; the
machine is shared, so both should see the same load); with it, it reads the results and the
--profile given:

    python tools/cost_model.py --validate --profile /tmp/p.json          # calibrate + bench
    python tools/cost_model.py --validate --bench-json /tmp/bench_dp4.json --profile /tmp/p.json

Published claims next to the model's predictions, and the plots:

    python tools/cost_model.py --claims
    python tools/cost_model.py --plot docs/cost_model

The model, its assumptions and its limits: ``tools/cost_model_lib.py`` and
``docs/cost_model.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # the model, also when imported as tools.cost_model

import cost_model_lib as cm  # noqa: E402

# A fresh calibration goes here unless --profile says otherwise; the profiles behind the
# documented tables live in docs/cost_model/ and are named explicitly in their commands.
DEFAULT_PROFILE = Path(tempfile.gettempdir()) / "megatron_muon_cpu_profile.json"
BENCH_OPT_NAMES = {"adam": "adamw", "muon_naive": "muon_naive", "dmuon": "dmuon"}


# ----------------------------------------------------------------------------- calibration
def _timeit(fn, min_reps: int = 3, budget: float = 1.0) -> float:
    """Fastest seconds of ``fn()`` over at least ``min_reps`` runs or ``budget`` seconds.

    The fastest run, not the median: the development machines are shared with other jobs,
    and the slow runs measure them, not us."""
    times = []
    t_end = time.perf_counter() + budget
    while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def calibrate_worker(ns_shapes: list, a2a_sizes: list, ag_sizes: list, elems: int,
                     budget: float, pair_groups: bool = False) -> dict:
    """Runs on every rank at once (one thread each), so contention matches the benchmark.

    ``pair_groups``: also time the collectives of groups of 2 neighbouring ranks (the TP
    groups of TP2) where the half-size groups are not of size 2 (world >= 8)."""
    import torch
    import torch.distributed as dist

    from megatron_muon.core.newton_schulz import newton_schulz, ns_flops

    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict = {"ns": [], "a2a": [], "ag": []}

    def synced(fn, reps=3):
        """Every rank runs ``fn`` at once (as in a step); the median of ``reps``, the
        statistic the benchmark reports for its steps."""
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    # the two barriers around every timed call cost something of their own: measure them
    barrier = synced(lambda: None, reps=10)
    out["barrier_s"] = barrier

    def timed(fn, reps):
        return max(1e-7, synced(fn, reps) - barrier)

    torch.manual_seed(rank)
    for b, m, n in ns_shapes:  # NS exactly as the optimizer runs it (fp32, quintic, 5 steps)
        x = torch.randn(b, m, n)
        newton_schulz(x, 5, "quintic", dtype=torch.float32)
        t = timed(lambda: newton_schulz(x, 5, "quintic", dtype=torch.float32), reps=3)
        out["ns"].append((min(m, n), max(m, n), b, b * ns_flops(m, n, 5) / t))
    for per_peer in a2a_sizes:  # fp32 elements per peer
        send = torch.randn(per_peer * world)
        recv = torch.empty_like(send)
        t = timed(lambda: dist.all_to_all_single(recv, send), reps=4)
        out["a2a"].append(((world - 1) * per_peer * 4, t))
    for per_rank in ag_sizes:
        src = torch.randn(per_rank)
        dst = torch.empty(per_rank * world)
        t = timed(lambda: dist.all_gather_into_tensor(dst, src), reps=4)
        out["ag"].append(((world - 1) * per_rank * 4, t))
    small = torch.zeros(2)
    out["allreduce_lat"] = timed(lambda: dist.all_reduce(small), reps=10)
    # half-size groups at stride 2 (the DP groups of TP2), all of them at once, as in a step
    half = world // 2
    out["ag_half"], out["a2a_half"] = [], []
    if half >= 2:
        groups = [dist.new_group(list(range(s, world, 2))) for s in range(2)]
        mine = groups[rank % 2]
        for per_rank in ag_sizes:
            src = torch.randn(per_rank)
            dst = torch.empty(per_rank * half)
            t = timed(lambda: dist.all_gather_into_tensor(dst, src, group=mine), reps=4)
            out["ag_half"].append(((half - 1) * per_rank * 4, t))
        for per_peer in a2a_sizes:
            send = torch.randn(per_peer * half)
            recv = torch.empty_like(send)
            t = timed(lambda: dist.all_to_all_single(recv, send, group=mine), reps=4)
            out["a2a_half"].append(((half - 1) * per_peer * 4, t))
    out["ag_pair"], out["a2a_pair"] = [], []
    if pair_groups and world >= 4 and half != 2 and world % 2 == 0:
        pairs = [dist.new_group([s, s + 1]) for s in range(0, world, 2)]
        mine = pairs[rank // 2]
        for per_rank in ag_sizes:
            src = torch.randn(per_rank)
            dst = torch.empty(per_rank * 2)
            t = timed(lambda: dist.all_gather_into_tensor(dst, src, group=mine), reps=4)
            out["ag_pair"].append((per_rank * 4, t))
        for per_peer in a2a_sizes:
            send = torch.randn(per_peer * 2)
            recv = torch.empty_like(send)
            t = timed(lambda: dist.all_to_all_single(recv, send, group=mine), reps=4)
            out["a2a_pair"].append((per_peer * 4, t))

    # Elementwise costs per element, on ``elems`` fp32 elements (all ranks at once).
    n = elems
    dist.barrier()
    params = [torch.nn.Parameter(torch.randn(n // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    adam = torch.optim.AdamW(params, lr=1e-3)
    adam.step()
    # all ranks at once, barrier-synchronised, like the step they model (an unsynchronised
    # loop would catch runs in which the other ranks were idle and look twice as fast)
    out["adam_s_per_elem"] = timed(adam.step, reps=5) / n
    g, buf, p = torch.randn(n), torch.randn(n), torch.randn(n)
    idx = torch.arange(n)

    def muon_elem():  # ShardedMuonStep + the shard side of OwnerCentricNS.run
        flat = torch.zeros(n)
        buf.mul_(0.95).add_(g)
        flat.copy_(buf)
        send = flat.index_select(0, idx)
        o = torch.zeros_like(flat)
        o.index_copy_(0, idx, send)
        p.mul_(1 - 1e-5).add_(o, alpha=-1e-3)

    def owned_elem():  # the owned-buffer side: gather in, NS output out, scatter out
        owned = torch.zeros(n)
        owned.index_copy_(0, idx, g)
        res = torch.empty_like(owned)
        res.copy_(owned).mul_(1.5)
        res.index_select(0, idx)

    def copy_pass():
        buf.copy_(g)

    out["muon_s_per_elem"] = timed(muon_elem, reps=5) / n
    out["owned_s_per_elem"] = timed(owned_elem, reps=5) / n
    out["copy_s_per_elem"] = timed(copy_pass, reps=5) / n
    tiny = torch.zeros(4)
    out["op_latency_s"] = _timeit(lambda: [tiny.add_(1) for _ in range(200)], budget=0.3) / 200
    return out


def _fit_line(points: list) -> tuple[float, float]:
    """Least squares t = lat + bytes / bw; returns (bw, lat)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    lat = max(0.0, my - slope * mx)
    return (1.0 / slope if slope > 0 else 1e12), lat


def calibration_kwargs(quick: bool = False, ns_shapes: Optional[list] = None) -> dict:
    """``calibrate_worker``'s arguments: NS on ``ns_shapes`` ((batch, m, n), default the
    bench's default GPT), collectives on three sizes each, elementwise on 2M elements."""
    default = [(8, 128, 128), (8, 384, 384), (4, 384, 1536)] if not quick else \
        [(2, 128, 128), (1, 384, 384)]
    return dict(ns_shapes=[tuple(x) for x in (ns_shapes or default)],
                a2a_sizes=[1024, 65536, 524288], ag_sizes=[1024, 262144, 1048576],
                elems=1 << 21, budget=0.5 if not quick else 0.1)


def profile_from_results(res: list, nproc: int, wall: float) -> dict:
    """The CPU profile (the dict ``cost_model_lib.cpu_hardware`` reads) from every rank's
    ``calibrate_worker`` result: the slowest rank's rates and times (the bench takes the max
    over ranks too), straight lines t = latency + bytes / bandwidth through the collectives."""
    ns_points = []
    for i, (s, big, b, _) in enumerate(res[0]["ns"]):
        ns_points.append((s, min(r["ns"][i][3] for r in res)))
    merged_pts = {}
    for s, rate in ns_points:  # several shapes with one small side: keep the mean
        merged_pts.setdefault(s, []).append(rate)
    ns_rate_points = sorted((s, statistics.mean(v)) for s, v in merged_pts.items())

    def worst(key):
        return [(res[0][key][i][0], max(r[key][i][1] for r in res))
                for i in range(len(res[0][key]))]

    a2a = _fit_line(worst("a2a"))
    ag = _fit_line(worst("ag"))
    ar_lat = max(r["allreduce_lat"] for r in res)
    coll = {"all_to_all": list(a2a), "all_gather": list(ag), "all_reduce": [a2a[0], ar_lat]}
    if res[0]["ag_half"]:  # groups of nproc / 2: 'kind@size' (see cost_model_lib.collective_time)
        coll[f"all_gather@{nproc // 2}"] = list(_fit_line(worst("ag_half")))
        coll[f"all_to_all@{nproc // 2}"] = list(_fit_line(worst("a2a_half")))
    if res[0].get("ag_pair"):  # groups of 2 neighbours (TP2's TP groups)
        coll["all_gather@2"] = list(_fit_line(worst("ag_pair")))
        coll["all_to_all@2"] = list(_fit_line(worst("a2a_pair")))
    return dict(
        when=time.strftime("%Y-%m-%d %H:%M"), nproc=nproc, wall_s=round(wall, 1),
        load_avg=os.getloadavg()[0], cpu_count=os.cpu_count(),
        ns_rate_points=ns_rate_points, ns_raw=[r["ns"] for r in res],
        collectives=coll,
        a2a_raw=worst("a2a"), ag_raw=worst("ag"),
        adam_s_per_elem=max(r["adam_s_per_elem"] for r in res),
        muon_s_per_elem=max(r["muon_s_per_elem"] for r in res),
        owned_s_per_elem=max(r["owned_s_per_elem"] for r in res),
        copy_s_per_elem=max(r["copy_s_per_elem"] for r in res),
        op_latency_s=max(r["op_latency_s"] for r in res),
        barrier_s=max(r["barrier_s"] for r in res),
        copy_bw=8.0 / max(r["copy_s_per_elem"] for r in res),
    )


def calibrate_cpu(nproc: int, out_path: Path, quick: bool = False) -> dict:
    from megatron_muon.testing.launch import run_ranks

    t0 = time.time()
    res = run_ranks("tools.cost_model:calibrate_worker", nproc, calibration_kwargs(quick),
                    timeout=300, env={"PYTHONPATH": str(ROOT)})
    prof = profile_from_results(res, nproc, time.time() - t0)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(prof, indent=1))
    return prof


def print_profile(prof: dict) -> None:
    print(f"# cpu profile: {prof['nproc']} ranks x 1 thread, {prof['when']}, load avg "
          f"{prof['load_avg']:.1f} on {prof['cpu_count']} cores, calibration took {prof['wall_s']}s")
    for s, r in prof["ns_rate_points"]:
        print(f"  NS rate (fp32, min side {s:5d}): {r / 1e9:7.2f} GFLOP/s per rank")
    for k, (bw, lat) in prof["collectives"].items():
        print(f"  gloo {k:11s}: {bw / 1e6:8.1f} MB/s received per rank, latency {lat * 1e6:8.1f} us")
    for k in ("adam_s_per_elem", "muon_s_per_elem", "owned_s_per_elem", "copy_s_per_elem"):
        print(f"  {k:17s}: {prof[k] * 1e9:6.2f} ns")
    print(f"  torch op latency : {prof['op_latency_s'] * 1e6:6.2f} us; barrier "
          f"{prof.get('barrier_s', 0) * 1e3:.2f} ms")


# ----------------------------------------------------------------------------- helpers
def parse_gpus(text: str) -> list[int]:
    """'8-4096' (powers of two) or '8,64,512'."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        out, w = [], lo
        while w <= hi:
            out.append(w)
            w *= 2
        return out
    return [int(x) for x in text.split(",") if x]


def model_from_args(a) -> cm.ModelConfig:
    m = cm.MODELS[a.model]
    over = {}
    for flag, field in (("num_layers", "num_layers"), ("hidden_size", "hidden_size"),
                        ("ffn_hidden_size", "ffn_hidden_size"),
                        ("num_attention_heads", "num_attention_heads"),
                        ("num_query_groups", "num_query_groups"), ("kv_channels", "kv_channels"),
                        ("num_experts", "num_experts"),
                        ("moe_ffn_hidden_size", "moe_ffn_hidden_size"),
                        ("moe_router_topk", "moe_topk"), ("vocab_size", "vocab_size"),
                        ("seq_length", "seq_length")):
        v = getattr(a, flag, None)
        if v is not None:
            over[field] = v
    if getattr(a, "swiglu", None) is not None:
        over["swiglu"] = a.swiglu
    return replace(m, **over) if over else m


def hardware(name: str, profile: Path) -> cm.Hardware:
    if name.lower() == "cpu":
        if not profile.exists():
            raise SystemExit(f"no CPU profile at {profile}: run --calibrate-cpu first")
        return cm.load_cpu_profile(str(profile))
    return cm.HARDWARE[name.upper()]


def fmt_bytes(b: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= div:
            return f"{b / div:7.1f} {unit}"
    return f"{b:7.0f} B  "


def fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:8.2f} s "
    if s >= 1e-3:
        return f"{s * 1e3:8.1f} ms"
    return f"{s * 1e6:8.1f} us"


def print_table(preds: list, title: str) -> None:
    print(title)
    hdr = (f"{'GPUs':>5s} {'TPxPPxDP(EP)':>13s} {'mode':16s} {'opt step':>11s} {'exposed':>11s} "
           f"{'step':>11s} {'vs AdamW':>8s} {'Muon recv/rank':>14s} {'opt recv/rank':>13s} "
           f"{'mem/rank':>11s} {'imbal':>6s}  notes")
    print(hdr)
    base = {}
    for p in preds:
        if p.mode == "adamw":
            base[p.world] = p.step_s
    for p in preds:
        lay = p.layout
        lt = f"{lay['tp']}x{lay['pp']}x{lay['dp']}" + (f"({lay['ep']})" if lay["ep"] > 1 else "")
        rel = f"{100 * (p.step_s / base[p.world] - 1):+7.2f}%" if p.world in base else "      -"
        note = "; ".join(n for n in p.notes if not n.startswith("owners:"))
        print(f"{p.world:5d} {lt:>13s} {p.mode:16s} {fmt_s(p.opt_s)} {fmt_s(p.exposed_s)} "
              f"{fmt_s(p.step_s)} {rel:>8s} {fmt_bytes(p.muon_recv_bytes):>14s} "
              f"{fmt_bytes(p.opt_recv_bytes):>13s} {fmt_bytes(p.memory_bytes):>11s} "
              f"{100 * p.imbalance:5.1f}%  {note}")


# ----------------------------------------------------------------------------- validate
def bench_run_config(a) -> cm.RunConfig:
    """The settings of tools/bench_optimizer.py: fp32 params and grads, fp32 NS ('highest'),
    one bucket, no overlap, a one-pass main-param copy (fp32 main params are views)."""
    return cm.RunConfig(global_batch=a.bench_nproc // a.bench_tp * 2, micro_batch=2,
                        ns_steps=5, param_bytes=4, grad_bytes=4, muon_comm_bytes=4,
                        ns_dtype_bytes=4, overlap_grad_reduce=False, overlap_param_gather=False,
                        main_copy_passes=1, step_overhead_s=None)


def bench_model(a) -> cm.ModelConfig:
    return cm.ModelConfig(name="bench-tiny", num_layers=a.bench_layers, hidden_size=a.bench_hidden,
                          ffn_hidden_size=a.bench_ffn, num_attention_heads=a.bench_heads,
                          vocab_size=256, normalization="LayerNorm", seq_length=32)


def run_bench(path: Path, nproc: int, tp: int) -> None:
    cmd = [sys.executable, str(ROOT / "tools" / "bench_optimizer.py"), "--nproc", str(nproc),
           "--tp", str(tp), "--optimizers", "adam,muon_naive,dmuon", "--json", str(path)]
    print("# running:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def cpu_overhead(prof: dict, model: cm.ModelConfig, mode: str) -> float:
    """Python cost of Megatron's optimizer.step() on CPU: ~OPS_PER_PARAM torch ops per
    parameter (copy grads, the update, copy params back, zero grads, grad-norm bookkeeping;
    a count read off the code, not measured) at the measured op latency."""
    n = len(cm.stage_tensors(model, cm.Layout()))
    ops = {"adamw": 20, "muon_naive": 30, "dmuon": 30}.get(mode, 25)
    # + the barrier after the step that the bench's timer includes (half a barrier pair)
    return prof["op_latency_s"] * ops * n + prof.get("barrier_s", 0.0) / 2


def predict_bench(hw: cm.Hardware, prof: dict, model: cm.ModelConfig, layout: cm.Layout,
                  mode: str, grad_norm_calls: int = 1, ns_dtype_bytes: int = 4) -> cm.Prediction:
    """The model's prediction of one ``tools/bench_optimizer.py`` row: the bench's settings
    (``bench_run_config``: fp32 params and grads, one bucket, nothing overlapped), the
    calibrated per-step Python overhead (``cpu_overhead``) and ``grad_norm_calls``
    all-reduces of the grad norm (1 with clipping)."""
    run = cm.RunConfig(global_batch=layout.dp * 2, micro_batch=2, ns_steps=5, param_bytes=4,
                       grad_bytes=4, muon_comm_bytes=4, ns_dtype_bytes=ns_dtype_bytes,
                       overlap_grad_reduce=False, overlap_param_gather=False,
                       main_copy_passes=1, step_overhead_s=cpu_overhead(prof, model, mode),
                       grad_norm_calls=grad_norm_calls)
    return cm.predict(model, layout, hw, mode, run)


def validate(a) -> int:
    profile_path = Path(a.profile)
    bench_path = Path(a.bench_json) if a.bench_json else Path("/tmp/bench_cost_model.json")
    if not a.bench_json:
        # Measure both now, back to back, so that they see the same machine: calibrate,
        # run the bench, and say how busy the machine was.
        print(f"# calibrating ({a.bench_nproc} ranks), load avg {os.getloadavg()[0]:.1f}",
              flush=True)
        calibrate_cpu(a.bench_nproc, profile_path)
        print(f"# benchmark, load avg {os.getloadavg()[0]:.1f}", flush=True)
        run_bench(bench_path, a.bench_nproc, a.bench_tp)
        print(f"# done, load avg {os.getloadavg()[0]:.1f}", flush=True)
    elif not profile_path.exists():
        print(f"# no CPU profile at {profile_path}: calibrating first", flush=True)
        calibrate_cpu(a.bench_nproc, profile_path)
    prof = json.loads(profile_path.read_text())
    hw = cm.load_cpu_profile(str(profile_path))
    res = json.loads(bench_path.read_text())
    nproc = len(res)
    if nproc != a.bench_nproc:
        print(f"# bench JSON has {nproc} ranks (not --bench-nproc {a.bench_nproc}); using {nproc}")
        a.bench_nproc = nproc
    model = bench_model(a)
    layout = cm.Layout(tp=a.bench_tp, pp=1, dp=nproc // a.bench_tp, gpus_per_node=nproc)
    print_profile(prof)
    print(f"# validate: {bench_path} ({nproc} ranks, TP{a.bench_tp} x DP{nproc // a.bench_tp}, "
          f"{model.num_layers} layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size})")
    print(f"# command: python tools/cost_model.py {' '.join(sys.argv[1:])}")
    print(f"{'optimizer':11s} {'pred step':>10s} {'meas step':>10s} {'err':>7s} | "
          f"{'pred recv':>10s} {'meas recv':>10s} {'err':>7s} | {'pred state':>10s} "
          f"{'meas state':>10s} | {'pred imb':>8s} {'meas imb':>8s} | predicted breakdown")
    rows = []
    for bench_name, mode in BENCH_OPT_NAMES.items():
        if bench_name not in res[0] or "error" in res[0][bench_name]:
            print(f"{bench_name:11s} not in the bench results")
            continue
        meas = max(r[bench_name]["step_s"] for r in res)
        # clip_grad=0: Megatron's plain AdamW skips the grad norm, the chained (Muon +
        # AdamW) optimizer always all-reduces it
        run = replace(bench_run_config(a), step_overhead_s=cpu_overhead(prof, model, mode),
                      grad_norm_calls=0 if mode == "adamw" else 1)
        p = cm.predict(model, layout, hw, mode, run)
        err = 100 * (p.opt_s / meas - 1)
        m_recv = max(r[bench_name].get("received", 0) for r in res)
        m_state = max(r[bench_name].get("state", 0) for r in res)
        m_imb = res[0][bench_name].get("imbalance")
        recv_err = f"{100 * (p.muon_recv_bytes / m_recv - 1):+6.1f}%" if m_recv else "     -"
        bd = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.breakdown.items()
                       if v > 0 and not k.endswith("_exposed"))
        state_meas = f"{m_state / 1024:8.0f}K" if m_state else "         -"
        imb_meas = f"{100 * m_imb:7.1f}%" if m_imb is not None else "       -"
        print(f"{bench_name:11s} {p.opt_s * 1e3:8.1f}ms {meas * 1e3:8.1f}ms {err:+6.1f}% | "
              f"{p.muon_recv_bytes / 1024:8.0f}K {m_recv / 1024:9.0f}K {recv_err:>7s} | "
              f"{p.muon_state_bytes / 1024:9.0f}K {state_meas} | {100 * p.imbalance:7.1f}% {imb_meas} "
              f"| ms: {bd}")
        rows.append(dict(optimizer=bench_name, predicted_s=p.opt_s, measured_s=meas,
                         err_pct=err, breakdown=p.breakdown))
    if rows:
        worst = max(abs(r["err_pct"]) for r in rows)
        print(f"# largest step-time error {worst:.1f}% ({'within' if worst <= 25 else 'outside'}"
              f" the 25% aim)")
        if "muon_naive" in [r["optimizer"] for r in rows] and "dmuon" in [r["optimizer"] for r in rows]:
            d = {r["optimizer"]: r for r in rows}
            print(f"# naive/dmuon speedup: predicted "
                  f"{d['muon_naive']['predicted_s'] / d['dmuon']['predicted_s']:.2f}x, measured "
                  f"{d['muon_naive']['measured_s'] / d['dmuon']['measured_s']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


# ----------------------------------------------------------------------------- claims
def claims_rows(overlap_eff: float = 0.5) -> list[dict]:
    """Each published claim, the settings we model it with, the model's numbers, a verdict
    and why (the reasons are the model's own breakdown, stated with the numbers)."""
    H100, A100 = cm.HARDWARE["H100"], cm.HARDWARE["A100"]
    base = cm.RunConfig(overlap_efficiency=overlap_eff)
    rows = []

    def muon_part(p):
        return p.breakdown["ns"] + p.breakdown["muon_comm"] + p.breakdown["owned"]

    # 1. DMuon optimizer step vs naive distributed Muon: 6.85x - 163x.
    got = []
    for name, tp, ep in (("llama3-8b", 1, 1), ("llama3-70b", 8, 1), ("qwen3-30b-a3b", 1, 8)):
        for w in (8, 16, 32, 64, 128, 256, 512, 1024):
            lay = cm.layout_for(w, tp=tp, ep=ep)
            nv = cm.predict(cm.MODELS[name], lay, H100, "muon_naive", base)
            dm = cm.predict(cm.MODELS[name], lay, H100, "dmuon", base)
            got.append((name, w, nv.opt_s / dm.opt_s, muon_part(nv) / muon_part(dm),
                        dm.imbalance))
    at8 = [g for g in got if g[1] == 8 and g[0] != "qwen3-30b-a3b"]
    top = max(got, key=lambda g: g[2])
    rows.append(dict(
        claim="DMuon optimizer step 6.85x-163x faster than naive distributed Muon",
        setting="H100; Llama-3-8B-like TP1, Llama-3-70B-like TP8, Qwen3-30B-A3B-like EP8; "
                "8-1024 GPUs; optimizer.step() with param all-gather overlapped",
        predicted=f"{min(g[2] for g in got):.1f}x-{top[2]:.1f}x (dense models at 8 GPUs "
                  f"{min(g[2] for g in at8):.1f}x-{max(g[2] for g in at8):.1f}x; largest: "
                  f"{top[0]} at {top[1]} GPUs)",
        verdict=("agrees" if all(abs(g[2] / 6.85 - 1) <= 0.25 for g in at8) else "disagrees")
        + " at the low end (one node); " + ("reaches" if top[2] >= 163 else "falls short of")
        + " the high end",
        why="Per rank DMuon divides NS by N and moves 2(N-1)/N^2 of the bytes naive moves "
            f"(N-1)/N of, so the speedup grows ~N on one node ({min(g[2] for g in at8):.1f}x-"
            f"{max(g[2] for g in at8):.1f}x at N=8, the paper's "
            "6.85x) and keeps growing past one node: where ranks outnumber the large units "
            "the planner splits a unit's Newton-Schulz across several ranks (plan imbalance "
            f"{top[4]:.1%} at {top[1]} GPUs), so DMuon's NS per rank falls ~1/N while naive "
            "still runs every NS on every rank and all-gathers every matrix. The model reaches "
            f"{top[2]:.0f}x at {top[1]} GPUs ({top[0]}); without split units "
            "(dmuon_split=off) the busiest owner holds one whole fc1/fc2 and the ratio "
            "saturates (the model topped out at 87x before splits; batched bf16 NS at 60% of "
            "peak, one all-to-all per "
            "bucket). Qwen3-30B-A3B-like with EP8 gains least at 8 GPUs (1.2x): its experts "
            "already live whole on one EP rank (expert-DP size 1), so naive is not redundant "
            "for them.",
        detail="; ".join(f"{n} {w}: {r:.1f}x (Muon part {m:.1f}x)" for n, w, r, m, _ in got
                         if w in (8, 64, 1024))))

    # 2. DMuon end-to-end: +1.7% to +3.4% step time vs AdamW on 16 nodes (128 GPUs).
    parts, dm_vals, ov_vals, exposed = [], [], [], []
    for gbs in (1024, 256):
        run = replace(base, global_batch=gbs)
        for name, tp, pp, ep in (("llama3-8b", 1, 1, 1), ("llama3-70b", 8, 2, 1),
                                 ("qwen3-30b-a3b", 1, 1, 8)):
            lay = cm.layout_for(128, tp=tp, pp=pp, ep=ep)
            ad = cm.predict(cm.MODELS[name], lay, H100, "adamw", run)
            for mode in ("dmuon", "dmuon_overlap"):
                p = cm.predict(cm.MODELS[name], lay, H100, mode, run)
                d = 100 * (p.step_s / ad.step_s - 1)
                (dm_vals if mode == "dmuon" else ov_vals).append(d)
                if mode == "dmuon":
                    exposed.append(p.exposed_s - ad.exposed_s)
                parts.append(f"{name} batch {gbs} {mode}: {d:+.2f}%")
    rows.append(dict(
        claim="DMuon end-to-end step +1.7% to +3.4% vs AdamW on 16 nodes",
        setting="128 H100, MFU 0.40, global batch 1024 and 256 sequences; Llama-3-8B-like "
                "TP1, Llama-3-70B-like TP8xPP2, Qwen3-30B-A3B-like EP8",
        predicted=f"dmuon {min(dm_vals):+.2f}% to {max(dm_vals):+.2f}%; dmuon_overlap "
                  f"{min(ov_vals):+.2f}% to {max(ov_vals):+.2f}%",
        verdict=_verdict_range((min(dm_vals), max(dm_vals)), (1.7, 3.4)) + " (dmuon)",
        why="The overhead is DMuon's exposed step (exchange + NS, "
            f"{1e3 * min(exposed):.0f}-{1e3 * max(exposed):.0f} ms more than AdamW here) over a "
            "forward/backward the model derives from an assumed MFU and batch, so the "
            "percentage scales inversely with the batch: the claim's range sits inside the "
            f"model's spread. With overlap the model hides most of it (window = {overlap_eff:g} x "
            "(the backward after the first bucket - the gradient reduce-scatter)) except "
            "where the reduce-scatter fills the backward (Qwen3-like at batch 256); the "
            "paper's +1.7-3.4% is closer to the non-overlapped prediction or to a much "
            "smaller window.",
        detail="; ".join(parts)))

    # 3. MatrixFSDP: 4.2x (1 node) and 54.6x (8 nodes, 64 A100) vs reconstruction.
    parts, got3 = [], {}
    for name in ("gpt-1.3b", "llama3-8b"):
        for w in (8, 64):
            lay = cm.layout_for(w, gpus_per_node=8)
            rc = cm.predict(cm.MODELS[name], lay, A100, "fsdp2_reconstruct", base)
            mf = cm.predict(cm.MODELS[name], lay, A100, "matrix_zero3", base)
            got3[(name, w)] = rc.opt_s / mf.opt_s
            parts.append(f"{name} {w} A100: {rc.opt_s * 1e3:.0f} ms / {mf.opt_s * 1e3:.0f} ms "
                         f"= {rc.opt_s / mf.opt_s:.1f}x (MatrixFSDP imbalance "
                         f"{100 * mf.imbalance:.0f}%)")
    one = [v for (n, w), v in got3.items() if w == 8]
    eight = [v for (n, w), v in got3.items() if w == 64]
    rows.append(dict(
        claim="MatrixFSDP optimizer step 4.2x (1 node) / 54.6x (8 nodes, 64 A100) vs "
              "FSDP2-Muon reconstruction",
        setting="A100, ZeRO-3, TP1, GPT-1.3B-like and Llama-3-8B-like; the baseline "
                "all-gathers every matrix (one call per parameter) and runs all NS everywhere",
        predicted=f"1 node {min(one):.1f}x-{max(one):.1f}x; 8 nodes {min(eight):.1f}x-"
                  f"{max(eight):.1f}x",
        verdict=_verdict_range((min(one), max(one)), (4.2, 4.2), tol=0.25) + " on 1 node; " +
        _verdict_range((min(eight), max(eight)), (54.6, 54.6), tol=0.5) + " on 8 nodes",
        why="On one node the reconstruction's NVLink all-gather is cheap, so the ratio is the "
            "NS redundancy, ~N = 8 in the model against 4.2x measured: the paper's MatrixFSDP "
            "step keeps costs the model does not charge it (uneven shards' collectives, "
            "per-matrix launches, NS kernels at lower efficiency on a rank's few matrices). "
            "Across 8 nodes the baseline's all-gather of every matrix goes over InfiniBand "
            "and dominates, which takes the ratio past N; the model's 51x-81x brackets 54.6x.",
        detail="; ".join(parts)))

    # 4. Megatron-Core Muon: ~2-4% throughput loss vs AdamW.
    parts, losses = [], {"0.16": [], "0.19": []}
    for name, w, tp, pp, ep in (("kimi-k2", 512, 1, 16, 16), ("qwen3-30b-a3b", 64, 1, 1, 8),
                                ("qwen3-30b-a3b", 128, 2, 1, 8)):
        lay = cm.layout_for(w, tp=tp, pp=pp, ep=ep)
        ad = cm.predict(cm.MODELS[name], lay, H100, "adamw", base)
        for v in ("0.19", "0.16"):
            mc = cm.predict(cm.MODELS[name], lay, H100, "mcore_layerwise",
                            replace(base, mcore_layout=v))
            loss = 100 * (1 - ad.step_s / mc.step_s)
            losses[v].append(loss)
            parts.append(f"{name} {w} GPUs TP{tp} PP{pp} EP{ep} mcore {v}: {loss:.2f}% "
                         f"(exposed {mc.exposed_s * 1e3:.0f} ms vs AdamW {ad.exposed_s * 1e3:.0f} "
                         f"ms, NS imbalance {100 * mc.imbalance:.0f}%)")
    rows.append(dict(
        claim="Megatron-Core layer-wise Muon: ~2-4% throughput loss vs AdamW (Kimi-K2-like, "
              "Qwen3-30B-A3B-like)",
        setting="H100, MFU 0.40, global batch 1024; Kimi-K2-like 512 GPUs PP16 EP16, "
                "Qwen3-30B-A3B-like 64 GPUs EP8 and 128 GPUs TP2 EP8; Megatron-Core 0.19 "
                "layout and 0.16 layout",
        predicted=f"0.19: {min(losses['0.19']):.2f}%-{max(losses['0.19']):.2f}%; 0.16: "
                  f"{min(losses['0.16']):.2f}%-{max(losses['0.16']):.2f}%",
        verdict=_verdict_range((min(losses["0.19"]), max(losses["0.19"])), (2, 4)) +
        " (0.19); " + _verdict_range((min(losses["0.16"]), max(losses["0.16"])), (2, 4)) +
        " (0.16)",
        why="0.16 all-gathers the updated parameters inside step() (never overlapped) and "
            f"all-reduces full gradients: {min(losses['0.16']):.0f}-"
            f"{max(losses['0.16']):.0f}% in the model. 0.19's shard-aligned buffer "
            "lets the distributed optimizer overlap both, leaving the duplicated NS of each "
            f"rank's whole matrices: {losses['0.19'][1]:.1f}% for Qwen3-30B-A3B-like, "
            f"{losses['0.19'][0]:.1f}% for Kimi-K2-like, whose "
            "stage of 4 layers with 384/16 experts per EP rank leaves expert-DP = 2 owners "
            "per expert and the dense fc1 (2 x 18432 x 7168) as one unit. The claim's 2-4% "
            "falls between the layouts' predictions.",
        detail="; ".join(parts)))
    return rows


def _verdict_range(got: tuple, claim: tuple, tol: float = 0.0) -> str:
    lo, hi = got
    clo, chi = claim[0] * (1 - tol), claim[1] * (1 + tol)
    if lo >= clo and hi <= chi:
        return "agrees"
    if hi < clo or lo > chi:
        return "disagrees"
    return "overlaps"


def print_claims(a) -> int:
    print("# published claims vs the cost model")
    print(f"# command: python tools/cost_model.py {' '.join(sys.argv[1:])}")
    for i, r in enumerate(claims_rows(a.overlap_efficiency), 1):
        print(f"\n[{i}] claim:     {r['claim']}")
        print(f"    setting:   {r['setting']}")
        print(f"    predicted: {r['predicted']}")
        print(f"    verdict:   {r['verdict']}")
        print(f"    why:       {r['why']}")
        print(f"    detail:    {r['detail']}")
    return 0


# ----------------------------------------------------------------------------- plots
def plot(a, out_dir: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    model = model_from_args(a)
    hw = hardware(a.hardware, Path(a.profile))
    run = run_from_args(a)
    worlds = parse_gpus(a.gpus)
    modes = list(cm.MODES)
    preds = cm.sweep(model, hw, modes, worlds, run, tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp,
                     gpus_per_node=a.gpus_per_node)
    tag = f"{model.name}_{hw.name}_tp{a.tp}pp{a.pp}ep{a.ep}"
    lay_txt = f"TP{a.tp} PP{a.pp} EP{a.ep}"
    styles = dict(adamw=("k", "o", "-"), muon_naive=("tab:red", "x", "--"),
                  mcore_layerwise=("tab:orange", "s", "-"), dmuon=("tab:blue", "o", "-"),
                  dmuon_overlap=("tab:cyan", "^", ":"), matrix_zero1=("tab:green", "D", "-"),
                  matrix_zero3=("tab:olive", "v", "--"))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    base = {p.world: p.step_s for p in preds if p.mode == "adamw"}
    for mode in modes:
        ps = [p for p in preds if p.mode == mode]
        xs = [p.world for p in ps]
        col, mk, ls = styles.get(mode, (None, "o", "-"))
        kw = dict(marker=mk, linestyle=ls, color=col, label=mode)
        axes[0].plot(xs, [p.step_s for p in ps], **kw)
        axes[1].plot(xs, [100 * (p.step_s / base[p.world] - 1) for p in ps], **kw)
        axes[2].plot(xs, [max(p.opt_s, 1e-5) for p in ps], **kw)
        for p in ps:  # ring where the model says it does not fit in memory
            if p.memory_bytes > hw.memory_gib * 2**30:
                axes[0].plot([p.world], [p.step_s], marker="o", ms=12, mfc="none", color=col)
    axes[0].set(yscale="log", ylabel="training step (s)",
                title=f"step time: {model.name} on {hw.name}, {lay_txt}, global batch "
                      f"{run.global_batch}\n(ring: > {hw.memory_gib:.0f} GiB before activations)")
    axes[1].set(yscale="symlog", ylabel="step time vs AdamW (%)",
                title=f"overhead vs AdamW (MFU {run.mfu}, overlap eff. {run.overlap_efficiency})")
    axes[2].set(yscale="log", ylabel="optimizer.step() (s)",
                title="optimizer.step() (param all-gather in it only if not overlapped)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("GPUs")
        ax.set_xticks(worlds)
        ax.set_xticklabels([str(w) for w in worlds], rotation=45)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    f1 = out_dir / f"step_time_vs_gpus_{tag}.png"
    fig.savefig(f1, dpi=100)
    plt.close(fig)

    at = a.breakdown_gpus or worlds[len(worlds) // 2]
    lay = cm.layout_for(at, a.tp, a.pp, a.ep, a.etp, a.gpus_per_node)
    comps = ["elementwise", "owned", "ns", "muon_comm", "param_gather", "grad_norm", "overhead"]
    colors = ["tab:gray", "tab:brown", "tab:green", "tab:red", "tab:purple", "tab:pink",
              "tab:olive"]
    ps = [cm.predict(model, lay, hw, m, run) for m in modes]
    fig, axes = plt.subplots(1, 2, figsize=(17, 5.2))
    for ax, sel in ((axes[0], modes), (axes[1], [m for m in modes if m != "muon_naive"])):
        sub = [p for p in ps if p.mode in sel]
        bottoms = [0.0] * len(sub)
        for comp, colr in zip(comps, colors):
            vals = [p.breakdown.get(comp, 0.0) * 1e3 for p in sub]
            hidden = [comp == "param_gather" and p.opt_s < sum(
                p.breakdown.get(k, 0.0) for k in comps) - 1e-12 for p in sub]
            for i, (v, h) in enumerate(zip(vals, hidden)):
                ax.bar(sel[i], v, bottom=bottoms[i], color=colr, alpha=0.35 if h else 1.0,
                       hatch="//" if h else None, edgecolor="white" if h else None,
                       label=(comp if not h else f"{comp} (overlapped, not in step)")
                       if i == 0 or (h and not any(hidden[:i])) else None)
            bottoms = [b + v for b, v in zip(bottoms, vals)]
        ax.scatter(sel, [p.exposed_s * 1e3 for p in sub], color="black", marker="_", s=700,
                   zorder=5, label="exposed (adds to the step)")
        ax.set(ylabel="ms per step")
        plt.setp(ax.get_xticklabels(), rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_title(f"optimizer breakdown: {model.name}, {hw.name}, {at} GPUs "
                      f"(TP{lay.tp} PP{lay.pp} DP{lay.dp} EP{lay.ep})")
    axes[1].set_title("same, without muon_naive")
    handles, labels = axes[1].get_legend_handles_labels()
    seen = {}
    for h, l in zip(handles, labels):
        seen.setdefault(l, h)
    axes[1].legend(seen.values(), seen.keys(), fontsize=8, loc="upper left",
                   bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    f2 = out_dir / f"breakdown_{tag}_{at}gpus.png"
    fig.savefig(f2, dpi=100)
    plt.close(fig)
    print(f"wrote {f1} and {f2}")
    print(f"# command: python tools/cost_model.py {' '.join(sys.argv[1:])}")
    return 0


# ----------------------------------------------------------------------------- main
def run_from_args(a) -> cm.RunConfig:
    return cm.RunConfig(global_batch=a.global_batch, micro_batch=a.micro_batch, mfu=a.mfu,
                        ns_steps=a.ns_steps, overlap_efficiency=a.overlap_efficiency,
                        naive_per_matrix_calls=a.naive_per_matrix_calls,
                        overlap_param_gather=not a.no_overlap, overlap_grad_reduce=not a.no_overlap,
                        overlap_policy=a.overlap_policy, clip_rate=a.clip_rate)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    act = p.add_argument_group("actions (default: predict a sweep)")
    act.add_argument("--calibrate-cpu", action="store_true")
    act.add_argument("--validate", action="store_true")
    act.add_argument("--claims", action="store_true")
    act.add_argument("--plot", metavar="DIR")
    g = p.add_argument_group("model (Megatron flag names override the preset)")
    g.add_argument("--model", default="llama3-8b", choices=sorted(cm.MODELS))
    for flag in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads",
                 "num-query-groups", "kv-channels", "num-experts", "moe-ffn-hidden-size",
                 "moe-router-topk", "vocab-size", "seq-length"):
        g.add_argument(f"--{flag}", type=int, default=None)
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=None)
    g = p.add_argument_group("layout and hardware")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--ep", type=int, default=1)
    g.add_argument("--etp", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--gpus", default="8-4096", help="'8-4096' (powers of 2) or a list")
    g.add_argument("--hardware", default="H100", help="H100, H200, A100, A800 or cpu")
    g.add_argument("--profile", default=str(DEFAULT_PROFILE), help="CPU profile JSON")
    g.add_argument("--modes", default="all", help=f"comma list of {', '.join(cm.MODES + cm.EXTRA_MODES)}")
    g = p.add_argument_group("run")
    g.add_argument("--global-batch", type=int, default=1024)
    g.add_argument("--micro-batch", type=int, default=1)
    g.add_argument("--mfu", type=float, default=0.40)
    g.add_argument("--ns-steps", type=int, default=5)
    g.add_argument("--overlap-efficiency", type=float, default=0.5)
    g.add_argument("--overlap-policy", default="on", choices=cm.OVERLAP_POLICIES,
                   help="the dmuon_overlap row's dmuon_overlap setting ('auto': measured with "
                        "PP > 1, off without)")
    g.add_argument("--clip-rate", type=float, default=0.0,
                   help="share of steps whose gradients are clipped after the speculation "
                        "(they redo the owner work)")
    g.add_argument("--naive-per-matrix-calls", action="store_true")
    g.add_argument("--no-overlap", action="store_true", help="no grad-reduce / param-gather overlap")
    g.add_argument("--breakdown-gpus", type=int, default=None)
    g.add_argument("--json", default=None, help="also write the results here")
    g = p.add_argument_group("validation (tools/bench_optimizer.py settings)")
    g.add_argument("--bench-json", default=None,
                   help="read these bench results and the --profile (else calibrate, run the "
                        "bench, and compare)")
    g.add_argument("--nproc", type=int, default=4, help="ranks for --calibrate-cpu")
    g.add_argument("--bench-nproc", type=int, default=4)
    g.add_argument("--bench-tp", type=int, default=1)
    g.add_argument("--bench-layers", type=int, default=4)
    g.add_argument("--bench-hidden", type=int, default=384)
    g.add_argument("--bench-ffn", type=int, default=1536)
    g.add_argument("--bench-heads", type=int, default=6)
    g.add_argument("--quick", action="store_true", help="shorter calibration (tests)")
    a = p.parse_args(argv)

    if a.calibrate_cpu:
        prof = calibrate_cpu(a.nproc, Path(a.profile), quick=a.quick)
        print_profile(prof)
        print(f"# wrote {a.profile}")
        return 0
    if a.validate:
        return validate(a)
    if a.claims:
        return print_claims(a)
    if a.plot:
        return plot(a, Path(a.plot))
    model = model_from_args(a)
    hw = hardware(a.hardware, Path(a.profile))
    modes = list(cm.MODES) if a.modes == "all" else a.modes.split(",")
    run = run_from_args(a)
    preds = cm.sweep(model, hw, modes, parse_gpus(a.gpus), run, tp=a.tp, pp=a.pp, ep=a.ep,
                     etp=a.etp, gpus_per_node=a.gpus_per_node)
    counts = cm.model_param_counts(model)
    print_table(preds, f"# {model.name} ({counts['total'] / 1e9:.2f} B params, "
                       f"{counts['muon'] / 1e9:.2f} B in Muon matrices) on {hw.name}; global batch "
                       f"{run.global_batch} x {model.seq_length}, MFU {run.mfu}\n"
                       f"# command: python tools/cost_model.py {' '.join(sys.argv[1:])}")
    if a.json:
        Path(a.json).write_text(json.dumps([x.as_dict() for x in preds], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
