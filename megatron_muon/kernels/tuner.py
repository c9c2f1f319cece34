"""Measure, validate and remember the fastest Newton-Schulz backend per problem size.

For a key (m, n, batch, dtype, device type, steps, coefficient set) the tuner runs every
candidate backend on a seeded random batch, drops candidates that raise or whose output
differs from the reference ``newton_schulz`` beyond tolerance, times the rest and keeps
the fastest.  Choices *and* all timings go to a JSON cache so later runs (and the owner
planner, which uses ``time()`` as its cost model) never re-tune a known key.

Why validate against the reference and not just time: a fast kernel with a wrong tile
config (or a miscompiled one) would otherwise win and silently change Muon's update.

Candidates compute NS by different methods (standard, Gram, Triton), so a second check
holds each to the reference's *accuracy*: its distance from the fp64 result may exceed
the reference's own distance (``newton_schulz`` in the compute dtype) by at most one
``_fp64_slack(dtype)``.  The first check alone would let a method that is, say, twice as
far from the exact result as standard bf16 NS through, since it is within tolerance of
the bf16 reference.

Tolerance is a Frobenius-norm test, ``||out - ref||_F <= atol * sqrt(numel) + rtol *
||ref||_F``: element-wise ``allclose`` is brittle for bf16 NS, whose rounding differences
are amplified a little by each step, while a wrong result (bad coefficients, a transposed
or stale buffer) is off by O(1) in this norm.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import tempfile
import time as _time
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from megatron_muon.core.newton_schulz import Coefficients, newton_schulz, resolve_coefficients
from megatron_muon.kernels.backends import Backend, get_backend, triton_usable

__all__ = ["NSTuner", "CACHE_ENV", "default_candidates"]

#: Environment variable naming the JSON cache when ``cache_path`` is not given.
CACHE_ENV = "MEGATRON_MUON_TUNER_CACHE"
_FORMAT_VERSION = 1

# GPU tile configs worth trying: big tensor-core tiles for large matrices, smaller ones for
# more programs (occupancy) on small matrices / small batches.
_TRITON_CUDA_CONFIGS = (
    "triton:128x64:w8:s3",
    "triton:128x32:w8:s3",
    "triton:64x64:w4:s3",
    "triton:64x32:w4:s4",
)


def default_candidates(device: Union[torch.device, str]) -> list[str]:
    """Backends tried when the caller names none: standard NS batched and looped, Gram NS
    (``torch_gram``, default restarts), and Triton only on CUDA: under the CPU
    interpreter it is a correctness tool, orders of magnitude too slow to win."""
    names = ["torch_batched", "torch_loop", "torch_gram"]
    dev = torch.device(device)
    if dev.type == "cuda" and triton_usable(dev):
        names.extend(_TRITON_CUDA_CONFIGS)
    return names


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _coef_tag(coefficients: Coefficients) -> str:
    if isinstance(coefficients, str):
        return coefficients
    flat = ",".join(f"{v:.6g}" for t in coefficients for v in t)
    return f"custom[{flat}]"


def _default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for the Frobenius test, per compute dtype.

    fp32 'highest': backends differ only by summation order (~1e-6 measured), 1e-3 leaves
    margin; fp32 with TF32 allowed and bf16/fp16 differ by a few 1e-3..1e-2 (bf16 vs bf16 of
    two backends measured <= 1e-2 on CPU); 5e-2 keeps wrong results (O(1)) out.
    """
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return 1e-3, 1e-6
    if dtype == torch.float64:
        return 1e-8, 1e-12
    return 5e-2, 1e-4


