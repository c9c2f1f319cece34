#!/usr/bin/env python3
"""IsoLoCo vs DiLoCo vs data-parallel AdamW as the number of islands grows, at equal tokens.

    python tools/sweep_islands.py                       # the grid of docs/isoloco.md
    python tools/sweep_islands.py --islands 16 --inner-steps 5,10,20 --orders iso_first,momentum_first

One process, K islands of one rank each EMULATED: K copies of the parameters and K inner
AdamW states over one tiny Megatron-Core GPT (no DDP wrapper), trained one after the other,
merged every H inner steps by the library's outer step (``megatron_muon.islands.isoloco``:
``mean_pseudo_gradient`` + ``OuterOptimizer``, the same class ``IslandOuterStep`` calls on
real islands; tests/test_islands.py checks real TP2 / PP2 islands against this emulation).

Equal tokens: a global batch of ``--global-batch`` sequences per inner step for
``--train-iters`` steps whatever K is; island k reads the samples that data-parallel rank k of
K reads (``examples/pretrain_gpt.py``'s sampler), so every K sees the same tokens. The data
is the Python standard library's sources as bytes (``examples/pretrain_gpt.py``'s corpus);
held-out loss is measured on the global parameters after the last outer step.

Methods: ``adam`` (data parallelism: one island over the whole batch, no outer step; the
same for every K, run once per seed), ``diloco`` (Nesterov SGD on mean D), ``isoloco-svd`` /
``isoloco-ns`` (Iso-C by SVD / Newton-Schulz). Outer lr: the published value (DiLoCo 0.7 /
mu 0.9, IsoLoCo 1.8 / mu 0.8, ``OUTER_DEFAULTS``) times each ``--lr-scales`` factor.
Writes ``<out-dir>/sweep_islands.json`` (every run), prints the table (mean and spread over
seeds at the best outer lr of each point, and at the published lr), and plots
``<out-dir>/sweep_islands.png`` when matplotlib is importable. Deterministic: one thread,
seeded init and data; a re-run gives the same numbers bitwise on the same machine and torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (str(REPO), str(REPO / "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

METHODS = ("adam", "diloco", "isoloco-svd", "isoloco-ns")


def _ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s):
    return [float(x) for x in s.split(",") if x.strip()]


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--islands", type=_ints, default=[1, 2, 4, 8, 16], help="K values")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated: " +
                   ", ".join(METHODS))
    p.add_argument("--seeds", type=_ints, default=[1, 2, 3], help="init and data-order seeds")
    p.add_argument("--diloco-lr-scales", type=_floats, default=[0.5, 1.0, 1.5],
                   help="DiLoCo outer lr = published 0.7 x each factor")
    p.add_argument("--isoloco-lr-scales", type=_floats, default=[1.0, 1.5, 2.5],
                   help="IsoLoCo outer lr = published 1.8 x each factor")
    p.add_argument("--ns-lr-scales", type=_floats, default=[],
                   help="isoloco-ns only at these factors (empty: --isoloco-lr-scales); "
                   "the NS-vs-SVD comparison pairs runs of equal lr")
    p.add_argument("--inner-steps", type=_ints, default=[5], help="H values")
    p.add_argument("--orders", default="iso_first", help="IsoLoCo momentum orders, "
                   "comma-separated: iso_first, momentum_first")
    p.add_argument("--train-iters", type=int, default=20, help="inner steps per run")
    p.add_argument("--global-batch", type=int, default=16,
                   help="sequences per inner step over all islands (divisible by every K)")
    p.add_argument("--micro-batch-size", type=int, default=4,
                   help="largest microbatch of an island (capped at its share)")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak inner AdamW lr")
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup-iters", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--curves", action="store_true",
                   help="also evaluate after every outer step (default: at the end only)")
    p.add_argument("--time-repeats", type=int, default=5,
                   help="NS vs SVD outer-step timing at the largest K: repeats of each")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: deterministic)")
    p.add_argument("--data-path", default=None, help="default: the Python stdlib sources")
    p.add_argument("--data-cache-dir", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_muon"))
    p.add_argument("--out-dir", default=str(REPO / "runs" / "sweep_islands"))
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs already in <out-dir>/sweep_islands.partial.json")
    p.add_argument("--report-only", action="store_true",
                   help="with --resume: train nothing, summarise the runs found (a grid "
                   "point with no finished run is left out of the table)")
    p.add_argument("--resume-from", nargs="*", default=[], metavar="JSON",
                   help="with --resume, also reuse the runs of these partial files (e.g. the "
                   "same grid split over processes with --seeds)")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        p.error(f"--methods: unknown {bad or '(none)'}; choose from {', '.join(METHODS)}")
    if [o for o in args.orders if o not in ("iso_first", "momentum_first")] or not args.orders:
        p.error("--orders: choose from iso_first, momentum_first")
    for K in args.islands:
        if K < 1 or args.global_batch % K:
            p.error(f"--islands {K}: must be >= 1 and divide --global-batch {args.global_batch}")
    for H in args.inner_steps:
        if H < 1 or args.train_iters % H:
            p.error(f"--inner-steps {H}: must be >= 1 and divide --train-iters")
    for name in ("seeds", "diloco_lr_scales", "isoloco_lr_scales"):
        v = getattr(args, name)
        if not v or (name != "seeds" and min(v) <= 0):
            p.error(f"--{name.replace('_', '-')} needs at least one value (scales > 0)")
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        p.error("--lr-warmup-iters must be in [0, --train-iters)")
    if args.hidden_size % args.num_attention_heads:
        p.error("--hidden-size must be a multiple of --num-attention-heads")
    return args


# ============================================================================ set-up
def setup(args):
    """A one-rank gloo world and Megatron's TP1 x PP1 groups; threads pinned."""
    import torch
    import torch.distributed as dist

    from megatron_muon.megatron.cpu_mode import enable_cpu_mode

    torch.set_num_threads(args.threads)
    enable_cpu_mode()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def datasets(args, seed: int):
    import isoloco_islands as ex  # examples/isoloco_islands.py: GPTDataset over the corpus

    a = argparse.Namespace(**vars(args))
    a.seed = seed
    a.global_batch_size = args.global_batch
    return ex.build_datasets(a)


