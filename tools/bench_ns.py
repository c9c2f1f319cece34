#!/usr/bin/env python3
"""Benchmark batched vs per-matrix Newton-Schulz on the Muon matrices of a GPT.

Model (defaults): 8 layers, hidden 1024, ffn 4096, 16 heads, QKV split into Q, K, V.
Per layer the Muon units are 4 x (h x h) (Q, K, V, proj), 1 x (ffn x h) (fc1) and
1 x (h x ffn) (fc2).  Batched backends group units by their *wide* shape: NS works on
X^T for tall X, so fc1^T and fc2 are the same (h x ffn) problem and share one batch.
The batched timings include stacking the inputs (what an optimizer pays to batch);
``torch_loop`` runs NS on each matrix as stored, one by one (the baseline).

CPU defaults are shrunk (1 layer, 1 timed repeat) so the run takes well under two
minutes on two cores; the output says so.  Example:

    python tools/bench_ns.py --device cuda --dtype bf16 --peak-tflops 790

``--methods`` compares standard and Gram Newton-Schulz (docs/design.md#gram-newton-schulz)
per shape instead: time (median of interleaved runs, so both methods see the same load),
model flops (``ns_flops``), speedup over standard and the relative Frobenius distance
from the fp64 result, for the default restart period and any ``--gram-restarts``:

    python tools/bench_ns.py --methods --threads 1 --coefficients quintic --shapes 512x2048,2048x512

``--mcore`` adds Megatron-Core's own Muon NS (``emerging_optimizers``) to that table, run the
way its Muon runs it (bf16 compute for ``--dtype bf16``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout too

from megatron_muon.kernels import available_backends, get_backend  # noqa: E402
from megatron_muon.core.newton_schulz import (default_gram_restart, newton_schulz, ns_flops,  # noqa: E402
                                         resolve_coefficients)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def muon_shapes(hidden: int, ffn: int, layers: int) -> list[tuple[int, int]]:
    """(m, n) of every Muon unit, layer by layer: Q, K, V, proj, fc1, fc2."""
    per_layer = [(hidden, hidden)] * 4 + [(ffn, hidden), (hidden, ffn)]
    return per_layer * layers


def wide_groups(mats: list[torch.Tensor]) -> dict[tuple[int, int], list[tuple[int, bool]]]:
    """Indices of the matrices per wide shape (s, max), with whether each is transposed."""
    groups: dict[tuple[int, int], list[tuple[int, bool]]] = defaultdict(list)
    for i, w in enumerate(mats):
        m, n = w.shape
        groups[(min(m, n), max(m, n))].append((i, m > n))
    return dict(groups)


def run_batched(fn: Callable, mats: list[torch.Tensor], groups: dict, coeffs: list,
                dtype: torch.dtype) -> list[torch.Tensor]:
    """Stack each wide-shape group, NS it in one call, hand back per-matrix views."""
    outs: list[Optional[torch.Tensor]] = [None] * len(mats)
    for members in groups.values():
        x = torch.stack([mats[i].T if t else mats[i] for i, t in members])
        y = fn(x, coeffs, 1e-7, dtype)
        for k, (i, t) in enumerate(members):
            outs[i] = y[k].T if t else y[k]
    return outs  # type: ignore[return-value]


def run_loop(mats: list[torch.Tensor], coeffs: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """The baseline: one NS call per matrix, in its stored orientation."""
    fn = get_backend("torch_loop")
    return [fn(w.unsqueeze(0), coeffs, 1e-7, dtype)[0] for w in mats]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(step: Callable[[], object], device: torch.device, warmup: int, repeat: int) -> float:
    """Median wall seconds of ``step`` (synchronised on GPU)."""
    for _ in range(warmup):
        step()
    sync(device)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def max_rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(a, b))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="NS compute dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--coefficients", default="simple")
    p.add_argument("--repeat", type=int, default=None, help="timed runs (default: 10 cuda, 1 cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs (default: 3 cuda, 1 cpu)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=None, help="default: 4 * hidden")
    p.add_argument("--layers", type=int, default=None, help="default: 8 on cuda, 1 on cpu")
    p.add_argument("--backends", default=None,
                   help="comma list of torch_batched,torch_loop,torch_gram[:rR],triton[:cfg] "
                        "(default: what runs on the device; triton only on cuda)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="print %% of this peak (e.g. 790 for H200 bf16 dense)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", action="store_true",
                   help="compare standard vs Gram NS per shape (time, flops, error vs fp64)")
    p.add_argument("--shapes", default="512x2048,2048x512,1024x1024,1024x4096",
                   help="--methods: comma list of MxN")
    p.add_argument("--batch", type=int, default=1, help="--methods: matrices per shape")
    p.add_argument("--gram-restarts", default="",
                   help="--methods: comma list of further Gram restart periods to show, besides "
                        "the coefficients' default (0: never)")
    p.add_argument("--mcore", action="store_true",
                   help="--methods: add Megatron-Core's own Muon NS (emerging_optimizers) as a row")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return p.parse_args(argv)


def mcore_ns(steps: int, coefficients: str, dtype: torch.dtype) -> Callable:
    """Megatron-Core's Muon NS (``emerging_optimizers``' ``newton_schulz``) as its Muon calls
    it: fp32 input, bf16 compute under ``fp32_matmul_prec='medium'`` (Megatron's default),
    fp32 under ``'highest'``.  ImportError when it is not installed."""
    import tools.bench_optimizer  # noqa: F401  (typing.override for emerging_optimizers)
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    prec = "medium" if dtype == torch.bfloat16 else "highest"

    def run(x: torch.Tensor) -> torch.Tensor:
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(prec)
        try:
            return muon_utils.newton_schulz(x, steps, coefficients)
        finally:
            torch.set_float32_matmul_precision(prev)

    return run


def compare_methods(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                    dtype_name: str) -> int:
    """Standard vs Gram NS per shape: one row per method and restart period."""
    default = default_gram_restart(args.coefficients)
    restarts = [default] + [r for r in (int(v) for v in args.gram_restarts.split(",") if v.strip())
                            if r != default]
    on_cpu = device.type == "cpu"
    repeat = args.repeat if args.repeat is not None else (5 if on_cpu else 20)
    warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 3)
    print(f"# standard vs Gram NS: device {device}, dtype {dtype_name}, steps {args.steps}, "
          f"coefficients {args.coefficients}, batch {args.batch}, threads {torch.get_num_threads()}, "
          f"median of {repeat} interleaved runs after {warmup} warmup")
    print(f"{'shape':>11} {'method':<10} {'time ms':>9} {'GFLOP':>8} {'flops/std':>9} "
          f"{'speedup':>8} {'rel err vs fp64':>16}")
    gen = torch.Generator().manual_seed(args.seed)
    for spec in args.shapes.split(","):
        m, n = (int(v) for v in spec.lower().split("x"))
        x = torch.randn(args.batch, m, n, generator=gen).to(device)
        exact = newton_schulz(x.double(), args.steps, args.coefficients)
        runs = {"standard": ("standard", 0)}
        runs.update({f"gram r{r}" + ("*" if r == default else ""): ("gram", r) for r in restarts})
        fns = {k: (lambda meth=meth, r=r: newton_schulz(x, args.steps, args.coefficients, dtype=dtype,
                                                         method=meth, gram_restart=r))
               for k, (meth, r) in runs.items()}
        if args.mcore:
            try:
                fn = mcore_ns(args.steps, args.coefficients, dtype)
                fns["mcore"] = lambda fn=fn: fn(x)
            except (ImportError, ValueError) as exc:
                print(f"# mcore: skipped ({type(exc).__name__}: {exc})")
        errs = {k: ((f().double() - exact).norm() / exact.norm()).item() for k, f in fns.items()}
        for _ in range(max(warmup - 1, 0)):
            for f in fns.values():
                f()
        samples: dict[str, list[float]] = defaultdict(list)
        for _ in range(repeat):
            for k, f in fns.items():  # interleaved: a load change hits every method alike
                sync(device)
                t0 = time.perf_counter()
                f()
                sync(device)
                samples[k].append(time.perf_counter() - t0)
        t_std = statistics.median(samples["standard"])
        f_std = ns_flops(m, n, args.steps) * args.batch
        for k in fns:
            meth, r = runs.get(k, ("standard", 0))  # mcore: standard NS, its own code
            t = statistics.median(samples[k])
            fl = ns_flops(m, n, args.steps, meth, gram_restart=r) * args.batch
            print(f"{spec:>11} {k:<10} {t * 1e3:>9.1f} {fl / 1e9:>8.2f} {fl / f_std:>9.2f} "
                  f"{t_std / t:>7.2f}x {errs[k]:>16.2e}")
    print("# gram rR: restart every R steps (0: never); * marks the default for these coefficients"
          + ("; mcore: Megatron-Core's Muon NS (emerging_optimizers), fp32 in, "
             + ("bf16 compute ('medium')" if dtype == torch.bfloat16 else "fp32 ('highest')")
             if args.mcore else ""))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    on_cpu = device.type == "cpu"
    dtype_name = args.dtype or ("fp32" if on_cpu else "bf16")
    dtype = DTYPES[dtype_name]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.methods:
        return compare_methods(args, device, dtype, dtype_name)
    layers = args.layers if args.layers is not None else (1 if on_cpu else 8)
    repeat = args.repeat if args.repeat is not None else (1 if on_cpu else 10)
    warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 3)
    ffn = args.ffn or 4 * args.hidden
    if args.backends:
        names = [b.strip() for b in args.backends.split(",") if b.strip()]
    else:
        names = [b for b in available_backends(device) if not (on_cpu and b.startswith("triton"))]
    if "torch_loop" not in names:
        names.append("torch_loop")  # the ratio column needs the baseline
    coeffs = resolve_coefficients(args.coefficients, args.steps)

    shapes = muon_shapes(args.hidden, ffn, layers)
    gen = torch.Generator().manual_seed(args.seed)
    mats = [torch.randn(m, n, generator=gen).to(device) for m, n in shapes]  # fp32 momenta
    groups = wide_groups(mats)
    flops = sum(ns_flops(m, n, args.steps) for m, n in shapes)

    print(f"# NS benchmark: {layers} layers, hidden {args.hidden}, ffn {ffn}: {len(shapes)} Muon "
          f"matrices in {len(groups)} wide-shape groups "
          f"({', '.join(f'{len(v)}x{k[0]}x{k[1]}' for k, v in groups.items())})")
    print(f"# device {device}{' (' + torch.cuda.get_device_name(device) + ')' if not on_cpu else ''}, "
          f"dtype {dtype_name}, steps {args.steps}, coefficients {args.coefficients}, "
          f"warmup {warmup}, repeat {repeat} (median), {flops / 1e12:.3f} TFLOP per sweep")
    if on_cpu and args.layers is None:
        print("# CPU defaults: 1 layer instead of 8 and 1 timed repeat, to finish in well under "
              "2 minutes on 2 cores; pass --layers 8 --repeat 3 for the full model")

    results: dict[str, float] = {}
    outputs: dict[str, list[torch.Tensor]] = {}
    errors: dict[str, str] = {}
    for name in names:
        try:
            if name == "torch_loop":
                step = lambda: run_loop(mats, coeffs, dtype)  # noqa: E731
            else:
                fn = get_backend(name)
                step = lambda fn=fn: run_batched(fn, mats, groups, coeffs, dtype)  # noqa: E731
            outputs[name] = step()  # also the first warmup / compile
            results[name] = time_it(step, device, max(warmup - 1, 0), repeat)
        except Exception as exc:  # report and keep benchmarking the others
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    loop_t = results.get("torch_loop")
    header = f"{'backend':<24} {'time/sweep ms':>14} {'TFLOP/s':>9}"
    if args.peak_tflops:
        header += f" {'% peak':>7}"
    header += f" {'speedup vs loop':>16} {'max rel err vs loop':>20}"
    print(header)
    for name, t in results.items():
        tf = flops / t / 1e12
        row = f"{name:<24} {t * 1e3:>14.2f} {tf:>9.3f}"
        if args.peak_tflops:
            row += f" {100 * tf / args.peak_tflops:>6.1f}%"
        speed = f"{loop_t / t:.2f}x" if loop_t else "n/a"
        err = f"{max_rel_err(outputs[name], outputs['torch_loop']):.2e}" if "torch_loop" in outputs else "n/a"
        row += f" {speed:>16} {err:>20}"
        print(row)
    for name, msg in errors.items():
        print(f"{name:<24} FAILED: {msg}")
    batched = {k: v for k, v in results.items() if k != "torch_loop"}
    if loop_t and batched:
        best = min(batched, key=batched.get)
        if "torch_batched" in batched:
            print(f"batched/loop time ratio (torch_batched): {batched['torch_batched'] / loop_t:.3f} "
                  f"(speedup {loop_t / batched['torch_batched']:.2f}x)")
        print(f"batched/loop time ratio (best: {best}): {batched[best] / loop_t:.3f} "
              f"(speedup {loop_t / batched[best]:.2f}x)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