def _fp64_slack(dtype: torch.dtype) -> float:
    """How much further from the fp64 result than the reference a candidate may be
    (relative Frobenius distance).

    16-bit and TF32: one unit roundoff (bf16 2^-8; fp16 and TF32 2^-11).  Standard NS is
    itself several unit roundoffs from the exact result (bf16: 0.6-1.7e-2 measured, 1.4-4
    u), and two methods round at different points, so their distances differ by a
    fraction of u: one u is the first size that separates "as accurate" from "less
    accurate" without rejecting a correct method by chance (bf16 Gram measured <= 0.5 u).
    fp32 'highest': 1e-5, about one standard-fp32 distance from fp64 on inputs with
    condition number 1e3 (measured <= 7.8e-6, 130 u; the polynomials' slope amplifies
    each step's rounding).  fp64: 1e-12.
    """
    if dtype == torch.float64:
        return 1e-12
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return 1e-5
    if dtype == torch.bfloat16:
        return 2.0**-8
    return 2.0**-11


def _rel_dist(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(a.double() - b.double())
            / torch.linalg.vector_norm(b.double()).clamp_min(1e-30)).item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(fn: Backend, x: torch.Tensor, coeffs: list, eps: float, dtype: torch.dtype,
             warmup: int, iters: int) -> float:
    """Median seconds of one call: CUDA events on GPU (no host overhead in the number
    beyond launch gaps), perf_counter on CPU."""
    for _ in range(warmup):
        fn(x, coeffs, eps, dtype)
    _sync(x.device)
    samples = []
    for _ in range(iters):
        if x.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x, coeffs, eps, dtype)
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = _time.perf_counter()
            fn(x, coeffs, eps, dtype)
            samples.append(_time.perf_counter() - t0)
    return float(statistics.median(samples))


