#!/usr/bin/env python3
"""ReLoRA and LoRA fine-tuning comparisons at equal tokens, with LR sweeps and seeds.

Two parts (``--parts``), each run as subprocesses of the repository's own recipes:

* ``pretrain``: ReLoRA (``examples/pretrain_relora.py``) with adapters under smuon / adam /
  muon_factors / riemannion, against full-rank dmuon and AdamW (``examples/pretrain_gpt.py
  --save``, its held-out loss then measured by ``pretrain_relora.py --load-base DIR
  --train-iters 0`` on the same held-out samples).  Same model, data order, batch and iterations: equal tokens.
* ``finetune``: a base pretrained with dmuon and one pretrained with AdamW
  (``pretrain_gpt.py``, ``--base-iters``), each fine-tuned with LoRA under smuon / adam /
  muon_factors / riemannion (``examples/finetune_lora.py``, its C-header domain, held-out
  loss).

Every optimizer gets its own LR grid: ``--lr-multipliers`` times its default LR (or
``--lrs NAME=a,b,...``), for every seed of ``--seeds``.  Results: ``--out-dir``/results.json
(every run), a table (per optimizer: mean and spread over seeds at each LR, best LR), a
time-to-target table (below), and ``compare_relora.png`` when matplotlib imports.

Time to target, per part: the target is the *worst* optimizer's best mean final held-out
loss (so every optimizer reaches it at its best LR, at the latest at the end); for each
optimizer at its best LR and each seed, the first held-out evaluation at or below the target
gives the iteration, and the per-step times logged by the run, summed up to that iteration,
give the training wall time (forward-backward + optimizer + merges; evaluations excluded)
and the optimizer-step time.  The resolution is the evaluation interval (``--eval-points``
evaluations per run).  Full-rank runs are evaluated only at the end, so theirs is the whole
run's time.  The runs of one job run one after another: their times are comparable only as
far as the machine's load stayed the same.

Runs already in ``--out-dir`` are reused (whatever ``--eval-points`` they ran with), so a
larger grid extends a smaller one.

    python tools/compare_relora.py                       # 1 rank, small grid (see --help)
    python tools/compare_relora.py --seeds 1 2 3 --lr-multipliers 0.25 0.5 1 2 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = ("smuon", "adam", "muon_factors", "riemannion", "full_dmuon", "full_adam")
FINETUNE = ("smuon", "adam", "muon_factors", "riemannion")
DEFAULT_LR = {"smuon": 0.02, "adam": 3e-3, "muon_factors": 0.02, "riemannion": 0.02,
              "full_dmuon": 3e-3, "full_adam": 3e-3}
FT_DEFAULT_LR = {"smuon": 0.01, "adam": 0.01, "muon_factors": 0.01, "riemannion": 0.01}


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=("pretrain", "finetune"),
                   default=["pretrain", "finetune"])
    p.add_argument("--optimizers", nargs="+", default=list(PRETRAIN),
                   help=f"pretraining runs among {list(PRETRAIN)}")
    p.add_argument("--ft-optimizers", nargs="+", default=list(FINETUNE), choices=FINETUNE)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--lr-multipliers", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                   help="each optimizer's LR grid: these x its default LR")
    p.add_argument("--lrs", nargs="*", default=[],
                   help="explicit grids, e.g. smuon=0.01,0.02 full_adam=1e-3,3e-3 "
                        "(ft:smuon=... for the fine-tuning part)")
    p.add_argument("--train-iters", type=int, default=100, help="pretraining steps (all runs)")
    p.add_argument("--relora-every", type=int, default=25)
    p.add_argument("--restart-warmup-iters", type=int, default=5)
    p.add_argument("--relora-reset", choices=("zero", "prune", "keep"), default="zero")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--base-iters", type=int, default=100, help="pretraining of the FT bases")
    p.add_argument("--ft-iters", type=int, default=60, help="fine-tuning steps")
    p.add_argument("--ft-lora-rank", type=int, default=8)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--eval-samples", type=int, default=128)
    p.add_argument("--eval-points", type=int, default=None,
                   help="held-out evaluations per run (default: 4 per ReLoRA run, 3 per "
                        "fine-tuning run), the resolution of the time-to-target table")
    p.add_argument("--out-dir", default=str(REPO / "runs" / "compare_relora"))
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = p.parse_args(argv)
    bad = [o for o in args.optimizers if o not in PRETRAIN]
    if bad:
        p.error(f"unknown pretraining optimizer(s) {bad}; choose from {list(PRETRAIN)}")
    if args.eval_points is not None and args.eval_points < 1:
        p.error("--eval-points must be >= 1")
    if any(m <= 0 for m in args.lr_multipliers) or not args.seeds:
        p.error("--lr-multipliers must be > 0 and --seeds non-empty")
    grids = {}
    for item in args.lrs:
        name, _, values = item.partition("=")
        try:
            grids[name] = [float(v) for v in values.split(",") if v]
        except ValueError:
            p.error(f"--lrs {item}: not NAME=lr,lr,...")
        if not grids[name] or min(grids[name]) <= 0:
            p.error(f"--lrs {item}: give positive learning rates")
    args.grids = grids
    return args


def grid(args, name: str, default: float) -> list[float]:
    return args.grids.get(name) or [float(f"{default * m:.6g}") for m in args.lr_multipliers]


def run(cmd: list[str], log: Path, dry: bool) -> None:
    print("  $ " + " ".join(cmd[1:]), flush=True)
    if dry:
        return
    t = time.perf_counter()
    with open(log, "w") as fh:
        code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    if code != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise SystemExit(f"error: run failed (exit {code}), see {log}: {' | '.join(tail)}")
    print(f"    done in {time.perf_counter() - t:.0f} s", flush=True)


def common(args) -> list[str]:
    return ["--nproc", str(args.nproc),
            "--tensor-model-parallel-size", str(args.tensor_model_parallel_size)]


def pretrain_full(args, out: Path, opt: str, lr: float, seed: int, iters: int,
                  tag: str) -> Path:
    """pretrain_gpt.py --save: returns the checkpoint directory (reused when present)."""
    ck = out / "ckpt" / tag
    js = out / "logs" / f"{tag}.json"
    if not (ck / "latest").is_file() or not js.is_file():
        run([sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), *common(args),
             "--optimizer", opt, "--lr", str(lr), "--min-lr", f"{lr / 10:g}", "--seed", str(seed),
             "--train-iters", str(iters), "--log-interval", str(max(1, iters // 5)),
             "--save", str(ck), "--log-json", str(js)], out / "logs" / f"{tag}.log",
            args.dry_run)
    return ck


def part_pretrain(args, out: Path) -> list[dict]:
    records = []
    for name in args.optimizers:
        for lr in grid(args, name, DEFAULT_LR[name]):
            for seed in args.seeds:
                tag = f"pt-{name}-lr{lr:g}-s{seed}"
                js = out / "logs" / f"{tag}.json"
                if name.startswith("full_"):
                    ck = pretrain_full(args, out, name[5:], lr, seed, args.train_iters, tag)
                    ev = out / "logs" / f"{tag}-eval.json"
                    if not ev.is_file():
                        run([sys.executable, str(REPO / "examples" / "pretrain_relora.py"),
                             *common(args), "--load-base", str(ck), "--train-iters", "0",
                             "--seed", str(seed), "--eval-samples", str(args.eval_samples),
                             "--log-json", str(ev)], out / "logs" / f"{tag}-eval.log",
                            args.dry_run)
                    if args.dry_run:
                        continue
                    d = json.loads(js.read_text())
                    s = d["summary"]
                    e = json.loads(ev.read_text())["summary"]
                    rec = dict(heldout=e["final_heldout"], train_last10=s["mean_loss_last_10"],
                               opt_ms=s["optimizer_ms"], fwd_bwd_ms=s["fwd_bwd_ms"],
                               train_s=s["train_s"],
                               curve=[(args.train_iters, e["final_heldout"])],
                               step_s=[1e-3 * (r["fwd_bwd_ms"] + r["optimizer_ms"])
                                       for r in d["steps"]],
                               step_opt_s=[1e-3 * r["optimizer_ms"] for r in d["steps"]])
                else:
                    if not js.is_file():
                        run([sys.executable, str(REPO / "examples" / "pretrain_relora.py"),
                             *common(args), "--optimizer", name, "--lr", str(lr),
                             "--seed", str(seed), "--train-iters", str(args.train_iters),
                             "--relora-every", str(args.relora_every),
                             "--restart-warmup-iters", str(args.restart_warmup_iters),
                             "--relora-reset", args.relora_reset,
                             "--lora-rank", str(args.lora_rank),
                             "--lora-alpha", str(args.lora_alpha),
                             "--eval-samples", str(args.eval_samples),
                             "--eval-interval",
                             str(max(1, args.train_iters // (args.eval_points or 4))),
                             "--log-interval", str(max(1, args.train_iters // 5)),
                             "--log-json", str(js)], out / "logs" / f"{tag}.log", args.dry_run)
                    if args.dry_run:
                        continue
                    d = json.loads(js.read_text())
                    s = d["summary"]
                    rec = dict(heldout=s["final_heldout"], train_last10=s["last_loss"],
                               opt_ms=s["opt_ms"], fwd_bwd_ms=s["fwd_bwd_ms"],
                               train_s=s["train_s"], curve=d["heldout"],
                               step_s=[a + b + c for a, b, c in zip(
                                   d["fwd_bwd_s"], d["opt_s"], d["restart_s"])],
                               step_opt_s=d["opt_s"])
                records.append(dict(part="pretrain", optimizer=name, lr=lr, seed=seed, **rec))
    return records


def part_finetune(args, out: Path) -> list[dict]:
    records = []
    for base in ("dmuon", "adam"):
        for seed in args.seeds:
            ck = pretrain_full(args, out, base, 3e-3, seed, args.base_iters,
                               f"base-{base}-s{seed}")
            for name in args.ft_optimizers:
                for lr in grid(args, f"ft:{name}", FT_DEFAULT_LR[name]):
                    tag = f"ft-{base}-{name}-lr{lr:g}-s{seed}"
                    d = out / "ft" / tag
                    if not (d / "results.json").is_file():
                        run([sys.executable, str(REPO / "examples" / "finetune_lora.py"),
                             "--load", str(ck), "--optimizer", name, "--lr", str(lr),
                             "--seed", str(seed), "--train-iters", str(args.ft_iters),
                             "--lora-rank", str(args.ft_lora_rank),
                             "--eval-interval",
                             str(max(1, args.ft_iters // (args.eval_points or 3))),
                             "--log-interval", str(args.ft_iters), "--out-dir", str(d)],
                            out / "logs" / f"{tag}.log", args.dry_run)
                    if args.dry_run:
                        continue
                    r = json.loads((d / "results.json").read_text())["records"][0]
                    records.append(dict(part=f"finetune-{base}-base", optimizer=name, lr=lr,
                                        seed=seed, heldout=r["final"], base_heldout=r["start"],
                                        opt_ms=r["optimizer_ms"], fwd_bwd_ms=r["fwd_bwd_ms"],
                                        train_s=r["wall_s"], curve=r["curve"],
                                        step_s=[a + b for a, b in zip(r.get("fwd_bwd_s", []),
                                                                      r.get("opt_s", []))],
                                        step_opt_s=r.get("opt_s", [])))
    return records


def _stats(xs: list[float]) -> tuple[float, float, float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0, min(xs), max(xs))


def paired_line(rs: list[dict], ranked: list) -> str:
    """Each optimizer at its best LR minus the leader at its best LR, seed by seed (every
    run of a seed sees the same data order and initialisation, so the seed-to-seed spread
    largely cancels): mean +- std of the differences over the seeds both have."""
    lead, (lead_lr, *_) = ranked[0]
    base = {r["seed"]: r["heldout"] for r in rs if r["optimizer"] == lead and r["lr"] == lead_lr}
    out = []
    for opt, (lr, *_) in ranked[1:]:
        d = [r["heldout"] - base[r["seed"]] for r in rs
             if r["optimizer"] == opt and r["lr"] == lr and r["seed"] in base]
        if d:
            m, sd, lo, hi = _stats(d)
            out.append(f"{opt} {m:+.4f} +- {sd:.4f} [{lo:+.4f}, {hi:+.4f}] ({len(d)} seeds)")
    return f"paired, best LR minus {lead}'s best LR, per seed: " + ("; ".join(out) or "-")


def table(records: list[dict]) -> str:
    lines = []
    for part in dict.fromkeys(r["part"] for r in records):
        rs = [r for r in records if r["part"] == part]
        lines += [f"\n{part}: held-out loss (nats/byte), mean +- std over seeds [min, max]",
                  "| optimizer    | lr       | seeds | held-out mean +- std [min, max]      "
                  "| opt ms | train s |",
                  "|--------------|----------|-------|--------------------------------------"
                  "|--------|---------|"]
        best = {}
        for opt in dict.fromkeys(r["optimizer"] for r in rs):
            for lr in sorted({r["lr"] for r in rs if r["optimizer"] == opt}):
                cell = [r for r in rs if r["optimizer"] == opt and r["lr"] == lr]
                m, s, lo, hi = _stats([r["heldout"] for r in cell])
                if opt not in best or m < best[opt][1]:
                    best[opt] = (lr, m, s, lo, hi)
                lines.append(
                    f"| {opt:<12} | {lr:<8g} | {len(cell):5d} | {m:.4f} +- {s:.4f} "
                    f"[{lo:.4f}, {hi:.4f}]     | {statistics.median(r['opt_ms'] for r in cell):6.1f} "
                    f"| {statistics.median(r['train_s'] for r in cell):7.1f} |")
        ranked = sorted(best.items(), key=lambda kv: kv[1][1])
        lines.append("best LR per optimizer: " + "; ".join(
            f"{o} {v[0]:g}: {v[1]:.4f} +- {v[2]:.4f}" for o, v in ranked))
        lines.append(paired_line(rs, ranked))
    return "\n".join(lines)


def _best_lrs(rs: list[dict]) -> dict:
    """optimizer -> (best lr, mean held-out there), by mean final held-out loss over seeds."""
    best = {}
    for opt in dict.fromkeys(r["optimizer"] for r in rs):
        for lr in sorted({r["lr"] for r in rs if r["optimizer"] == opt}):
            m = statistics.fmean(r["heldout"] for r in rs
                                 if r["optimizer"] == opt and r["lr"] == lr)
            if opt not in best or m < best[opt][1]:
                best[opt] = (lr, m)
    return best


def reach(rec: dict, target: float):
    """(iteration, train s, optimizer s) of the first held-out evaluation <= target, or
    None; the times are the run's per-step times summed over the steps before it."""
    steps, opt = rec.get("step_s"), rec.get("step_opt_s")
    for it, loss in rec.get("curve") or []:
        if it >= 1 and loss <= target:
            if not steps or len(steps) < it:
                return it, float("nan"), float("nan")
            return it, sum(steps[:it]), sum(opt[:it])
    return None


