"""sMuon: Muon for LoRA adapters (docs/design.md#smuon-and-lora).

A LoRA layer is ``W = W0 + gamma * B @ A`` with ``B: m x r``, ``A: r x n`` and ``W0`` frozen.
Only the factor gradients ``G_A = gamma B^T G_W`` and ``G_B = gamma G_W A^T`` are seen.
sMuon steers the factors so that the first-order change of ``W`` is the Muon direction of the
whole m x n layer, restricted to what the factors can express:

1. Tangent projection of the unseen full gradient, from the factors alone.  With
   ``P_U = B (B^T B)^-1 B^T`` and ``P_V = A^T (A A^T)^-1 A``::

       D = P_U G_W + G_W P_V - P_U G_W P_V
         = (1/gamma) [ Bp G_A + G_B Ap - Bp C Ap ],   Bp = B (B^T B)^-1,  Ap = (A A^T)^-1 A,

   with ``C = B^T G_W A^T * gamma``.  For exact gradients ``B^T G_B == G_A A^T == C``; for
   momenta the two differ and we use their mean ``C = (B^T G_B + G_A A^T) / 2`` (this keeps
   the map equivariant under transposing the layer, and every term still lies in the tangent
   space, whatever C is).  So ``D = L R`` with ``L = [Bp, G_B]`` (m x 2r) and
   ``R = [G_A - C Ap; Ap] / gamma`` (2r x n).

2. ``msign(D)`` from a small core: thin QR ``L = Q_L R_L`` and ``R^T = Q_R R_R``; then
   ``msign(D) = Q_L msign(R_L R_R^T) Q_R^T``.  The core is at most 2r x 2r.  With
   ``exact_sign=False`` (default) the core goes through Muon's Newton-Schulz; because NS is an
   odd matrix polynomial and ``||D||_F == ||core||_F``, this is *exactly* Muon's NS of the
   dense D (same coefficients, same normalisation), just computed on 2r x 2r.  With
   ``exact_sign=True`` the core's SVD gives the exact ``U V^T`` (singular values below
   ``max(m, n) * eps(dtype) * sigma_max`` count as zero, like ``numpy.linalg.matrix_rank``).

3. Least squares.  The factors can express ``dW = gamma (dB A + B dA)``, whose range is the
   tangent space T.  The least-squares solution of ``gamma (dB A + B dA) ~= O`` (O = msign(D))
   has ``gamma (dB A + B dA) = P_T(O) = O P_V + P_U O - P_U O P_V``; we return the solution

       dB = O A^T (A A^T)^-1 / gamma,   dA = (B^T B)^-1 B^T O (I - P_V) / gamma,

   (the gauge ``(dB + B X, dA - X A)`` is fixed, docs/design.md#smuon-and-lora).  O is never formed: every
   product is m x r, r x n or smaller.

Gamma: the returned factor directions satisfy ``gamma (dB A + B dA) = P_T(msign(G_W))``, i.e.
the induced step of W is independent of gamma (only the factor steps scale as 1/gamma).  Any
finite nonzero gamma is accepted (a negative gamma flips D and the 1/gamma back again).

Damping (relative): ``(B^T B)^-1`` is replaced by ``(B^T B + delta_B I)^-1`` with
``delta_B = damping * ||B||_F^2 / r`` (``damping`` times the mean eigenvalue of ``B^T B``), the
same for ``A A^T``.  It is relative so that rescaling a factor does not change the result, and
it is applied through a thin QR of ``[B; sqrt(delta_B) I]`` (Tikhonov-style), so the damped
Gram is positive definite by construction (no Cholesky breakdown in fp32); then only r x r
triangular solves.  Damping changes the projector's eigenvalues from 1 to
``lambda / (lambda + delta)``, i.e. a relative error ~ ``damping * mean(lambda) / min(lambda)``.

The LoRA start ``B = 0``: the factor map is then ``(dA, dB) -> gamma dB A`` whose range is
``{X A}``, i.e. ``P_U = 0`` and ``P_T(Y) = Y P_V``.  Hence ``D = G_W P_V =
G_B (A A^T)^-1 A / gamma`` (G_A = 0), ``O = msign(G_W P_V)`` already lies in T, and
``dB = O A^T (A A^T)^-1 / gamma``, ``dA = 0``.  The damped formulas give exactly this: for a
zero factor the damping falls back to ``delta = 1`` so ``B (B^T B + I)^-1 = 0`` exactly (no
0/0).  The same holds symmetrically for ``A = 0``; both zero gives a zero direction.
(Note that this is *not* the limit of ``B = eps B1`` for ``eps -> 0``, where P_U stays the
projector onto col(B1): the rank-r manifold is singular at B = 0; relative damping keeps the
``B = eps B1`` case scale-invariant, as it should be.)
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch

from megatron_muon.core.muon import (check_finite_gradient, check_muon_hyperparameters, decoupled_update,
                   evaluate_closure, momentum_step)
from megatron_muon.core.newton_schulz import Coefficients, muon_scale, newton_schulz, resolve_coefficients

__all__ = ["smuon_direction", "SMuon"]


# ----------------------------------------------------------------------------------------------
# the maths
# ----------------------------------------------------------------------------------------------


def _check_number(name: str, value, *, positive: bool = False, nonzero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0.0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if nonzero and value == 0.0:
        raise ValueError(f"{name} must be nonzero, got {value}")
    return value


def _damped_pinv_t(F: torch.Tensor, damping: float) -> torch.Tensor:
    """``F (F^T F + delta I)^-1`` for F: k x r, ``delta = damping * ||F||_F^2 / r``.

    For F = B this is ``Bp = B (B^T B)^-1`` (damped); for F = A^T it is ``Ap^T``.  Computed as
    F normalised by max|F|, thin QR of ``[F; sqrt(delta) I]`` -> R with R^T R = F^T F + delta I,
    then two r x r triangular solves.  Exactly zero for F == 0 (delta falls back to 1 there).
    No host synchronisation.
    """
    r = F.shape[1]
    s = F.abs().amax()
    s = torch.where(s > 0, s, torch.ones_like(s))
    Fh = F / s
    delta = damping * Fh.square().sum() / r
    delta = torch.where(delta > 0, delta, torch.ones_like(delta))
    eye = torch.eye(r, dtype=F.dtype, device=F.device)
    R = torch.linalg.qr(torch.cat([Fh, delta.sqrt() * eye], dim=0), mode="r").R
    Z = torch.linalg.solve_triangular(R, Fh, upper=True, left=False)  # Z R = Fh
    Y = torch.linalg.solve_triangular(R.mT, Z, upper=False, left=False)  # Y R^T = Z
    # (F^T F + delta s^2 I) = s^2 (Fh^T Fh + delta I)  ->  F (..)^-1 = Fh (..)^-1 / s
    return Y / s


def _msign_exact(K: torch.Tensor, rank_dim: int) -> torch.Tensor:
    """U V^T of K's SVD; singular values <= rank_dim * eps * sigma_max count as zero."""
    U, S, Vh = torch.linalg.svd(K, full_matrices=False)
    tol = S.amax() * (rank_dim * torch.finfo(K.dtype).eps)
    mask = (S > tol).to(K.dtype)
    return (U * mask) @ Vh


