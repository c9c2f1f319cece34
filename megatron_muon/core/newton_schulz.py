"""Newton-Schulz orthogonalization: the maths every Muon path in this package shares.

The iteration, the coefficient sets and the scale modes are described in
docs/design.md#muon.  ``newton_schulz`` is the reference implementation (plain torch,
batched via ``bmm``); faster backends in ``megatron_muon.kernels`` are tested against it.

Two methods compute the same polynomial (docs/design.md#gram-newton-schulz):
``'standard'`` iterates on the rectangular s x N matrix X (s = the short side) and
``'gram'`` iterates on the small s x s Gram matrix G = X X^T, accumulating the left
factor Q of X_k = Q X_0 and touching the rectangular X only at the start, at restarts
and at the end: at aspect ratio N / s = 4 and 5 steps it needs 56-78% of the flops
(never restarting / restarting every 2 steps; 67% with quintic's default, every 3).
Equal in exact arithmetic; in floating point Gram's error grows with the square of X's
condition number between restarts, which is why it restarts every ``gram_restart``
steps (default 2; 3 for quintic and cubic) and why, for a 16-bit compute dtype, it
keeps the s x s matrices (G, Q) in fp32.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

__all__ = [
    "COEFFICIENT_SETS",
    "CYCLING_SETS",
    "FIXED_STEP_SETS",
    "SCALE_MODES",
    "resolve_coefficients",
    "NS_METHODS",
    "DEFAULT_GRAM_RESTART",
    "GRAM_RESTART_BY_SET",
    "default_gram_restart",
    "check_ns_method",
    "newton_schulz",
    "ns_step_scalars",
    "ns_workspace_numel",
    "newton_schulz_in_workspace",
    "muon_scale",
    "ns_flops",
]

# Per-step (a, b, c) triples, as Emerging-Optimizers (the Newton-Schulz of Megatron-Core's
# own Muon) defines them; ``cubic`` is the classic (1.5, -0.5, 0) iteration.  Past a set's
# end, ``CYCLING_SETS`` start again from its first triple and the others repeat their last
# (Emerging-Optimizers' rule); a ``FIXED_STEP_SETS`` schedule only runs at its own length.
COEFFICIENT_SETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (  # arXiv 2505.16932, with its 1.01^degree safety division
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "cans": (  # arXiv 2506.10935 (Remez + adaptive interval)
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    "aol": (  # flash-newton-schulz's AOL-preconditioned schedule
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    # DeepSeek-V4's hybrid: 8 fast steps of 'simple', then 2 steps that settle the singular
    # values at 1 (2 - 1.5 + 0.5 = 1 with slope 0 there); at fewer than 10 steps only the
    # first ones run, as in Emerging-Optimizers
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
    "cubic5": (  # a relaxed cubic five-step schedule (c = 0), Emerging-Optimizers main
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ),
    "cubic": ((1.5, -0.5, 0.0),),
}
CYCLING_SETS = frozenset({"simple", "quintic", "aol", "cubic5", "cubic"})
FIXED_STEP_SETS = frozenset({"cubic5"})

SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")

Coefficients = Union[str, Sequence[Sequence[float]]]



def resolve_coefficients(coefficients: Coefficients, steps: int) -> list[tuple[float, float, float]]:
    """Return exactly ``steps`` (a, b, c) triples for a named set (past its end cycling or
    repeating the last, ``CYCLING_SETS``) or an explicit list (its last triple repeated)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(
                f"unknown Newton-Schulz coefficient set {coefficients!r}; "
                f"choose one of {sorted(COEFFICIENT_SETS)}"
            )
        table = COEFFICIENT_SETS[coefficients]
        if coefficients in FIXED_STEP_SETS and steps != len(table):
            raise ValueError(f"the {coefficients!r} coefficient set is a fixed {len(table)}-step "
                             f"schedule; use ns_steps={len(table)}, got {steps}")
        if coefficients in CYCLING_SETS:
            return [tuple(table[i % len(table)]) for i in range(steps)]
    else:
        table = tuple(tuple(float(v) for v in t) for t in coefficients)
        if not table or any(len(t) != 3 for t in table):
            raise ValueError("explicit coefficients must be a non-empty list of (a, b, c) triples")
    return [tuple(table[min(i, len(table) - 1)]) for i in range(steps)]