def lr_at(args, step: int) -> float:
    """Linear warmup from 0, cosine decay to --min-lr (Megatron's schedule)."""
    w, T = args.lr_warmup_iters, args.train_iters
    if step < w:
        return args.lr * (step + 1) / w
    frac = (step - w) / max(1, T - w)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))


class Run:
    """One model, K emulated islands (K parameter copies and K AdamW states)."""

    def __init__(self, args, seed: int, K: int, train, valid):
        import torch

        from megatron_muon.megatron.models import init_parallel
        from megatron_muon.testing.gpt import TinyGPTConfig, build_gpt

        init_parallel(1, 1, seed=seed)
        self.args, self.K, self.train, self.valid = args, K, train, valid
        cfg = TinyGPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                            ffn_hidden_size=4 * args.hidden_size,
                            num_attention_heads=args.num_attention_heads,
                            num_query_groups=args.num_attention_heads, vocab_size=256,
                            seq_length=args.seq_length, micro_batch_size=1,
                            num_microbatches=1, seed=seed)
        self.model = build_gpt(cfg, wrap_ddp=False)
        self.named = list(self.model[0].named_parameters())
        self.theta0 = {n: p.detach().clone() for n, p in self.named}
        self.islands = [{n: t.clone() for n, t in self.theta0.items()} for _ in range(K)]
        decay = [p for n, p in self.named if p.ndim > 1 and not n.endswith(".bias")]
        rest = [p for n, p in self.named if not (p.ndim > 1 and not n.endswith(".bias"))]
        self.opts = [torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                        {"params": rest, "weight_decay": 0.0}],
                                       lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
                     for _ in range(K)]
        share = args.global_batch // K
        self.data_args = argparse.Namespace(
            micro_batch_size=min(args.micro_batch_size, share), data_parallel_size=K,
            global_batch_size=args.global_batch, seq_length=args.seq_length)
        while share % self.data_args.micro_batch_size:
            self.data_args.micro_batch_size -= 1

    def _use(self, params: dict) -> None:
        for n, p in self.named:
            p.data = params[n]

    def inner_step(self, step: int) -> None:
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        import pretrain_gpt as pre

        lr = lr_at(self.args, step)
        for k in range(self.K):
            self._use(self.islands[k])
            for _, p in self.named:
                p.grad = None
            batches = pre.get_microbatches(self.train, self.data_args, step, k)
            get_forward_backward_func()(
                forward_step_func=partial(pre.forward_step, check=False),
                data_iterator=iter(batches), model=self.model[0],
                num_microbatches=len(batches), seq_length=self.args.seq_length,
                micro_batch_size=self.data_args.micro_batch_size, forward_only=False)
            if self.args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_([p for _, p in self.named], self.args.clip_grad)
            for g in self.opts[k].param_groups:
                g["lr"] = lr
            self.opts[k].step()

    def held_out_loss(self, params: dict) -> float:
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        import isoloco_islands as ex
        import pretrain_gpt as pre

        self._use(params)
        self.model[0].eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for j in range(0, self.args.eval_samples, 16):
                idx = range(j, min(j + 16, self.args.eval_samples))
                b = ex._batch([self.valid[i] for i in idx])
                out = get_forward_backward_func()(
                    forward_step_func=pre.forward_step, data_iterator=iter([b]),
                    model=self.model[0], num_microbatches=1, seq_length=self.args.seq_length,
                    micro_batch_size=len(idx), forward_only=True)
                total += float(out[0]["lm loss"]) * len(idx)
                n += len(idx)
        self.model[0].train()
        return total / n


