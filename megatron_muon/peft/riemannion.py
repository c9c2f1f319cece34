"""Riemannion: Muon on the rank-r matrix manifold for LoRA (docs/relora.md#riemannion).

Paper: V. Bogachev, V. Aletov, A. Molozhavenko, D. Bobkov, V. Soboleva, A. Alanov, M. Rakhuba,
"LoRA meets Riemannion: Muon Optimizer for Parametrization-independent Low-Rank Adapters",
arXiv:2507.12142 (its first version was titled "RiemannLoRA: A Unified Riemannian Framework for
Ambiguity-Free LoRA Optimization").  This is an implementation written from the maths below,
not from the authors' code.

A LoRA layer is ``W = W0 + gamma * B @ A`` (``B: m x r``, ``A: r x n``, ``W0`` frozen).  The
optimizer's variable is the adapter delta ``X = gamma B A``, a point of the manifold M_r of
m x n matrices of rank r; the factors are only a representation of X, and every quantity
below depends on X (and the loss) alone, not on which of the factorisations
``(B M)(M^-1 A)`` holds it.  Per step, with ``G = dL/dW`` (never formed):

1. Basis.  Orthonormal ``U`` (m x r) of col(B) = col(X) and ``V`` (n x r) of row(A) = row(X),
   from a thin QR of each factor and an SVD of its r x r triangle; singular values of a factor
   below ``max(shape) * eps(dtype) * sigma_max`` count as zero (as ``numpy.linalg.matrix_rank``;
   their basis columns are zeroed).  The same step gives ``C_B`` with ``U = B C_B`` and ``C_A``
   with ``V = A^T C_A``.

2. Riemannian gradient: the projection on the tangent space
   ``T_X = {U K^T + Y V^T : U^T Y = 0}`` (standard fixed-rank geometry, Absil et al.):

       P_T(G) = U U^T G + G V V^T - U U^T G V V^T = Y_L V^T + U Y_R,
       Y_R = U^T G = C_B^T G_A / gamma,   Y_L = (I - U U^T) G V = (I - U U^T) G_B C_A / gamma,

   from the factor gradients ``G_A = gamma B^T G`` and ``G_B = gamma G A^T`` alone.
   ``U^T G V`` is computed both ways and averaged (equal for exact gradients; the mean keeps
   the map equivariant under transposing the layer).  A tangent vector is stored as its two
   components ``(Y_L: m x r, Y_R: r x n)`` with the basis they refer to.

3. Momentum in the tangent space (heavy ball, as Muon, docs/design.md#muon).  The previous
   momentum lives in the tangent space of the previous point; it is carried to the current
   one by the vector transport "orthogonal projection": ``T(M) = P_T(M)``, computed on its
   rank-2r form ``M = [M_L, U_old] [V_old, M_R^T]^T`` without forming it.  Then

       M <- mu T(M_old) + P_T(G);   Z <- P_T(G) + mu M (Nesterov) | M.

4. Orthogonalise in the tangent space: ``D = P_T(msign(Z))``.  Z has rank <= 2r:
   ``Z = [Z_L, U] [V, Z_R^T]^T``; thin QRs of the two m x 2r / n x 2r factors give
   ``Z = Q_L K Q_R^T`` with a 2r x 2r core K, and ``msign(Z) = Q_L msign(K) Q_R^T``.
   Default: Muon's Newton-Schulz on K, which equals NS of the dense Z exactly (NS is an odd
   matrix polynomial and ``||Z||_F = ||K||_F``, as in ``smuon.py``); ``exact_sign=True`` uses
   K's SVD (exact ``U V^T``, tiny singular values dropped as in ``smuon._msign_exact``).
   msign(Z) generally leaves T (its rank-2r column/row spaces mix U's complement with V's
   complement), so it is projected back: D is the tangent vector closest to Muon's
   direction of the dense momentum.

5. Retraction by rank-r truncated SVD (the metric projection onto M_r):

       X+ = truncSVD_r( (1 - lr wd) X - lr scale(m, n) D ),

   where the argument has rank <= 2r: ``U [(1 - lr wd) U^T X - s D_R] - s D_L V^T``; QRs of
   ``[U, D_L]`` and ``[(..)^T, V]`` and an SVD of the 2r x 2r core give ``X+ = U+ S+ V+^T``.
   ``scale`` is Muon's ``muon_scale`` of the full m x n layer (as sMuon), so the first-order
   change of W is ``-lr scale D`` whatever gamma is; weight decay multiplies the adapter delta
   by ``1 - lr wd`` (decoupled, pulling W towards W0, never W0 itself).

6. Factors, balanced: ``B = sign(gamma) U+ sqrt(S+ / |gamma|)``, ``A = sqrt(S+ / |gamma|) V+^T``
   (so ``B^T B = A A^T = S+ / |gamma|``).  Balanced factors split X's conditioning evenly, so
   the division by a factor's singular values in step 2 amplifies rounding by only
   ``sqrt(cond(X))``.  The factors are a gauge choice: W (and so the model) is what the step
   defines.  When the r singular values of X+ are (nearly) equal -- e.g. right after a step
   from B = 0, where X+ is a multiple of msign(G V V^T) (a partial isometry) or of its NS
   approximation -- the SVD basis is not unique (or very sensitive to rounding) and the
   factors are fixed only up to an r x r rotation; W is unaffected.

Rank-deficient points.  The LoRA start ``B = 0`` (X = 0) is not on M_r.  Steps 1-2 then use
the factors' column / row spaces: U = 0, so ``P_T(Y) = Y V V^T`` -- exactly the range of
the factor map ``(dA, dB) -> gamma (dB A + B dA)`` at ``B = 0``, the convention sMuon uses
(docs/design.md#smuon-and-lora).  The first step is then ``X+ = -s msign(G V V^T)`` (up to
NS), of rank r for a generic gradient.  If the retracted matrix is exactly zero (a zero
gradient at X = 0) the old factors are kept, so a zero step does not erase A.  Directions
with zero singular values in X+ get zero factor columns (A and B both), so a pair whose
factors are both zero stays zero.

Dtypes: fp64 if any input is fp64, else fp32.  Only thin QRs of (m or n) x (r or 2r)
matrices, SVDs of r x r and 2r x 2r cores and matmuls with one dimension <= 2r; no m x n
matrix and no host synchronisation.  Pure functions: nothing is modified in place.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from megatron_muon.core.muon import momentum_update_
from megatron_muon.core.newton_schulz import (Coefficients, muon_scale, newton_schulz,
                                              resolve_coefficients)
from megatron_muon.peft.smuon import LoRAPairOptimizer, _check_common, _check_number, _msign_exact

__all__ = ["TangentBasis", "tangent_basis", "riemannian_gradient", "project_low_rank",
           "transport", "riemannion_direction", "retract", "riemannion_update", "Riemannion"]


# ----------------------------------------------------------------------------------------------
# the maths
# ----------------------------------------------------------------------------------------------


class TangentBasis(NamedTuple):
    """Orthonormal bases of the point's column space ``U`` (m x r) and row space ``V``
    (n x r), zero columns where a factor is rank-deficient, and ``C_B``, ``C_A`` (r x r) with
    ``U = B C_B``, ``V = A^T C_A``."""

    U: torch.Tensor
    V: torch.Tensor
    C_B: torch.Tensor
    C_A: torch.Tensor


def _range_basis(F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, C)`` for F (k x r, k >= r): Q orthonormal columns spanning col(F) (zeroed for
    singular values <= max(k, r) eps sigma_max), C (r x r) with ``Q = F C`` (C = W S^+)."""
    Q0, R0 = torch.linalg.qr(F, mode="reduced")  # k x r, r x r
    Ur, S, Wh = torch.linalg.svd(R0)  # R0 = Ur diag(S) Wh
    tol = S.amax() * (max(F.shape) * torch.finfo(F.dtype).eps)
    keep = S > tol
    inv = torch.where(keep, 1.0 / torch.where(keep, S, torch.ones_like(S)), torch.zeros_like(S))
    Q = (Q0 @ Ur) * keep.to(F.dtype)
    return Q, Wh.mT * inv