#: ``method`` names of ``newton_schulz`` and ``ns_flops``.
NS_METHODS = ("standard", "gram")

#: Gram NS re-forms X = Q X_0 and G = X X^T before every ``gram_restart``-th step.
#: 2 keeps fp32 Gram within 1.6e-6 of standard fp32's own distance from the exact result
#: on Gaussian, power-law (sigma_i = 1/i) and condition-1e3 inputs for every coefficient
#: set; 3 does for ``quintic`` and ``cubic`` (<= 4.1e-6) at fewer flops (4 instead of 6
#: rectangular products for 5 steps), but not for ``polar_express`` (3.3e-5: its first
#: a = 8.2 grows the Gram error by a^2 = 67 in one step) nor reliably for ``simple``
#: (7.7e-6).  Measurements: docs/design.md#gram-newton-schulz.
DEFAULT_GRAM_RESTART = 2
GRAM_RESTART_BY_SET: dict[str, int] = {"quintic": 3, "cubic": 3}


def default_gram_restart(coefficients: Coefficients = "simple") -> int:
    """Restart period Gram NS uses for ``coefficients`` when none is given: by set name,
    or for explicit triples, those of the named set they equal (the kernel backends see
    resolved triples only), else ``DEFAULT_GRAM_RESTART``."""
    if isinstance(coefficients, str):
        return GRAM_RESTART_BY_SET.get(coefficients, DEFAULT_GRAM_RESTART)
    triples = [tuple(float(v) for v in t) for t in coefficients]
    for name, restart in GRAM_RESTART_BY_SET.items():
        if triples and triples == resolve_coefficients(name, len(triples)):
            return restart
    return DEFAULT_GRAM_RESTART


def check_ns_method(method: str, gram_restart: Optional[int] = None) -> None:
    """ValueError naming the valid choices for a bad ``method`` / ``gram_restart``."""
    if method not in NS_METHODS:
        raise ValueError(f"unknown Newton-Schulz method {method!r}; choose one of {list(NS_METHODS)}")
    if gram_restart is not None and (not isinstance(gram_restart, int) or isinstance(gram_restart, bool)
                                     or gram_restart < 0):
        raise ValueError(
            f"gram_restart must be an integer >= 0 (0: never restart) or None (the "
            f"coefficients' default), got {gram_restart!r}"
        )