def smuon_direction(
    A: torch.Tensor,
    B: torch.Tensor,
    grad_A: torch.Tensor,
    grad_B: torch.Tensor,
    *,
    gamma: float = 1.0,
    damping: float = 1e-6,
    ns_steps: int = 5,
    coefficients: Coefficients = "simple",
    exact_sign: bool = False,
    eps: float = 1e-7,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sMuon factor directions ``(dA, dB)`` for the LoRA layer ``W = W0 + gamma B A``.

    Args:
        A: ``r x n`` LoRA down factor; B: ``m x r`` LoRA up factor.
        grad_A, grad_B: gradients of A and B (``gamma B^T G_W``, ``gamma G_W A^T``) or their
            momenta / Nesterov updates; same shapes as A and B.
        gamma: LoRA scale (alpha / r), finite and nonzero.
        damping: relative damping of the r x r Gram inverses, ``delta = damping * mean
            eigenvalue of the Gram`` (``||F||_F^2 / r``); must be > 0.
        ns_steps, coefficients: Newton-Schulz steps and coefficient set for the 2r x 2r core
            (ignored with ``exact_sign=True``).
        exact_sign: use the core's SVD (exact ``U V^T``) instead of Newton-Schulz.
        eps: NS normalisation epsilon, as in :func:`newton_schulz` / Muon.

    Returns:
        ``(dA, dB)`` with ``gamma (dB A + B dA) = P_T(msign(D))``, D the tangent projection of
        the full-layer gradient (see the module docstring); a *descent* step is
        ``A -= lr * dA``, ``B -= lr * dB``.  dtype: float64 if any input is float64, else
        float32.  Only matmuls, thin QRs of ``(m or n) x 2r`` / ``(m|n + r) x r`` matrices and
        r x r triangular solves; NS or SVD only on the at most 2r x 2r core.  No input
        finiteness check (no host sync); :class:`SMuon` checks gradients.
    """
    for name, t in (("A", A), ("B", B), ("grad_A", grad_A), ("grad_B", grad_B)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"smuon_direction: {name} must be a tensor, got {type(t).__name__}")
        if t.ndim != 2:
            raise ValueError(f"smuon_direction: {name} must be 2-D, got shape {tuple(t.shape)}")
        if not (t.is_floating_point()):
            raise ValueError(f"smuon_direction: {name} must be floating point, got {t.dtype}")
    r, n = A.shape
    m, rb = B.shape
    if rb != r:
        raise ValueError(
            f"smuon_direction: LoRA rank mismatch, A is {tuple(A.shape)} (r x n) but B is "
            f"{tuple(B.shape)} (m x r)"
        )
    if r < 1 or m < 1 or n < 1:
        raise ValueError(f"smuon_direction: empty factors A {tuple(A.shape)}, B {tuple(B.shape)}")
    if grad_A.shape != A.shape or grad_B.shape != B.shape:
        raise ValueError(
            f"smuon_direction: gradient shapes {tuple(grad_A.shape)}, {tuple(grad_B.shape)} do "
            f"not match A {tuple(A.shape)}, B {tuple(B.shape)}"
        )
    gamma = _check_number("gamma", gamma, nonzero=True)
    damping = _check_number("damping", damping, positive=True)
    if not exact_sign:
        resolve_coefficients(coefficients, ns_steps)  # raises on bad names / steps

    dtype = torch.float64 if torch.float64 in (A.dtype, B.dtype, grad_A.dtype, grad_B.dtype) \
        else torch.float32
    A, B, gA, gB = (t.detach().to(dtype) for t in (A, B, grad_A, grad_B))

    Bp = _damped_pinv_t(B, damping)  # m x r   B (B^T B)^-1
    Apt = _damped_pinv_t(A.mT, damping)  # n x r   A^T (A A^T)^-1  (= Ap^T)
    C = 0.5 * (B.mT @ gB + gA @ A.mT)  # r x r

    inv_gamma = 1.0 / gamma
    L = torch.cat([Bp, gB], dim=1)  # m x 2r
    Rt = torch.cat([(gA.mT - Apt @ C.mT), Apt], dim=1) * inv_gamma  # n x 2r  (= R^T)
    Q_L, R_L = torch.linalg.qr(L, mode="reduced")  # m x kL, kL x 2r
    Q_R, R_R = torch.linalg.qr(Rt, mode="reduced")  # n x kR, kR x 2r
    K = R_L @ R_R.mT  # kL x kR core, D = Q_L K Q_R^T

    if exact_sign:
        S = _msign_exact(K, max(m, n))
    else:
        S = newton_schulz(K, steps=ns_steps, coefficients=coefficients, eps=eps, dtype=dtype)

    # O = Q_L S Q_R^T, never formed.
    QRtApt = Q_R.mT @ Apt  # kR x r      Q_R^T A^T (A A^T)^-1
    dB = Q_L @ (S @ QRtApt) * inv_gamma  # m x r  O A^T (A A^T)^-1 / gamma
    left = (Bp.mT @ Q_L) @ S  # r x kR     (B^T B)^-1 B^T Q_L S
    # (B^T B)^-1 B^T O (I - P_V) = left (Q_R^T - (Q_R^T Apt) A)
    dA = (left @ Q_R.mT - (left @ QRtApt) @ A) * inv_gamma  # r x n
    return dA, dB


# ----------------------------------------------------------------------------------------------
# the optimizers: shared machinery of LoRA factor-pair optimizers (SMuon, Riemannion)
# ----------------------------------------------------------------------------------------------


def _check_common(group: dict) -> None:
    """The hyperparameters every LoRA pair optimizer here shares (lr, weight decay, Muon's)."""
    lr = _check_number("lr", group["lr"])
    wd = _check_number("weight_decay", group["weight_decay"])
    if lr < 0.0:
        raise ValueError(f"learning rate must be >= 0, got {lr}")
    if wd < 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {wd}")
    if lr * wd > 1.0:
        raise ValueError(f"lr * weight_decay must be <= 1 (got {lr * wd}); the decay factor "
                         "(1 - lr * wd) would be negative")
    _check_number("momentum", group["momentum"])
    check_muon_hyperparameters(momentum=group["momentum"], ns_steps=group["ns_steps"],
                               coefficient_type=group["coefficient_type"],
                               scale_mode=group["scale_mode"])
    _check_number("gamma", group["gamma"], nonzero=True)
    _check_number("extra_scale_factor", group["extra_scale_factor"])
    _check_number("eps", group["eps"])
    for key in ("nesterov", "exact_sign"):
        if not isinstance(group[key], bool):
            raise ValueError(f"{key} must be a bool, got {group[key]!r}")


def _check_group(group: dict) -> None:
    _check_common(group)
    _check_number("damping", group["damping"], positive=True)


def _check_pairs(pairs, who: str = "SMuon") -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(pairs, torch.Tensor) or not isinstance(pairs, Iterable):
        raise ValueError(f"{who} 'pairs' must be a list of (A, B) tuples")
    out = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, torch.Tensor) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(
                f"{who} pair {i} must be an (A, B) tuple of LoRA factors (A: r x n, B: m x r), "
                f"got {type(pair).__name__}"
            )
        A, B = pair
        if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor):
            raise ValueError(f"{who} pair {i}: A and B must be tensors")
        if A.ndim != 2 or B.ndim != 2:
            raise ValueError(f"{who} pair {i}: A and B must be 2-D, got shapes "
                             f"{tuple(A.shape)} and {tuple(B.shape)}")
        if A.shape[0] != B.shape[1]:
            raise ValueError(
                f"{who} pair {i}: rank mismatch, A is {tuple(A.shape)} (r x n) and B is "
                f"{tuple(B.shape)} (m x r); pass pairs as (lora_A.weight, lora_B.weight)"
            )
        if A.numel() == 0 or B.numel() == 0:
            raise ValueError(f"{who} pair {i}: empty factor")
        if not (A.is_floating_point() and B.is_floating_point()):
            raise ValueError(f"{who} pair {i}: factors must be floating point")
        if A.device != B.device:
            raise ValueError(f"{who} pair {i}: A on {A.device} but B on {B.device}")
        if A is B:
            raise ValueError(f"{who} pair {i}: A and B are the same tensor")
        out.append((A, B))
    if not out:
        raise ValueError(f"{who} got an empty list of (A, B) pairs")
    return out


