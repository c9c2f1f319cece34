"""IsoLoCo maths (docs/design.md#isoloco-and-islands): Iso-C (SVD and NS fast mode) and the outer optimizer."""

import copy
import io

import pytest
import torch

from megatron_muon.islands.isoloco import (
    ISO_NS_CLEANUP_STEPS,
    ISO_NS_STEPS,
    OUTER_DEFAULTS,
    OuterOptimizer,
    conditioned_matrix,
    iso_c,
    iso_c_ns_error,
    mean_pseudo_gradient,
    ns_error_table,
    polar_ns,
    pseudo_gradient,
)
from megatron_muon.core.newton_schulz import newton_schulz

# Documented bound of the default NS schedule (14 polar_express + 1 cleanup, gram
# normalisation): relative Frobenius error of iso_c(.., "ns") vs the exact SVD formula.
NS_BOUND_FP32 = 1e-4   # cond <= 1e3 (geometric or flat spectrum) and exactly rank-deficient
NS_BOUND_FP64 = 1e-10  # same cases in float64

SHAPES = [(40, 40), (56, 24), (24, 56)]


def _iso_formula(U, s, V):
    """mean(s) * U_r V_r^T, the documented formula, from known float64 factors."""
    keep = s > 0
    return s.sum() / s.numel() * (U[:, keep] @ V[:, keep].mT)


# ----------------------------------------------------------------------------- Iso-C (SVD)
@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape", SHAPES)
def test_iso_c_svd_equals_formula(shape):
    m, n = shape
    k = min(m, n)
    g = torch.Generator().manual_seed(m * 1000 + n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = torch.rand(k, generator=g, dtype=torch.float64) * 3 + 0.1
    D = (U * s) @ V.mT
    out = iso_c(D, "svd")
    expected = s.mean() * (U @ V.mT)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    # every singular value of the result is mean(s)
    torch.testing.assert_close(torch.linalg.svdvals(out), s.mean().expand(k), rtol=1e-12, atol=0)
    assert out.dtype == D.dtype and out.shape == D.shape


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape", SHAPES)
def test_iso_c_svd_rank_deficient(shape):
    m, n = shape
    k = min(m, n)
    r = k // 3
    D, U, s, V = conditioned_matrix(m, n, 10.0, rank=r, seed=3, dtype=torch.float64)
    out = iso_c(D, "svd")
    # mean over all min(m, n) singular values (zeros included), partial isometry on the range
    torch.testing.assert_close(out, _iso_formula(U, s, V), rtol=0, atol=1e-12)
    sv = torch.linalg.svdvals(out)
    mean = s.sum() / k
    torch.testing.assert_close(sv[:r], mean.expand(r), rtol=1e-12, atol=0)
    assert sv[r:].abs().max() < 1e-12
    # fp32 input: numerical-noise singular values fall under the default rank cutoff
    out32 = iso_c(D.float(), "svd")
    torch.testing.assert_close(out32.double(), _iso_formula(U, s, V), rtol=0, atol=1e-5)


@pytest.mark.timeout(30)
def test_iso_c_zero_matrix_and_properties():
    for mode in ("svd", "ns"):
        assert torch.equal(iso_c(torch.zeros(6, 4), mode), torch.zeros(6, 4))
    D = conditioned_matrix(32, 20, 30.0, seed=5, dtype=torch.float64)[0]
    base = iso_c(D)
    # positive homogeneity, odd, transpose- and orthogonally equivariant
    torch.testing.assert_close(iso_c(2.5 * D), 2.5 * base, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(iso_c(-D), -base, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(iso_c(D.mT.contiguous()), base.mT, rtol=1e-12, atol=1e-14)
    Q1, _ = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))
    Q2, _ = torch.linalg.qr(torch.randn(20, 20, dtype=torch.float64))
    torch.testing.assert_close(iso_c(Q1 @ D @ Q2), Q1 @ base @ Q2, rtol=1e-10, atol=1e-12)
    # nuclear norm preserved for full rank; <Iso, D> = s * mean(S)^2
    s = torch.linalg.svdvals(D)
    torch.testing.assert_close(torch.linalg.matrix_norm(base, "nuc"), s.sum())
    torch.testing.assert_close((base * D).sum(), 20 * s.mean() ** 2)
    # low-precision input: computed in fp32, returned in the input dtype
    out = iso_c(D.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), base, rtol=0.05, atol=0.01)


