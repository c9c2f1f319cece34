"""The optimizer step against the number of ranks, measured and predicted.

``muon_naive`` vs ``dmuon`` vs Megatron-Core's layer-wise Muon vs AdamW on the same GPT at
N = 2, 4, 8 gloo ranks, DP and TP2 x DP, with the cost model's prediction next to every point:

    python tools/bench_scaling.py                    # every point, ~16 min on 2 shared cores
    python tools/bench_scaling.py --points dp2,dp4 --json /tmp/s.json --plot /tmp/s.png
    python tools/bench_scaling.py --from-json docs/scaling/scaling.json --plot docs/scaling/scaling.png

Each point (N, layout) is one job of N ranks.  It calibrates the cost model's CPU profile
(``tools/cost_model.py``'s ``calibrate_worker``: NS at the model's unit shapes, gloo
all-to-all / all-gather bandwidth and latency for the world, half-size and 2-rank groups,
AdamW / Muon elementwise costs, op latency; every rank at once, as in a step), runs
``tools/bench_optimizer.py``'s worker (every optimizer built on the same GPT, their training
steps interleaved: step s of every optimizer before step s+1 of any), and calibrates again.
Per timed step the slowest rank counts; the timed steps form ``--reps`` blocks of
``--steps`` consecutive steps.  A cell is the median over all timed steps, its spread the
lowest and highest block median; a ratio is the median of the step-by-step ratios (step s
of two optimizers ran next to each other), its spread the lowest and highest block median.

Prediction (``cost_model.predict_bench``, the mean of the predictions from the two
calibrations of the same job; ``*_range_ms`` spans them): the optimizer step
is the model's ``opt_s`` for the mode (``adam`` -> adamw, ``muon_naive``, ``dmuon``,
``mcore_muon_duplicated`` and, at TP1 where the two modes are the same, ``mcore_muon_blockwise``
-> mcore_layerwise; the model has no blockwise TP mode, so that row has no prediction at
TP2).  The model's forward/backward is an assumed MFU, meaningless on a CPU, so the predicted
total step is AdamW's *measured* forward+backward of the same job plus the model's difference
in gradient synchronisation between the mode and AdamW plus the predicted optimizer step:
the differences between the optimizers' predicted totals are all model.

More ranks than cores (N = 4 and 8 on 2 cores) means time-slicing: every measured wall time
includes waiting for a core, and the calibration (taken with all N ranks running) carries the
same contention into the prediction.  ``opt cpu`` is the CPU time of the optimizer step
summed over the ranks: the work, which time-slicing does not change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

DEFAULT_POINTS = "dp2,dp4,dp8,tp2dp1,tp2dp2,tp2dp4"
DEFAULT_OPTIMIZERS = "adam,muon_naive,dmuon,mcore_muon_blockwise,mcore_muon_duplicated"
# bench_optimizer variant -> cost model mode (mcore_muon_blockwise: only where it equals
# the duplicated mode, TP1)
MODE_OF = {"adam": "adamw", "muon_naive": "muon_naive", "dmuon": "dmuon",
           "mcore_muon_duplicated": "mcore_layerwise", "mcore_muon_blockwise": "mcore_layerwise"}
RATIOS = (("muon_naive", "dmuon", "opt"), ("muon_naive", "dmuon", "opt_cpu"),
          ("dmuon", "adam", "opt"), ("dmuon", "adam", "total"),
          ("dmuon", "mcore_muon_blockwise", "opt"), ("dmuon", "mcore_muon_duplicated", "opt"),
          ("muon_naive", "dmuon", "total"))
STYLE = {"adam": ("k", "o"), "muon_naive": ("tab:red", "x"), "dmuon": ("tab:blue", "o"),
         "mcore_muon_blockwise": ("tab:orange", "s"), "mcore_muon_duplicated": ("tab:brown", "D")}


def parse_point(text: str) -> tuple[int, int]:
    """'dp4' -> (TP 1, DP 4); 'tp2dp2' -> (2, 2)."""
    t = text.strip().lower()
    tp = 1
    if t.startswith("tp"):
        tp_s, _, t = t[2:].partition("dp")
        tp, t = int(tp_s), "dp" + t
    if not t.startswith("dp"):
        raise ValueError(f"point {text!r}: want dpN or tpMdpN")
    return tp, int(t[2:])


def job_worker(calib: dict, bench: dict) -> dict:
    """One rank of one point: a calibration, the interleaved bench, a second calibration,
    in one job (the machine is shared: the two calibrations bracket the bench)."""
    from tools.bench_optimizer import worker
    from tools.cost_model import calibrate_worker

    t0 = time.perf_counter()
    before = calibrate_worker(**calib)
    t1 = time.perf_counter()
    res = worker(**bench)
    t2 = time.perf_counter()
    after = calibrate_worker(**calib)
    return dict(calib=[before, after], bench=res, calib_s=t1 - t0 + time.perf_counter() - t2,
                bench_s=t2 - t1)


def _model(a):
    import cost_model_lib as cm

    return cm.ModelConfig(name="bench", num_layers=a["num_layers"], hidden_size=a["hidden_size"],
                          ffn_hidden_size=a["ffn_hidden_size"],
                          num_attention_heads=a["num_attention_heads"], vocab_size=256,
                          normalization="LayerNorm", seq_length=a["seq_length"])


def ns_shapes(model) -> list:
    """(batch, small side, big side) of each NS unit shape of the model, for the calibration."""
    import cost_model_lib as cm

    shapes = sorted({(min(u), max(u)) for t in cm.stage_tensors(model, cm.Layout())
                     for _, u in t.units})
    return [(4, s, b) for s, b in shapes]


def run_point(tp: int, dp: int, settings: dict, quick: bool) -> dict:
    """Runs one job of TP x DP ranks; returns its raw record (profile, per-step series)."""
    from cost_model import calibration_kwargs, profile_from_results

    from megatron_muon.testing.launch import run_ranks

    n = tp * dp
    opts = [o for o in settings["optimizers"] if not (o == "mcore_muon_duplicated" and tp == 1)]
    cfg = dict(num_layers=settings["num_layers"], hidden_size=settings["hidden_size"],
               ffn_hidden_size=settings["ffn_hidden_size"],
               num_attention_heads=settings["num_attention_heads"], num_query_groups=None,
               vocab_size=256, seq_length=settings["seq_length"], micro_batch_size=2,
               num_microbatches=1)
    calib = calibration_kwargs(quick, ns_shapes(_model(settings)))
    calib["pair_groups"] = True
    bench = dict(cfg=cfg, tp=tp, optimizers=opts, steps=settings["reps"] * settings["steps"],
                 warmup=settings["warmup"], prec="highest", ns_steps=5,
                 clip_grad=settings["clip_grad"])
    load0, t0 = os.getloadavg()[0], time.time()
    print(f"# point TP{tp} x DP{dp} ({n} ranks): {','.join(opts)}; load avg {load0:.1f}",
          flush=True)
    res = run_ranks("tools.bench_scaling:job_worker", n, dict(calib=calib, bench=bench),
                    timeout=3000, env={"PYTHONPATH": str(ROOT)})
    wall = time.time() - t0
    calib_s = max(r["calib_s"] for r in res)
    profiles = []
    for i in range(2):  # before and after the bench
        prof = profile_from_results([r["calib"][i] for r in res], n, calib_s / 2)
        for k in ("ns_raw", "when", "load_avg", "wall_s"):  # the driver's, not the ranks'
            prof.pop(k, None)
        profiles.append(prof)
    rec = dict(layout=f"tp{tp}dp{dp}" if tp > 1 else f"dp{dp}", n=n, tp=tp, dp=dp,
               cores=os.cpu_count(), load_avg=[load0, os.getloadavg()[0]], wall_s=wall,
               calib_s=calib_s, bench_s=max(r["bench_s"] for r in res), profiles=profiles,
               raw={})
    for name in opts:
        r0 = res[0]["bench"].get(name)
        if r0 is None or "error" in r0:
            rec["raw"][name] = {"error": (r0 or {}).get("error", "not run")}
            continue
        per = [r["bench"][name] for r in res]
        rec["raw"][name] = dict(
            # per timed step, the slowest rank; CPU summed over the ranks
            opt_s=[max(v) for v in zip(*(p["step_list"] for p in per))],
            fwd_bwd_s=[max(v) for v in zip(*(p["fwd_bwd_list"] for p in per))],
            total_s=[max(st + fb for st, fb in ranks) for ranks in
                     zip(*(zip(p["step_list"], p["fwd_bwd_list"]) for p in per))],
            opt_cpu_s=[sum(v) for v in zip(*(p["step_cpu_list"] for p in per))],
            received=max(p.get("received", 0) for p in per),
            sent=max(p.get("sent", 0) for p in per))
    print(f"#   done in {wall:.0f}s (calibration {calib_s:.0f}s), load avg "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    return rec


def _blocks(xs: list, reps: int) -> list:
    k = max(1, len(xs) // reps)
    return [statistics.median(xs[i * k:(i + 1) * k]) for i in range(reps) if xs[i * k:(i + 1) * k]]


def analyse(rec: dict, settings: dict) -> dict:
    """Measured cells (median, block spread), predictions, and ratios of one point."""
    import cost_model_lib as cm
    from cost_model import predict_bench

    reps = settings["reps"]
    model = _model(settings)
    layout = cm.Layout(tp=rec["tp"], pp=1, dp=rec["dp"], gpus_per_node=rec["n"])
    hws = [cm.cpu_hardware(prof) for prof in rec["profiles"]]
    gn = 1 if settings["clip_grad"] > 0 else 0
    out = {}
    preds = {}  # name -> [prediction with the calibration before, after the bench]
    for name, raw in rec["raw"].items():
        if "error" in raw:
            out[name] = {"error": raw["error"]}
            continue
        m = {}
        for key in ("opt", "total", "fwd_bwd", "opt_cpu"):
            xs = raw[f"{key}_s"]
            b = _blocks(xs, reps)
            m[f"{key}_ms"] = 1e3 * statistics.median(xs)
            m[f"{key}_spread_ms"] = [1e3 * min(b), 1e3 * max(b)]
        m["recv_kib"] = raw["received"] / 1024
        out[name] = {"measured": m}
        mode = MODE_OF.get(name)
        if name == "mcore_muon_blockwise" and rec["tp"] > 1:
            mode = None  # the model has no blockwise TP mode
        if mode is not None:
            preds[name] = [predict_bench(hw, prof, model, layout, mode, gn)
                           for hw, prof in zip(hws, rec["profiles"])]
    fb_adam = out.get("adam", {}).get("measured", {}).get("fwd_bwd_ms")
    for name, ps in preds.items():
        opt = [1e3 * p.opt_s for p in ps]
        keys = sorted({k for p in ps for k, v in p.breakdown.items() if v})
        pr = dict(opt_ms=statistics.mean(opt), opt_range_ms=[min(opt), max(opt)],
                  muon_recv_kib=ps[0].muon_recv_bytes / 1024, imbalance=ps[0].imbalance,
                  breakdown_ms={k: statistics.mean(1e3 * p.breakdown.get(k, 0.0) for p in ps)
                                for k in keys})
        if fb_adam is not None and "adam" in preds:
            # AdamW's measured fwd+bwd + the model's difference in gradient sync + opt step
            tot = [fb_adam + 1e3 * (p.breakdown["grad_sync_exposed"] -
                                    pa.breakdown["grad_sync_exposed"] + p.opt_s)
                   for p, pa in zip(ps, preds["adam"])]
            pr["total_ms"] = statistics.mean(tot)
            pr["total_range_ms"] = [min(tot), max(tot)]
        out[name]["predicted"] = pr
        m = out[name]["measured"]
        m["opt_err_pct"] = 100 * (pr["opt_ms"] / m["opt_ms"] - 1)
        if "total_ms" in pr:
            m["total_err_pct"] = 100 * (pr["total_ms"] / m["total_ms"] - 1)
    ratios = {}
    for a, b, key in RATIOS:
        if "measured" not in out.get(a, {}) or "measured" not in out.get(b, {}):
            continue
        # step k of a and step k of b ran next to each other: their ratio is what the
        # interleaving protects from the load changing; median over the steps, spread over
        # the blocks' medians
        per_step = [x / y for x, y in zip(rec["raw"][a][f"{key}_s"], rec["raw"][b][f"{key}_s"])]
        per_block = _blocks(per_step, reps)
        r = dict(measured=statistics.median(per_step), spread=[min(per_block), max(per_block)])
        pa, pb = out[a].get("predicted", {}), out[b].get("predicted", {})
        if f"{key}_ms" in pa and f"{key}_ms" in pb:
            r["predicted"] = pa[f"{key}_ms"] / pb[f"{key}_ms"]
        ratios[f"{a}/{b} {key}"] = r
    return dict(results=out, ratios=ratios)


def _layout(pt: dict, sep: str) -> str:
    return f"TP{pt['tp']}{sep}DP{pt['dp']}" if pt["tp"] > 1 else f"DP{pt['dp']}"


def print_table(doc: dict) -> None:
    s = doc["settings"]
    print(f"# scaling: GPT {s['num_layers']} x {s['hidden_size']} (ffn {s['ffn_hidden_size']}, "
          f"{s['num_attention_heads']} heads, seq {s['seq_length']}, micro-batch 2 per DP "
          f"rank), fp32 NS (5 quintic steps), clip_grad {s['clip_grad']}; {s['reps']} blocks of "
          f"{s['steps']} interleaved steps after {s['warmup']} warm-up; slowest rank per step; "
          f"cell: median [lowest, highest block median]; pred: cost model, calibrated in the "
          f"same job")
    print(f"# command: {doc['command']}")
    hdr = (f"{'N':>2s} {'layout':8s} {'optimizer':22s} {'opt ms':>8s} {'[spread]':>15s} "
           f"{'pred':>8s} {'err':>7s} | {'total ms':>8s} {'[spread]':>15s} {'pred':>8s} "
           f"{'err':>7s} | {'opt cpu ms':>10s}")
    print(hdr)
    for pt in doc["points"]:
        lay = _layout(pt, "x")
        for name, r in pt["results"].items():
            if "error" in r:
                print(f"{pt['n']:2d} {lay:8s} {name:22s} fails: {r['error']}")
                continue
            m, p = r["measured"], r.get("predicted", {})

            def cell(key):
                sp = m[f"{key}_spread_ms"]
                pv = f"{p[key + '_ms']:8.1f}" if f"{key}_ms" in p else f"{'-':>8s}"
                er = f"{m[key + '_err_pct']:+6.0f}%" if f"{key}_err_pct" in m else f"{'-':>7s}"
                return f"{m[key + '_ms']:8.1f} [{sp[0]:6.1f},{sp[1]:7.1f}] {pv} {er}"

            print(f"{pt['n']:2d} {lay:8s} {name:22s} {cell('opt')} | {cell('total')} | "
                  f"{m['opt_cpu_ms']:10.1f}")
        parts = []
        for k, r in pt["ratios"].items():
            pv = f", pred {r['predicted']:.2f}" if "predicted" in r else ""
            parts.append(f"{k} {r['measured']:.2f} [{r['spread'][0]:.2f},{r['spread'][1]:.2f}]{pv}")
        print("   ratios: " + "; ".join(parts))
        print(f"   load avg {pt['load_avg'][0]:.1f} -> {pt['load_avg'][1]:.1f}, {pt['n']} ranks on "
              f"{pt['cores']} cores{' (oversubscribed)' if pt['n'] > pt['cores'] else ''}, job "
              f"{pt['wall_s']:.0f}s (calibration {pt['calib_s']:.0f}s); NS "
              + " -> ".join("/".join(f"{r / 1e9:.1f}" for _, r in prof["ns_rate_points"])
                            for prof in pt["profiles"])
              + " GFLOP/s per rank (calibration before -> after); all_to_all "
              + " -> ".join(f"{prof['collectives']['all_to_all'][0] / 1e6:.0f} MB/s + "
                            f"{prof['collectives']['all_to_all'][1] * 1e3:.2f} ms"
                            for prof in pt["profiles"]))


COLUMNS = tuple(DEFAULT_OPTIMIZERS.split(","))  # the tables' columns, in the header's order
MD_RATIOS = (("muon_naive/dmuon opt", "naive / dmuon, opt step"),
             ("muon_naive/dmuon opt_cpu", "naive / dmuon, opt CPU"),
             ("dmuon/adam opt", "dmuon / adam, opt step"),
             ("dmuon/adam total", "dmuon / adam, total"),
             ("dmuon/mcore_muon_blockwise opt", "dmuon / blockwise, opt"),
             ("dmuon/mcore_muon_duplicated opt", "dmuon / duplicated, opt"))


def _fmt(ratio: float) -> str:
    return f"{ratio:.1f}" if ratio >= 10 else f"{ratio:.2f}"  # two decimals, one from 10 up


def markdown(doc: dict) -> str:
    """The docs' three tables (optimizer step, total step, ratios) from a --json result."""
    def cell(pt, name, key):
        r = pt["results"].get(name)
        if r is None:  # duplicated runs at TP > 1 only: at TP1 it is the blockwise mode
            same = name == "mcore_muon_duplicated" and pt["tp"] == 1 and \
                "mcore_muon_blockwise" in pt["results"]
            return "= blockwise" if same else "-"
        if "error" in r:
            return "fails"
        pv = r.get("predicted", {}).get(f"{key}_ms")
        return f"{r['measured'][f'{key}_ms']:.0f} ({f'{pv:.0f}' if pv is not None else '-'})"

    out = []
    for key, title in (("opt", "`optimizer.step()`"), ("total", "Total step (forward + "
                                                       "backward + optimizer step)")):
        out += [f"{title}, ms, measured (predicted):", "",
                "| N | layout | adam | muon_naive | dmuon | Megatron's Muon, blockwise | "
                "Megatron's Muon, duplicated (exact) |", "|---|---|---|---|---|---|---|"]
        out += [f"| {pt['n']} | {_layout(pt, ' x ')} | "
                + " | ".join(cell(pt, c, key) for c in COLUMNS) + " |" for pt in doc["points"]]
        out.append("")
    out += ["Ratios, measured [block spread] (predicted):", "",
            "| N | layout | " + " | ".join(t for _, t in MD_RATIOS) + " | load avg |",
            "|---|---|" + "---|" * (len(MD_RATIOS) + 1)]
    for pt in doc["points"]:
        cells = []
        for k, _ in MD_RATIOS:
            r = pt["ratios"].get(k)
            if r is None:
                cells.append("-")
                continue
            c = _fmt(r["measured"])
            if not k.endswith("opt_cpu"):
                c += f" [{_fmt(r['spread'][0])}-{_fmt(r['spread'][1])}]"
            if "predicted" in r:
                c += f" ({_fmt(r['predicted'])})"
            cells.append(c)
        la = pt["load_avg"]
        out.append(f"| {pt['n']} | {_layout(pt, ' x ')} | " + " | ".join(cells)
                   + f" | {la[0]:.0f} -> {la[1]:.0f} |")
    return "\n".join(out) + "\n"


