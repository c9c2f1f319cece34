"""IsoLoCo: Iso-C merging as DiLoCo's outer step, single-process reference.

Overview: docs/design.md#isoloco-and-islands.

DiLoCo: K islands each train H inner steps alone from the global parameters theta, then
synchronise. Island k's pseudo-gradient is ``D_k = theta_global - theta_k`` and the outer
optimizer sees ``mean D = (1/K) sum_k D_k``.

* ``diloco`` outer step (Nesterov SGD on mean D; DiLoCo paper defaults lr 0.7, mu 0.9)::

      m <- mu m + D;   u = D + mu m   (nesterov) | u = m;   theta <- theta - lr u

* ``isoloco`` outer step (reference-code defaults lr 1.8, mu 0.8). For every 2-D parameter
  ``Iso = iso_c(mean D)`` (all singular values replaced by their mean); other parameters use
  mean D as is::

      order="iso_first" (default):   m <- mu m + Iso;  u = Iso + mu m;  theta <- theta - lr u
      order="momentum_first":        m <- mu m + D;    u = iso_c(D + mu m);  theta <- theta - lr u

Iso-C (``iso_c``), for a 2-D ``D = U S V^T`` with s = min(m, n) singular values:

    iso_c(D) = mean(S) * U_r V_r^T,     mean(S) = sum(S) / s = ||D||_* / s

Definition for rank-deficient inputs: the mean is over all s = min(m, n) singular values
(zeros included, so mean(S) = ||D||_* / s), and ``U_r V_r^T`` is the partial isometry on the
numerical range of D: singular directions whose singular value is at or below
``rank_rtol * sigma_max`` (default ``rank_rtol = max(m, n) * eps`` of the compute dtype, as
``torch.linalg.matrix_rank``) are dropped, because their singular vectors are arbitrary.
So for full-rank D every singular value of the result equals mean(S); for rank r < s the
result has r singular values equal to ||D||_* / s and s - r zeros.

Fast mode (``mode="ns"``, matmuls only): ``O = polar_ns(D) ~ U_r V_r^T`` and
``mean(S) = <O, D>_F / s``. Unlike Muon, the polar factor must be accurate, so the default
schedule (``ISO_NS_*`` below) is:

1. normalisation by ``||D D^T||_F^(1/2)`` (after a Frobenius pre-scale), an upper bound of
   sigma_max that is at most s^(1/4) * sigma_max, tighter than Muon's ``||D||_F``
   (<= s^(1/2) * sigma_max); it reuses the first Gram matrix, so it costs no extra matmul;
2. 14 ``polar_express`` steps: its 8 optimized steps multiply small singular values by
   ~6.4e3 and bring [1e-3, 1] of the scale close to 1; the last triple (1.875, -1.25, 0.375)
   is the classical quintic Newton-Schulz iteration (15x - 10x^3 + 3x^5) / 8, which
   converges cubically to the exact polar factor and multiplies small values by 1.875; it
   repeats for steps 9-14. Together: singular values down to ~2.5e-5 of the scale (i.e.
   cond * s^(1/4) <= ~4e4: cond 1e3 for any practical s, cond 1e4 for s <= 256) converge;
3. 1 "cleanup" step with (a, b, c) = (0, 2.5, -1.5), p(x) = 2.5 x^3 - 1.5 x^5: p(1) = 1,
   p'(1) = 0 (keeps the converged values at 1) and p(x) ~ 2.5 x^3 near 0. Without it the
   rounding noise in the null space of a rank-deficient D (fp32: ~1e-7 of the scale) is
   amplified by the ~3e5 small-value gain of steps 1-14 to ~1e-2; p crushes it (measured on
   rank-s/2 inputs: 2e-6..6e-6 with the cleanup, 3e-3..8e-3 without). Singular values
   below ~5e-6 of the scale therefore act like the SVD mode's rank cutoff (a soft
   threshold: values in ~[5e-6, 2.5e-5] of the scale end partially converged).
   Choice of 14: 12 steps leave cond-1e4 flat spectra unconverged (1e-4), 16 steps let the
   null-space noise through the single cleanup step (4e-5 .. 8e-5 on rank-deficient).

Measured error ``||iso_ns - iso_svd||_F / ||iso_svd||_F`` with this schedule (reference:
fp64 SVD with the NS dtype's rank cutoff); ``python -m megatron_muon.islands.isoloco [--large]
[--dtype float64]`` prints the table:
- fp32, cond <= 1e3 (geometric or flat spectrum; 256^2, 512x128, 128x512, 1024^2, 2048^2,
  1024x4096): <= 1.2e-5; exactly rank-deficient (rank s/2): <= 2.6e-6; mean(S) itself
  <= 1.2e-7 relative.
- fp32, cond 1e4: 5e-6 .. 1.3e-4 for s <= 256 / 512x128; at max(m, n) >= 1024 the fp32 SVD
  cutoff (max(m, n) * eps = 1.2e-4 of sigma_max) drops directions that NS keeps, so the two
  modes legitimately differ there (3e-2 .. 0.46 in the table; a definition, not an NS
  failure: both agree to 1e-13 in fp64).
- fp64, every case above up to 1024^2 including cond 1e4: <= 6.5e-13.
The bound the tests check: 1e-4 (fp32) and 1e-10 (fp64) for cond <= 1e3 and rank-deficient
inputs. The fp32 floor grows like cond * eps (the polar factor itself is that
ill-conditioned).

Nothing here uses torch.distributed: the distributed version only has to all-reduce
mean D across islands and call the same maths.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from megatron_muon.core.newton_schulz import Coefficients, resolve_coefficients

__all__ = [
    "ISO_NS_STEPS",
    "ISO_NS_COEFFICIENTS",
    "ISO_NS_CLEANUP_STEPS",
    "CLEANUP_COEFFICIENTS",
    "polar_ns",
    "iso_c",
    "iso_c_ns_error",
    "conditioned_matrix",
    "ns_error_table",
    "pseudo_gradient",
    "mean_pseudo_gradient",
    "OuterOptimizer",
    "OUTER_DEFAULTS",
]

ISO_NS_STEPS = 14
ISO_NS_COEFFICIENTS = "polar_express"
ISO_NS_CLEANUP_STEPS = 1
CLEANUP_COEFFICIENTS = (0.0, 2.5, -1.5)

OUTER_DEFAULTS = {"diloco": {"lr": 0.7, "momentum": 0.9}, "isoloco": {"lr": 1.8, "momentum": 0.8}}
_ORDERS = ("iso_first", "momentum_first")
_ISO_MODES = ("svd", "ns")


# --------------------------------------------------------------------------------------
# Iso-C maths
# --------------------------------------------------------------------------------------

def _compute_dtype(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        if not dtype.is_floating_point:
            raise ValueError(f"compute dtype must be floating point, got {dtype}")
        return dtype
    return torch.promote_types(t.dtype, torch.float32)


def _check_matrix(delta: Any, what: str = "iso_c") -> None:
    if not isinstance(delta, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(delta).__name__}")
    if delta.ndim != 2:
        raise ValueError(
            f"{what} needs a 2-D matrix, got shape {tuple(delta.shape)}; non-2-D parameters "
            "(biases, norms, ...) are averaged as is by the outer optimizer, not Iso-C merged"
        )
    if delta.numel() == 0:
        raise ValueError(f"{what} got an empty matrix of shape {tuple(delta.shape)}")
    if not delta.is_floating_point():
        raise ValueError(f"{what} needs a floating-point matrix, got {delta.dtype}")
    if not bool(torch.isfinite(delta).all()):
        raise ValueError(f"{what} got a matrix with inf/nan entries (shape {tuple(delta.shape)})")


def polar_ns(
    x: torch.Tensor,
    steps: int = ISO_NS_STEPS,
    coefficients: Coefficients = ISO_NS_COEFFICIENTS,
    cleanup_steps: int = ISO_NS_CLEANUP_STEPS,
    normalization: str = "gram",
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Accurate polar factor ``U_r V_r^T`` of a 2-D ``x`` by Newton-Schulz (matmuls only).

    ``steps`` iterations of ``coefficients`` (a named set of ``newton_schulz`` or explicit
    (a, b, c) triples, last one repeated) followed by ``cleanup_steps`` iterations of
    ``CLEANUP_COEFFICIENTS``. ``normalization``: ``"gram"`` divides by
    ``||X X^T||_F^(1/2)`` (default, see module docstring), ``"frobenius"`` by ``||X||_F``
    exactly like ``newton_schulz``. ``dtype``: compute dtype (default: x's, at least fp32).
    Returns x's dtype and shape; a zero matrix gives zeros.
    """
    _check_matrix(x, "polar_ns")
    if normalization not in ("gram", "frobenius"):
        raise ValueError(f"normalization must be 'gram' or 'frobenius', got {normalization!r}")
    if not isinstance(cleanup_steps, int) or isinstance(cleanup_steps, bool) or cleanup_steps < 0:
        raise ValueError(f"cleanup_steps must be an integer >= 0, got {cleanup_steps!r}")
    coeffs = resolve_coefficients(coefficients, steps) + [CLEANUP_COEFFICIENTS] * cleanup_steps
    cd = _compute_dtype(x, dtype)
    X = x.to(cd)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.mT
    fro = torch.linalg.vector_norm(X)
    if not bool(fro > 0):
        return torch.zeros_like(x)
    X = X / fro
    A = X @ X.mT
    if normalization == "gram":
        # ||A||_F = (sum sigma^4)^(1/2) in [s^-1/2, 1] after the Frobenius pre-scale.
        c = torch.linalg.vector_norm(A).sqrt()
        X = X / c
        A = A / (c * c)
    for i, (a, b, cc) in enumerate(coeffs):
        if i > 0:
            A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=cc) if cc != 0.0 else A * b
        X = torch.addmm(X, B, X, beta=a) if a != 0.0 else B @ X
    if tall:
        X = X.mT
    return X.to(x.dtype)