def one_run(args, seed: int, K: int, method: str, lr_scale: float, H: int, order: str,
            data) -> dict:
    """Train and merge; return the held-out curve, final loss and outer-step seconds."""
    from megatron_muon.islands.isoloco import (OUTER_DEFAULTS, OuterOptimizer,
                                               mean_pseudo_gradient)

    run = Run(args, seed, K, *data)
    outer, lr = None, None
    if method != "adam":
        base = OUTER_DEFAULTS["diloco" if method == "diloco" else "isoloco"]
        lr = base["lr"] * lr_scale
        kw = dict(lr=lr, momentum=base["momentum"])
        if method.startswith("isoloco"):
            kw.update(iso_mode=method.split("-")[1], order=order)
        outer = OuterOptimizer(run.theta0, "diloco" if method == "diloco" else "isoloco", **kw)
    curve, outer_s = [], []
    t0 = time.perf_counter()
    for step in range(args.train_iters):
        run.inner_step(step)
        if outer is not None and (step + 1) % H == 0:
            t = time.perf_counter()
            new = outer.step(mean_pseudo_gradient(outer.params, run.islands))
            outer_s.append(time.perf_counter() - t)
            for isl in run.islands:
                for n, v in isl.items():
                    v.copy_(new[n])
            if args.curves or step + 1 == args.train_iters:
                curve.append(dict(step=step + 1, loss=run.held_out_loss(run.islands[0])))
    if not curve or curve[-1]["step"] != args.train_iters:
        curve.append(dict(step=args.train_iters, loss=run.held_out_loss(run.islands[0])))
    return dict(seed=seed, islands=K, method=method, lr_scale=lr_scale, outer_lr=lr, H=H,
                order=order if method.startswith("isoloco") else None, curve=curve,
                final_loss=curve[-1]["loss"], outer_seconds=outer_s,
                seconds=time.perf_counter() - t0)