class LoRAPairOptimizer(torch.optim.Optimizer):
    """Base of the optimizers over LoRA factor pairs (:class:`SMuon`, ``Riemannion``).

    Params: either a list of ``(A, B)`` tuples (A = ``lora_A.weight``: r x n, B =
    ``lora_B.weight``: m x r, the layer being ``W0 + gamma B A``), or a list of param-group
    dicts ``{"pairs": [(A, B), ...], **overrides}``.  A group's ``params`` are stored
    interleaved ``[A1, B1, A2, B2, ...]`` (so ``state_dict`` / ``load_state_dict`` work as for
    any torch optimizer); ``add_param_group`` also takes ``{"pairs": ...}``.

    A step of one pair is three calls, so that ``LoRAOptimizer`` can run the middle one on
    one owner rank per pair and exchange its result (``peft/lora_optimizer.py``):

    * ``pair_prepare(group, A, B)``: the cheap replicated part (every rank), e.g. momenta;
    * ``pair_work(group, A, B, job)``: the expensive part, a tuple of tensors whose shapes
      are ``result_shapes(A, B)``; must not change any state (only the owner runs it);
    * ``pair_finish(group, A, B, job, result)``: apply the result (every rank).

    Subclasses set ``NAME`` and ``_check_group`` and implement the three calls.
    """

    NAME = "LoRAPairOptimizer"

    @staticmethod
    def _check_group(group: dict) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __init__(self, params, defaults: dict):
        self._check_group(defaults)
        who = self.NAME
        if isinstance(params, torch.Tensor):
            raise ValueError(f"{who} takes (A, B) pairs or {{'pairs': [...]}} groups, not a tensor")
        params = list(params)
        if not params:
            raise ValueError(f"{who} got an empty parameter list")
        if all(isinstance(g, dict) for g in params):
            groups = params
        elif any(isinstance(g, dict) for g in params):
            raise ValueError(f"{who}: mix of param-group dicts and (A, B) pairs")
        else:
            groups = [{"pairs": params}]
        super().__init__(groups, defaults)

    def add_param_group(self, param_group: dict) -> None:
        who = self.NAME
        if not isinstance(param_group, dict):
            raise ValueError(f"{who} param groups must be dicts {{'pairs': [(A, B), ...], ...}}")
        if "params" in param_group:
            raise ValueError(f"{who} param groups take 'pairs': [(A, B), ...], not 'params'")
        if "pairs" not in param_group:
            raise ValueError(f"{who} param group without 'pairs'")
        group = dict(param_group)
        pairs = _check_pairs(group.pop("pairs"), who)
        flat = [t for pair in pairs for t in pair]
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        ids = [id(t) for t in flat]
        if len(set(ids)) != len(ids) or seen.intersection(ids):
            raise ValueError(f"{who}: a tensor appears in more than one LoRA pair")
        group["params"] = flat
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        self._check_group(group)
        super().add_param_group(group)

    @staticmethod
    def _pairs(group: dict):
        params = group["params"]
        return list(zip(params[0::2], params[1::2]))

    @staticmethod
    def compute_dtype(A: torch.Tensor, B: torch.Tensor) -> torch.dtype:
        """fp64 for fp64 params, else fp32 (bf16 / fp16 params: fp32 maths)."""
        return torch.float64 if torch.float64 in (A.dtype, B.dtype) else torch.float32

    def pair_gradients(self, A: torch.Tensor, B: torch.Tensor,
                       check_finite: bool = True) -> list[torch.Tensor]:
        """``[G_A, G_B]`` in the compute dtype; a missing gradient counts as zero.
        ``check_finite=False`` skips the NaN/Inf check (a host sync each)."""
        cdt = self.compute_dtype(A, B)
        grads = []
        for p in (A, B):
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"{self.NAME} does not support sparse gradients")
            g = torch.zeros_like(p, dtype=cdt) if p.grad is None else p.grad.to(cdt)
            if check_finite:
                check_finite_gradient(g, self.NAME, "LoRA factor")
            grads.append(g)
        return grads

    def result_shapes(self, A: torch.Tensor, B: torch.Tensor) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def pair_prepare(self, group: dict, A: torch.Tensor, B: torch.Tensor,
                     check_finite: bool = True):
        raise NotImplementedError

    def pair_work(self, group: dict, A: torch.Tensor, B: torch.Tensor, job) -> tuple:
        raise NotImplementedError

    def pair_finish(self, group: dict, A: torch.Tensor, B: torch.Tensor, job,
                    result: tuple) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            for A, B in self._pairs(group):
                if A.grad is None and B.grad is None:
                    continue
                job = self.pair_prepare(group, A, B)
                self.pair_finish(group, A, B, job, self.pair_work(group, A, B, job))
        return loss


