"""Megatron-Core's own Muon against the reference Muon (megatron_muon.core.muon, run by
megatron_muon/testing/reference.py) on the tiny GPT.

Megatron-Core 0.19's ``--optimizer muon`` is emerging_optimizers' ``TensorParallelMuon``
inside its layer-wise distributed optimizer (each DP rank updates whole matrices and
all-gathers the parameters; AdamW's DistributedOptimizer takes the rest).  Here in its exact
TP mode, ``duplicated`` (each TP rank all-gathers a unit's shards and orthogonalises the
whole unit), at TP2 x DP2.  The other peers, emerging_optimizers' ``AdaptiveMuon`` and
``Lion``, are compared in tests/test_moment2.py and tests/test_scalars.py.

The peers are not installed in the primary CI lane (megatron-core 0.16.1 has no
emerging_optimizers): there these tests skip; the 0.19.2 lane installs them and sets
``MEGATRON_MUON_REQUIRE_PEERS=1``, where a peer that does not import fails
(megatron_muon/testing/peers.py).
"""

import pytest

from megatron_muon.megatron.params import is_muon_matrix
from megatron_muon.testing.launch import run_ranks
from megatron_muon.testing.peers import REQUIRE_PEERS, import_peer

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# tests/test_dmuon.py's settings (fp32 NS: muon_fp32_matmul_prec='highest'; adam_eps 1e-3,
# see its ADAM_ATOL) with weight decay 0.1: 5 steps of it move a weight by
# 1 - (1 - lr wd)^5 = 1e-3 of |w|, 1e-5..1e-4 here, so a missing or doubled decay is
# 2-20x the tolerance below.
PEER_OPT = dict(muon_fp32_matmul_prec="highest", muon_nesterov=True, lr=2e-3, adam_eps=1e-3,
                weight_decay=0.1)


def _need_mcore_muon():
    import megatron.core
    from packaging.version import Version

    import_peer("emerging_optimizers")
    if Version(megatron.core.__version__) < Version("0.19"):
        import os

        if os.environ.get(REQUIRE_PEERS) == "1":
            pytest.fail(f"{REQUIRE_PEERS}=1 but megatron-core {megatron.core.__version__} "
                        "has no emerging-optimizer Muon (needs >= 0.19)")
        pytest.skip("Megatron-Core's Muon needs megatron-core >= 0.19")
    return import_peer("megatron.core.optimizer.emerging_optimizers")


def test_megatron_cores_layer_wise_muon_equals_reference():
    """Megatron-Core's Muon (TensorParallelMuon, tp_mode='duplicated', layer-wise distributed
    optimizer), TP2 x DP2, 5 steps, against the single-process reference."""
    eo = _need_mcore_muon()
    assert eo.HAVE_EMERGING_OPTIMIZERS
    from test_dmuon import MUON_ATOL, STEPS, worst_excess

    res = run_ranks("megatron_muon.testing.peers:mcore_muon_train", 4,
                    dict(cfg={"num_microbatches": 2}, tp=2, steps=STEPS, opt=PEER_OPT,
                         tp_mode="duplicated"), timeout=420)
    # ns_eps=0: emerging_optimizers normalises by max(||U||, 1e-7) (never the eps here:
    # ||U|| >= 1.7e-4 for its EMA momentum, (1 - mu) times ours), the reference by
    # ||U|| + 1e-7, a relative difference 1e-7 / ||U|| of up to 2.9e-5 (smallest unit of
    # this run: ||U|| = 3.4e-3), as large as the whole rounding budget below; with eps 0
    # both divide by the norm.
    ref, init = (r["params"] for r in run_ranks(
        "megatron_muon.testing.reference:reference_variants", 1, dict(variants=[
            dict(cfg={"num_microbatches": 4}, dp_size=1, steps=STEPS, opt=PEER_OPT, ns_eps=0.0),
            dict(cfg={"num_microbatches": 4}, dp_size=1, steps=0)]), timeout=300)[0])
    for r in res:  # what ran is Megatron-Core's Muon in the exact TP mode, on the matrices
        assert r["optimizers"] == ["AdamW", "TensorParallelMuon"], r["optimizers"]
        assert r["muon_tp_mode"] == ["duplicated"]
    # the layer-wise optimizer gives each matrix to one DP rank: per TP rank, the DP ranks'
    # Muon elements add up to that TP rank's shard of all the matrices, i.e. the four ranks
    # to the whole model's
    total = sum(p.numel() for n, p in ref.items() if is_muon_matrix(n, p))
    assert sum(r["muon_numel"] for r in res) == total
    full = {}
    for r in res:
        if r["layout"]["tp"] == 0 and r["layout"]["dp"] == 0:
            full.update(r["params"])
    assert set(full) == set(ref)
    # Tolerance: tests/test_dmuon.py's fp32_atol (MUON_ATOL 4.3e-6 on the matrices,
    # ADAM_ATOL 3.9e-6 on the rest), derived there for a layout that adds the reference's
    # numbers in another order: here TP2 x DP2 splits the gradients' sums the same way
    # (K = 4 microbatch / DP partials + up to 128 inner-product terms; relative momentum
    # error <= 2 K EPS32 = 3.1e-5, NS in fp32 on both sides).  What Megatron-Core's Muon
    # does differently is rounding, not arithmetic: its momentum is an EMA (lerp, (1 - mu)
    # times M = mu M + G, which NS's normalisation removes; a lerp rounds twice where
    # mu M + G rounds twice, <= 4 EPS32 relative per step, 20 EPS32 over 5 steps, < 10% of
    # 2 K EPS32), NS runs as mm on one matrix where the reference runs bmm on a batch of one
    # (same inner products, inner dimension <= 128 <= K), and the decay is p + (-lr wd) p
    # instead of p (1 - lr wd) (one fp32 rounding of |w| <= 0.09 per step: 5 x 0.09 x
    # EPS32 = 5e-8, 1% of MUON_ATOL).  AdamW is Megatron's DistributedOptimizer in both
    # Megatron paths, torch.optim.AdamW in the reference, as in every DMuon comparison.
    excess, name = worst_excess(full, ref)
    print(f"mcore muon vs reference: worst {excess:.3f} x tolerance ({name}); max |w| "
          f"{max(ref[n].abs().max().item() for n in ref if is_muon_matrix(n, ref[n])):.3f}")
    assert excess < 1, f"{name}: {excess:.2f} x its tolerance"
    moved = max((init[n] - ref[n]).abs().max().item()
                for n in ref if is_muon_matrix(n, ref[n]))
    assert moved > 100 * MUON_ATOL, "the Muon matrices barely moved: a vacuous comparison"