def time_outer_step(args, K: int, seed: int, data) -> dict:
    """Median seconds of one IsoLoCo outer step (svd vs ns), interleaved, on the mean
    pseudo-gradient of K islands after H inner steps; and how far the two results are apart."""
    import torch

    from megatron_muon.islands.isoloco import OuterOptimizer, mean_pseudo_gradient

    H = args.inner_steps[0]
    run = Run(args, seed, K, *data)
    for step in range(H):
        run.inner_step(step)
    mean = mean_pseudo_gradient(run.theta0, run.islands)
    times = {"svd": [], "ns": []}
    res = {}
    for _ in range(args.time_repeats):
        for mode in ("svd", "ns"):
            opt = OuterOptimizer(run.theta0, "isoloco", iso_mode=mode)
            t = time.perf_counter()
            res[mode] = opt.step(mean)
            times[mode].append(time.perf_counter() - t)
    rel = max((torch.linalg.norm(res["ns"][n] - res["svd"][n]) /
               torch.linalg.norm(res["svd"][n] - run.theta0[n])).item()
              for n in opt.iso_names)
    out = dict(islands=K, H=H, svd_s=statistics.median(times["svd"]),
               ns_s=statistics.median(times["ns"]), repeats=args.time_repeats,
               max_rel_update_diff=rel, n_iso_matrices=len(opt.iso_names))
    print(f"outer step at K {K} (median of {args.time_repeats}, interleaved): svd "
          f"{1e3 * out['svd_s']:.1f} ms, ns {1e3 * out['ns_s']:.1f} ms (svd / ns "
          f"{out['svd_s'] / out['ns_s']:.2f}x); max over matrices of ||step_ns - step_svd|| / "
          f"||step_svd|| = {rel:.1e}", flush=True)
    return out


# ============================================================================ report
def _run_id(r):
    return (r["seed"], r["islands"], r["method"], r["lr_scale"], r["H"], r["order"])


def _key(r):
    return (r["method"], r["islands"], r["H"], r["order"])


def summarise(runs: list) -> list:
    """Per (method, K, H, order): mean / min / max over seeds at each lr; best and published."""
    groups = {}
    for r in runs:
        groups.setdefault(_key(r), {}).setdefault(r["lr_scale"], []).append(r["final_loss"])
    rows = []
    for key, by_lr in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                            str(kv[0][3]))):
        stats = {s: dict(mean=statistics.fmean(v), lo=min(v), hi=max(v), n=len(v),
                         std=statistics.pstdev(v)) for s, v in by_lr.items()}
        best = min(stats, key=lambda s: stats[s]["mean"])
        pub = 1.0 if 1.0 in stats else best
        rows.append(dict(method=key[0], islands=key[1], H=key[2], order=key[3], by_lr=stats,
                         best_scale=best, best=stats[best], published=stats[pub]))
    return rows