def _iso_parts(delta: torch.Tensor, mode: str, ns_steps, coefficients, cleanup_steps,
               rank_rtol, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean(S), polar factor) of ``delta`` in the compute dtype."""
    cd = _compute_dtype(delta, dtype)
    m, n = delta.shape
    s = min(m, n)
    D = delta.to(cd)
    if mode == "svd":
        if rank_rtol is None:
            rank_rtol = max(m, n) * torch.finfo(cd).eps
        if not rank_rtol >= 0:
            raise ValueError(f"rank_rtol must be >= 0, got {rank_rtol}")
        U, S, Vh = torch.linalg.svd(D, full_matrices=False)
        mean_s = S.sum() / s
        keep = S > rank_rtol * S[0]
        polar = U[:, keep] @ Vh[keep]
        return mean_s, polar
    polar = polar_ns(
        D,
        ISO_NS_STEPS if ns_steps is None else ns_steps,
        ISO_NS_COEFFICIENTS if coefficients is None else coefficients,
        ISO_NS_CLEANUP_STEPS if cleanup_steps is None else cleanup_steps,
        dtype=cd,
    )
    mean_s = (polar * D).sum() / s
    return mean_s, polar


def _check_iso_args(mode, ns_steps, coefficients, cleanup_steps, rank_rtol) -> None:
    if mode not in _ISO_MODES:
        raise ValueError(f"iso_c mode must be one of {list(_ISO_MODES)}, got {mode!r}")
    if mode == "svd" and (ns_steps is not None or coefficients is not None
                          or cleanup_steps is not None):
        raise ValueError("ns_steps / coefficients / cleanup_steps only apply to mode='ns'")
    if mode == "ns" and rank_rtol is not None:
        raise ValueError("rank_rtol only applies to mode='svd' (NS has a soft cutoff)")
    if mode == "ns":  # validate early, with the same messages as newton_schulz
        resolve_coefficients(ISO_NS_COEFFICIENTS if coefficients is None else coefficients,
                             ISO_NS_STEPS if ns_steps is None else ns_steps)
        if cleanup_steps is not None and (not isinstance(cleanup_steps, int)
                                          or isinstance(cleanup_steps, bool) or cleanup_steps < 0):
            raise ValueError(f"cleanup_steps must be an integer >= 0, got {cleanup_steps!r}")


def iso_c(
    delta: torch.Tensor,
    mode: str = "svd",
    ns_steps: Optional[int] = None,
    coefficients: Optional[Coefficients] = None,
    *,
    cleanup_steps: Optional[int] = None,
    rank_rtol: Optional[float] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Iso-C of a 2-D ``delta``: ``mean(S) * U_r V_r^T`` (all singular values -> their mean).

    ``mode="svd"``: exact, via ``torch.linalg.svd``; directions with singular value
    ``<= rank_rtol * sigma_max`` are dropped from ``U_r V_r^T`` (default
    ``max(m, n) * eps``), the mean is over all min(m, n) singular values.
    ``mode="ns"``: matmuls only, ``O = polar_ns(delta)`` and ``mean(S) = <O, delta>_F / s``;
    ``ns_steps`` / ``coefficients`` / ``cleanup_steps`` default to ``ISO_NS_STEPS`` (14),
    ``ISO_NS_COEFFICIENTS`` ("polar_express") and ``ISO_NS_CLEANUP_STEPS`` (1); ns_steps
    counts the main iterations, the cleanup ones come on top.
    ``dtype``: compute dtype (default: delta's, at least fp32). Returns delta's dtype.
    Raises ValueError for non-2-D, empty, integer or non-finite input.
    """
    _check_iso_args(mode, ns_steps, coefficients, cleanup_steps, rank_rtol)
    _check_matrix(delta)
    mean_s, polar = _iso_parts(delta, mode, ns_steps, coefficients, cleanup_steps, rank_rtol, dtype)
    return (mean_s * polar).to(delta.dtype)


