"""Megatron's Muon extras under dmuon: Lion for the non-matrix parameters
(``muon_scalar_optimizer='lion'``) against a single-process Lion, with checkpoint resume,
and QK-clip against single-process Muon + QK-clip.  All distributed runs share one 2-rank
launch and all references one 1-rank launch (CI time).

Exactness.  Lion's update is lr * sign(c), so any rounding difference in a gradient can flip
a sign and move a parameter by 2 lr: a tolerance would have to be 2 lr and would test
little.  The comparisons here are therefore bitwise, on a layout whose gradients are
bitwise those of the reference: DP2 with one microbatch per rank against one process with
the same two microbatches.  Every gradient element is then g0 / 2 + g1 / 2 in both (the
loss scale 1 / num_microbatches and the DP average 1 / 2 are powers of two, exact in fp32,
and a two-term sum is the same in either order), and Lion is element-wise, so a DP shard's
update is the whole tensor's.  ``dmuon_adam_params='.*'`` gives every parameter to the Lion
subset: Newton-Schulz (batched on the owner, unbatched in the reference) rounds differently,
and that difference would reach the Lion parameters through the next step's gradients.
"""

import tempfile
from pathlib import Path

import pytest
import torch

from megatron_muon.core.lion import Lion, lion_update
from megatron_muon.testing.launch import run_ranks
from megatron_muon.testing.peers import import_peer

LION = dict(muon_scalar_optimizer="lion", lion_beta1=0.9, lion_beta2=0.99, lr=2e-3,
            weight_decay=0.1, dmuon_adam_params=".*")
CFG = {"num_microbatches": 1}
STEPS, SAVE_AT = 4, 2


def test_lion_update_is_the_papers_update():
    """core.lion against the paper's formulas, written out here (fp64, so rounding cannot
    flip a sign): c = b1 m + (1 - b1) g; p <- p - lr (sign(c) + wd p); m <- b2 m + (1 - b2) g."""
    torch.manual_seed(0)
    b1, b2, lr, wd = 0.9, 0.99, 1e-2, 0.1
    p = torch.randn(64, 33, dtype=torch.float64)
    m = torch.randn_like(p)
    ref_p, ref_m = p.clone(), m.clone()
    for _ in range(3):
        g = torch.randn_like(p)
        lion_update(p, g, m, lr=lr, weight_decay=wd, beta1=b1, beta2=b2)
        c = b1 * ref_m + (1 - b1) * g
        ref_p = ref_p - lr * (torch.sign(c) + wd * ref_p)
        ref_m = b2 * ref_m + (1 - b2) * g
    # p: the paper's (1 - lr wd) p - lr sign(c) vs our p - lr wd p - lr sign(c) differ by a
    # few fp64 roundings of numbers <= 5 per step: 3 steps x 4 x 2^-52 x 5 < 1e-14.
    assert torch.allclose(p, ref_p, rtol=0, atol=1e-14)
    # m: lerp vs b2 m + (1 - b2) g, a few fp64 roundings of |m| <= 5 per step.
    assert torch.allclose(m, ref_m, rtol=0, atol=1e-14)
    # a weight-decay-free step of a zero gradient and zero state leaves p alone (sign(0) = 0)
    q = torch.ones(3)
    q.grad = torch.zeros(3)
    Lion([q], lr=1.0, weight_decay=0.0).step()
    assert torch.equal(q, torch.ones(3))