def table(rows: list) -> list:
    lines = ["| method | K | H | order | best outer lr x | loss at best (mean, min..max; "
             "seeds) | loss at published lr (mean, min..max; seeds) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, p = r["best"], r["published"]
        lines.append(f"| {r['method']} | {r['islands']} | {r['H']} | {r['order'] or '-'} | "
                     f"{r['best_scale']:g} | {b['mean']:.4f} ({b['lo']:.4f}..{b['hi']:.4f}; "
                     f"{b['n']}) | {p['mean']:.4f} ({p['lo']:.4f}..{p['hi']:.4f}; {p['n']}) |")
    return lines


def plot(args, rows: list, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    H0, o0 = args.inner_steps[0], args.orders[0]
    for i, m in enumerate(args.methods):
        sel = sorted((r for r in rows if r["method"] == m and r["H"] in (0, H0)
                      and r["order"] in (None, o0)), key=lambda r: r["islands"])
        if m == "adam" and sel:  # one run per seed, the same for every K
            ys = [sel[0]["best"]["mean"]] * len(args.islands)
            ax.axhline(ys[0], color=f"C{i}", ls="--", label="data-parallel AdamW")
            continue
        xs = [r["islands"] for r in sel]
        ax.errorbar(xs, [r["best"]["mean"] for r in sel],
                    yerr=[[r["best"]["mean"] - r["best"]["lo"] for r in sel],
                          [r["best"]["hi"] - r["best"]["mean"] for r in sel]],
                    marker="o", capsize=3, color=f"C{i}", label=f"{m} (best outer lr)")
        ax.plot(xs, [r["published"]["mean"] for r in sel], ls=":", color=f"C{i}",
                label=f"{m} (published lr)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("islands K (equal tokens)")
    ax.set_ylabel("held-out loss (mean over seeds; bars: min..max)")
    ax.set_title(f"H = {H0}, {args.train_iters} inner steps x {args.global_batch} sequences")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}", flush=True)


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron's CPU-mode notices (no TE / apex)
    args = get_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup(args)
    t_all = time.perf_counter()
    partial_path = out / "sweep_islands.partial.json"
    done = {}
    if args.resume:
        for path in [partial_path] + [Path(f) for f in args.resume_from]:
            if path.exists():
                for r in json.loads(path.read_text()):
                    done[_run_id(r)] = r
        print(f"resuming: {len(done)} runs already done", flush=True)
    runs, missing = [], []
    for seed in args.seeds:
        data = None if args.report_only else datasets(args, seed)
        for H in args.inner_steps:
            for K in args.islands:
                for method in args.methods:
                    if method == "adam" and (K != args.islands[0] or H != args.inner_steps[0]):
                        continue  # data parallelism does not depend on K or H
                    scales = [1.0] if method == "adam" else args.diloco_lr_scales \
                        if method == "diloco" else args.ns_lr_scales or args.isoloco_lr_scales \
                        if method == "isoloco-ns" else args.isoloco_lr_scales
                    orders = args.orders if method.startswith("isoloco") else [None]
                    for order in orders:
                        for s in scales:
                            rid = (seed, K if method != "adam" else 0, method, s,
                                   H if method != "adam" else 0, order)
                            if rid in done:
                                runs.append(done[rid])
                                continue
                            if args.report_only:
                                missing.append(rid)
                                continue
                            r = one_run(args, seed, K, method, s, H, order, data)
                            if method == "adam":  # the same for every K and H
                                r["islands"], r["H"] = 0, 0
                            runs.append(r)
                            partial_path.write_text(json.dumps(runs))
                            print(f"seed {seed} K {K:2d} H {H:3d} {method:11s} "
                                  f"{order or '':14s} lr x {s:<4g} loss {r['final_loss']:.4f} "
                                  f"({r['seconds']:.1f} s)", flush=True)
    if missing:
        print(f"--report-only: {len(missing)} grid points have no finished run: "
              + ", ".join(f"seed {m[0]} K {m[1]} {m[2]} lr x {m[3]:g} H {m[4]} {m[5] or ''}"
                          for m in missing), flush=True)
    rows = summarise(runs)
    lines = table(rows)
    print("\n".join(lines))
    fast = {}
    for K in args.islands:
        a = [r for r in runs if r["method"] == "isoloco-svd" and r["islands"] == K]
        b = {(r["seed"], r["lr_scale"], r["H"], r["order"]): r for r in runs
             if r["method"] == "isoloco-ns" and r["islands"] == K}
        pairs = [(x, b[(x["seed"], x["lr_scale"], x["H"], x["order"])]) for x in a
                 if (x["seed"], x["lr_scale"], x["H"], x["order"]) in b]
        if pairs:
            ts = statistics.fmean(t for x, _ in pairs for t in x["outer_seconds"])
            tn = statistics.fmean(t for _, y in pairs for t in y["outer_seconds"])
            d = [y["final_loss"] - x["final_loss"] for x, y in pairs]
            fast[K] = dict(svd_s=ts, ns_s=tn, ratio=ts / tn, max_abs_loss_diff=max(map(abs, d)),
                           mean_loss_diff=statistics.fmean(d), pairs=len(pairs))
            print(f"K {K:2d}: outer step svd {1e3 * ts:.1f} ms, ns {1e3 * tn:.1f} ms "
                  f"(svd / ns {ts / tn:.2f}x); final loss ns - svd: mean "
                  f"{fast[K]['mean_loss_diff']:+.2e}, max |.| {fast[K]['max_abs_loss_diff']:.2e}"
                  f" over {len(pairs)} paired runs", flush=True)
    timing = None
    if {"isoloco-svd", "isoloco-ns"} & set(args.methods) and args.time_repeats > 0:
        timing = time_outer_step(args, max(args.islands), args.seeds[0],
                                 datasets(args, args.seeds[0]))
    (out / "sweep_islands.json").write_text(json.dumps(dict(
        args=vars(args), runs=runs, summary=rows, table=lines, ns_vs_svd=fast, missing=missing,
        outer_step_timing=timing,
        seconds=time.perf_counter() - t_all), indent=1))
    print(f"wrote {out / 'sweep_islands.json'} ({time.perf_counter() - t_all:.0f} s)", flush=True)
    plot(args, rows, out / "sweep_islands.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
