"""sMuon (docs/design.md#smuon-and-lora): factored LoRA direction vs a dense oracle, and the SMuon optimizer."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import megatron_muon
from megatron_muon.peft import smuon as smuon_mod
from megatron_muon.core.newton_schulz import muon_scale, newton_schulz, resolve_coefficients
from megatron_muon.peft.smuon import SMuon, smuon_direction

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: intra-op threads only add contention on the shared CPU cores."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

# (m, n, r): r = 1, tall, wide, square, m < 2r (core not square), n == 2r, r close to min(m, n)
SHAPES = [(12, 9, 1), (20, 7, 3), (6, 30, 2), (16, 16, 4), (5, 40, 3), (33, 10, 5), (9, 11, 4)]


# ---------------------------------------------------------------------------------------------
# dense oracle helpers (explicit m x n matrices, explicit projectors)
# ---------------------------------------------------------------------------------------------


def svd_sign(X: torch.Tensor, rtol: float = 1e-10) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    return (U * (S > rtol * S.max()).to(X.dtype)) @ Vh


def projectors(A, B):
    """P_U onto col(B), P_V onto row(A) (pseudo-inverses: exact also for B = 0)."""
    return B @ torch.linalg.pinv(B), torch.linalg.pinv(A) @ A


def tangent(PU, PV, Y):
    return PU @ Y + Y @ PV - PU @ Y @ PV


def lora_problem(m, n, r, gamma, seed, b_zero=False, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(r, n, generator=g, dtype=dtype)
    B = torch.zeros(m, r, dtype=dtype) if b_zero else torch.randn(m, r, generator=g, dtype=dtype)
    G = torch.randn(m, n, generator=g, dtype=dtype)
    return A, B, G, gamma * B.mT @ G, gamma * G @ A.mT


def rel(x, y):
    return ((x - y).norm() / y.norm()).item()


# ---------------------------------------------------------------------------------------------
# smuon_direction vs the dense oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("m,n,r", SHAPES)
@pytest.mark.parametrize("gamma", [1.0, 2.5, -0.5])
def test_exact_sign_matches_dense_oracle(m, n, r, gamma):
    A, B, G, gA, gB = lora_problem(m, n, r, gamma, seed=m * 100 + n * 10 + r)
    PU, PV = projectors(A, B)
    D = tangent(PU, PV, G)
    oracle = tangent(PU, PV, svd_sign(D))
    # tiny damping: the factored path is the oracle up to rounding
    dA, dB = smuon_direction(A, B, gA, gB, gamma=gamma, damping=1e-12, exact_sign=True)
    assert dA.dtype == F64 and dA.shape == A.shape and dB.shape == B.shape
    assert rel(gamma * (dB @ A + B @ dA), oracle) < 1e-8
    # default relative damping 1e-6: the damped projector has eigenvalues l / (l + delta), so
    # the error is ~ 1e-6 * mean(l) / min(l) (Gram conditioning of these random factors < 100)
    dA, dB = smuon_direction(A, B, gA, gB, gamma=gamma, exact_sign=True)
    assert rel(gamma * (dB @ A + B @ dA), oracle) < 1e-4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("m,n,r", [(20, 14, 3), (7, 25, 1), (30, 8, 4)])
@pytest.mark.parametrize("exact", [True, False])
def test_b_zero_lora_start(m, n, r, exact):
    """B = 0: range of the factor map is {X A}, so P_U = 0, D = G P_V = G_B (AA^T)^-1 A / gamma,
    and dB = msign(D) A^T (A A^T)^-1 / gamma, dA = 0 (exactly)."""
    gamma = 2.0
    A, B, G, gA, gB = lora_problem(m, n, r, gamma, seed=7, b_zero=True)
    assert gA.abs().max() == 0
    gram_inv = torch.linalg.inv(A @ A.mT)
    D = gB @ gram_inv @ A / gamma
    assert rel(D, G @ torch.linalg.pinv(A) @ A) < 1e-12  # D = G_W P_V
    O = svd_sign(D) if exact else newton_schulz(D)
    dA, dB = smuon_direction(A, B, gA, gB, gamma=gamma, damping=1e-12, exact_sign=exact)
    assert torch.all(dA == 0)
    assert torch.isfinite(dB).all()
    assert rel(dB, O @ A.mT @ gram_inv / gamma) < 1e-8
    assert rel(gamma * dB @ A, O) < 1e-8  # msign(G P_V) already lies in T = {X A}
    # the same with the default damping (it only touches A A^T, which is well conditioned)
    dA2, dB2 = smuon_direction(A, B, gA, gB, gamma=gamma, exact_sign=exact)
    assert torch.all(dA2 == 0) and rel(dB2, dB) < 1e-4
    # and the generic pseudo-inverse oracle agrees (pinv(0) = 0)
    PU, PV = projectors(A, B)
    assert PU.abs().max() == 0
    if exact:
        assert rel(gamma * (dB @ A + B @ dA), tangent(PU, PV, svd_sign(tangent(PU, PV, G)))) < 1e-8


@pytest.mark.timeout(30)
def test_zero_factors_and_zero_gradients():
    m, n, r = 10, 8, 2
    A, B, G, gA, gB = lora_problem(m, n, r, 1.0, seed=3)
    # A = 0 (mirror image of B = 0): P_V = 0, dB = 0, B dA = msign(P_U G)
    Z = torch.zeros_like(A)
    dA, dB = smuon_direction(Z, B, B.mT @ G, torch.zeros_like(B), damping=1e-12, exact_sign=True)
    assert torch.all(dB == 0)
    PU = B @ torch.linalg.pinv(B)
    assert rel(B @ dA, svd_sign(PU @ G)) < 1e-8
    # both zero, or zero gradients: zero direction, no NaN
    for exact in (True, False):
        dA, dB = smuon_direction(Z, torch.zeros_like(B), torch.zeros_like(A), torch.zeros_like(B),
                                 exact_sign=exact)
        assert torch.all(dA == 0) and torch.all(dB == 0)
        dA, dB = smuon_direction(A, B, torch.zeros_like(A), torch.zeros_like(B), exact_sign=exact)
        assert torch.all(dA == 0) and torch.all(dB == 0)


def _scalar_ns(x: torch.Tensor, steps: int, coefficients) -> torch.Tensor:
    for a, b, c in resolve_coefficients(coefficients, steps):
        x = a * x + b * x**3 + c * x**5
    return x


@pytest.mark.timeout(30)
@pytest.mark.parametrize("m,n,r", [(12, 9, 1), (20, 7, 3), (6, 30, 2), (5, 40, 3)])
@pytest.mark.parametrize("coefficients,steps", [("simple", 5), ("quintic", 5),
                                                ("polar_express", 8), ("cubic", 12)])
def test_newton_schulz_mode(m, n, r, coefficients, steps):
    """NS on the 2r x 2r core == Muon's NS on the dense D (NS is an odd matrix polynomial and
    ||D||_F = ||core||_F), so the match is tight.  Against the exact sign the error is bounded
    by the scalar NS map on D's singular values: ||NS(D) - msign(D)||_F =
    sqrt(sum_i (phi(s_i / ||D||_F) - 1)^2), and P_T is an orthogonal projector (contraction)."""
    gamma = 1.5
    A, B, G, gA, gB = lora_problem(m, n, r, gamma, seed=11 + r)
    PU, PV = projectors(A, B)
    D = tangent(PU, PV, G)
    dA, dB = smuon_direction(A, B, gA, gB, gamma=gamma, damping=1e-12, ns_steps=steps,
                             coefficients=coefficients)
    got = gamma * (dB @ A + B @ dA)
    dense_ns = tangent(PU, PV, newton_schulz(D, steps=steps, coefficients=coefficients))
    assert rel(got, dense_ns) < 1e-8
    s = torch.linalg.svdvals(D)
    s = s[s > 1e-10 * s[0]]
    phi = _scalar_ns(s / (D.norm() + 1e-7), steps, coefficients)
    bound = torch.sqrt(((phi - 1) ** 2).sum()).item()
    exact = tangent(PU, PV, svd_sign(D))
    assert (got - exact).norm().item() <= bound * (1 + 1e-6) + 1e-9


@pytest.mark.timeout(30)
@pytest.mark.parametrize("m,n,r", [(6, 5, 1), (7, 4, 2), (4, 9, 2)])
def test_least_squares(m, n, r):
    """(dB, dA) minimise ||gamma (dB A + B dA) - O||_F for O = msign(D): normal equations hold,
    the residual equals the Kronecker-system lstsq residual, and the documented gauge is used."""
    gamma = 0.7
    A, B, G, gA, gB = lora_problem(m, n, r, gamma, seed=5)
    PU, PV = projectors(A, B)
    O = svd_sign(tangent(PU, PV, G))
    dA, dB = smuon_direction(A, B, gA, gB, gamma=gamma, damping=1e-12, exact_sign=True)
    res = O / gamma - (dB @ A + B @ dA)
    scale = O.norm().item() / abs(gamma)
    assert (res @ A.mT).norm().item() < 1e-9 * scale * A.norm().item()  # d/d(dB)
    assert (B.mT @ res).norm().item() < 1e-9 * scale * B.norm().item()  # d/d(dA)
    # brute force: vec(dB A + B dA) = [A^T (x) I_m] vec(dB) + [I_n (x) B] vec(dA) (column-major)
    At = torch.empty(n, r, dtype=F64).copy_(A.mT)  # fresh strides (kron dislikes r = 1 views)
    M = torch.cat([torch.kron(At, torch.eye(m, dtype=F64)),
                   torch.kron(torch.eye(n, dtype=F64), B)], dim=1)
    target = (O / gamma).mT.reshape(-1)
    sol = torch.linalg.lstsq(M, target.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    best = (M @ sol - target).norm().item()
    assert abs(res.norm().item() - best) < 1e-9 * scale
    # the documented formulas: dB = O A^T (AA^T)^-1 / gamma, dA = (B^TB)^-1 B^T O (I - P_V) / gamma
    assert rel(dB, O @ A.mT @ torch.linalg.inv(A @ A.mT) / gamma) < 1e-8
    assert rel(dA, torch.linalg.inv(B.mT @ B) @ B.mT @ O @ (torch.eye(n, dtype=F64) - PV)
               / gamma) < 1e-8


@pytest.mark.timeout(30)
def test_momenta_inputs_gauge_and_transpose():
    """Inconsistent (momentum-like) factor gradients: the W-step still lies in T, is invariant
    under the LoRA gauge (c B, A / c), and equivariant under transposing the layer."""
    m, n, r, gamma = 14, 9, 3, 1.3
    g = torch.Generator().manual_seed(2)
    A, B = torch.randn(r, n, generator=g, dtype=F64), torch.randn(m, r, generator=g, dtype=F64)
    gA, gB = torch.randn(r, n, generator=g, dtype=F64), torch.randn(m, r, generator=g, dtype=F64)
    dA, dB = smuon_direction(A, B, gA, gB, gamma=gamma, damping=1e-12, exact_sign=True)
    Y = gamma * (dB @ A + B @ dA)
    PU, PV = projectors(A, B)
    I_m, I_n = torch.eye(m, dtype=F64), torch.eye(n, dtype=F64)
    assert ((I_m - PU) @ Y @ (I_n - PV)).norm().item() < 1e-9
    # gauge: same W = c B (A / c); factor gradients transform as G_B -> G_B / c, G_A -> c G_A
    c = 3.0
    dA2, dB2 = smuon_direction(A / c, c * B, c * gA, gB / c, gamma=gamma, damping=1e-12,
                               exact_sign=True)
    assert rel(gamma * (dB2 @ (A / c) + c * B @ dA2), Y) < 1e-9
    # transpose: W^T = W0^T + gamma A^T B^T, i.e. (A', B') = (B^T, A^T)
    dA3, dB3 = smuon_direction(B.mT, A.mT, gB.mT, gA.mT, gamma=gamma, damping=1e-12,
                               exact_sign=True)
    assert rel(gamma * (dB3 @ B.mT + A.mT @ dA3), Y.mT) < 1e-9


@pytest.mark.timeout(30)
def test_float32_and_bfloat16_inputs():
    m, n, r, gamma = 40, 24, 4, 2.0
    A, B, G, gA, gB = lora_problem(m, n, r, gamma, seed=9)
    PU, PV = projectors(A, B)
    oracle = tangent(PU, PV, svd_sign(tangent(PU, PV, G)))
    dA, dB = smuon_direction(A.float(), B.float(), gA.float(), gB.float(), gamma=gamma,
                             exact_sign=True)
    assert dA.dtype == torch.float32 and dB.dtype == torch.float32
    assert rel(gamma * (dB.double() @ A + B @ dA.double()), oracle) < 1e-4
    bf = [t.bfloat16() for t in (A, B, gA, gB)]
    dA, dB = smuon_direction(*bf, gamma=gamma, exact_sign=True)
    assert dA.dtype == torch.float32 and torch.isfinite(dA).all() and torch.isfinite(dB).all()


@pytest.mark.timeout(30)
def test_rank_deficient_and_tiny_factors():
    """Relative damping: a rank-deficient B (repeated columns) gives the pseudo-inverse
    projector's answer, also in fp32 (damped Gram via QR, never an fp32 Cholesky), and a tiny
    B (1e-20 scale, right after a LoRA start) gives the same W-step as a unit-scale B."""
    m, n, r = 60, 40, 4
    g = torch.Generator().manual_seed(8)
    A = torch.randn(r, n, generator=g, dtype=F64)
    b = torch.randn(m, 1, generator=g, dtype=F64)
    B = torch.cat([b, b, 2 * b, torch.randn(m, 1, generator=g, dtype=F64)], dim=1)  # rank 2
    G = torch.randn(m, n, generator=g, dtype=F64)
    PU, PV = B @ torch.linalg.pinv(B, rtol=1e-10), torch.linalg.pinv(A) @ A
    oracle = tangent(PU, PV, svd_sign(tangent(PU, PV, G)))
    for dt, tol in ((F64, 1e-5), (torch.float32, 1e-4)):
        dA, dB = smuon_direction(A.to(dt), B.to(dt), (B.mT @ G).to(dt), (G @ A.mT).to(dt),
                                 exact_sign=True)
        assert rel(dB.double() @ A + B @ dA.double(), oracle) < tol
    B = torch.randn(m, r, generator=g)
    A32, G32 = A.float(), G.float()
    dA, dB = smuon_direction(A32, B, B.mT @ G32, G32 @ A32.mT, exact_sign=True)
    c = 1e-20
    dA2, dB2 = smuon_direction(A32, c * B, c * B.mT @ G32, G32 @ A32.mT, exact_sign=True)
    Y, Y2 = dB @ A32 + B @ dA, dB2 @ A32 + (c * B) @ dA2
    assert torch.isfinite(Y2).all() and rel(Y2, Y) < 1e-4


@pytest.mark.timeout(30)
def test_no_full_size_ns_or_svd(monkeypatch):
    """The only NS / SVD calls are on the <= 2r x 2r core."""
    m, n, r = 64, 48, 3
    A, B, G, gA, gB = lora_problem(m, n, r, 1.0, seed=1)
    shapes = []
    real_ns, real_svd = smuon_mod.newton_schulz, torch.linalg.svd

    def spy_ns(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return real_ns(x, *args, **kwargs)

    def spy_svd(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return real_svd(x, *args, **kwargs)

    monkeypatch.setattr(smuon_mod, "newton_schulz", spy_ns)
    monkeypatch.setattr(torch.linalg, "svd", spy_svd)
    smuon_direction(A, B, gA, gB)
    smuon_direction(A, B, gA, gB, exact_sign=True)
    assert len(shapes) == 2 and all(max(s) <= 2 * r for s in shapes)


@pytest.mark.timeout(30)
def test_smuon_direction_bad_inputs():
    A, B, G, gA, gB = lora_problem(8, 6, 2, 1.0, seed=0)
    with pytest.raises(ValueError, match="rank mismatch"):
        smuon_direction(A, torch.randn(8, 3, dtype=F64), gA, gB)
    with pytest.raises(ValueError, match="do not match"):
        smuon_direction(A, B, gA[:, :-1], gB)
    with pytest.raises(ValueError, match="2-D"):
        smuon_direction(A.reshape(-1), B, gA, gB)
    with pytest.raises(ValueError, match="floating"):
        smuon_direction(A.long(), B, gA, gB)
    for bad in (0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gamma"):
            smuon_direction(A, B, gA, gB, gamma=bad)
    for bad in (0.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match="damping"):
            smuon_direction(A, B, gA, gB, damping=bad)
    with pytest.raises(ValueError, match="ns_steps"):
        smuon_direction(A, B, gA, gB, ns_steps=0)
    with pytest.raises(ValueError, match="coefficient"):
        smuon_direction(A, B, gA, gB, coefficients="nope")


# ---------------------------------------------------------------------------------------------
# the SMuon optimizer
# ---------------------------------------------------------------------------------------------


def _lora(m, n, r, seed, dtype=torch.float32, b_zero=True):
    g = torch.Generator().manual_seed(seed)
    A = torch.nn.Parameter((torch.rand(r, n, generator=g) * 2 - 1).div(math.sqrt(n)).to(dtype))
    B = torch.nn.Parameter(torch.zeros(m, r, dtype=dtype) if b_zero
                           else torch.randn(m, r, generator=g).to(dtype) * 0.1)
    return A, B


def _quadratic(A, B, W0, Wstar, gamma):
    return (W0 + gamma * B @ A - Wstar).square().sum()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("exact_sign", [False, True])
def test_smuon_reduces_quadratic_from_lora_init(exact_sign):
    m, n, r, gamma = 32, 24, 4, 2.0
    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(m, n, generator=g)
    Wstar = W0 + torch.randn(m, r, generator=g) @ torch.randn(r, n, generator=g) / 2
    A, B = _lora(m, n, r, seed=1)
    opt = SMuon([(A, B)], lr=0.3, momentum=0.9, gamma=gamma, scale_mode="shape_scaling",
                exact_sign=exact_sign)
    initial = _quadratic(A, B, W0, Wstar, gamma).item()  # "nothing": the loss without steps
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = _quadratic(A, B, W0, Wstar, gamma)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    final = _quadratic(A, B, W0, Wstar, gamma).item()
    assert losses[0] == pytest.approx(initial)
    assert losses[1] < initial  # the first step (from B = 0) already helps
    assert final < 0.2 * initial, (initial, final)  # ~0.07 observed
    assert A.grad is not None and torch.isfinite(A).all() and torch.isfinite(B).all()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nesterov", [True, False])
def test_smuon_step_matches_manual(nesterov):
    m, n, r = 10, 7, 2
    A, B = _lora(m, n, r, seed=4, b_zero=False)
    A0, B0 = A.detach().clone(), B.detach().clone()
    kw = dict(lr=0.03, momentum=0.8, nesterov=nesterov, weight_decay=0.5, gamma=1.7,
              scale_mode="spectral", extra_scale_factor=0.2, ns_steps=6,
              coefficient_type="quintic")
    opt = SMuon([(A, B)], **kw)
    g = torch.Generator().manual_seed(5)
    grads = [(torch.randn(r, n, generator=g), torch.randn(m, r, generator=g)) for _ in range(2)]
    MA, MB = torch.zeros(r, n), torch.zeros(m, r)
    for gA, gB in grads:
        A.grad, B.grad = gA.clone(), gB.clone()
        opt.step()
        MA, MB = kw["momentum"] * MA + gA, kw["momentum"] * MB + gB
        uA = gA + kw["momentum"] * MA if nesterov else MA
        uB = gB + kw["momentum"] * MB if nesterov else MB
        dA, dB = smuon_direction(A0, B0, uA, uB, gamma=kw["gamma"], ns_steps=6,
                                 coefficients="quintic")
        step = kw["lr"] * muon_scale(m, n, "spectral", 0.2)
        c = math.sqrt(1 - kw["lr"] * kw["weight_decay"])
        A0, B0 = c * A0 - step * dA, c * B0 - step * dB
        torch.testing.assert_close(A.detach(), A0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(B.detach(), B0, rtol=1e-5, atol=1e-6)
    assert torch.equal(opt.state[A]["momentum_buffer"], MA)


@pytest.mark.timeout(30)
def test_weight_decay_shrinks_adapter_product_exactly():
    m, n, r, lr, wd = 9, 6, 2, 0.1, 0.3
    A, B = _lora(m, n, r, seed=6, b_zero=False)
    before = (B @ A).detach().clone()
    opt = SMuon([(A, B)], lr=lr, weight_decay=wd)
    A.grad, B.grad = torch.zeros_like(A), torch.zeros_like(B)  # zero gradient: no Muon step
    opt.step()
    torch.testing.assert_close((B @ A).detach(), (1 - lr * wd) * before)


@pytest.mark.timeout(30)
def test_param_groups_state_dict_and_dtypes():
    (A1, B1), (A2, B2), (A3, B3) = _lora(8, 6, 2, 1), _lora(12, 5, 3, 2), _lora(7, 9, 1, 3)
    opt = SMuon([{"pairs": [(A1, B1), (A2, B2)], "gamma": 4.0}, {"pairs": [(A3, B3)]}],
                lr=0.01, momentum=0.9)
    assert [g["gamma"] for g in opt.param_groups] == [4.0, 1.0]
    assert opt.param_groups[0]["params"] == [A1, B1, A2, B2]
    (A4, B4) = _lora(6, 6, 2, 4)
    opt.add_param_group({"pairs": [(A4, B4)], "lr": 0.5})
    assert opt.param_groups[2]["lr"] == 0.5
    g = torch.Generator().manual_seed(0)

    def fill():
        for p in (A1, B1, A2, B2, A3, B3, A4, B4):
            p.grad = torch.randn(p.shape, generator=g)

    fill()
    opt.step()
    clone_params = [p.detach().clone() for p in (A1, B1, A2, B2, A3, B3, A4, B4)]
    sd = copy.deepcopy(opt.state_dict())
    fill()
    grads = [p.grad.clone() for p in (A1, B1, A2, B2, A3, B3, A4, B4)]
    opt.step()
    expected = [p.detach().clone() for p in (A1, B1, A2, B2, A3, B3, A4, B4)]
    # a fresh optimizer on copies, loaded from the checkpoint, reproduces the second step
    params2 = [torch.nn.Parameter(c.clone()) for c in clone_params]
    opt2 = SMuon([{"pairs": [(params2[0], params2[1]), (params2[2], params2[3])]},
                  {"pairs": [(params2[4], params2[5])]}], lr=0.01, momentum=0.9)
    opt2.add_param_group({"pairs": [(params2[6], params2[7])]})
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["gamma"] == 4.0 and opt2.param_groups[2]["lr"] == 0.5
    for p, gr in zip(params2, grads):
        p.grad = gr
    opt2.step()
    for p, e in zip(params2, expected):
        torch.testing.assert_close(p.detach(), e)
    # bf16 factors: fp32 maths, params keep their dtype; a pair with no grads is skipped
    A5, B5 = _lora(8, 6, 2, 5, dtype=torch.bfloat16, b_zero=False)
    A6, B6 = _lora(8, 6, 2, 6)
    opt3 = SMuon([(A5, B5), (A6, B6)])
    A5.grad, B5.grad = torch.randn_like(A5), torch.randn_like(B5)
    before6 = (A6.detach().clone(), B6.detach().clone())
    opt3.step()
    assert A5.dtype == torch.bfloat16 and opt3.state[A5]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(A6, before6[0]) and torch.equal(B6, before6[1])


@pytest.mark.timeout(30)
def test_smuon_bad_inputs():
    A, B = _lora(8, 6, 2, 0)
    with pytest.raises(ValueError, match="rank mismatch"):
        SMuon([(A, torch.nn.Parameter(torch.zeros(8, 3)))])
    with pytest.raises(ValueError, match="rank mismatch"):
        SMuon([(B, A)])  # swapped factors
    with pytest.raises(ValueError, match="2-D"):
        SMuon([(torch.nn.Parameter(torch.zeros(2)), B)])
    with pytest.raises(ValueError, match=r"\(A, B\) tuple"):
        SMuon([(A, B, A)])
    with pytest.raises(ValueError, match=r"\(A, B\) tuple"):
        SMuon([A, B])
    with pytest.raises(ValueError, match="empty"):
        SMuon([])
    with pytest.raises(ValueError, match="more than one"):
        SMuon([(A, B), (A, torch.nn.Parameter(torch.zeros(5, 2)))])
    with pytest.raises(ValueError, match="'pairs'"):
        SMuon([{"params": [A, B]}])
    with pytest.raises(ValueError, match="same tensor"):
        S = torch.nn.Parameter(torch.zeros(3, 3))
        SMuon([(S, S)])
    bad_hparams = [dict(lr=-1.0), dict(weight_decay=-0.1), dict(lr=1.0, weight_decay=2.0),
                   dict(momentum=1.0), dict(momentum=-0.1), dict(ns_steps=0),
                   dict(coefficient_type="nope"), dict(scale_mode="nope"), dict(gamma=0.0),
                   dict(gamma=float("nan")), dict(damping=0.0), dict(lr=float("inf")),
                   dict(nesterov=1), dict(exact_sign="yes")]
    for kw in bad_hparams:
        with pytest.raises(ValueError):
            SMuon([(A, B)], **kw)
    with pytest.raises(ValueError, match="gamma"):
        SMuon([{"pairs": [(A, B)], "gamma": 0.0}])
    opt = SMuon([(A, B)])
    A.grad, B.grad = torch.zeros_like(A), torch.full_like(B, float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    # lazy export from the package
    assert megatron_muon.SMuon is SMuon and megatron_muon.smuon_direction is smuon_direction