def _n_axis(ax, pts) -> None:
    from matplotlib.ticker import NullFormatter

    ax.set_xticks([p["n"] for p in pts])
    ax.set_xticklabels([str(p["n"]) for p in pts])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="both", alpha=0.3)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = sorted({pt["tp"] for pt in doc["points"]})
    fig, axes = plt.subplots(len(tps), 3, figsize=(18, 5 * len(tps)), squeeze=False)
    names = [o for o in doc["settings"]["optimizers"]]
    for row, tp in enumerate(tps):
        pts = sorted((pt for pt in doc["points"] if pt["tp"] == tp), key=lambda p: p["n"])
        lay = "DP" if tp == 1 else f"TP{tp} x DP"
        for col, key in enumerate(("opt", "total")):
            ax = axes[row][col]
            for name in names:
                col_, mk = STYLE.get(name, (None, "o"))
                xs, ys, lo, hi, px, py, band = [], [], [], [], [], [], []
                for pt in pts:
                    r = pt["results"].get(name, {})
                    if "measured" not in r:
                        continue
                    m = r["measured"]
                    xs.append(pt["n"])
                    ys.append(m[f"{key}_ms"])
                    lo.append(m[f"{key}_ms"] - m[f"{key}_spread_ms"][0])
                    hi.append(m[f"{key}_spread_ms"][1] - m[f"{key}_ms"])
                    if f"{key}_ms" in r.get("predicted", {}):
                        px.append(pt["n"])
                        py.append(r["predicted"][f"{key}_ms"])
                        band.append(r["predicted"][f"{key}_range_ms"])
                if xs:
                    ax.errorbar(xs, ys, yerr=[lo, hi], color=col_, marker=mk, linestyle="-",
                                capsize=3, label=name)
                if px:
                    ax.plot(px, py, color=col_, marker=mk, mfc="none", linestyle="--",
                            alpha=0.8)
                    ax.fill_between(px, [b[0] for b in band], [b[1] for b in band],
                                    color=col_, alpha=0.12, linewidth=0)
            for pt in pts:  # where a row failed, say so at its N
                for name, r in pt["results"].items():
                    if "error" in r:
                        ax.annotate(f"{name}: fails", (pt["n"], ax.get_ylim()[0]), fontsize=7,
                                    rotation=90, va="bottom", color=STYLE.get(name, ("r",))[0])
            ax.set(xscale="log", yscale="log", xlabel="gloo ranks N",
                   ylabel=("optimizer.step()" if key == "opt" else "total step") + " (ms)",
                   title=f"{lay}: {'optimizer step' if key == 'opt' else 'total step (fwd+bwd+opt)'}")
            _n_axis(ax, pts)
            if col == 0:
                from matplotlib.lines import Line2D

                handles, _ = ax.get_legend_handles_labels()
                handles += [Line2D([], [], color="gray", linestyle="-", marker="o",
                                   label="measured (bars: block spread)"),
                            Line2D([], [], color="gray", linestyle="--", marker="o", mfc="none",
                                   label="cost model (band: calibration before / after)")]
                ax.legend(handles=handles, fontsize=7, ncol=2)
        ax = axes[row][2]
        for key, col_ in (("muon_naive/dmuon opt", "tab:red"),
                          ("muon_naive/dmuon opt_cpu", "tab:pink"), ("dmuon/adam opt", "tab:blue"),
                          ("dmuon/adam total", "tab:green"),
                          ("dmuon/mcore_muon_blockwise opt", "tab:orange"),
                          ("dmuon/mcore_muon_duplicated opt", "tab:brown")):
            xs, ys, lo, hi, px, py = [], [], [], [], [], []
            for pt in pts:
                r = pt["ratios"].get(key)
                if r is None:
                    continue
                xs.append(pt["n"])
                ys.append(r["measured"])
                lo.append(max(0.0, r["measured"] - r["spread"][0]))
                hi.append(max(0.0, r["spread"][1] - r["measured"]))
                if "predicted" in r:
                    px.append(pt["n"])
                    py.append(r["predicted"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], color=col_, marker="o", capsize=3,
                            label=key)
            if px:
                ax.plot(px, py, color=col_, marker="o", mfc="none", linestyle="--")
        ax.axhline(6.85, color="tab:red", linestyle=":", linewidth=1)
        ax.text(pts[0]["n"], 6.85, " paper: naive/dmuon 6.85x at 8 GPUs", fontsize=7,
                va="bottom", color="tab:red")
        ax.axhline(1.02, color="tab:green", linestyle=":", linewidth=1)
        ax.text(pts[0]["n"], 1.02, " paper: total ~1.02x AdamW", fontsize=7, va="bottom",
                color="tab:green")
        ax.set(xscale="log", yscale="log", xlabel="gloo ranks N", ylabel="ratio",
               title=f"{lay}: ratios (solid: measured, dashed: predicted)")
        _n_axis(ax, pts)
        ax.legend(fontsize=7)
    s = doc["settings"]
    fig.suptitle(f"GPT {s['num_layers']} x {s['hidden_size']} on {doc['points'][0]['cores']} CPU "
                 f"cores, gloo; steps interleaved in one job per point; error bars: lowest and "
                 f"highest of {s['reps']} block medians; predicted: cost model calibrated in the "
                 f"same job", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for pkg in ("torch", "megatron-core", "emerging-optimizers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default=DEFAULT_POINTS, help="comma list of dpN / tpMdpN")
    p.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS,
                   help="bench_optimizer variants (mcore_muon_duplicated only runs at TP > 1)")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--ffn-hidden-size", type=int, default=1536)
    p.add_argument("--num-attention-heads", type=int, default=6)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="timed steps per block")
    p.add_argument("--reps", type=int, default=3, help="blocks of --steps timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="shorter calibration (tests)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write the plot here (.png)")
    p.add_argument("--markdown", default=None,
                   help="write the docs' tables (optimizer step, total step, ratios) here")
    p.add_argument("--from-json", default=None,
                   help="no run: read a --json file, predict again from its profiles, print "
                        "(and --plot)")
    a = p.parse_args(argv)
    if a.from_json:
        doc = json.loads(Path(a.from_json).read_text())
        for pt in doc["points"]:
            pt.update(analyse(pt, doc["settings"]))
    else:
        settings = dict(num_layers=a.num_layers, hidden_size=a.hidden_size,
                        ffn_hidden_size=a.ffn_hidden_size,
                        num_attention_heads=a.num_attention_heads, seq_length=a.seq_length,
                        steps=a.steps, reps=a.reps, warmup=a.warmup, clip_grad=a.clip_grad,
                        optimizers=[o for o in a.optimizers.split(",") if o],
                        quick_calibration=a.quick)
        doc = dict(command="python tools/bench_scaling.py " + " ".join(
            sys.argv[1:] if argv is None else argv), when=time.strftime("%Y-%m-%d %H:%M"),
            versions=_versions(), settings=settings, points=[])
        t0 = time.time()
        for text in a.points.split(","):
            if not text:
                continue
            tp, dp = parse_point(text)
            pt = run_point(tp, dp, settings, a.quick)
            pt.update(analyse(pt, settings))
            doc["points"].append(pt)
            if a.json:  # after every point: a partial run keeps what it measured
                Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                Path(a.json).write_text(json.dumps(doc, indent=1))
        doc["wall_s"] = time.time() - t0
    print_table(doc)
    if a.json:
        if a.from_json:  # the measuring command stays; say how it was analysed again
            doc["analysis_command"] = "python tools/bench_scaling.py " + " ".join(
                sys.argv[1:] if argv is None else argv)
        Path(a.json).write_text(json.dumps(doc, indent=1))
    if a.plot:
        plot(doc, Path(a.plot))
        print(f"# wrote {a.plot}")
    if a.markdown:
        Path(a.markdown).write_text(markdown(doc))
        print(f"# wrote {a.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