# ----------------------------------------------------------------------------- Iso-C (NS)
@pytest.mark.timeout(60)
def test_iso_c_ns_error_bound_fp32():
    """Default schedule meets NS_BOUND_FP32 on random, cond-1e3 and rank-deficient inputs."""
    cases = ((1.0, "geometric", None), (1e2, "geometric", None), (1e3, "geometric", None),
             (1e3, "flat", None), (1e3, "geometric", "half"), (1.0, "geometric", "half"))
    rows = ns_error_table(((96, 96), (128, 48), (48, 128)), cases, dtype=torch.float32, seed=7)
    worst = max(r["rel_error"] for r in rows)
    for r in rows:
        print(f"{r['shape']} cond={r['cond']:.0e} {r['spectrum']} rank={r['rank']}: "
              f"rel_error={r['rel_error']:.2e} mean_s_rel_error={r['mean_s_rel_error']:.1e}")
        assert r["iterations"] == ISO_NS_STEPS + ISO_NS_CLEANUP_STEPS
        assert r["dtype"] == "float32"
        assert r["rel_error"] < NS_BOUND_FP32, r
        assert r["mean_s_rel_error"] < 1e-5, r
    print(f"worst fp32 Iso-C NS error: {worst:.2e} (bound {NS_BOUND_FP32:.0e})")
    # plain random Gaussian matrices (cond ~ tens) are far below the bound
    for seed in range(3):
        D = torch.randn(80, 60, generator=torch.Generator().manual_seed(seed))
        assert iso_c_ns_error(D)["rel_error"] < 1e-5


