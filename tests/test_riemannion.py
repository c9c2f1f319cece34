"""Riemannion (docs/relora.md#riemannion): the factored step against a dense fixed-rank
reference, parametrisation independence, the optimizer, state round trips.

Tolerances.  Every comparison below is ``rel = ||x - y||_F / ||y||_F`` of m x n matrices
(the adapter delta gamma B A).  They are derived, not fitted, from

    tol = C * kappa * k * eps(dtype)

* ``eps``: the unit roundoff of the dtype the *factored* path runs in (fp64 2^-53,
  fp32 2^-24; the dense reference always runs in fp64, so its own error is negligible
  against fp32);
* ``k = max(m, n)``: the longest reduction (inner-product length) of any matmul / QR in
  either path; a length-k sum in a backward-stable order is off by at most ~k eps
  relatively (the standard gamma_k bound), whatever order the two paths sum in;
* ``kappa``: how much one step amplifies a relative input perturbation, measured on the
  dense reference: the polar factor of Z (rank <= 2r) moves by ``||dZ|| / sigma_min(Z)``
  relative to its unit size, i.e. ``kappa_sign = ||Z||_2 / sigma_min+(Z)``; the rank-r
  truncated SVD of Y moves by ``||dY|| / (sigma_r(Y) - sigma_r+1(Y))``, i.e.
  ``kappa_retr = ||Y||_2 / gap``; over several steps we take the largest product per step
  times the number of steps (errors of successive steps add after amplification);
* ``C = 10``: a constant for the handful of operations per step (QRs, SVDs, products).

These are worst-case bounds: the observed errors are about 80 to 6000 times smaller.

Newton-Schulz mode: NS on the 2r x 2r core equals NS of the dense Z exactly (same odd
polynomial, ``||Z||_F = ||K||_F``), but the polynomial amplifies perturbations of small
singular values by up to its slope at 0 per step (``a`` of each (a, b, c) triple: 3.4445 for
``simple``), so kappa_sign is replaced by ``prod(a)``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import megatron_muon
from megatron_muon.core.newton_schulz import muon_scale, newton_schulz, resolve_coefficients
from megatron_muon.peft import riemannion as rmod
from megatron_muon.peft.riemannion import Riemannion, riemannion_update
from megatron_muon.testing.launch import run_ranks

F64 = torch.float64
C = 10.0


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# (m, n, r): r = 1, tall, wide, square, m < 2r, r = min(m, n) - small
SHAPES = [(12, 9, 1), (20, 7, 3), (6, 30, 2), (16, 16, 4), (5, 40, 3), (9, 11, 4)]


# ---------------------------------------------------------------------------------------------
# dense reference: explicit m x n matrices, SVD-based projector, msign and truncation
# ---------------------------------------------------------------------------------------------


def svd_sign(Z: torch.Tensor, rtol: float = 1e-10) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(Z, full_matrices=False)
    return (U * (S > rtol * S.max()).to(Z.dtype)) @ Vh


def frame(X: torch.Tensor, r: int):
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    return U[:, :r], Vh[:r].mT


def tangent(X: torch.Tensor, r: int, Y: torch.Tensor) -> torch.Tensor:
    """P_T(Y) at the rank-r point X: U U^T Y + Y V V^T - U U^T Y V V^T."""
    U, V = frame(X, r)
    PU, PV = U @ U.mT, V @ V.mT
    return PU @ Y + Y @ PV - PU @ Y @ PV


def truncate(Y: torch.Tensor, r: int) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(Y, full_matrices=False)
    return (U[:, :r] * S[:r]) @ Vh[:r]


def kappas(Z: torch.Tensor, Y: torch.Tensor, r: int) -> tuple[float, float]:
    s = torch.linalg.svdvals(Z)
    s = s[s > 1e-12 * s[0]]
    t = torch.linalg.svdvals(Y)
    gap = (t[r - 1] - (t[r] if len(t) > r else 0.0)).item()
    return (s[0] / s[-1]).item(), t[0].item() / gap


class DenseRiemannion:
    """The algorithm on explicit m x n matrices in fp64 (written independently of
    ``peft/riemannion.py``): tangent-space heavy ball, msign, projection, truncated SVD."""

    def __init__(self, X, r, *, lr, mu, nesterov, wd, scale, ns=None):
        self.X, self.r, self.lr, self.mu = X.clone(), r, lr, mu
        self.nesterov, self.wd = nesterov, wd
        self.scale, self.ns = scale, ns
        self.M = torch.zeros_like(X)
        self.kappa = 0.0

    def step(self, G):
        X, r = self.X, self.r
        PG = tangent(X, r, G)
        self.M = self.mu * tangent(X, r, self.M) + PG  # transport = projection
        Z = PG + self.mu * self.M if self.nesterov else self.M
        O = svd_sign(Z) if self.ns is None else newton_schulz(Z, steps=self.ns[1],
                                                             coefficients=self.ns[0])
        D = tangent(X, r, O)
        Y = (1 - self.lr * self.wd) * X - self.lr * self.scale * D
        k_sign, k_retr = kappas(Z, Y, r)
        if self.ns is not None:
            k_sign = math.prod(a for a, _, _ in resolve_coefficients(*self.ns))
        self.kappa = max(self.kappa, k_sign * k_retr)
        self.X = truncate(Y, r)
        return self.X


def problem(m, n, r, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(r, n, generator=g, dtype=dtype)
    B = torch.randn(m, r, generator=g, dtype=dtype)
    Gs = [torch.randn(m, n, generator=g, dtype=dtype) for _ in range(3)]
    return A, B, Gs


def rel(x, y):
    return ((x - y).norm() / y.norm()).item()


def run_factored(A, B, Gs, gamma, dtype, **kw):
    """riemannion_update over the gradient sequence; the factor gradients are computed from
    the dense G at the current factors, as backprop would: G_A = gamma B^T G, G_B = gamma G A^T."""
    A, B, state, out = A.to(dtype), B.to(dtype), None, []
    for G in Gs:
        G = G.to(dtype)
        A, B, state = riemannion_update(A, B, gamma * B.mT @ G, gamma * G @ A.mT, state,
                                        gamma=gamma, **kw)
        out.append(gamma * B.double() @ A.double())
    return out


# ---------------------------------------------------------------------------------------------
# (a) the factored step equals the dense reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("m,n,r", SHAPES)
@pytest.mark.parametrize("gamma,nesterov", [(1.0, True), (2.5, False), (-0.5, True)])
def test_matches_dense_reference_exact_sign(m, n, r, gamma, nesterov):
    A, B, Gs = problem(m, n, r, seed=m * 100 + n * 10 + r)
    kw = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.3, exact_sign=True,
              scale_mode="spectral", extra_scale_factor=0.5)
    ref = DenseRiemannion(gamma * B @ A, r, lr=0.05, mu=0.9, nesterov=nesterov, wd=0.3,
                          scale=muon_scale(m, n, "spectral", 0.5))
    Xs = [ref.step(G) for G in Gs]
    k = max(m, n)
    for dtype in (F64, torch.float32):
        got = run_factored(A, B, Gs, gamma, dtype, **kw)
        tol = C * ref.kappa * len(Gs) * k * torch.finfo(dtype).eps
        for step, (x, y) in enumerate(zip(got, Xs)):
            assert rel(x, y) < tol, (dtype, step, rel(x, y), tol)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("m,n,r", [(12, 9, 1), (20, 7, 3), (6, 30, 2), (9, 11, 4)])
@pytest.mark.parametrize("coefficients,steps", [("simple", 5), ("quintic", 5),
                                                ("polar_express", 8)])
def test_matches_dense_reference_newton_schulz(m, n, r, coefficients, steps):
    """NS on the 2r x 2r core == Muon's NS of the dense tangent momentum."""
    A, B, Gs = problem(m, n, r, seed=7 + r)
    kw = dict(lr=0.05, momentum=0.8, nesterov=True, ns_steps=steps, coefficients=coefficients)
    ref = DenseRiemannion(B @ A, r, lr=0.05, mu=0.8, nesterov=True, wd=0.0,
                          scale=muon_scale(m, n), ns=(coefficients, steps))
    Xs = [ref.step(G) for G in Gs]
    got = run_factored(A, B, Gs, 1.0, F64, **kw)
    tol = C * ref.kappa * len(Gs) * max(m, n) * torch.finfo(F64).eps
    for x, y in zip(got, Xs):
        assert rel(x, y) < tol, (rel(x, y), tol)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("exact", [True, False])
