"""AdaMuon / NorMuon second moments (docs/variants.md#adaptive-second-moments): the maths and
the reference ``Muon(moment2=...)`` against emerging_optimizers' ``AdaptiveMuon``, the code
Megatron-Core 0.19.2's ``--optimizer adaptive_muon`` builds."""

import pytest
import torch

from megatron_muon import Muon
from megatron_muon.core.moment2 import (check_moment2_hyperparameters, moment2_expand,
                                        moment2_init, moment2_normalize, moment2_reduce)
from megatron_muon.core.units import qkv_units
from megatron_muon.testing.peers import import_peer

pytestmark = pytest.mark.timeout(120)  # importing Megatron-Core on a loaded CI machine


@pytest.mark.parametrize("method", ["adamuon", "normuon"])
@pytest.mark.parametrize("shape", [(32, 16), (16, 48)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_reference_matches_emerging_optimizers(method, shape, nesterov):
    """Same tensors through ``Muon(moment2=...)`` and ``AdaptiveMuon`` (fp32 NS, quintic,
    spectral scale, decoupled weight decay), 4 steps."""
    # a skip without emerging_optimizers; a failure in the CI lane that installs it
    eo = import_peer("emerging_optimizers.orthogonalized_optimizers.adaptive_muon")
    torch.manual_seed(3)
    w0 = torch.randn(*shape)
    a = torch.nn.Parameter(w0.clone())
    b = torch.nn.Parameter(w0.clone())
    ours = Muon([a], lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1, ns_steps=5,
                coefficient_type="quintic", scale_mode="spectral", extra_scale_factor=0.5,
                moment2=method, beta2=0.9, moment2_eps=1e-8)
    ref = eo.AdaptiveMuon([b], lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=nesterov,
                          fp32_matmul_prec="highest", coefficient_type="quintic",
                          num_ns_steps=5, scale_mode="spectral", extra_scale_factor=0.5,
                          moment2_method=method, beta2=0.9, eps=1e-8)
    for step in range(4):
        g = torch.randn(*shape)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        # The two differ only below fp32 rounding: AdaptiveMuon's momentum is an EMA
        # ((1 - mu) times ours; NS is scale-invariant up to its 1e-7 normalisation eps),
        # it normalises by max(||U||, eps) where we use ||U|| + eps, and decays by
        # p + (-lr wd) p instead of p (1 - lr wd).  Each is a few fp32 ulps (1.2e-7
        # relative) per op; 5 NS steps of 16..48-long dot products grow that to ~1e-5
        # of the update, which the per-element second moment passes on unchanged.
        rel = ((a - b).norm() / (b - w0).norm()).item()
        assert rel < 1e-5, (step, rel)
        state = ref.state[b]["moment2_buffer"]
        mine = ours.state[a]["moment2"][0]
        assert mine.shape == state.shape
        # V is an EMA of O^2: an absolute error ~1e-5 max|O| on O (above) moves V by
        # ~2 (1 - beta2) 1e-5 max O^2 <= 2e-5 max V, so 1e-4 max V leaves a 5x margin
        # (near-zero elements of O make a relative bound meaningless).
        assert torch.allclose(mine, state, rtol=1e-4, atol=1e-4 * state.max().item()), step


def test_moment2_by_hand():
    """One NorMuon and one AdaMuon step written out (a wide and a tall unit)."""
    o = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, 1.0]])  # wide: per-column state
    v = moment2_init(2, 3, "normuon")
    assert v.shape == (1, 3)
    d = moment2_normalize(o, v, "normuon", 0.5, 1e-8)
    col = (o ** 2).mean(0, keepdim=True) * 0.5
    assert torch.allclose(v, col)
    raw = o / col.sqrt()
    assert torch.allclose(d, raw * o.norm() / raw.norm())
    vt = moment2_init(3, 2, "normuon")
    assert vt.shape == (3, 1)
    va = moment2_init(2, 3, "adamuon")
    da = moment2_normalize(o, va, "adamuon", 0.75, 1e-8)
    assert torch.allclose(va, 0.25 * o ** 2)
    assert torch.allclose(da, o / ((0.25 * o ** 2).sqrt() + 1e-8))
    for method, st in (("normuon", v), ("normuon", vt), ("adamuon", va)):
        m, n = (2, 3) if st is not vt else (3, 2)
        assert torch.equal(moment2_reduce(moment2_expand(st, m, n).contiguous(), method), st)


