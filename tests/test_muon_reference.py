"""Reference Muon (docs/design.md#muon) against torch.optim.Muon, the SVD and hand-made unit splits."""

import math

import pytest
import torch

from megatron_muon import Muon, newton_schulz
from megatron_muon.core.newton_schulz import muon_scale
from megatron_muon.core.units import (expert_units, extract_unit, gate_up_units, insert_unit,
                                 qkv_units, unit_flat_indices)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("shape", [(32, 16), (16, 48), (24, 24)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon(shape, nesterov):
    """Same settings (simple coefficients, bf16 NS, shape_scaling = torch's 'original')."""
    torch.manual_seed(1)
    w0 = torch.randn(*shape)
    a = torch.nn.Parameter(w0.clone())
    b = torch.nn.Parameter(w0.clone())
    ours = Muon([a], lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1, ns_steps=5,
                coefficient_type="simple", scale_mode="shape_scaling", ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon([b], lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1,
                           ns_steps=5, adjust_lr_fn="original")
    for step in range(4):
        g = torch.randn(*shape)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        rel = (a - b).norm() / (b - w0).norm()
        assert rel < 2e-2, (step, rel)  # bf16 NS on both sides


def test_cubic_converges_to_polar_factor():
    x = torch.randn(40, 24, dtype=torch.float64)
    u, _, vt = torch.linalg.svd(x, full_matrices=False)
    o = newton_schulz(x, steps=40, coefficients="cubic")
    assert torch.allclose(o, u @ vt, atol=1e-8)


def test_update_rule_by_hand():
    """One step of the Muon update rule written out with explicit SVD-free maths."""
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(8, 12))
    w0 = w.detach().clone()
    g = torch.randn(8, 12)
    opt = Muon([w], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.5, ns_steps=3,
               coefficient_type="quintic", scale_mode="spectral", extra_scale_factor=0.2)
    w.grad = g
    opt.step()
    m = g  # M = 0.9 * 0 + g
    u = g + 0.9 * m
    expected = w0 * (1 - 0.1 * 0.5) - 0.1 * 0.2 * math.sqrt(12) * newton_schulz(
        u, steps=3, coefficients="quintic")
    assert torch.allclose(w.detach(), expected, atol=1e-6)


@pytest.mark.parametrize("groups,heads,head_dim", [(2, 4, 8), (4, 4, 4), (1, 8, 4)])
def test_qkv_split_matches_hand_split(groups, heads, head_dim):
    """GQA (groups < heads), MHA (groups == heads) and MQA."""
    per = heads // groups
    rows = groups * (per + 2) * head_dim
    w = torch.randn(rows, 16)
    q_u, k_u, v_u = qkv_units(w.shape, groups, per, head_dim)
    blocks = w.view(groups, (per + 2) * head_dim, 16)
    q = blocks[:, : per * head_dim].reshape(-1, 16)
    k = blocks[:, per * head_dim: (per + 1) * head_dim].reshape(-1, 16)
    v = blocks[:, (per + 1) * head_dim:].reshape(-1, 16)
    assert torch.equal(extract_unit(w, q_u), q)
    assert torch.equal(extract_unit(w, k_u), k)
    assert torch.equal(extract_unit(w, v_u), v)
    assert torch.equal(w.reshape(-1)[unit_flat_indices(k_u)], k.reshape(-1))
    out = torch.zeros_like(w)
    for u in (q_u, k_u, v_u):
        insert_unit(out, u, extract_unit(w, u))
    assert torch.equal(out, w)


def test_qkv_split_changes_the_update():
    """Per-block NS is not whole-matrix NS (the split really happens)."""
    torch.manual_seed(3)
    a = torch.nn.Parameter(torch.randn(64, 16))
    b = torch.nn.Parameter(a.detach().clone())
    units = {a: qkv_units(a.shape, 2, 2, 8)}
    g = torch.randn(64, 16)
    for p, u in ((a, units), (b, None)):
        p.grad = g.clone()
        Muon([p], lr=0.1, units=u).step()
    assert (a - b).abs().max() > 1e-3


def test_expert_and_gate_up_units():
    w = torch.randn(12, 6)
    ex = expert_units(w.shape, 3, dim=1)
    assert [tuple(extract_unit(w, u).shape) for u in ex] == [(12, 2)] * 3
    assert torch.equal(extract_unit(w, ex[1]), w[:, 2:4])
    g, u = gate_up_units(w.shape)
    assert torch.equal(extract_unit(w, g), w[:6]) and torch.equal(extract_unit(w, u), w[6:])


def test_scale_modes():
    assert muon_scale(64, 16, "spectral") == 8.0
    assert muon_scale(64, 16, "shape_scaling") == 2.0
    assert muon_scale(16, 64, "shape_scaling") == 1.0
    assert muon_scale(64, 16, "unit_rms_norm", 0.5) == 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(coefficient_type="bogus"), "unknown Newton-Schulz coefficient set"),
    (dict(scale_mode="bogus"), "unknown muon scale mode"),
    (dict(ns_steps=0), "ns_steps must be an integer >= 1"),
    (dict(momentum=1.5), "momentum must be in"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_non_matrix_parameter_rejected():
    with pytest.raises(ValueError, match="only takes 2-D parameters"):
        Muon([torch.nn.Parameter(torch.randn(4))])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_rejected(bad):
    p = torch.nn.Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4)
    p.grad[1, 2] = bad
    with pytest.raises(ValueError, match="non-finite"):
        Muon([p]).step()
