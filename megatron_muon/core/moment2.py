"""Adaptive second moments on the orthogonalised update: AdaMuon and NorMuon.

docs/variants.md#adaptive-second-moments.  The maths of emerging_optimizers 0.3.0's
``AdaptiveMuon`` (what Megatron-Core 0.19.2's ``--optimizer adaptive_muon`` builds), applied
to one NS unit O (the raw Newton-Schulz output, before the Muon scale), in fp32:

    adamuon:  V <- lerp(V, O*O, 1 - beta2)                  V shaped like O
              D  = O / (sqrt(V) + eps)
    normuon:  a  = -1 (mean over columns, one value per row) if m >= n else -2 (per column)
              V <- lerp(V, mean_a(O*O), 1 - beta2)           V is m x 1 or 1 x n
              D  = O * rsqrt(max(V, eps));  D <- D * ||O||_F / max(||D||_F, eps)

and the caller multiplies D by the Muon scale of the unit.  Framework-free: every Muon in
the package (the reference ``Muon``, DMuon's owners) calls ``moment2_normalize``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MOMENT2_METHODS", "moment2_shape", "moment2_init", "moment2_normalize",
           "moment2_expand", "moment2_reduce", "check_moment2_hyperparameters"]

MOMENT2_METHODS = ("adamuon", "normuon")


def _normuon_dim(m: int, n: int) -> int:
    # emerging_optimizers: average along the longer dimension (rows when m >= n)
    return -1 if m >= n else -2


def moment2_shape(m: int, n: int, method: str) -> tuple:
    """Shape of the second-moment state of one m x n unit."""
    if method == "adamuon":
        return (m, n)
    if method == "normuon":
        return (m, 1) if _normuon_dim(m, n) == -1 else (1, n)
    raise ValueError(f"unknown moment2 method {method!r}; choose one of {list(MOMENT2_METHODS)}")


def moment2_init(m: int, n: int, method: str, device=None) -> torch.Tensor:
    return torch.zeros(moment2_shape(m, n, method), dtype=torch.float32, device=device)


@torch.no_grad()
def moment2_normalize(o: torch.Tensor, state: torch.Tensor, method: str, beta2: float,
                      eps: float) -> torch.Tensor:
    """Update ``state`` in place from the raw NS output ``o`` (m x n, fp32) and return the
    normalised update (before the Muon scale).  Same op order as emerging_optimizers."""
    if method == "adamuon":
        state.lerp_(o.square(), 1 - beta2)
        return o / (state.sqrt() + eps)
    if method == "normuon":
        v_mean = o.square().mean(dim=_normuon_dim(*o.shape[-2:]), keepdim=True)
        state.lerp_(v_mean, 1 - beta2)
        update = o * state.clamp_min(eps).rsqrt_()
        # keep the raw orthogonalised update's Frobenius norm
        return update * (torch.linalg.vector_norm(o) /
                         torch.linalg.vector_norm(update).clamp_min(eps))
    raise ValueError(f"unknown moment2 method {method!r}; choose one of {list(MOMENT2_METHODS)}")


def moment2_expand(state: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The state as an m x n tensor (NorMuon's row/column values broadcast): the
    element-shaped form checkpoints store, so they reshard like any parameter-shaped state."""
    return state.expand(m, n)


def moment2_reduce(full: torch.Tensor, method: str) -> torch.Tensor:
    """Inverse of ``moment2_expand`` (exact: every element of a NorMuon row/column is equal)."""
    m, n = full.shape
    if method == "adamuon":
        return full.clone()
    return full[:, :1].clone() if _normuon_dim(m, n) == -1 else full[:1, :].clone()


def check_moment2_hyperparameters(method: Optional[str], beta2: float, eps: float) -> None:
    if method is None:
        return
    if method not in MOMENT2_METHODS:
        raise ValueError(f"unknown moment2 method {method!r}; choose one of "
                         f"{list(MOMENT2_METHODS)} (or None for plain Muon)")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"moment2 beta2 must be in [0, 1), got {beta2}")
    if not eps > 0.0:
        raise ValueError(f"moment2 eps must be > 0, got {eps}")