def iso_c_ns_error(
    delta: torch.Tensor,
    ns_steps: Optional[int] = None,
    coefficients: Optional[Coefficients] = None,
    *,
    cleanup_steps: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
) -> dict:
    """Error of ``iso_c(delta, "ns", ...)`` against the exact SVD formula.

    The reference is ``iso_c(delta, "svd")`` computed in float64, with the rank cutoff of
    the NS compute dtype (``max(m, n) * eps``). Returns a dict: ``rel_error``
    (||iso_ns - iso_svd||_F / ||iso_svd||_F, absolute if the reference is 0),
    ``polar_rel_error`` (same for the polar factors), ``mean_s_rel_error``, ``mean_s_svd``,
    ``mean_s_ns``, ``rank`` (reference numerical rank), ``shape``, ``iterations``
    (NS steps + cleanup steps) and ``dtype``.
    """
    _check_iso_args("ns", ns_steps, coefficients, cleanup_steps, None)
    _check_matrix(delta, "iso_c_ns_error")
    cd = _compute_dtype(delta, dtype)
    m, n = delta.shape
    rtol = max(m, n) * torch.finfo(cd).eps
    ref_mean, ref_polar = _iso_parts(delta, "svd", None, None, None, rtol, torch.float64)
    ns_mean, ns_polar = _iso_parts(delta, "ns", ns_steps, coefficients, cleanup_steps, None, cd)
    ns_mean, ns_polar = ns_mean.double(), ns_polar.double()
    ref_iso, ns_iso = ref_mean * ref_polar, ns_mean * ns_polar

    def rel(a, b):
        den = torch.linalg.vector_norm(b)
        num = torch.linalg.vector_norm(a - b)
        return float(num / den) if den > 0 else float(num)

    steps = ISO_NS_STEPS if ns_steps is None else ns_steps
    cleanup = ISO_NS_CLEANUP_STEPS if cleanup_steps is None else cleanup_steps
    return {
        "rel_error": rel(ns_iso, ref_iso),
        "polar_rel_error": rel(ns_polar, ref_polar),
        "mean_s_rel_error": abs(float(ns_mean - ref_mean)) / max(abs(float(ref_mean)), 1e-300),
        "mean_s_svd": float(ref_mean),
        "mean_s_ns": float(ns_mean),
        "rank": int(round(float(torch.linalg.vector_norm(ref_polar)) ** 2)),
        "shape": (m, n),
        "iterations": steps + cleanup,
        "dtype": str(cd).replace("torch.", ""),
    }