def test_b_zero_lora_start(exact):
    """B = 0 (X = 0, off the manifold): the generalised tangent space of the factor map,
    P(Y) = Y P_V, so the first step is X+ = -s msign(G P_V) (exactly in T: row space in
    row(A)), of rank r; a zero gradient keeps the old factors (A is not erased)."""
    m, n, r, gamma = 20, 14, 3, 2.0
    g = torch.Generator().manual_seed(3)
    A = torch.randn(r, n, generator=g, dtype=F64)
    B = torch.zeros(m, r, dtype=F64)
    G = torch.randn(m, n, generator=g, dtype=F64)
    PV = torch.linalg.pinv(A) @ A
    Z = 1.95 * (G @ PV)  # Nesterov with the default mu = 0.95: G + mu (0 + G)
    O = svd_sign(Z) if exact else newton_schulz(Z)
    s = 0.1 * muon_scale(m, n)
    A1, B1, state = riemannion_update(A, B, gamma * B.mT @ G, gamma * G @ A.mT, lr=0.1,
                                      gamma=gamma, exact_sign=exact)
    X1 = gamma * B1 @ A1
    assert rel(X1, -s * O) < 1e-10
    assert torch.linalg.matrix_rank(X1).item() == r
    assert rel(A1.mT @ A1 @ PV, A1.mT @ A1) < 1e-10  # row(A1) stays in row(A)
    assert state[1].abs().max() == 0  # the momentum's U basis: B = 0 has none
    # zero gradient at X = 0: nothing to retract to, the factors stay as they are
    A2, B2, _ = riemannion_update(A, B, torch.zeros_like(A), torch.zeros_like(B), lr=0.1,
                                  gamma=gamma, weight_decay=0.5)
    assert torch.equal(A2, A) and torch.equal(B2, B)