def time_to_target(records: list[dict]) -> str:
    """Per part: every optimizer at its best LR, side by side, to the worst optimizer's best
    mean final held-out loss (see the module docstring)."""
    lines = []
    for part in dict.fromkeys(r["part"] for r in records):
        rs = [r for r in records if r["part"] == part]
        best = _best_lrs(rs)
        target = max(m for _, m in best.values())
        lines += [f"\n{part}: time to the target held-out loss {target:.4f} (the worst "
                  "optimizer's best mean final loss), each optimizer at its best LR; mean over "
                  "the seeds that reach it",
                  "| optimizer    | lr       | reached | iteration | train s | opt s   |",
                  "|--------------|----------|---------|-----------|---------|---------|"]
        for opt, (lr, _) in sorted(best.items(), key=lambda kv: kv[1][1]):
            cell = [r for r in rs if r["optimizer"] == opt and r["lr"] == lr]
            hits = [h for h in (reach(r, target) for r in cell) if h is not None]
            if hits:
                it, ts, os_ = (statistics.fmean(h[k] for h in hits) for k in range(3))
                cols = f"{it:9.1f} | {ts:7.1f} | {os_:7.2f}"
            else:
                cols = f"{'-':>9} | {'-':>7} | {'-':>7}"
            lines.append(f"| {opt:<12} | {lr:<8g} | {len(hits):3d}/{len(cell):<3d} | {cols} |")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    parts = list(dict.fromkeys(r["part"] for r in records))
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        rs = [r for r in records if r["part"] == part]
        for opt in dict.fromkeys(r["optimizer"] for r in rs):
            lrs = sorted({r["lr"] for r in rs if r["optimizer"] == opt})
            stats = [_stats([r["heldout"] for r in rs if r["optimizer"] == opt and r["lr"] == lr])
                     for lr in lrs]
            ax.errorbar(lrs, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o",
                        capsize=3, label=opt)
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_title(part, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = get_args(argv)
    out = Path(args.out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    records = []
    if "pretrain" in args.parts:
        records += part_pretrain(args, out)
    if "finetune" in args.parts:
        records += part_finetune(args, out)
    if args.dry_run:
        return 0
    config = {k: v for k, v in vars(args).items() if k != "dry_run"}
    (out / "results.json").write_text(json.dumps(dict(config=config, records=records), indent=1))
    text = table(records) + "\n" + time_to_target(records)
    print(text)
    (out / "table.md").write_text(text + "\n")
    plot(records, out / "compare_relora.png")
    print(f"results in {out} ({time.perf_counter() - t:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