def test_moment2_is_per_unit():
    """With the QKV split each unit (Q, K, V) has its own state and its own Frobenius match."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 8))
    units = qkv_units((16, 8), num_query_groups=2, heads_per_group=2, head_dim=2)
    opt = Muon([p], lr=0.1, moment2="normuon", units={p: units})
    p.grad = torch.randn(16, 8)
    opt.step()
    # Q is 8 x 8 (per-row state), K and V are 4 x 8 (wide: per-column state)
    assert [tuple(s.shape) for s in opt.state[p]["moment2"]] == [(8, 1), (1, 8), (1, 8)]


@pytest.mark.parametrize("args,match", [
    (("bogus", 0.95, 1e-8), "unknown moment2 method"),
    (("adamuon", 1.0, 1e-8), "beta2 must be in"),
    (("normuon", 0.9, 0.0), "eps must be > 0"),
])
def test_bad_moment2_settings(args, match):
    with pytest.raises(ValueError, match=match):
        check_moment2_hyperparameters(*args)
    with pytest.raises(ValueError, match=match):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], moment2=args[0], beta2=args[1],
             moment2_eps=args[2])


# --------------------------------------------------------------------------- DMuon
# One 4-rank launch runs every DMuon case (train_variants) and one process every reference
# (reference_variants): DP4, PP2 x DP2, matrix placement (TP2 x DP2), ZeRO-3 (DP4), and
# checkpoint resume (bitwise on the same layout; resharded DP4 -> TP2 x DP2, compared with
# the reference like the other cases).
M2_STEPS, M2_SAVE = 3, 2
# AdaMuon's denominator sqrt(V) + eps: a larger eps than Megatron's 1e-8 keeps the comparison
# well-conditioned (see ADAMUON_ATOL); NorMuon keeps Megatron's default.
ADAMUON_EPS = 1e-2


def _dmuon_cases(tmp_normuon: str, tmp_adamuon: str) -> list:
    from test_dmuon import LAYOUTS, OPT, ZERO3_DDP

    def lay(name):
        tp, pp, _, m = LAYOUTS[name]
        return dict(tp=tp, pp=pp, cfg={"num_microbatches": m})

    nor = dict(OPT, dmuon_moment2="normuon")
    ada = dict(OPT, dmuon_moment2="adamuon", adaptive_muon_eps=ADAMUON_EPS)
    z3 = dict(ada, dmuon_placement="matrix", dmuon_zero3=True)
    return [  # (name, method, variant)
        ("dp4", "normuon", dict(lay("dp4"), opt=nor,
                                checkpoint=dict(save=tmp_normuon, save_at=M2_SAVE))),
        ("dp4-resume", "normuon", dict(lay("dp4"), opt=nor, checkpoint=dict(load=tmp_normuon))),
        # resharded DP4 -> TP2 x DP2 (its last step runs at TP2 on the loaded state)
        ("tp2dp2-reshard", "normuon", dict(lay("tp2dp2"), opt=nor,
                                           checkpoint=dict(load=tmp_normuon))),
        ("pp2dp2", "adamuon", dict(lay("pp2dp2"), opt=ada)),
        ("matrix-tp2dp2", "adamuon", dict(lay("tp2dp2"), opt=dict(ada, dmuon_placement="matrix"))),
        ("zero3-dp4", "adamuon", dict(lay("dp4"), opt=z3, ddp=ZERO3_DDP,
                                      checkpoint=dict(save=tmp_adamuon, save_at=M2_SAVE))),
        ("zero3-dp4-resume", "adamuon", dict(lay("dp4"), opt=z3, ddp=ZERO3_DDP,
                                             checkpoint=dict(load=tmp_adamuon))),
    ]


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_dmuon_moment2_equals_reference_and_resumes(tmp_path):
    from megatron_muon.megatron.params import is_muon_matrix
    from megatron_muon.testing.launch import run_ranks
    from test_dmuon import EPS32, K, OPT, fp32_atol, merged_params

    # AdaMuon, per element: D = O / (sqrt(V) + eps), V an EMA of O^2 whose weights sum to
    # <= 1.  An error dO (|dO| <= d every step) moves sqrt(V) by <= d (Cauchy-Schwarz on the
    # EMA), so |dD| <= d / (sqrt(V) + eps) * (1 + |O| / (sqrt(V) + eps)) and, as
    # V >= (1 - beta2) O^2, <= d (1 + 1 / sqrt(1 - beta2)) / eps.  d: the typical error of
    # O, 1.2 sqrt(2 K) EPS32 (tests/test_dmuon.py's ADAM_ATOL takes the typical sum error
    # too; the worst case 2 K would be 16x looser).  Each step moves a parameter by
    # lr sqrt(128) D (scale of the largest unit), so after M2_STEPS steps:
    beta2 = 0.95  # adaptive_muon_beta2's default
    d = 1.2 * (2 * K) ** 0.5 * EPS32
    adamuon_atol = M2_STEPS * OPT["lr"] * 128 ** 0.5 * d * (1 + (1 - beta2) ** -0.5) / ADAMUON_EPS

    def atol(method, n, p):
        if method == "adamuon" and is_muon_matrix(n, p):
            return adamuon_atol
        return fp32_atol(n, p)

    (tmp_path / "normuon").mkdir()
    (tmp_path / "adamuon").mkdir()
    cases = _dmuon_cases(str(tmp_path / "normuon"), str(tmp_path / "adamuon"))
    per_rank = run_ranks("megatron_muon.testing.workers:train_variants", 4,
                         dict(variants=[v for _, _, v in cases], steps=M2_STEPS,
                              optimizer="dmuon"), timeout=840)
    runs = {name: merged_params([r[i] for r in per_rank])
            for i, (name, _, _) in enumerate(cases)}
    refs = run_ranks("megatron_muon.testing.reference:reference_variants", 1, dict(variants=[
        dict(cfg={"num_microbatches": 4}, dp_size=1, steps=M2_STEPS,
             opt=dict(OPT, dmuon_moment2=m, adaptive_muon_eps=ADAMUON_EPS if m == "adamuon"
                      else 1e-8)) for m in (None, "normuon", "adamuon")]),
        timeout=600)[0]
    plain, ref = refs[0]["params"], {"normuon": refs[1]["params"], "adamuon": refs[2]["params"]}
    # the second moment changes the update far beyond the tolerance (not a vacuous test)
    for m in ref:
        assert max((ref[m][n] - plain[n]).abs().max().item() / atol(m, n, plain[n])
                   for n in plain if is_muon_matrix(n, plain[n])) > 10, m
    for name, method, _ in cases:
        if name.endswith("-resume"):
            continue
        got = runs[name]
        assert set(got) == set(ref[method])
        # NorMuon: fp32_atol, tests/test_dmuon.py's worst-case bound for another summation
        # order (relative error of O <= 2 K EPS32).  D = c r_i O_ij: the row factor r_i and
        # the norm match c are ratios of root-mean-squares of O (rows, whole unit) that
        # carry O's relative error, so D's error stays of the order of O's as long as no
        # row of O is far smaller than the others; the worst-case factor 2 K (16x the
        # typical sum error) is the margin for that.
        worst = max(((got[n] - ref[method][n]).abs().max().item() / atol(method, n, got[n]), n)
                    for n in got)
        print(f"moment2 {name} {method}: worst {worst[0]:.3f} x tolerance ({worst[1]})")
        assert worst[0] < 1, (name, method, worst)
    # resume: bitwise on the same layout (DMuon default placement and ZeRO-3)
    for name in ("dp4", "zero3-dp4"):
        a, b = runs[name], runs[name + "-resume"]
        for n in a:
            assert torch.equal(a[n], b[n]), (name, n)


# --------------------------------------------------------------------------- config / flags
@pytest.mark.parametrize("kwargs,match", [
    (dict(dmuon_moment2="namo"), "dmuon_moment2 'namo' is unknown; choose one of adamuon, normuon"),
    (dict(dmuon_moment2="normuon", adaptive_muon_beta2=1.0), "adaptive_muon_beta2 must be in"),
    (dict(dmuon_moment2="adamuon", adaptive_muon_eps=0.0), "adaptive_muon_eps must be a finite"),
    (dict(dmuon_moment2="adamuon", dmuon_overlap="on"), "dmuon_overlap='on' does not work with "
                                                         "dmuon_moment2='adamuon'"),
])
def test_bad_moment2_config(kwargs, match):
    from megatron_muon import DMuonOptimizerConfig

    with pytest.raises(ValueError, match=match):
        DMuonOptimizerConfig(use_distributed_optimizer=True, **kwargs)


def test_moment2_flags_and_overlap_policy():
    import argparse

    from megatron_muon.megatron.arguments import (DMuonArgumentError, add_dmuon_args,
                                                  dmuon_config_from_args, validate_dmuon_args)

    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    add_dmuon_args(p)
    a = p.parse_args(["--optimizer", "dmuon", "--use-distributed-optimizer", "--dmuon-moment2",
                      "normuon", "--adaptive-muon-beta2", "0.9", "--adaptive-muon-eps", "1e-6"])
    c = dmuon_config_from_args(validate_dmuon_args(a))
    assert (c.dmuon_moment2, c.adaptive_muon_beta2, c.adaptive_muon_eps) == ("normuon", 0.9, 1e-6)
    # under Megatron-LM (its OptimizerConfig as the base) the flags still win
    from megatron.core.optimizer import OptimizerConfig

    c = dmuon_config_from_args(a, OptimizerConfig(lr=1e-3, use_distributed_optimizer=True))
    assert (c.dmuon_moment2, c.adaptive_muon_beta2, c.adaptive_muon_eps) == ("normuon", 0.9, 1e-6)
    # 'auto' would speculate with PP > 1; with a second moment it is off
    assert c.overlap_policy(2) == "off"
    assert p.parse_args([]).dmuon_moment2 is None
    bad = p.parse_args(["--optimizer", "dmuon", "--use-distributed-optimizer", "--dmuon-moment2",
                        "adamuon", "--dmuon-overlap", "on"])
    with pytest.raises(DMuonArgumentError, match="--dmuon-overlap on does not work with "
                                                 "--dmuon-moment2 adamuon"):
        validate_dmuon_args(bad)