def conditioned_matrix(
    m: int,
    n: int,
    cond: float = 1.0,
    *,
    spectrum: str = "geometric",
    rank: Optional[int] = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Test matrix ``D = U diag(s) V^T`` with known factors (built in float64).

    ``spectrum="geometric"``: s from 1 down to 1/cond log-uniformly; ``"flat"``: all ones
    except the last = 1/cond. ``rank``: zero the singular values from index ``rank`` on.
    Returns ``(D in dtype, U, s, V)`` (factors in float64, U: m x k, V: n x k, k = min).
    """
    if spectrum not in ("geometric", "flat"):
        raise ValueError(f"spectrum must be 'geometric' or 'flat', got {spectrum!r}")
    k = min(m, n)
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    if spectrum == "geometric":
        s = torch.logspace(0.0, -math.log10(cond), k, dtype=torch.float64)
    else:
        s = torch.ones(k, dtype=torch.float64)
        s[-1] = 1.0 / cond
    if rank is not None:
        s[rank:] = 0.0
    return ((U * s) @ V.mT).to(dtype), U, s, V


def ns_error_table(
    shapes: Sequence[tuple[int, int]] = ((256, 256), (512, 128), (128, 512), (1024, 1024)),
    cases: Sequence[tuple[float, str, Optional[str]]] = (
        (1.0, "geometric", None), (1e2, "geometric", None), (1e3, "geometric", None),
        (1e3, "flat", None), (1e4, "geometric", None), (1e4, "flat", None),
        (1e3, "geometric", "half"),
    ),
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **ns_kwargs,
) -> list[dict]:
    """``iso_c_ns_error`` over shapes x (cond, spectrum, rank) cases; rank "half" = s // 2."""
    rows = []
    for i, (m, n) in enumerate(shapes):
        for j, (cond, spectrum, rank) in enumerate(cases):
            r = min(m, n) // 2 if rank == "half" else rank
            D = conditioned_matrix(m, n, cond, spectrum=spectrum, rank=r, seed=seed + 100 * i + j,
                                   dtype=dtype)[0]
            row = iso_c_ns_error(D, **ns_kwargs)
            row.update(cond=cond, spectrum=spectrum, rank_arg=rank)
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------
# Pseudo-gradients and the outer optimizer
# --------------------------------------------------------------------------------------

Params = Union[Mapping[str, torch.Tensor], Sequence[torch.Tensor]]


def _as_items(params: Any, what: str) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """[(name, tensor)] and whether the container was a mapping."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{what} must be a dict name->tensor or a list of tensors, not one tensor")
    if isinstance(params, Mapping):
        items, is_map = [(str(k), v) for k, v in params.items()], True
    elif isinstance(params, Iterable):
        items, is_map = [(str(i), v) for i, v in enumerate(params)], False
    else:
        raise TypeError(f"{what} must be a dict name->tensor or a list of tensors, "
                        f"got {type(params).__name__}")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
    return items, is_map


def _match(ref_items: list[tuple[str, torch.Tensor]], ref_map: bool, other: Any,
           what: str) -> list[torch.Tensor]:
    """Tensors of ``other`` in the order of ``ref_items``; same names/length and shapes."""
    items, is_map = _as_items(other, what)
    if is_map != ref_map:
        kind = "a dict" if ref_map else "a list"
        raise TypeError(f"{what} must be {kind}, like the parameters")
    names = [k for k, _ in ref_items]
    if is_map:
        got = dict(items)
        missing = [k for k in names if k not in got]
        extra = [k for k in got if k not in set(names)]
        if missing or extra:
            raise ValueError(f"{what} keys differ from the parameters: missing {missing}, "
                             f"unexpected {extra}")
        tensors = [got[k] for k in names]
    else:
        if len(items) != len(names):
            raise ValueError(f"{what} has {len(items)} tensors, the parameters {len(names)}")
        tensors = [t for _, t in items]
    for (name, p), t in zip(ref_items, tensors):
        if t.shape != p.shape:
            raise ValueError(f"{what}[{name!r}] has shape {tuple(t.shape)}, "
                             f"parameter has {tuple(p.shape)}")
    return tensors


def _pack(names: list[str], tensors: list[torch.Tensor], is_map: bool):
    return dict(zip(names, tensors)) if is_map else list(tensors)


def pseudo_gradient(global_params: Params, local_params: Params,
                    dtype: Optional[torch.dtype] = None):
    """``D = theta_global - theta_local`` per parameter (same container kind as the input).

    ``dtype``: result dtype (default: the promoted dtype of the pair, at least fp32).
    ``theta_global - D == theta_local`` holds bitwise when the subtraction is exact, e.g.
    every local value within a factor 2 of the global one (Sterbenz) - not for entries that
    move across zero or far relative to their size, where fp32 D is rounded (<= 1 ulp).
    ``dtype=torch.float64`` makes it exact for fp32 parameters (the difference of two fp32
    numbers with exponents within 29 of each other fits in fp64).
    """
    g_items, g_map = _as_items(global_params, "global_params")
    l_tensors = _match(g_items, g_map, local_params, "local_params")
    out = []
    for (name, g), loc in zip(g_items, l_tensors):
        dt = dtype or torch.promote_types(torch.promote_types(g.dtype, loc.dtype), torch.float32)
        out.append(g.detach().to(dt) - loc.detach().to(device=g.device, dtype=dt))
    return _pack([k for k, _ in g_items], out, g_map)


def mean_pseudo_gradient(global_params: Params, local_params_list: Sequence[Params],
                         dtype: Optional[torch.dtype] = None):
    """``mean D = (1/K) sum_k (theta_global - theta_k)`` over K islands (summed in order)."""
    if isinstance(local_params_list, (Mapping, torch.Tensor)) or len(local_params_list) == 0:
        raise ValueError("local_params_list must be a non-empty list of per-island parameters")
    total = None
    for loc in local_params_list:
        d = pseudo_gradient(global_params, loc, dtype)
        if total is None:
            total = d
        elif isinstance(d, dict):
            total = {k: total[k] + v for k, v in d.items()}
        else:
            total = [a + b for a, b in zip(total, d)]
    K = len(local_params_list)
    if K == 1:
        return total
    return {k: v / K for k, v in total.items()} if isinstance(total, dict) else [v / K for v in total]


class OuterOptimizer:
    """DiLoCo / IsoLoCo outer optimizer over the global parameters (single process).

    Args:
        params: dict name->tensor or list of tensors; cloned (detached) - the optimizer owns
            the global copy, read it with ``.params`` (live tensors, same container kind).
        method: ``"diloco"`` (Nesterov SGD on mean D) or ``"isoloco"`` (Iso-C on 2-D params).
        lr, momentum: default per method (``OUTER_DEFAULTS``: diloco 0.7 / 0.9,
            isoloco 1.8 / 0.8).
        nesterov: ``u = D + mu m`` (default) or ``u = m``.
        order: isoloco only; ``"iso_first"`` (Iso-C of mean D, then momentum; default) or
            ``"momentum_first"`` (momentum on mean D, Iso-C of u).
        iso_mode: ``"svd"`` (exact) or ``"ns"`` (matmuls only, ``polar_ns``);
            ``ns_steps`` / ``ns_coefficients`` / ``ns_cleanup_steps`` as in ``iso_c``.
        iso_filter: ``f(name, tensor) -> bool`` choosing the Iso-C parameters (default: all
            2-D parameters); it may only pick 2-D parameters.

    Momentum buffers are kept in (param dtype promoted to) fp32; the update is computed in
    the promotion of the param, mean-D and fp32 dtypes and written back in the param dtype.
    """

    def __init__(
        self,
        params: Params,
        method: str = "isoloco",
        lr: Optional[float] = None,
        momentum: Optional[float] = None,
        *,
        nesterov: bool = True,
        order: str = "iso_first",
        iso_mode: str = "svd",
        ns_steps: Optional[int] = None,
        ns_coefficients: Optional[Coefficients] = None,
        ns_cleanup_steps: Optional[int] = None,
        iso_filter: Optional[Callable[[str, torch.Tensor], bool]] = None,
    ):
        if method not in OUTER_DEFAULTS:
            raise ValueError(f"method must be one of {list(OUTER_DEFAULTS)}, got {method!r}")
        self.method = method
        self.lr = OUTER_DEFAULTS[method]["lr"] if lr is None else lr
        self.momentum = OUTER_DEFAULTS[method]["momentum"] if momentum is None else momentum
        self.nesterov = nesterov
        self.order = order
        self.iso_mode = iso_mode
        self.ns_steps = ns_steps
        self.ns_coefficients = ns_coefficients
        self.ns_cleanup_steps = ns_cleanup_steps
        self._validate_hparams()

        items, self._is_map = _as_items(params, "params")
        if not items:
            raise ValueError("OuterOptimizer got no parameters")
        self._names = [k for k, _ in items]
        self._params = []
        for name, p in items:
            if not p.is_floating_point():
                raise ValueError(f"parameter {name!r} is {p.dtype}, not floating point")
            self._params.append(p.detach().clone())
        self._momentum = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
                          for p in self._params]
        pick = iso_filter or (lambda name, p: p.ndim == 2)
        self._iso = []
        for name, p in zip(self._names, self._params):
            use = bool(pick(name, p)) and method == "isoloco"
            if use and p.ndim != 2:
                raise ValueError(f"iso_filter picked {name!r} of shape {tuple(p.shape)}; "
                                 "Iso-C needs 2-D parameters")
            self._iso.append(use)
        self.step_count = 0

    # -- configuration ------------------------------------------------------------------
    def _validate_hparams(self) -> None:
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"outer lr must be a finite number >= 0, got {self.lr!r}")
        if not (isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum!r}")
        if self.order not in _ORDERS:
            raise ValueError(f"order must be one of {list(_ORDERS)}, got {self.order!r}")
        if self.method == "diloco" and self.order != "iso_first":
            raise ValueError("order='momentum_first' only exists for method='isoloco'")
        if self.iso_mode not in _ISO_MODES:
            raise ValueError(f"iso_mode must be one of {list(_ISO_MODES)}, got {self.iso_mode!r}")
        _check_iso_args(self.iso_mode, *self._ns_args(), None)

    def _ns_args(self):
        if self.iso_mode == "svd":
            if (self.ns_steps, self.ns_coefficients, self.ns_cleanup_steps) != (None, None, None):
                raise ValueError("ns_steps / ns_coefficients / ns_cleanup_steps need iso_mode='ns'")
            return None, None, None
        return self.ns_steps, self.ns_coefficients, self.ns_cleanup_steps

    def _iso_c(self, x: torch.Tensor) -> torch.Tensor:
        steps, coeffs, cleanup = self._ns_args()
        return iso_c(x, self.iso_mode, steps, coeffs, cleanup_steps=cleanup)

    @property
    def params(self):
        """The global parameters (live tensors; same container kind as given)."""
        return _pack(self._names, self._params, self._is_map)

    @property
    def iso_names(self) -> list[str]:
        """Names of the parameters that get Iso-C (list indices as strings for lists)."""
        return [k for k, use in zip(self._names, self._iso) if use]

    # -- the step ------------------------------------------------------------------------
    def _checked_deltas(self, mean_delta: Params) -> list[torch.Tensor]:
        deltas = _match(list(zip(self._names, self._params)), self._is_map, mean_delta,
                        "mean_delta")
        for name, d in zip(self._names, deltas):
            if not d.is_floating_point():
                raise ValueError(f"mean_delta[{name!r}] is {d.dtype}, not floating point")
            if not bool(torch.isfinite(d).all()):
                raise ValueError(f"mean_delta[{name!r}] has inf/nan entries")
        return deltas

    def _momentum_update(self, buf: torch.Tensor, g: torch.Tensor, cd: torch.dtype):
        """(new momentum m, update u before any momentum-first Iso-C) for input g."""
        mu = float(self.momentum)
        m = buf.to(cd) * mu + g
        u = g + mu * m if self.nesterov else m
        return m, u

    @torch.no_grad()
    def iso_inputs(self, mean_delta: Params) -> dict:
        """The matrices whose Iso-C the next ``step(mean_delta)`` computes, by name.

        ``order="iso_first"``: mean D of each Iso-C parameter; ``"momentum_first"``:
        ``u = D + mu (mu m + D)`` (or ``mu m + D`` without Nesterov). Changes no state.
        A distributed caller computes ``iso_c`` of these once (on an owner rank) and passes
        the results to ``step(mean_delta, iso_results=...)``.
        """
        deltas = self._checked_deltas(mean_delta)
        out = {}
        for name, p, buf, d, use_iso in zip(self._names, self._params, self._momentum, deltas,
                                            self._iso):
            if not use_iso:
                continue
            cd = torch.promote_types(torch.promote_types(p.dtype, d.dtype), torch.float32)
            d = d.to(device=p.device, dtype=cd)
            out[name] = d if self.order == "iso_first" else self._momentum_update(buf, d, cd)[1]
        return out

    @torch.no_grad()
    def step(self, mean_delta: Params, iso_results: Optional[Mapping[str, torch.Tensor]] = None):
        """One outer step with ``mean D`` (same container kind, names and shapes).

        ``iso_results``: optional ``{name: iso_c(iso_inputs(mean_delta)[name])}`` computed
        elsewhere (the distributed outer step computes each one once, on an owner rank);
        by default ``iso_c`` is computed here. Returns ``self.params``. Raises ValueError on
        mismatched structure or inf/nan in D (before any state is modified).
        """
        deltas = self._checked_deltas(mean_delta)
        if iso_results is not None:
            iso_results = dict(iso_results)
            names = set(self.iso_names)
            if set(iso_results) != names:
                raise ValueError(f"iso_results keys differ from the Iso-C parameters: missing "
                                 f"{sorted(names - set(iso_results))}, unexpected "
                                 f"{sorted(set(iso_results) - names)}")
            for name, p in zip(self._names, self._params):
                if name in names and tuple(iso_results[name].shape) != tuple(p.shape):
                    raise ValueError(f"iso_results[{name!r}] has shape "
                                     f"{tuple(iso_results[name].shape)}, expected {tuple(p.shape)}")

        def iso(name, x):
            return self._iso_c(x) if iso_results is None else iso_results[name].to(x)

        lr = float(self.lr)
        new_params, new_moms = [], []
        for name, p, buf, d, use_iso in zip(self._names, self._params, self._momentum, deltas,
                                            self._iso):
            cd = torch.promote_types(torch.promote_types(p.dtype, d.dtype), torch.float32)
            d = d.to(device=p.device, dtype=cd)
            pre_momentum = use_iso and self.order == "iso_first"
            g = iso(name, d) if pre_momentum else d
            m, u = self._momentum_update(buf, g, cd)
            if use_iso and self.order == "momentum_first":
                u = iso(name, u)
            new_params.append((p.to(cd) - lr * u).to(p.dtype))
            new_moms.append(m.to(buf.dtype))
        for p, buf, np_, nm in zip(self._params, self._momentum, new_params, new_moms):
            p.copy_(np_)
            buf.copy_(nm)
        self.step_count += 1
        return self.params

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed for a bitwise-identical resume (tensors cloned)."""
        return {
            "method": self.method,
            "order": self.order,
            "lr": self.lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "iso_mode": self.iso_mode,
            "ns_steps": self.ns_steps,
            "ns_coefficients": self.ns_coefficients,
            "ns_cleanup_steps": self.ns_cleanup_steps,
            "step_count": self.step_count,
            "names": list(self._names),
            "iso_names": self.iso_names,
            "params": {k: p.clone() for k, p in zip(self._names, self._params)},
            "momentum_buffer": {k: b.clone() for k, b in zip(self._names, self._momentum)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore params, momentum, step count and hyperparameters (lr, momentum, ...).

        ``method``, ``order``, the parameter names/shapes and the Iso-C parameter set must
        match this optimizer (the momentum buffers mean different things otherwise).
        """
        required = {"method", "order", "lr", "momentum", "nesterov", "iso_mode", "ns_steps",
                    "ns_coefficients", "ns_cleanup_steps", "step_count", "names", "iso_names",
                    "params", "momentum_buffer"}
        missing = required - set(state)
        if missing:
            raise ValueError(f"outer optimizer state_dict lacks {sorted(missing)}")
        for key in ("method", "order"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state_dict {key}={state[key]!r} does not match this "
                                 f"optimizer's {getattr(self, key)!r}")
        if list(state["names"]) != self._names:
            raise ValueError("state_dict parameter names differ from this optimizer's")
        if list(state["iso_names"]) != self.iso_names:
            raise ValueError("state_dict Iso-C parameter set differs from this optimizer's")
        for key, mine in (("params", self._params), ("momentum_buffer", self._momentum)):
            for name, t in zip(self._names, mine):
                if tuple(state[key][name].shape) != tuple(t.shape):
                    raise ValueError(f"state_dict {key}[{name!r}] has shape "
                                     f"{tuple(state[key][name].shape)}, expected {tuple(t.shape)}")
        old = {k: getattr(self, k) for k in ("lr", "momentum", "nesterov", "iso_mode", "ns_steps",
                                             "ns_coefficients", "ns_cleanup_steps")}
        for k in old:
            setattr(self, k, state[k])
        try:
            self._validate_hparams()
        except ValueError:
            for k, v in old.items():
                setattr(self, k, v)
            raise
        for name, p, buf in zip(self._names, self._params, self._momentum):
            p.copy_(state["params"][name])
            buf.copy_(state["momentum_buffer"][name])
        self.step_count = int(state["step_count"])


def _main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Iso-C fast-mode (NS) error vs SVD")
    ap.add_argument("--large", action="store_true", help="add 2048x2048 and 1024x4096")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--ns-steps", type=int, default=None)
    ap.add_argument("--coefficients", default=None)
    ap.add_argument("--cleanup-steps", type=int, default=None)
    args = ap.parse_args(argv)
    shapes = [(256, 256), (512, 128), (128, 512), (1024, 1024)]
    if args.large:
        shapes += [(2048, 2048), (1024, 4096)]
    kw = {k: v for k, v in (("ns_steps", args.ns_steps), ("coefficients", args.coefficients),
                            ("cleanup_steps", args.cleanup_steps)) if v is not None}
    print(f"schedule: {kw.get('ns_steps', ISO_NS_STEPS)} x "
          f"{kw.get('coefficients', ISO_NS_COEFFICIENTS)} + "
          f"{kw.get('cleanup_steps', ISO_NS_CLEANUP_STEPS)} cleanup {CLEANUP_COEFFICIENTS}, "
          f"gram normalisation, {args.dtype}")
    print(f"{'shape':>11} {'cond':>7} {'spectrum':>9} {'rank':>5} {'rel_err':>9} "
          f"{'polar_err':>9} {'mean_err':>9}")
    for r in ns_error_table(shapes, dtype=getattr(torch, args.dtype), **kw):
        print(f"{r['shape'][0]:>5}x{r['shape'][1]:<5} {r['cond']:>7.0e} {r['spectrum']:>9} "
              f"{r['rank']:>5} {r['rel_error']:>9.2e} {r['polar_rel_error']:>9.2e} "
              f"{r['mean_s_rel_error']:>9.2e}", flush=True)


if __name__ == "__main__":
    _main()
