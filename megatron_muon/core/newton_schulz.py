"""Newton-Schulz orthogonalization: the maths every Muon path in this package shares.

The iteration, the coefficient sets and the scale modes are described in
docs/design.md#muon.  ``newton_schulz`` is the reference implementation (plain torch,
batched via ``bmm``); faster backends in ``megatron_muon.kernels`` are tested against it.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch

__all__ = [
    "COEFFICIENT_SETS",
    "SCALE_MODES",
    "resolve_coefficients",
    "newton_schulz",
    "muon_scale",
    "ns_flops",
]

# Per-step (a, b, c); the last triple repeats when more steps are asked for.
COEFFICIENT_SETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "cubic": ((1.5, -0.5, 0.0),),
}

SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")

Coefficients = Union[str, Sequence[Sequence[float]]]


def resolve_coefficients(coefficients: Coefficients, steps: int) -> list[tuple[float, float, float]]:
    """Return exactly ``steps`` (a, b, c) triples for a named set or an explicit list."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(
                f"unknown Newton-Schulz coefficient set {coefficients!r}; "
                f"choose one of {sorted(COEFFICIENT_SETS)}"
            )
        table = COEFFICIENT_SETS[coefficients]
    else:
        table = tuple(tuple(float(v) for v in t) for t in coefficients)
        if not table or any(len(t) != 3 for t in table):
            raise ValueError("explicit coefficients must be a non-empty list of (a, b, c) triples")
    return [tuple(table[min(i, len(table) - 1)]) for i in range(steps)]


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "simple",
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U V^T of ``x`` ([m, n] or [b, m, n]).

    X = x / (||x||_F + eps); tall inputs are transposed so that X X^T is the small Gram
    matrix; per step A = X X^T (computed once), B = b A + c A A, X = a X + B X.
    ``dtype`` is the compute dtype (default: x's dtype, fp32 for anything below fp32 is
    *not* forced: pass ``torch.bfloat16`` explicitly to run in bf16).  The result has
    ``x``'s dtype and shape.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects [m, n] or [b, m, n], got shape {tuple(x.shape)}")
    coeffs = resolve_coefficients(coefficients, steps)
    batched = x.ndim == 3
    X = x if batched else x.unsqueeze(0)
    X = X.to(dtype or x.dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    X = X / (norm + eps)
    for a, b, c in coeffs:
        A = torch.bmm(X, X.transpose(-2, -1))
        B = torch.baddbmm(A, A, A, beta=b, alpha=c) if c != 0.0 else A * b
        X = torch.baddbmm(X, B, X, beta=a)
    if tall:
        X = X.transpose(-2, -1)
    X = X.to(x.dtype)
    return X if batched else X.squeeze(0)


def muon_scale(m: int, n: int, mode: str = "spectral", extra_scale_factor: float = 1.0) -> float:
    """Update scale for an m x n unit (Megatron-Core ``muon_scale_mode`` names)."""
    if mode == "spectral":
        s = math.sqrt(max(m, n))
    elif mode == "shape_scaling":
        s = math.sqrt(max(1.0, m / n))
    elif mode == "unit_rms_norm":
        s = math.sqrt(m / n)
    else:
        raise ValueError(f"unknown muon scale mode {mode!r}; choose one of {list(SCALE_MODES)}")
    return s * extra_scale_factor


def ns_flops(m: int, n: int, steps: int) -> float:
    """Flops of ``steps`` NS iterations on one m x n matrix: k * (2 m n s + s^3) * 2 (FMA=2)."""
    s, big = min(m, n), max(m, n)
    # X X^T: 2 s^2 big ; A A: 2 s^3 ; B X: 2 s^2 big  -> per step 4 s^2 big + 2 s^3
    return steps * (4.0 * s * s * big + 2.0 * s**3)