# ---------------------------------------------------------------------------------------------
# (b) parametrisation independence: the paper's point
# ---------------------------------------------------------------------------------------------


def _gauge(r, seed, cond):
    g = torch.Generator().manual_seed(seed)
    Q1, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=F64))
    Q2, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=F64))
    return Q1 @ torch.diag(torch.logspace(0, math.log10(cond), r, dtype=F64)) @ Q2


def _trajectory(A, B, W0, target, gamma, gauges, dtype, steps=4):
    """Riemannion on f(W) = 1/2 ||W0 + gamma B A - target||^2 (G = W - target, a function of
    W only); before each step the factors are re-parametrised (B M_k, M_k^-1 A) in place --
    the optimizer state (momentum, basis) is kept.  Returns W after every step."""
    A = torch.nn.Parameter(A.to(dtype).clone())
    B = torch.nn.Parameter(B.to(dtype).clone())
    opt = Riemannion([(A, B)], lr=0.05, momentum=0.9, gamma=gamma, weight_decay=0.1,
                     exact_sign=True)
    Ws = []
    for k in range(steps):
        if gauges is not None:
            M = gauges[k].to(dtype)
            with torch.no_grad():
                B.copy_(B @ M)
                A.copy_(torch.linalg.solve(M, A))
        loss = 0.5 * (W0.to(dtype) + gamma * B @ A - target.to(dtype)).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        Ws.append(gamma * B.detach().double() @ A.detach().double())
    return Ws


@pytest.mark.timeout(60)
@pytest.mark.parametrize("m,n,r", [(24, 16, 3), (10, 30, 2)])
def test_parametrisation_independence(m, n, r, monkeypatch):
    """Two factorisations of the same W -- (B, A) and (B M, M^-1 A), with a new M of
    condition number 100 before every step -- give the same W after every step.

    Tolerance: the re-parametrised factors carry a relative rounding error of ~cond(M) eps
    (one matmul and one solve of size r), which every later quantity inherits; with the
    derivation of the module docstring, tol = C * cond(M) * k * eps * steps * kappa, and
    kappa (the step's amplification) is bounded here by 100 (checked on the dense run: the
    momenta and retraction arguments of these problems have kappa < 100)."""
    gamma = 1.5
    g = torch.Generator().manual_seed(m + n + r)
    A = torch.randn(r, n, generator=g, dtype=F64)
    B = torch.randn(m, r, generator=g, dtype=F64)
    W0 = torch.randn(m, n, generator=g, dtype=F64)
    target = W0 + torch.randn(m, 2 * r, generator=g, dtype=F64) @ torch.randn(
        2 * r, n, generator=g, dtype=F64)
    cond, steps = 100.0, 4
    gauges = [_gauge(r, 100 + k, cond) for k in range(steps)]
    # kappa of these problems, from the dense reference
    ref = DenseRiemannion(gamma * B @ A, r, lr=0.05, mu=0.9, nesterov=True, wd=0.1,
                          scale=muon_scale(m, n))
    for _ in range(steps):
        ref.step(W0 + ref.X - target)
    assert ref.kappa < 100
    for dtype in (F64, torch.float32):
        tol = C * cond * max(m, n) * torch.finfo(dtype).eps * steps * 100
        plain = _trajectory(A, B, W0, target, gamma, None, dtype, steps)
        gauged = _trajectory(A, B, W0, target, gamma, gauges, dtype, steps)
        for k, (x, y) in enumerate(zip(gauged, plain)):
            assert rel(x, y) < tol, (dtype, k, rel(x, y), tol)
        if dtype == F64:
            assert rel(plain[-1], ref.X) < 1e-9  # and it is the dense algorithm's W
    # guard: the same check fails when the step uses the raw factor gradients as tangent
    # components (what a per-factor optimizer does) instead of their projection
    def raw(basis, grad_A, grad_B, gamma):
        U = basis.U
        return (grad_B - U @ (U.mT @ grad_B)) / gamma, grad_A / gamma

    monkeypatch.setattr(rmod, "riemannian_gradient", raw)
    plain = _trajectory(A, B, W0, target, gamma, None, F64, steps)
    gauged = _trajectory(A, B, W0, target, gamma, gauges, F64, steps)
    assert rel(gauged[0], plain[0]) > 1e-3, "the check cannot see raw factor gradients"