def tangent_basis(A: torch.Tensor, B: torch.Tensor) -> TangentBasis:
    """Step 1 of the module docstring, for the point ``gamma B A`` (any nonzero gamma)."""
    U, C_B = _range_basis(B)
    V, C_A = _range_basis(A.mT)
    return TangentBasis(U, V, C_B, C_A)


def riemannian_gradient(basis: TangentBasis, grad_A: torch.Tensor, grad_B: torch.Tensor,
                        gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Components ``(Y_L, Y_R)`` of ``P_T(G_W)`` (step 2) from the factor gradients
    ``grad_A = gamma B^T G_W``, ``grad_B = gamma G_W A^T``."""
    U, V, C_B, C_A = basis
    inv_gamma = 1.0 / gamma
    GU = (C_B.mT @ grad_A) * inv_gamma  # r x n   U^T G
    GV = (grad_B @ C_A) * inv_gamma  # m x r   G V
    UtGV = 0.5 * (GU @ V + U.mT @ GV)  # r x r
    return GV - U @ UtGV, GU


def project_low_rank(U: torch.Tensor, V: torch.Tensor, L: torch.Tensor,
                     R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Components ``(Y_L, Y_R)`` of ``P_T(L R^T)`` at bases U, V (L: m x k, R: n x k):
    ``Y_R = U^T L R^T``, ``Y_L = (I - U U^T) L R^T V``."""
    UtL = U.mT @ L  # r x k
    RtV = R.mT @ V  # k x r
    return L @ RtV - U @ (UtL @ RtV), UtL @ R.mT


def transport(basis: TangentBasis, momentum: Optional[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored momentum ``(M_L, U_old, M_R, V_old^T)`` projected on the tangent space at
    ``basis`` (step 3); zeros when there is none yet."""
    U, V = basis.U, basis.V
    if momentum is None:
        return torch.zeros_like(U), torch.zeros_like(V.mT)
    M_L, U_old, M_R, Vt_old = (t.to(U.dtype) for t in momentum)
    return project_low_rank(U, V, torch.cat([M_L, U_old], dim=1),
                            torch.cat([Vt_old.mT, M_R.mT], dim=1))


def riemannion_direction(basis: TangentBasis, Z_L: torch.Tensor, Z_R: torch.Tensor, *,
                         ns_steps: int = 5, coefficients: Coefficients = "simple",
                         exact_sign: bool = False, eps: float = 1e-7
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Components of ``D = P_T(msign(Z))`` for the tangent vector ``Z = Z_L V^T + U Z_R``
    (step 4)."""
    U, V = basis.U, basis.V
    m, n = U.shape[0], V.shape[0]
    Q_L, R_L = torch.linalg.qr(torch.cat([Z_L, U], dim=1), mode="reduced")  # m x 2r
    Q_R, R_R = torch.linalg.qr(torch.cat([V, Z_R.mT], dim=1), mode="reduced")  # n x 2r
    K = R_L @ R_R.mT  # Z = Q_L K Q_R^T
    if exact_sign:
        S = _msign_exact(K, max(m, n))
    else:
        S = newton_schulz(K, steps=ns_steps, coefficients=coefficients, eps=eps, dtype=K.dtype)
    return project_low_rank(U, V, Q_L @ S, Q_R)


def retract(basis: TangentBasis, A: torch.Tensor, B: torch.Tensor, D_L: torch.Tensor,
            D_R: torch.Tensor, *, gamma: float, step: float, decay: float = 1.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """New balanced factors ``(A+, B+)`` with ``gamma B+ A+ = truncSVD_r(decay gamma B A -
    step (D_L V^T + U D_R))`` (steps 5-6); the old factors if that matrix is zero."""
    U, V = basis.U, basis.V
    r = U.shape[1]
    X_R = (U.mT @ B) @ A * gamma  # r x n   U^T X  (X = U U^T X: col(X) = col(B))
    left = torch.cat([U, D_L], dim=1)  # m x 2r
    right = torch.cat([(decay * X_R - step * D_R).mT, -step * V], dim=1)  # n x 2r
    Q_P, R_P = torch.linalg.qr(left, mode="reduced")
    Q_Q, R_Q = torch.linalg.qr(right, mode="reduced")
    Uc, S, Vch = torch.linalg.svd(R_P @ R_Q.mT)
    root = torch.sqrt(S[:r] / abs(gamma))
    B_new = (Q_P @ Uc[:, :r]) * root * math.copysign(1.0, gamma)
    A_new = root[:, None] * (Vch[:r] @ Q_Q.mT)
    nonzero = S[0] > 0
    return torch.where(nonzero, A_new, A), torch.where(nonzero, B_new, B)


def riemannion_update(
    A: torch.Tensor,
    B: torch.Tensor,
    grad_A: torch.Tensor,
    grad_B: torch.Tensor,
    momentum_state: Optional[tuple] = None,
    *,
    lr: float,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    gamma: float = 1.0,
    ns_steps: int = 5,
    coefficients: Coefficients = "simple",
    exact_sign: bool = False,
    scale_mode: str = "spectral",
    extra_scale_factor: float = 1.0,
    eps: float = 1e-7,
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One Riemannion step of one LoRA pair (steps 1-6 of the module docstring).

    Args:
        A: ``r x n``; B: ``m x r`` (``r <= min(m, n)``), the layer ``W0 + gamma B A``.
        grad_A, grad_B: the factors' gradients (``gamma B^T G_W``, ``gamma G_W A^T``).
        momentum_state: what the previous call returned (``None`` at the start): the
            momentum's components and the basis they refer to, ``(M_L: m x r, U: m x r,
            M_R: r x n, V^T: r x n)``.
        lr, momentum, nesterov, weight_decay (``lr * weight_decay <= 1``), gamma (nonzero),
        ns_steps, coefficients, exact_sign, scale_mode, extra_scale_factor, eps: as
        :class:`Riemannion`.

    Returns:
        ``(A+, B+, momentum_state+)`` in the compute dtype (fp64 if any input is fp64, else
        fp32); the inputs are not modified.
    """
    for name, t in (("A", A), ("B", B), ("grad_A", grad_A), ("grad_B", grad_B)):
        if not isinstance(t, torch.Tensor) or t.ndim != 2 or not t.is_floating_point():
            raise ValueError(f"riemannion_update: {name} must be a 2-D floating-point tensor")
    r, n = A.shape
    m, rb = B.shape
    if rb != r:
        raise ValueError(f"riemannion_update: LoRA rank mismatch, A is {tuple(A.shape)} (r x n) "
                         f"but B is {tuple(B.shape)} (m x r)")
    if not 1 <= r <= min(m, n):
        raise ValueError(f"riemannion_update: rank {r} must be in [1, min(m, n) = {min(m, n)}]")
    if grad_A.shape != A.shape or grad_B.shape != B.shape:
        raise ValueError(f"riemannion_update: gradient shapes {tuple(grad_A.shape)}, "
                         f"{tuple(grad_B.shape)} do not match A {tuple(A.shape)}, B "
                         f"{tuple(B.shape)}")
    gamma = _check_number("gamma", gamma, nonzero=True)
    if not exact_sign:
        resolve_coefficients(coefficients, ns_steps)
    dtype = torch.float64 if torch.float64 in (A.dtype, B.dtype, grad_A.dtype, grad_B.dtype) \
        else torch.float32
    A, B, gA, gB = (t.detach().to(dtype) for t in (A, B, grad_A, grad_B))

    basis = tangent_basis(A, B)
    G_L, G_R = riemannian_gradient(basis, gA, gB, gamma)
    M_L, M_R = transport(basis, momentum_state)
    Z_L, Z_R = momentum_update_([M_L, M_R], [G_L, G_R], momentum, nesterov)
    D_L, D_R = riemannion_direction(basis, Z_L, Z_R, ns_steps=ns_steps,
                                    coefficients=coefficients, exact_sign=exact_sign, eps=eps)
    step = lr * muon_scale(m, n, scale_mode, extra_scale_factor)
    A_new, B_new = retract(basis, A, B, D_L, D_R, gamma=gamma, step=step,
                           decay=1.0 - lr * weight_decay)
    return A_new, B_new, (M_L, basis.U, M_R, basis.V.mT.contiguous())


# ----------------------------------------------------------------------------------------------
# the optimizer
# ----------------------------------------------------------------------------------------------


class Riemannion(LoRAPairOptimizer):
    """Riemannion (arXiv:2507.12142, docs/relora.md#riemannion): Muon on the rank-r manifold.

    Params as :class:`~megatron_muon.peft.smuon.SMuon`: ``(A, B)`` pairs or groups
    ``{"pairs": [...], **overrides}``.  Per pair and step: :func:`riemannion_update` (fp32
    maths, fp64 for fp64 params; the factors are overwritten with the new balanced factors,
    cast to their dtype).  State per pair: ``state[B] = {"momentum": M_L, "basis": U}``,
    ``state[A] = {"momentum": M_R, "basis": V^T}`` -- the tangent momentum's components and
    the basis they refer to (2 r (m + n) numbers; ``state_dict`` round-trips them exactly).

    Hyperparameters: lr, momentum (mu), nesterov, weight_decay (decoupled, on the adapter
    delta gamma B A; ``lr * wd <= 1``), gamma (LoRA scale alpha / r, nonzero), ns_steps,
    coefficient_type, exact_sign (core SVD instead of NS), scale_mode and
    extra_scale_factor (``muon_scale`` of the full m x n layer), eps (NS normalisation).

    A pair whose two gradients are both None is skipped; a single missing gradient counts as
    zero.  Non-finite gradients, bad shapes and bad hyperparameters raise ``ValueError``.
    """

    NAME = "Riemannion"
    _check_group = staticmethod(_check_common)

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, gamma: float = 1.0, ns_steps: int = 5,
                 coefficient_type: Coefficients = "simple", scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, exact_sign: bool = False, eps: float = 1e-7):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        gamma=gamma, ns_steps=ns_steps, coefficient_type=coefficient_type,
                        scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,
                        exact_sign=exact_sign, eps=eps)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for A, B in self._pairs(self.param_groups[-1]):
            r, n = A.shape
            if r > min(B.shape[0], n):
                raise ValueError(f"Riemannion: LoRA rank {r} exceeds min(m, n) = "
                                 f"{min(B.shape[0], n)}")

    def momentum_state(self, A: torch.Tensor, B: torch.Tensor) -> Optional[tuple]:
        sB, sA = self.state.get(B, {}), self.state.get(A, {})
        if "momentum" not in sB:
            return None
        return sB["momentum"], sB["basis"], sA["momentum"], sA["basis"]

    # the three-part step (LoRAPairOptimizer): all the work on the owner, which returns the
    # new factors and the new momentum state; every rank copies them
    def result_shapes(self, A, B):
        a, b = tuple(A.shape), tuple(B.shape)
        return [a, b, b, b, a, a]

    def pair_prepare(self, group, A, B, check_finite=True):
        return self.pair_gradients(A, B, check_finite)

    def pair_work(self, group, A, B, job):
        gA, gB = job
        A_new, B_new, (M_L, U, M_R, Vt) = riemannion_update(
            A, B, gA, gB, self.momentum_state(A, B), lr=group["lr"],
            momentum=group["momentum"], nesterov=group["nesterov"],
            weight_decay=group["weight_decay"], gamma=group["gamma"],
            ns_steps=group["ns_steps"], coefficients=group["coefficient_type"],
            exact_sign=group["exact_sign"], scale_mode=group["scale_mode"],
            extra_scale_factor=group["extra_scale_factor"], eps=group["eps"])
        return A_new, B_new, M_L, U, M_R, Vt

    def pair_finish(self, group, A, B, job, result):
        A_new, B_new, M_L, U, M_R, Vt = result
        A.copy_(A_new.to(A.dtype))
        B.copy_(B_new.to(B.dtype))
        self.state[B]["momentum"], self.state[B]["basis"] = M_L.clone(), U.clone()
        self.state[A]["momentum"], self.state[A]["basis"] = M_R.clone(), Vt.clone()
