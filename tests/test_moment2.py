"""AdaMuon / NorMuon second moments (docs/variants.md#adaptive-second-moments): the maths and
the reference ``Muon(moment2=...)`` against emerging_optimizers' ``AdaptiveMuon``, the code
Megatron-Core 0.19.2's ``--optimizer adaptive_muon`` builds."""

import pytest
import torch

from megatron_muon import Muon
from megatron_muon.core.moment2 import (check_moment2_hyperparameters, moment2_expand,
                                        moment2_init, moment2_normalize, moment2_reduce)
from megatron_muon.core.units import qkv_units

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("method", ["adamuon", "normuon"])
@pytest.mark.parametrize("shape", [(32, 16), (16, 48)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_reference_matches_emerging_optimizers(method, shape, nesterov):
    """Same tensors through ``Muon(moment2=...)`` and ``AdaptiveMuon`` (fp32 NS, quintic,
    spectral scale, decoupled weight decay), 4 steps."""
    eo = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers.adaptive_muon")
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