class SMuon(LoRAPairOptimizer):
    """sMuon (docs/design.md#smuon-and-lora): Muon for LoRA factor pairs.

    Params: either a list of ``(A, B)`` tuples (A = ``lora_A.weight``: r x n, B =
    ``lora_B.weight``: m x r, the layer being ``W0 + gamma B A``), or a list of param-group
    dicts ``{"pairs": [(A, B), ...], **overrides}`` (any keyword below can be overridden per
    group, e.g. ``gamma`` for layers of different rank/alpha).  Internally a group's
    ``params`` are stored interleaved ``[A1, B1, A2, B2, ...]`` (so ``state_dict`` /
    ``load_state_dict`` work as for any torch optimizer); ``add_param_group`` also takes
    ``{"pairs": ...}``.

    Per pair and step (all in fp32, or fp64 for fp64 params):

        M_A <- mu M_A + G_A,  M_B <- mu M_B + G_B            (momentum on factor gradients)
        U_X <- G_X + mu M_X (nesterov) | M_X                  (docs/design.md#muon)
        dA, dB <- smuon_direction(A, B, U_A, U_B, gamma, damping, ...)
        c <- sqrt(1 - lr * wd)
        A <- c A - lr * scale(m, n) * dA;   B <- c B - lr * scale(m, n) * dB

    ``scale(m, n) = muon_scale(m, n, scale_mode, extra_scale_factor)`` of the *full* layer
    shape m x n, so the induced step of W is ``-lr * scale * P_T(msign(.))`` to first order, as
    Muon's on a dense layer (independent of gamma).

    Weight decay is decoupled and acts on the adapter delta ``gamma B A`` (pulling W towards
    the frozen W0, never W0 itself): it is split evenly (geometrically) between the factors,
    each multiplied by ``sqrt(1 - lr * wd)``, so that ``gamma B A`` is multiplied by exactly
    ``1 - lr * wd`` like Muon's ``W *= 1 - lr * wd``; the ratio ||B|| / ||A|| is unchanged.
    Requires ``lr * wd <= 1``.

    A pair whose two gradients are both None is skipped; a single missing gradient counts as
    zero.  Non-finite gradients, bad shapes, mismatched pairs and bad hyperparameters raise
    ``ValueError``.
    """

    NAME = "SMuon"
    _check_group = staticmethod(_check_group)

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, gamma: float = 1.0, damping: float = 1e-6,
                 ns_steps: int = 5, coefficient_type: Coefficients = "simple",
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0,
                 exact_sign: bool = False, eps: float = 1e-7):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        gamma=gamma, damping=damping, ns_steps=ns_steps,
                        coefficient_type=coefficient_type, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor, exact_sign=exact_sign, eps=eps)
        super().__init__(params, defaults)

    def pair_momenta(self, group: dict, A: torch.Tensor, B: torch.Tensor,
                     check_finite: bool = True) -> list[torch.Tensor]:
        """``[U_A, U_B]``: the momentum step on one pair's factor gradients (in fp32, fp64 for
        fp64 params; a missing gradient counts as zero).  ``check_finite=False`` skips the
        per-factor NaN/Inf check (a host sync each) where the caller has checked already."""
        grads = self.pair_gradients(A, B, check_finite)
        return [momentum_step(self.state[p], g, group["momentum"], group["nesterov"])
                for p, g in zip((A, B), grads)]

    @staticmethod
    def pair_direction(group: dict, A: torch.Tensor, B: torch.Tensor, uA: torch.Tensor,
                       uB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``smuon_direction`` of one pair with its group's settings."""
        return smuon_direction(A, B, uA, uB, gamma=group["gamma"], damping=group["damping"],
                               ns_steps=group["ns_steps"], coefficients=group["coefficient_type"],
                               exact_sign=group["exact_sign"], eps=group["eps"])

    @staticmethod
    def apply_pair(group: dict, A: torch.Tensor, B: torch.Tensor, dA: torch.Tensor,
                   dB: torch.Tensor) -> None:
        """The decoupled step of one pair: ``X <- sqrt(1 - lr wd) X - lr scale(m, n) dX``."""
        lr = group["lr"]
        decay = math.sqrt(1.0 - lr * group["weight_decay"])
        m, n = B.shape[0], A.shape[1]
        step = lr * muon_scale(m, n, group["scale_mode"], group["extra_scale_factor"])
        for p, d in ((A, dA), (B, dB)):
            decoupled_update(p, d.to(p.dtype), step, decay)

    # the three-part step (LoRAPairOptimizer): momenta everywhere, the direction on the
    # owner, the factor update everywhere
    def result_shapes(self, A, B):
        return [tuple(A.shape), tuple(B.shape)]

    def pair_prepare(self, group, A, B, check_finite=True):
        return self.pair_momenta(group, A, B, check_finite)

    def pair_work(self, group, A, B, job):
        return self.pair_direction(group, A, B, *job)

    def pair_finish(self, group, A, B, job, result):
        self.apply_pair(group, A, B, *result)