class NSTuner:
    """Per-key autotuner for batched NS; see the module docstring.

    Args:
        cache_path: JSON file for choices and timings (default: ``$MEGATRON_MUON_TUNER_CACHE``;
            neither given: in memory only).  Written atomically after each new key and
            merged, under a lock file next to it, with entries other processes wrote.
        candidates: backend names (``get_backend`` names) or a ``{name: callable}`` mapping
            (for custom or experimental backends); default ``default_candidates(device)``.
        warmup, iters: untimed and timed calls per candidate (the median is kept).
        rtol, atol: Frobenius tolerance vs the reference (default per dtype).
        steps, coefficients, eps: the NS problem being tuned (part of the key).
        seed: seed of the random test batch.
    """

    def __init__(
        self,
        cache_path: Optional[Union[str, os.PathLike]] = None,
        candidates: Optional[Union[Sequence[str], Mapping[str, Backend]]] = None,
        warmup: int = 1,
        iters: int = 3,
        rtol: Optional[float] = None,
        atol: Optional[float] = None,
        steps: int = 5,
        coefficients: Coefficients = "simple",
        eps: float = 1e-7,
        seed: int = 0,
    ) -> None:
        if warmup < 0 or iters < 1:
            raise ValueError(f"NSTuner needs warmup >= 0 and iters >= 1, got {warmup}, {iters}")
        path = cache_path if cache_path is not None else os.environ.get(CACHE_ENV) or None
        self.cache_path: Optional[str] = os.fspath(path) if path is not None else None
        self._custom: dict[str, Backend] = {}
        self._names: Optional[list[str]] = None
        if isinstance(candidates, Mapping):
            self._custom = dict(candidates)
            self._names = list(candidates)
        elif candidates is not None:
            self._names = list(candidates)
            for name in self._names:
                get_backend(name)  # ValueError for unknown names, now rather than mid-training
        self.warmup, self.iters = int(warmup), int(iters)
        self.rtol, self.atol = rtol, atol
        self.coeffs = resolve_coefficients(coefficients, steps)
        self.steps, self.coef_tag, self.eps, self.seed = steps, _coef_tag(coefficients), eps, seed
        self.tune_count = 0  # keys measured by this instance (tests, logging)
        self._entries: dict[str, dict[str, Any]] = self._read_cache()

    # ----------------------------------------------------------------- public API
    def backend(self, name: str) -> Backend:
        """Callable for a candidate name (custom mapping first, then the registry)."""
        if name in self._custom:
            return self._custom[name]
        return get_backend(name)

    def choose(self, m: int, n: int, batch: int, dtype: torch.dtype,
               device: Union[torch.device, str]) -> str:
        """Name of the fastest validated backend for this key (tuning it if unknown)."""
        return self._entry(m, n, batch, dtype, device)["choice"]

    def time(self, m: int, n: int, batch: int, dtype: torch.dtype,
             device: Union[torch.device, str]) -> float:
        """Measured seconds of NS on ``batch`` m x n matrices with the chosen backend.

        The owner planner's cost model: tuned once per key, then a dict lookup.
        Measurements differ between ranks, so DMuon's planner times on one rank of each
        group and shares the numbers (``megatron.dmuon._shared_tuner_costs``).
        """
        return float(self._entry(m, n, batch, dtype, device)["seconds"])

    def tune(self, m: int, n: int, batch: int, dtype: torch.dtype,
             device: Union[torch.device, str]) -> dict[str, Any]:
        """Measure this key now (even if cached) and store the result."""
        key, meta = self._key(m, n, batch, dtype, device)
        entry = self._measure_key(meta)
        self._entries[key] = entry
        self._write_cache(key, entry)
        return dict(entry)

    def table(self) -> list[dict[str, Any]]:
        """One row per known key: shape, batch, dtype, device, choice, seconds, all timings
        and the rejected candidates with their reasons."""
        rows = [dict(self._entries[k]) for k in sorted(self._entries)]
        for r in rows:
            r["timings"] = dict(r.get("timings", {}))
            r["rejected"] = dict(r.get("rejected", {}))
        return rows

    # ----------------------------------------------------------------- internals
    def _candidate_names(self, device: torch.device) -> list[str]:
        return list(self._names) if self._names is not None else default_candidates(device)

    def _key(self, m: int, n: int, batch: int, dtype: torch.dtype,
             device: Union[torch.device, str]) -> tuple[str, dict[str, Any]]:
        if min(int(m), int(n), int(batch)) < 1:
            raise ValueError(f"NSTuner key needs m, n, batch >= 1, got {(m, n, batch)}")
        dev = torch.device(device)
        meta = {
            "m": int(m), "n": int(n), "batch": int(batch), "dtype": _dtype_name(dtype),
            "device": dev.type, "steps": self.steps, "coefficients": self.coef_tag,
        }
        key = "{m}x{n}|b{batch}|{dtype}|{device}|k{steps}|{coefficients}".format(**meta)
        return key, {**meta, "_device": dev, "_dtype": dtype}

    def _entry(self, m: int, n: int, batch: int, dtype: torch.dtype,
               device: Union[torch.device, str]) -> dict[str, Any]:
        key, meta = self._key(m, n, batch, dtype, device)
        entry = self._entries.get(key)
        if entry is not None and self._still_valid(entry, meta["_device"]):
            return entry
        entry = self._measure_key(meta)
        self._entries[key] = entry
        self._write_cache(key, entry)
        return entry

    def _still_valid(self, entry: Mapping[str, Any], device: torch.device) -> bool:
        """A cached entry is reused when its choice is still a candidate here and every
        current candidate was already tried for it (else something new might be faster)."""
        names = set(self._candidate_names(device))
        tried = set(entry.get("timings", {})) | set(entry.get("rejected", {}))
        return entry.get("choice") in names and names <= tried

    def _test_input(self, meta: Mapping[str, Any]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randn(meta["batch"], meta["m"], meta["n"], generator=gen)
        return x.to(meta["_device"])

    def _within_tolerance(self, out: torch.Tensor, ref: torch.Tensor,
                          dtype: torch.dtype) -> tuple[bool, float]:
        rtol0, atol0 = _default_tolerance(dtype)
        rtol = self.rtol if self.rtol is not None else rtol0
        atol = self.atol if self.atol is not None else atol0
        diff = torch.linalg.vector_norm((out.double() - ref.double())).item()
        scale = torch.linalg.vector_norm(ref.double()).item()
        ok = math.isfinite(diff) and diff <= atol * math.sqrt(ref.numel()) + rtol * scale
        return ok, diff / max(scale, 1e-30)

    def _measure_key(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        dtype: torch.dtype = meta["_dtype"]
        x = self._test_input(meta)
        ref = newton_schulz(x, steps=self.steps, coefficients=self.coeffs, eps=self.eps, dtype=dtype)
        exact = newton_schulz(x.double(), steps=self.steps, coefficients=self.coeffs, eps=self.eps)
        budget = _rel_dist(ref, exact) + _fp64_slack(dtype)
        timings: dict[str, float] = {}
        rejected: dict[str, str] = {}
        for name in self._candidate_names(meta["_device"]):
            try:
                fn = self.backend(name)
                out = fn(x, self.coeffs, self.eps, dtype)
                if tuple(out.shape) != tuple(x.shape):
                    rejected[name] = f"wrong output shape {tuple(out.shape)}"
                    continue
                ok, rel = self._within_tolerance(out, ref, dtype)
                if not ok:
                    rejected[name] = f"differs from reference: relative Frobenius error {rel:.3e}"
                    continue
                dist = _rel_dist(out, exact)
                if not dist <= budget:
                    rejected[name] = (f"less accurate than the reference: {dist:.3e} from the fp64 "
                                      f"result, allowed {budget:.3e}")
                    continue
                timings[name] = _measure(fn, x, self.coeffs, self.eps, dtype, self.warmup, self.iters)
            except Exception as exc:  # a candidate that cannot run here is just not chosen
                rejected[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not timings:
            # The reference is always correct; better slow than no optimizer step.
            warnings.warn(f"NSTuner: every candidate failed for {meta}; using torch_batched ({rejected})")
            timings["torch_batched"] = _measure(self.backend("torch_batched"), x, self.coeffs,
                                                self.eps, dtype, self.warmup, self.iters)
        choice = min(timings, key=timings.get)
        self.tune_count += 1
        entry = {k: v for k, v in meta.items() if not k.startswith("_")}
        entry.update(choice=choice, seconds=timings[choice], timings=timings, rejected=rejected)
        if meta["_device"].type == "cuda":
            entry["device_name"] = torch.cuda.get_device_name(meta["_device"])
        return entry

    # ----------------------------------------------------------------- persistence
    def _read_cache(self, warn: bool = True) -> dict[str, dict[str, Any]]:
        if not self.cache_path or not os.path.exists(self.cache_path):
            return {}
        try:
            with open(self.cache_path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("version") != _FORMAT_VERSION \
                    or not isinstance(data.get("entries"), dict):
                raise ValueError("not an NSTuner cache of format version 1")
            return dict(data["entries"])
        except (OSError, ValueError) as exc:
            if warn:
                warnings.warn(f"NSTuner: ignoring unreadable cache {self.cache_path}: {exc}")
            return {}

    def _write_cache(self, key: str, entry: dict[str, Any]) -> None:
        """Merge this entry into the file and replace it atomically: written to a temporary
        file in the same folder, then ``os.replace``d, so that a reader (or a crash) never
        sees half a file.  Re-reading and replacing happen under an exclusive lock
        (``_cache_lock``): two processes tuning their first keys at once would otherwise both
        read the old file and the second replace would drop the first one's entry."""
        if not self.cache_path:
            return
        directory = os.path.dirname(os.path.abspath(self.cache_path))
        os.makedirs(directory, exist_ok=True)
        with _cache_lock(self.cache_path):
            merged = self._read_cache(warn=False)  # already warned about at construction
            merged[key] = entry
            fd, tmp = tempfile.mkstemp(prefix=".ns_tuner.", suffix=".json", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"version": _FORMAT_VERSION, "entries": merged}, f, indent=1,
                              sort_keys=True)
                os.replace(tmp, self.cache_path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise


@contextlib.contextmanager
def _cache_lock(cache_path: str):
    """An exclusive advisory lock on ``<cache_path>.lock`` (POSIX ``flock``, which also
    separates threads that open the file separately; where there is no ``fcntl`` no lock:
    concurrent writers may then lose each other's new keys, never the file)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(cache_path + ".lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