def test_lion_matches_megatron_cores_lion():
    """Megatron-Core 0.19's --optimizer lion / --muon-scalar-optimizer lion is
    emerging_optimizers' Lion: ours gives the same parameters bitwise (same op order)."""
    # a skip without emerging_optimizers; a failure in the CI lane that installs it
    eo = import_peer("emerging_optimizers.scalar_optimizers.lion")
    torch.manual_seed(0)
    a = torch.randn(16, 8, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    ours = Lion([a], lr=1e-2, betas=(0.95, 0.98), weight_decay=0.1)
    theirs = eo.Lion([b], lr=1e-2, betas=(0.95, 0.98), weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(16, 8)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.equal(a, b)
    # emerging_optimizers torch.compiles its update, which may fuse the state's lerp into
    # one rounding where eager torch rounds twice: <= 1 fp32 ulp of |m| per step (older
    # differences shrink by beta2 < 1), so 3 steps stay within 3 eps32 max |m|.
    m_ours, m_theirs = ours.state[a]["exp_avg"], theirs.state[b]["exp_avg"]
    atol = 3 * torch.finfo(torch.float32).eps * m_theirs.abs().max().item()
    assert torch.allclose(m_ours, m_theirs, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_clip_maths_is_megatrons(dtype):
    """core.qk_clip on a whole fused QKV weight and on flat DP-shard slices of it equals
    Megatron-Core's own SelfAttention._clip_linear_qkv bitwise (GQA: 8 heads, 2 groups;
    some groups above the threshold, some not)."""
    from types import SimpleNamespace

    from megatron.core.transformer.attention import SelfAttention

    from megatron_muon.core.qk_clip import qk_clip_eta, qkv_row_scales, scale_flat_rows

    torch.manual_seed(0)
    heads, groups, d, hidden, tau, alpha = 8, 2, 4, 16, 1.0, 0.3
    w = torch.randn(groups * (heads // groups + 2) * d, hidden).to(dtype)
    max_logits = torch.tensor([0.5, 3.0, 0.2, 0.9, 0.1, 0.4, 0.7, 0.95])  # group 1: <= tau
    eta = qk_clip_eta(max_logits, groups, tau)
    assert eta is not None and eta[0] < 1 and eta[1] == 1
    megatron = SimpleNamespace(num_query_groups_per_partition=groups,
                               query_projection_size=heads * d, kv_projection_size=groups * d,
                               qk_clip_balancing_eta=eta.view(groups, 1, 1),
                               config=SimpleNamespace(qk_clip_alpha=alpha))
    expected = SelfAttention._clip_linear_qkv(megatron, w.clone())
    scales = qkv_row_scales(eta, heads // groups, d, alpha)
    whole = w.clone()
    scale_flat_rows(whole.view(-1), scales, 0, hidden)
    assert torch.equal(whole, expected)
    flat = w.clone().view(-1)
    for start, end in ((0, 37), (37, 200), (200, flat.numel())):  # shards cut mid-row
        scale_flat_rows(flat[start:end], scales, start, hidden)
    assert torch.equal(flat.view_as(w), expected)
    assert qk_clip_eta(max_logits.clamp(max=tau), groups, tau) is None  # nothing to clip


# ---- QK-clip with dmuon ------------------------------------------------------------------
# The tiny GPT's initial max attention logit is 0.094 (reference run, seed 1234); with a
# threshold of 0.05 every step clips.
QK = {"qk_clip": True, "qk_clip_threshold": 0.05, "qk_clip_alpha": 0.5}
QK_OPT = dict(muon_fp32_matmul_prec="highest", muon_nesterov=True, lr=2e-3, adam_eps=1e-3)
ZERO3_DDP = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=20000)
PLACEMENTS = {"dmuon": ({}, None), "matrix": (dict(dmuon_placement="matrix"), None),
              "zero3": (dict(dmuon_placement="matrix", dmuon_zero3=True), ZERO3_DDP)}
QK_STEPS = 2


def _variant(opt, ddp=None, **kw):
    return dict(kw, opt=opt, ddp=ddp) if ddp else dict(kw, opt=opt)


@pytest.fixture(scope="module")
def runs():
    """{name: rank 0's result} of every distributed run, plus the references."""
    d = tempfile.mkdtemp(prefix="lion_ckpt_")
    named = {"lion_half": _variant(LION, steps=SAVE_AT, cfg=CFG,
                                   checkpoint=dict(save=d, save_at=SAVE_AT)),
             "lion_resumed": _variant(LION, steps=STEPS, cfg=CFG, checkpoint=dict(load=d))}
    for name, (opt, ddp) in PLACEMENTS.items():
        named[f"qk_{name}"] = _variant({**QK_OPT, **opt}, ddp, steps=QK_STEPS,
                                       cfg={**CFG, "extra": QK})
        named[f"qk_bf16_{name}"] = _variant({**QK_OPT, **opt, "lr": 0.0, "bf16": True}, ddp,
                                            steps=2, cfg={**CFG, "extra": QK, "bf16": True},
                                            recheck_max_logit=True)
    results = run_ranks("megatron_muon.testing.workers:train_variants", 2,
                        dict(variants=list(named.values()), optimizer="dmuon"), timeout=840)[0]
    out = dict(zip(named, results))
    ref2 = {"num_microbatches": 2}
    out["ref_lion"], out["ref_qk"] = run_ranks(
        "megatron_muon.testing.reference:reference_variants", 1, dict(variants=[
            dict(cfg=ref2, dp_size=1, steps=STEPS, opt=LION, muon=False),
            dict(cfg={**ref2, "extra": QK}, dp_size=1, steps=QK_STEPS, opt=QK_OPT)]),
        timeout=300)[0]
    out["ckpt"] = d
    return out


def _checkpoint_keys(path: str) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_lion_subset_equals_reference_and_resumes_exactly(runs):
    """DP2 dmuon with Lion for the non-matrix parameters, saved at step 2 and resumed
    (fresh model and optimizer) to step 4: bitwise equal to 4 steps of single-process Lion;
    the checkpoint holds Lion's exp_avg only."""
    ref, half, resumed = (runs[k] for k in ("ref_lion", "lion_half", "lion_resumed"))
    assert set(resumed["params"]) == set(ref["params"])
    for name, p in ref["params"].items():
        # the resumed run (2 steps, save, fresh model and optimizer, load, 2 steps) equals
        # the reference's 4 uninterrupted steps, hence also the uninterrupted dmuon run
        assert torch.equal(resumed["params"][name], p), name
        # not vacuous: Lion moves an element with c != 0 by about lr per step (sign steps)
        assert (p - half["params"][name]).abs().max() > LION["lr"], name
    keys = _checkpoint_keys(str(Path(runs["ckpt"]) / f"iter_{SAVE_AT:07d}"))
    assert any(".optimizer.state.exp_avg." in k for k in keys), sorted(keys)[:20]
    assert not any("exp_avg_sq" in k for k in keys)


@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_qk_clip_with_dmuon_equals_reference_and_stays_clipped(runs):
    """Muon + QK-clip at DP2 in the three placements against the single-process reference
    (fp32), and in bf16 with lr = 0: two steps whose only change is the clip, after which
    the max logit of the last batch, recomputed with the published weights, is under the
    threshold.  bf16 keeps separate fp32 main-param shards: had the rescale reached only the
    model weights, the second step's main -> model copy would undo the first clip (the max
    logit would stay about 0.092)."""
    ref = runs["ref_qk"]
    assert all(m > QK["qk_clip_threshold"] for m in ref["max_logits"])  # every step clipped
    for name in PLACEMENTS:
        run = runs[f"qk_{name}"]
        # max logits: the same up to the parameters' rounding differences (below), 1e-5 rel
        assert run["max_logits"] == pytest.approx(ref["max_logits"], rel=1e-5), name
        for key, p in ref["params"].items():
            # fp32 with the same gradients bitwise (see the module docstring); Newton-Schulz
            # on the owner is batched, so Muon matrices may differ by its rounding: an fp32
            # ulp or two of the update, lr sqrt(128) 1.2 x 2^-22 = 1.4e-8 per step.
            atol = QK_STEPS * QK_OPT["lr"] * 128 ** 0.5 * 1.2 * 2.0 ** -22
            assert torch.allclose(run["params"][key], p, rtol=0, atol=atol), (name, key)
    for name in PLACEMENTS:
        run = runs[f"qk_bf16_{name}"]
        # unclipped, the logit would be about 0.092, 1.8x the threshold; the clipped bf16
        # weights round each q, k element by <= 2^-8 relative (twice: weight, then output),
        # so the logit moves by <= 4 x 2^-8 of sum |q_i k_i|, which here is within a few
        # times |q . k|: 2^-4 of slack.
        assert run["max_logit_after"] <= QK["qk_clip_threshold"] * (1 + 2.0 ** -4), name