def ns_step_scalars(coeffs: Sequence[tuple[float, float, float]],
                    dtype: torch.dtype) -> list[tuple[float, float, float, float]]:
    """Per step of standard NS, the scalars ``(beta_b, alpha_b, beta_x, alpha_x)`` of
    ``B~ = beta_b G + alpha_b G G`` (``beta_b G`` when c = 0) and
    ``Y' = beta_x Y + alpha_x B~ Y``, where G = Y Y^T and the stored iterate Y is the true
    X divided by a scalar sigma that the scalars carry.

    Why: the CPU runs 16-bit matmuls through oneDNN, which compiles and keeps one kernel
    per distinct beta of a ``baddbmm`` (about 0.7 MiB each, for the process's life).  The
    plain step (B = b A + c A A, X' = a X + B X) gives each step of a per-step coefficient
    set two new betas: 11 kernels per batch shape for quintic's 5 steps.  Here every step
    but the last stores Y' = X' / (a sigma), so its betas are 1:
    B = b sigma^2 B~ with B~ = G + (c sigma^2 / b) G G, and
    X' = a sigma (Y + (b sigma^2 / a) B~ Y); sigma <- a sigma.  The last step (and a step
    with a = 0 or b = 0) returns to the true scale:
    B~ = b sigma^2 G + c sigma^4 G G, X' = a sigma Y + sigma B~ Y.  4 kernels per batch
    shape instead of 11, with the rounding of the plain step (one rounding per product,
    the scalars applied inside it; docs/design.md#muon).  A set that repeats one triple
    ('simple', 'cubic') keeps the plain step, which needs no more kernels (2 betas); so
    does one step (sigma = 1: the same scalars) and float16: Y shrinks by the product of
    the a's before the last (about 170 for quintic, 3400 for polar_express) and fp16's
    range would lose it to underflow (bf16 and fp32 share fp32's exponent range)."""
    plain_kernels = len({b for _, b, c in coeffs if c != 0.0}) + len({a for a, _, _ in coeffs})
    rescale = dtype != torch.float16 and plain_kernels > 4
    out = []
    sigma = 1.0
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        s2 = sigma * sigma
        if rescale and i < last and a != 0.0 and b != 0.0:
            out.append((1.0, c * s2 / b, 1.0, b * s2 / a))
            sigma *= a
        else:
            out.append((b * s2, c * s2 * s2, a * sigma, sigma))
            sigma = 1.0
    return out


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "simple",
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    method: str = "standard",
    gram_restart: Optional[int] = None,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U V^T of ``x`` ([m, n] or [..., m, n]).

    X = x / (||x||_F + eps); tall inputs are transposed so that X X^T is the small Gram
    matrix; per step A = X X^T (computed once), B = b A + c A A, X = a X + B X (computed
    on a rescaled X, ``ns_step_scalars``).
    ``dtype`` is the compute dtype (default: x's dtype, fp32 for anything below fp32 is
    *not* forced: pass ``torch.bfloat16`` explicitly to run in bf16).  The result has
    ``x``'s dtype and shape; leading dimensions are a batch of independent matrices.

    ``method='gram'`` computes the same polynomial on the s x s Gram matrix (see
    ``_gram_iterations``), restarting every ``gram_restart`` steps (0: never; None:
    ``default_gram_restart(coefficients)``, 3 for quintic and cubic, else 2).
    """
    check_ns_method(method, gram_restart)
    if x.ndim < 2:
        raise ValueError(f"newton_schulz expects [m, n] or [..., m, n], got shape {tuple(x.shape)}")
    coeffs = resolve_coefficients(coefficients, steps)
    if x.ndim == 2:
        X = x.unsqueeze(0)
    elif x.ndim == 3:
        X = x
    else:  # [..., m, n] -> one batch dimension
        X = x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])
    X = X.to(dtype or x.dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    X = X / (norm + eps)
    if method == "gram":
        restart = default_gram_restart(coefficients) if gram_restart is None else gram_restart
        X = _gram_iterations(X, coeffs, restart)
    else:
        for (_, _, c), (bb, cc, aa, alpha) in zip(coeffs, ns_step_scalars(coeffs, X.dtype)):
            A = torch.bmm(X, X.transpose(-2, -1))
            B = torch.baddbmm(A, A, A, beta=bb, alpha=cc) if c != 0.0 else A * bb
            X = torch.baddbmm(X, B, X, beta=aa, alpha=alpha)
    if tall:
        X = X.transpose(-2, -1)
    X = X.to(x.dtype)
    if x.ndim == 2:
        return X.squeeze(0)
    return X if x.ndim == 3 else X.reshape(x.shape)


def ns_workspace_numel(count: int, m: int, n: int) -> int:
    """Elements (of the compute dtype) ``newton_schulz_in_workspace`` needs for a batch of
    ``count`` m x n matrices: two s x N iterates and two s x s products per matrix
    (s = min(m, n), N = max(m, n)), at most 4 x the batch."""
    s, big = min(m, n), max(m, n)
    return count * (2 * s * big + 2 * s * s)


def newton_schulz_in_workspace(x: torch.Tensor, workspace: torch.Tensor, steps: int = 5,
                               coefficients: Coefficients = "simple", eps: float = 1e-7,
                               dtype: torch.dtype | None = None) -> torch.Tensor:
    """``newton_schulz(x, ..., method='standard')`` of a batch x [b, m, n], computed in
    ``workspace`` (1-D, the compute dtype, at least ``ns_workspace_numel(b, m, n)``
    elements) with ``out=`` ops: no other tensor of the batch's size is allocated.  Returns
    a view of ``workspace`` holding the result in the compute dtype, shaped [b, m, n]; the
    caller converts it (``x`` is only read, before the first product, so the result may be
    written over it).

    The same operations on the same values, in the same memory layouts, as
    ``newton_schulz``: the normalised X keeps x's layout (a tall input's first step
    multiplies its transposed view, as ``newton_schulz`` does), every later iterate is a
    contiguous s x N batch.  So the result is bitwise ``newton_schulz``'s (tested on the
    CPU in fp32 and bf16, tests/test_kernels.py); only where the tensors live differs."""
    if x.ndim != 3:
        raise ValueError(f"newton_schulz_in_workspace expects [b, m, n], got {tuple(x.shape)}")
    coeffs = resolve_coefficients(coefficients, steps)
    dt = dtype or x.dtype
    b, m, n = x.shape
    s, big = min(m, n), max(m, n)
    need = ns_workspace_numel(b, m, n)
    if workspace.dtype != dt or workspace.ndim != 1 or workspace.numel() < need:
        raise ValueError(f"workspace must be 1-D {dt} with >= {need} elements, got "
                         f"{tuple(workspace.shape)} {workspace.dtype}")
    tall = m > n
    k = b * s * big
    x0, x1 = workspace[:k], workspace[k: 2 * k]
    A = workspace[2 * k: 2 * k + b * s * s].view(b, s, s)
    B = workspace[2 * k + b * s * s: need].view(b, s, s)
    src = x
    if dt != x.dtype:  # the 16-bit copy of x, in x's layout (as newton_schulz's x.to(dtype))
        src = x1.view(b, m, n)
        src.copy_(x)
    if tall:
        src = src.transpose(-2, -1)
    norm = torch.linalg.vector_norm(src, dim=(-2, -1), keepdim=True)
    # X / (norm + eps) into x0, in x's layout (newton_schulz's result keeps the input's
    # strides); x1 (the 16-bit copy, dead now) takes the first step's product
    X = x0.view(b, m, n).transpose(-2, -1) if tall else x0.view(b, s, big)
    torch.div(src, norm + eps, out=X)
    Xn = x1.view(b, s, big)
    for (_, _, c), (bb, cc, aa, alpha) in zip(coeffs, ns_step_scalars(coeffs, dt)):
        torch.bmm(X, X.transpose(-2, -1), out=A)
        if c != 0.0:
            torch.baddbmm(A, A, A, beta=bb, alpha=cc, out=B)
        else:
            torch.mul(A, bb, out=B)
        torch.baddbmm(X, B, X, beta=aa, alpha=alpha, out=Xn)
        # the iterate just read is dead: its storage takes the next product, contiguous
        X, Xn = Xn, (x0 if Xn.data_ptr() == x1.data_ptr() else x1).view(b, s, big)
    return X.transpose(-2, -1) if tall else X


def _gram_iterations(X: torch.Tensor, coeffs: Sequence[tuple[float, float, float]],
                     restart: int) -> torch.Tensor:
    """The NS steps of ``coeffs`` on a wide, normalised batch X [b, s, N] via its Gram matrix.

    With G = X X^T and P = a I + Z, Z = b G + c G^2, one NS step is X <- P X.  P is a
    polynomial in G, so it is symmetric and commutes with G, and the next Gram matrix is
    P X X^T P = P G P: the iteration never needs the rectangular X.  Q accumulates the
    steps' P (Q <- P Q) and X_final = Q X_0.  Per step: Z (one s x s product), Q (one,
    none on a segment's first step, where Q = P), G <- P (G P) (two, skipped before a
    restart and after the last step).  A restart materialises X = Q X_0 and G = X X^T.

    Rounding: products are formed as a M + Z M (``baddbmm``), so the scalar part a of
    P is applied inside the product as the standard path does with a X + B X.  For a
    16-bit compute dtype X stays 16-bit, but G = X X^T is accumulated and kept in fp32
    (a tensor-core GEMM with fp32 output) and the s x s iteration runs in fp32; only Q
    is rounded to 16 bits for Q X.  A bf16 G has absolute eigenvalue errors ~2^-8
    lambda_max that the iteration grows by ~a^2 per step instead of recomputing them:
    with G in bf16, Gram was up to 7.7 unit roundoffs further from the exact result
    than bf16 standard NS, and diverged on power-law spectra without restarts; with
    G in fp32 it is within 0.8 (docs/design.md#gram-newton-schulz).
    """
    dt = X.dtype
    sq = torch.float32 if dt in (torch.bfloat16, torch.float16) else dt
    k = len(coeffs)

    def gram(Y: torch.Tensor) -> torch.Tensor:
        Y = Y.to(sq)  # exact: a 16-bit X's products accumulate and are kept in fp32
        return torch.bmm(Y, Y.transpose(-2, -1))

    def apply(Q: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
        return torch.bmm(Q.to(dt), Y)

    G = gram(X)
    eye = torch.eye(X.shape[-2], dtype=sq, device=X.device)
    Q: Optional[torch.Tensor] = None
    for i, (a, b, c) in enumerate(coeffs):
        if Q is not None and restart and i % restart == 0:
            X = apply(Q, X)
            G = gram(X)
            Q = None
        Z = torch.baddbmm(G, G, G, beta=b, alpha=c) if c != 0.0 else G * b
        Q = torch.add(Z, eye, alpha=a) if Q is None else torch.baddbmm(Q, Z, Q, beta=a)
        last_of_segment = i == k - 1 or (restart and (i + 1) % restart == 0)
        if not last_of_segment:
            R = torch.baddbmm(G, G, Z, beta=a)  # G P = a G + G Z
            G = torch.baddbmm(R, Z, R, beta=a)  # P (G P) = a R + Z R
    assert Q is not None  # steps >= 1
    return apply(Q, X)


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


def ns_flops(m: int, n: int, steps: int, method: str = "standard",
             gram_restart: Optional[int] = None, coefficients: Coefficients = "simple") -> float:
    """Flops of ``steps`` NS iterations on one m x n matrix (FMA = 2 flops).

    s = min(m, n), N = max(m, n); a rectangular product (X X^T or Q X) costs 2 s^2 N,
    an s x s product 2 s^3.  ``standard``: per step X X^T, A A and B X, so
    k (4 s^2 N + 2 s^3).  ``gram`` with its steps split into J segments by restarts:
    2 J rectangular products (G_0 or a restart's X X^T, and Q X) and 4 k - 3 J s x s
    products (Z every step; G <- P G P and Q <- P Q on all but a segment's last /
    first step), i.e. 4 J s^2 N + 2 (4 k - 3 J) s^3.  At N = 4 s, k = 5: standard
    90 s^3, gram 50 s^3 without restarts, 60 s^3 restarting every 3 steps (J = 2, the
    quintic default), 70 s^3 every 2 (J = 3).  ``gram_restart=None`` is
    ``default_gram_restart(coefficients)``, as in ``newton_schulz``.  Both methods count
    B = b A + c A A as a product (for c = 0 it is elementwise in both).
    """
    check_ns_method(method, gram_restart)
    s, big = min(m, n), max(m, n)
    if method == "gram":
        if gram_restart is None:
            gram_restart = default_gram_restart(coefficients)
        segments = -(-steps // gram_restart) if gram_restart else 1
        return 4.0 * segments * s * s * big + 2.0 * (4 * steps - 3 * segments) * s**3
    # X X^T: 2 s^2 big ; A A: 2 s^3 ; B X: 2 s^2 big  -> per step 4 s^2 big + 2 s^3
    return steps * (4.0 * s * s * big + 2.0 * s**3)