@pytest.mark.timeout(60)
def test_iso_c_ns_error_bound_fp64_and_agreement():
    for m, n in ((64, 64), (80, 32)):
        for cond, spectrum, rank in ((1e3, "geometric", None), (1e3, "flat", None),
                                     (1e2, "geometric", min(m, n) // 2)):
            D, U, s, V = conditioned_matrix(m, n, cond, spectrum=spectrum, rank=rank, seed=m + n,
                                            dtype=torch.float64)
            err = iso_c_ns_error(D)
            assert err["rel_error"] < NS_BOUND_FP64, err
            assert err["rank"] == (rank or min(m, n))
            torch.testing.assert_close(iso_c(D, "ns"), _iso_formula(U, s, V), rtol=0, atol=1e-10)
    # fp32 NS agrees with the exact formula elementwise too
    D, U, s, V = conditioned_matrix(64, 40, 1e3, seed=1)
    torch.testing.assert_close(iso_c(D, "ns").double(), _iso_formula(U, s, V), rtol=0, atol=1e-5)


@pytest.mark.timeout(60)
def test_ns_schedule_choices_matter():
    """Muon's rough sign is not the polar factor; the cleanup step removes null-space noise."""
    D = conditioned_matrix(96, 96, 1e2, seed=11)[0]
    rough = iso_c_ns_error(D, ns_steps=5, coefficients="simple", cleanup_steps=0)
    assert rough["rel_error"] > 1e-2
    hard = conditioned_matrix(96, 96, 1e4, spectrum="flat", seed=2)[0]
    assert iso_c_ns_error(hard, ns_steps=10)["rel_error"] > 1e-2  # too few steps: unconverged
    assert iso_c_ns_error(hard)["rel_error"] < NS_BOUND_FP32  # the default converges it
    R = conditioned_matrix(96, 96, 10.0, rank=48, seed=12)[0]
    no_cleanup = iso_c_ns_error(R, cleanup_steps=0)["rel_error"]
    with_cleanup = iso_c_ns_error(R)["rel_error"]
    assert with_cleanup < NS_BOUND_FP32 < no_cleanup
    # enough cubic steps also reach the exact polar factor (slower: 30 steps)
    assert iso_c_ns_error(D, ns_steps=30, coefficients="cubic")["rel_error"] < NS_BOUND_FP32


@pytest.mark.timeout(30)
def test_polar_ns_frobenius_matches_newton_schulz():
    x = torch.randn(48, 24, generator=torch.Generator().manual_seed(0))
    for coeffs, steps in (("simple", 5), ("polar_express", 8), ("cubic", 6)):
        ours = polar_ns(x, steps, coeffs, cleanup_steps=0, normalization="frobenius")
        torch.testing.assert_close(ours, newton_schulz(x, steps, coeffs), rtol=1e-5, atol=1e-5)
    O = polar_ns(x)  # accurate: orthonormal columns
    torch.testing.assert_close(O.mT @ O, torch.eye(24), rtol=0, atol=1e-5)


@pytest.mark.timeout(30)
def test_iso_c_bad_inputs():
    with pytest.raises(ValueError, match="2-D"):
        iso_c(torch.randn(5))
    with pytest.raises(ValueError, match="2-D"):
        iso_c(torch.randn(2, 3, 4), "ns")
    with pytest.raises(ValueError, match="empty"):
        iso_c(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="floating"):
        iso_c(torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="inf/nan"):
        iso_c(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="inf/nan"):
        iso_c(torch.tensor([[1.0, float("inf")], [0.0, 1.0]]), "ns")
    with pytest.raises(ValueError, match="mode"):
        iso_c(torch.randn(3, 3), "qr")
    with pytest.raises(ValueError, match="only apply to mode='ns'"):
        iso_c(torch.randn(3, 3), "svd", ns_steps=5)
    with pytest.raises(ValueError, match="rank_rtol"):
        iso_c(torch.randn(3, 3), "ns", rank_rtol=1e-3)
    with pytest.raises(ValueError, match="ns_steps"):
        iso_c(torch.randn(3, 3), "ns", ns_steps=0)
    with pytest.raises(ValueError, match="coefficient"):
        iso_c(torch.randn(3, 3), "ns", coefficients="nope")
    with pytest.raises(ValueError, match="cleanup_steps"):
        iso_c(torch.randn(3, 3), "ns", cleanup_steps=-1)
    with pytest.raises(TypeError):
        iso_c([[1.0, 2.0]])


# ----------------------------------------------------------------------------- outer step
def _inner_run(seed=0, steps=10, lr=1e-2):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                              torch.nn.Linear(32, 6))
    glob = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    for _ in range(steps):
        loss = net(torch.randn(16, 12)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return glob, {k: v.detach().clone() for k, v in net.named_parameters()}


@pytest.mark.timeout(30)
def test_k1_diloco_lr1_mu0_reproduces_inner_run():
    glob, local = _inner_run()
    # fp64 pseudo-gradient: bitwise exact for fp32 params
    for nesterov in (True, False):
        D = pseudo_gradient(glob, local, dtype=torch.float64)
        opt = OuterOptimizer(glob, "diloco", lr=1.0, momentum=0.0, nesterov=nesterov)
        new = opt.step(D)
        assert list(new) == list(local)
        for k in local:
            assert new[k].dtype == torch.float32
            assert torch.equal(new[k], local[k]), k
        torch.testing.assert_close(mean_pseudo_gradient(glob, [local], dtype=torch.float64), D,
                                   rtol=0, atol=0)
    # default fp32 pseudo-gradient: exact where the subtraction is (Sterbenz), else <= 1 ulp
    D32 = pseudo_gradient(glob, local)
    new = OuterOptimizer(glob, "diloco", lr=1.0, momentum=0.0).step(D32)
    for k in local:
        g, l_ = glob[k], local[k]
        sterbenz = (l_ / 2 <= g) & (g <= 2 * l_) | (l_ * 2 <= g) & (g <= l_ / 2)
        assert torch.equal(new[k][sterbenz], l_[sterbenz]), k
        ulp = torch.finfo(torch.float32).eps * torch.maximum(g.abs(), l_.abs())
        assert ((new[k] - l_).abs() <= ulp).all(), k
    # list container works the same way
    keys = list(glob)
    newl = OuterOptimizer([glob[k] for k in keys], "diloco", lr=1.0, momentum=0.0).step(
        pseudo_gradient([glob[k] for k in keys], [local[k] for k in keys], dtype=torch.float64))
    assert isinstance(newl, list) and all(torch.equal(a, local[k]) for a, k in zip(newl, keys))
    # the optimizer cloned the globals: the caller's dict is untouched
    assert not torch.equal(glob["0.weight"], local["0.weight"])


def _params64():
    g = torch.Generator().manual_seed(21)
    return {"w": torch.randn(7, 5, generator=g, dtype=torch.float64),
            "b": torch.randn(5, generator=g, dtype=torch.float64),
            "conv": torch.randn(2, 3, 4, generator=g, dtype=torch.float64)}


def _deltas64(k):
    g = torch.Generator().manual_seed(100 + k)
    return {name: 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            for name, p in _params64().items()}


def _svd_iso(D):
    U, S, Vh = torch.linalg.svd(D, full_matrices=False)
    return S.mean() * U @ Vh


@pytest.mark.timeout(30)
def test_diloco_two_steps_by_hand():
    theta = _params64()
    opt = OuterOptimizer(theta, "diloco")
    assert (opt.lr, opt.momentum) == (0.7, 0.9) == tuple(OUTER_DEFAULTS["diloco"].values())
    lr, mu = 0.7, 0.9
    m = {k: torch.zeros_like(v) for k, v in theta.items()}
    for step in range(2):
        D = _deltas64(step)
        out = opt.step(D)
        for k in theta:
            m[k] = mu * m[k] + D[k]
            theta[k] = theta[k] - lr * (D[k] + mu * m[k])
            torch.testing.assert_close(out[k], theta[k], rtol=0, atol=1e-15)
    assert opt.step_count == 2 and opt.iso_names == []


@pytest.mark.timeout(30)
def test_isoloco_orderings_two_steps_by_hand():
    lr, mu = 1.8, 0.8
    D1, D2 = _deltas64(0), _deltas64(1)
    init = _params64()

    # order="iso_first": m <- mu m + Iso(D); u = Iso + mu m
    th = {k: v.clone() for k, v in init.items()}
    m = {k: torch.zeros_like(v) for k, v in th.items()}
    iso_first = []
    for D in (D1, D2):
        for k in th:
            g = _svd_iso(D[k]) if k == "w" else D[k]
            m[k] = mu * m[k] + g
            th[k] = th[k] - lr * (g + mu * m[k])
        iso_first.append({k: v.clone() for k, v in th.items()})

    # order="momentum_first": m <- mu m + D; u = Iso(D + mu m)
    th = {k: v.clone() for k, v in init.items()}
    m = {k: torch.zeros_like(v) for k, v in th.items()}
    mom_first = []
    for D in (D1, D2):
        for k in th:
            m[k] = mu * m[k] + D[k]
            u = D[k] + mu * m[k]
            th[k] = th[k] - lr * (_svd_iso(u) if k == "w" else u)
        mom_first.append({k: v.clone() for k, v in th.items()})

    for order, expected in (("iso_first", iso_first), ("momentum_first", mom_first)):
        opt = OuterOptimizer(init, "isoloco", order=order)
        assert (opt.lr, opt.momentum) == (lr, mu) and opt.iso_names == ["w"]
        for D, exp in zip((D1, D2), expected):
            out = opt.step(D)
            for k in exp:
                torch.testing.assert_close(out[k], exp[k], rtol=0, atol=1e-12)

    # step 1: identical (Iso-C is positively homogeneous and u = (1 + mu) D);
    # step 2: the matrix differs, the non-2-D parameters do not
    torch.testing.assert_close(iso_first[0]["w"], mom_first[0]["w"], rtol=0, atol=1e-12)
    assert (iso_first[1]["w"] - mom_first[1]["w"]).abs().max() > 1e-3
    for k in ("b", "conv"):
        torch.testing.assert_close(iso_first[1][k], mom_first[1][k], rtol=0, atol=1e-14)

    # momentum 0: both orderings are the same map theta - lr Iso(D)
    a = OuterOptimizer(init, "isoloco", momentum=0.0)
    b = OuterOptimizer(init, "isoloco", momentum=0.0, order="momentum_first")
    for D in (D1, D2):
        oa, ob = a.step(D), b.step(D)
        for k in oa:
            torch.testing.assert_close(oa[k], ob[k], rtol=0, atol=1e-13)


@pytest.mark.timeout(30)
def test_isoloco_ns_mode_filter_and_islands():
    init = {"w": torch.randn(24, 16), "v": torch.randn(16, 24), "b": torch.randn(16)}
    islands = [{k: v - 0.05 * torch.randn_like(v) for k, v in init.items()} for _ in range(3)]
    D = mean_pseudo_gradient(init, islands)
    for k in init:
        manual = sum(init[k] - isl[k] for isl in islands) / 3
        torch.testing.assert_close(D[k], manual, rtol=1e-6, atol=1e-7)
    svd = OuterOptimizer(init, "isoloco").step(D)
    ns = OuterOptimizer(init, "isoloco", iso_mode="ns").step(D)
    for k in init:
        torch.testing.assert_close(ns[k], svd[k], rtol=0, atol=1e-5)
    # iso_filter: "v" excluded -> plain Nesterov with the isoloco hyperparameters
    opt = OuterOptimizer(init, "isoloco", iso_filter=lambda name, p: name == "w")
    assert opt.iso_names == ["w"]
    out = opt.step(D)
    torch.testing.assert_close(out["v"], init["v"] - 1.8 * (1 + 0.8) * D["v"])
    torch.testing.assert_close(out["w"], svd["w"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kw", [dict(method="isoloco"), dict(method="isoloco", iso_mode="ns"),
                                dict(method="isoloco", order="momentum_first"),
                                dict(method="diloco", nesterov=False)])
def test_state_dict_round_trip(kw):
    init = {"w": torch.randn(12, 8), "b": torch.randn(8), "e": torch.randn(8, 20)}
    deltas = [{k: 0.1 * torch.randn_like(v) for k, v in init.items()} for _ in range(3)]
    a = OuterOptimizer(init, **kw)
    for D in deltas[:2]:
        a.step(D)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    b = OuterOptimizer({k: torch.zeros_like(v) for k, v in init.items()}, **kw)
    b.load_state_dict(state)
    assert b.step_count == 2
    sa, sb = a.step(deltas[2]), b.step(deltas[2])
    for k in init:
        assert torch.equal(sa[k], sb[k]), k
    for k in init:
        assert torch.equal(a.state_dict()["momentum_buffer"][k], b.state_dict()["momentum_buffer"][k])
    # hyperparameters are restored from the state
    c = OuterOptimizer(init, **kw, **({} if "lr" in kw else {"lr": 0.123}))
    c.load_state_dict(state)
    assert c.lr == a.lr
    # mismatches are refused and leave the optimizer unchanged
    other = "diloco" if kw["method"] == "isoloco" else "isoloco"
    with pytest.raises(ValueError, match="method"):
        OuterOptimizer(init, other).load_state_dict(state)
    with pytest.raises(ValueError, match="names"):
        OuterOptimizer({"x": torch.zeros(3)}, **kw).load_state_dict(state)
    bad = copy.deepcopy(state)
    bad["momentum"] = 1.5
    with pytest.raises(ValueError, match="momentum"):
        b.load_state_dict(bad)
    assert b.momentum == a.momentum
    bad = copy.deepcopy(state)
    del bad["params"]
    with pytest.raises(ValueError, match="lacks"):
        b.load_state_dict(bad)


@pytest.mark.timeout(30)
def test_outer_bad_inputs():
    init = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    D = {k: torch.zeros_like(v) for k, v in init.items()}
    with pytest.raises(ValueError, match="method"):
        OuterOptimizer(init, "adam")
    with pytest.raises(ValueError, match="lr"):
        OuterOptimizer(init, lr=-1.0)
    with pytest.raises(ValueError, match="momentum"):
        OuterOptimizer(init, momentum=1.0)
    with pytest.raises(ValueError, match="order"):
        OuterOptimizer(init, order="sideways")
    with pytest.raises(ValueError, match="only exists for method='isoloco'"):
        OuterOptimizer(init, "diloco", order="momentum_first")
    with pytest.raises(ValueError, match="iso_mode"):
        OuterOptimizer(init, iso_mode="eig")
    with pytest.raises(ValueError, match="iso_mode='ns'"):
        OuterOptimizer(init, ns_steps=10)
    with pytest.raises(ValueError, match="ns_steps"):
        OuterOptimizer(init, iso_mode="ns", ns_steps=0)
    with pytest.raises(ValueError, match="cleanup_steps"):
        OuterOptimizer(init, iso_mode="ns", ns_cleanup_steps=-1)
    with pytest.raises(ValueError, match="Iso-C needs 2-D"):
        OuterOptimizer(init, iso_filter=lambda name, p: True)
    with pytest.raises(ValueError, match="no parameters"):
        OuterOptimizer({})
    with pytest.raises(TypeError):
        OuterOptimizer(torch.randn(3, 3))
    with pytest.raises(ValueError, match="floating"):
        OuterOptimizer({"i": torch.ones(3, dtype=torch.int64)})
    opt = OuterOptimizer(init)
    before = {k: v.clone() for k, v in opt.params.items()}
    with pytest.raises(ValueError, match="missing"):
        opt.step({"w": D["w"]})
    with pytest.raises(ValueError, match="unexpected"):
        opt.step({**D, "z": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        opt.step({"w": torch.zeros(3, 4), "b": D["b"]})
    with pytest.raises(TypeError, match="dict"):
        opt.step([D["w"], D["b"]])
    nan = {"w": D["w"].clone(), "b": D["b"].clone()}
    nan["b"][0] = float("nan")
    with pytest.raises(ValueError, match="inf/nan"):
        opt.step(nan)
    assert opt.step_count == 0
    for k in init:  # nothing was modified by the refused steps
        assert torch.equal(opt.params[k], before[k])
    lst = OuterOptimizer([init["w"], init["b"]])
    with pytest.raises(ValueError, match="tensors"):
        lst.step([D["w"]])
    with pytest.raises(ValueError, match="keys"):
        pseudo_gradient(init, {"w": init["w"]})
    with pytest.raises(ValueError, match="non-empty"):
        mean_pseudo_gradient(init, [])