# ---------------------------------------------------------------------------------------------
# structure, the optimizer, state round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_balanced_factors_and_transpose_equivariance():
    m, n, r, gamma = 14, 9, 3, 1.3
    A, B, Gs = problem(m, n, r, seed=2)
    G = Gs[0]
    A1, B1, _ = riemannion_update(A, B, gamma * B.mT @ G, gamma * G @ A.mT, lr=0.05,
                                  gamma=gamma, exact_sign=True)
    gram = B1.mT @ B1
    assert rel(gram, A1 @ A1.mT) < 1e-12  # balanced: B^T B = A A^T (diagonal)
    assert (gram - torch.diag(torch.diagonal(gram))).abs().max() < 1e-12 * gram.abs().max()
    # transposed layer W^T = W0^T + gamma A^T B^T: (A', B') = (B^T, A^T), G' = G^T
    A2, B2, _ = riemannion_update(B.mT, A.mT, gamma * A @ G.mT, gamma * G.mT @ B, lr=0.05,
                                  gamma=gamma, exact_sign=True)
    assert rel(B2 @ A2, (B1 @ A1).mT) < 1e-12


@pytest.mark.timeout(30)
def test_optimizer_matches_update_and_reduces_loss_from_lora_init():
    m, n, r, gamma = 32, 24, 4, 2.0
    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(m, n, generator=g)
    target = W0 + torch.randn(m, r, generator=g) @ torch.randn(r, n, generator=g) / 2
    A = torch.nn.Parameter((torch.rand(r, n, generator=g) * 2 - 1) / math.sqrt(n))
    B = torch.nn.Parameter(torch.zeros(m, r))
    A0, B0, state = A.detach().clone(), B.detach().clone(), None
    kw = dict(lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.0, gamma=gamma,
              scale_mode="shape_scaling")
    opt = Riemannion([(A, B)], **kw)
    f = lambda A, B: (W0 + gamma * B @ A - target).square().sum()  # noqa: E731
    initial = f(A, B).item()
    for it in range(40):
        opt.zero_grad()
        loss = f(A, B)
        loss.backward()
        gA, gB = A.grad.clone(), B.grad.clone()
        opt.step()
        if it < 3:  # the optimizer is riemannion_update with its state
            A0, B0, state = riemannion_update(A0, B0, gA, gB, state, lr=0.3, momentum=0.9,
                                              gamma=gamma, scale_mode="shape_scaling")
            assert torch.equal(A.detach(), A0) and torch.equal(B.detach(), B0)
            assert torch.equal(opt.state[B]["momentum"], state[0])
            assert torch.equal(opt.state[A]["basis"], state[3])
    final = f(A, B).item()
    assert final < 0.2 * initial, (initial, final)


