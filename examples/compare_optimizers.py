#!/usr/bin/env python3
"""Train the same GPT with AdamW and with DMuon (optionally naive distributed Muon) and compare.

    python examples/compare_optimizers.py                         # adam vs dmuon, ~4-5 min on CPU
    python examples/compare_optimizers.py --optimizers adam,dmuon,muon_naive
    python examples/compare_optimizers.py -- --train-iters 100 --hidden-size 256   # to pretrain_gpt

Every run is ``examples/pretrain_gpt.py`` with the same seed, data, model and schedule; only
``--optimizer`` changes (arguments after ``--`` go to every run).  Writes, under --out-dir:
``<optimizer>.json`` / ``<optimizer>.log`` (per-step losses and timings, full output),
``loss_curves.png`` (loss per iteration, raw and smoothed, plus the step-time split) and
``comparison.json``; prints a table of step times (forward-backward, optimizer step, total;
max over ranks, after the warm-up iterations) with ratios against AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRETRAIN = HERE / "pretrain_gpt.py"
KNOWN = ("adam", "dmuon", "muon_naive")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizers", default="adam,dmuon",
                   help=f"comma-separated, from {', '.join(KNOWN)}; the first is the baseline")
    p.add_argument("--out-dir", default="runs/compare_optimizers")
    p.add_argument("--smooth", type=float, default=0.9, help="EMA factor for the smoothed curves")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("pretrain_args", nargs=argparse.REMAINDER,
                   help="after --: arguments for pretrain_gpt.py (same for every run)")
    args = p.parse_args(argv)
    args.optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    bad = [o for o in args.optimizers if o not in KNOWN]
    if bad or not args.optimizers:
        p.error(f"unknown optimizer(s) {', '.join(bad) or '(none)'}; choose from {', '.join(KNOWN)}")
    if args.pretrain_args[:1] == ["--"]:
        args.pretrain_args = args.pretrain_args[1:]
    if "--optimizer" in args.pretrain_args or "--log-json" in args.pretrain_args:
        p.error("--optimizer and --log-json are set per run by this script")
    return args


def run(optimizer: str, args) -> dict:
    out = Path(args.out_dir)
    log_json, log_txt = out / f"{optimizer}.json", out / f"{optimizer}.log"
    cmd = [sys.executable, str(PRETRAIN), "--optimizer", optimizer, "--log-json", str(log_json),
           *args.pretrain_args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    print(f"[{optimizer}] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(log_txt, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                              timeout=args.timeout)
    wall = time.perf_counter() - t0
    text = log_txt.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-15:])
        raise SystemExit(f"[{optimizer}] failed (exit {proc.returncode}), see {log_txt}:\n{tail}")
    data = json.loads(log_json.read_text())
    s = data["summary"]
    print(f"[{optimizer}] done in {wall:.0f} s: loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, "
          f"{s['step_ms']:.1f} ms/step (optimizer {100 * s['optimizer_share']:.1f} %)", flush=True)
    data["wall_s"] = wall
    return data


def ema(values, factor):
    out, acc = [], None
    for v in values:
        acc = v if acc is None else factor * acc + (1 - factor) * v
        out.append(acc)
    return out


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for i, (name, data) in enumerate(results.items()):
        steps = data["steps"]
        it = [r["iter"] for r in steps]
        loss = [r["loss"] for r in steps]
        color = f"C{i}"
        ax.plot(it, loss, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(it, ema(loss, args.smooth), color=color, linewidth=2,
                label=f"{name} (last 10: {data['summary']['mean_loss_last_10']:.3f})")
    first = next(iter(results.values()))
    a = first["args"]
    ax.set_title(f"GPT {a['num_layers']}L/{a['hidden_size']}H, seq {a['seq_length']}, "
                 f"TP{a['tensor_model_parallel_size']} x PP{a['pipeline_model_parallel_size']} "
                 f"x DP{a['data_parallel_size']}, {first['data']['name']} bytes")
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend()

    names = list(results)
    fb = [results[n]["summary"]["fwd_bwd_ms"] for n in names]
    opt = [results[n]["summary"]["optimizer_ms"] for n in names]
    bx.bar(names, fb, color="0.7", label="forward-backward")
    bx.bar(names, opt, bottom=fb, color=[f"C{i}" for i in range(len(names))],
           label="optimizer step")
    for i, (f, o) in enumerate(zip(fb, opt)):
        bx.text(i, f + o, f"{f + o:.0f} ms\n({100 * o / (f + o):.0f} % opt)", ha="center",
                va="bottom", fontsize=9)
    bx.set_ylabel("ms per iteration (max over ranks)")
    bx.set_ylim(0, 1.25 * max(f + o for f, o in zip(fb, opt)))
    bx.set_title("step time")
    bx.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict) -> str:
    names = list(results)
    base = results[names[0]]["summary"]
    rows = [f"{'optimizer':<11} {'fwd-bwd ms':>10} {'optimizer ms':>12} {'total ms':>9} "
            f"{'opt share':>9} {'opt x ' + names[0]:>12} {'total x ' + names[0]:>14} "
            f"{'last-10 loss':>12}"]
    for n in names:
        s = results[n]["summary"]
        rows.append(f"{n:<11} {s['fwd_bwd_ms']:10.1f} {s['optimizer_ms']:12.1f} "
                    f"{s['step_ms']:9.1f} {100 * s['optimizer_share']:8.1f}% "
                    f"{s['optimizer_ms'] / base['optimizer_ms']:11.2f}x "
                    f"{s['step_ms'] / base['step_ms']:13.2f}x {s['mean_loss_last_10']:12.4f}")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {name: run(name, args) for name in args.optimizers}
    png = out / "loss_curves.png"
    plot(results, args, png)
    print()
    print(table(results))
    print(f"\nloss curves: {png}")
    summary = {n: {**d["summary"], "wall_s": d["wall_s"]} for n, d in results.items()}
    (out / "comparison.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