@pytest.mark.timeout(30)
def test_state_dict_round_trip():
    """A fresh optimizer loaded from a state_dict continues bit for bit, and its own
    state_dict equals the loaded one exactly."""
    pairs = [(torch.nn.Parameter(torch.randn(2, 6)), torch.nn.Parameter(torch.zeros(8, 2))),
             (torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(12, 3)))]
    opt = Riemannion([{"pairs": [pairs[0]], "gamma": 4.0}, {"pairs": [pairs[1]], "lr": 0.1}],
                     lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    params = [p for pair in pairs for p in pair]

    def fill(ps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)

    for _ in range(2):
        fill(params)
        opt.step()
    snapshot = [p.detach().clone() for p in params]
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][1]) == {"momentum", "basis"}  # B of pair 0
    fill(params)
    grads = [p.grad.clone() for p in params]
    opt.step()
    expected = [p.detach().clone() for p in params]
    fresh = [torch.nn.Parameter(s.clone()) for s in snapshot]
    opt2 = Riemannion([{"pairs": [(fresh[0], fresh[1])]}, {"pairs": [(fresh[2], fresh[3])]}])
    opt2.load_state_dict(sd)
    sd2 = opt2.state_dict()
    assert sd2["param_groups"] == sd["param_groups"]
    for i, st in sd["state"].items():
        assert st.keys() == sd2["state"][i].keys()
        for key in st:
            assert torch.equal(st[key], sd2["state"][i][key]), (i, key)
    for p, gr in zip(fresh, grads):
        p.grad = gr
    opt2.step()
    for p, e in zip(fresh, expected):
        assert torch.equal(p.detach(), e)


@pytest.mark.timeout(200)
def test_lora_optimizer_state_round_trip(tmp_path):
    """LoRAOptimizer("riemannion") on the tiny Megatron GPT (1 rank): two resumes from
    state_dict files (each into a fresh model and optimizer) equal 6 uninterrupted steps bit
    for bit, and state_dict() right after load_state_dict() equals the loaded state."""
    res = run_ranks("megatron_muon.testing.lora_workers:lora_resume_chain", 1,
                    dict(cfg=dict(swiglu=True, num_microbatches=2), directory=str(tmp_path),
                         tp=1, optimizers=("riemannion",)), timeout=180)[0]
    run = res["riemannion"]
    assert run["reloaded_equal"] == [True, True]
    assert run["chain"] == run["whole"]
    for k, (A, B) in run["whole_factors"].items():
        A2, B2 = run["chain_factors"][k]
        assert torch.equal(A, A2) and torch.equal(B, B2), k
        assert B.abs().max() > 0  # the adapters moved


@pytest.mark.timeout(30)
def test_no_full_size_decompositions(monkeypatch):
    """SVDs only on r x r and 2r x 2r cores; QRs only of matrices at most 2r wide."""
    m, n, r = 64, 48, 3
    A, B, Gs = problem(m, n, r, seed=1)
    seen = []
    real_svd, real_qr = torch.linalg.svd, torch.linalg.qr

    def spy_svd(x, *a, **k):
        seen.append(("svd", tuple(x.shape)))
        return real_svd(x, *a, **k)

    def spy_qr(x, *a, **k):
        seen.append(("qr", tuple(x.shape)))
        return real_qr(x, *a, **k)

    monkeypatch.setattr(torch.linalg, "svd", spy_svd)
    monkeypatch.setattr(torch.linalg, "qr", spy_qr)
    riemannion_update(A, B, B.mT @ Gs[0], Gs[0] @ A.mT, lr=0.1, exact_sign=True)
    assert seen and all(max(s) <= 2 * r for kind, s in seen if kind == "svd")
    assert all(min(s) <= 2 * r for kind, s in seen if kind == "qr")


@pytest.mark.timeout(30)
def test_bad_inputs():
    A, B = torch.randn(2, 6), torch.randn(8, 2)
    with pytest.raises(ValueError, match="rank mismatch"):
        riemannion_update(A, torch.randn(8, 3), A, torch.randn(8, 3), lr=0.1)
    with pytest.raises(ValueError, match="do not match"):
        riemannion_update(A, B, A[:, :-1], B, lr=0.1)
    with pytest.raises(ValueError, match="rank 4 must be"):
        riemannion_update(torch.randn(4, 3), torch.randn(8, 4), torch.randn(4, 3),
                          torch.randn(8, 4), lr=0.1)
    with pytest.raises(ValueError, match="gamma"):
        riemannion_update(A, B, A, B, lr=0.1, gamma=0.0)
    pA, pB = torch.nn.Parameter(A), torch.nn.Parameter(B)
    with pytest.raises(ValueError, match="Riemannion pair 0: rank mismatch"):
        Riemannion([(pB, pA)])
    with pytest.raises(ValueError, match="exceeds min"):
        Riemannion([(torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(8, 4)))])
    for kw in (dict(lr=-1.0), dict(momentum=1.0), dict(gamma=0.0), dict(ns_steps=0),
               dict(lr=1.0, weight_decay=2.0), dict(exact_sign="yes")):
        with pytest.raises(ValueError):
            Riemannion([(pA, pB)], **kw)
    opt = Riemannion([(pA, pB)])
    pA.grad, pB.grad = torch.zeros_like(A), torch.full_like(B, float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    assert megatron_muon.Riemannion is Riemannion
