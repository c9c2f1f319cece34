"""Newton-Schulz of units split across ranks (``distributed.split_ns``, the planner's
``SplitPolicy``) against the single-process reference: the same matrices, each unit's NS
computed whole in one process."""

import pytest
import torch

from megatron_muon.core.newton_schulz import muon_scale, newton_schulz
from megatron_muon.core.plan import SplitPolicy, UnitTask, flops_cost, plan_owners
from megatron_muon.core.units import extract_unit, insert_unit
from megatron_muon.testing.launch import run_ranks
from megatron_muon.testing.split_workers import local_input, split_case

pytestmark = pytest.mark.timeout(300)


def reference(world: int, seed: int, dtype=torch.float32, steps: int = 5,
              coefficients: str = "quintic", names=None) -> list:
    """Every rank's expected output pieces: each unit's NS whole (times the Muon scale)."""
    mats, fulls, offset = split_case(world, seed, names)
    results = {}
    for mat in mats:
        full = fulls[mat.key]
        out = torch.zeros_like(full)
        for u in mat.units:
            o = newton_schulz(extract_unit(full, u), steps=steps, coefficients=coefficients,
                              dtype=dtype).float()
            insert_unit(out, u, o * muon_scale(*u.shape, "spectral"))
        results[mat.key] = out
    return [local_input(mats, results, r, offset[r]) for r in range(world)]


def test_split_units_equal_whole_ns_in_fp32():
    """Every unit cut into 2, 3 and 4 parts on 4 ranks (both forms of the step occur: 'b'
    for parts at least as wide as the short side, 'ay' for narrower ones).

    Tolerance: the split sums the Gram matrix X X^T over parts (k partial fp32 sums of
    w_j products each, then k - 1 adds) where the reference accumulates the L products in
    one GEMM: a different order of the same fp32 sum, each entry off by at most ~L u |X|^2
    (u = 2^-24, |X| <= 1 after the normalisation: about 2e-6 at L = 48); form 'ay' applies
    B X as b A X + c A (A X), a reassociation with the same bound.  Five NS steps with
    quintic coefficients amplify a perturbation of X by at most ~|a| = 3.4 per step on the
    singular values already near 1, and contract it elsewhere; times the Muon scale
    sqrt(max(m, n)) <= 7: 2e-6 x 3.4^5 x 7 = 6e-3 is the worst case; measured 3.7e-6 to 5.6e-6.
    We use 2e-4 absolute (the outputs are O(1)); a wrong part, chunk or order is O(1)."""
    world = 4
    want = reference(world, seed=0)
    forms = set()
    for parts in (2, 3, 4):
        res = run_ranks("megatron_muon.testing.split_workers:split_run", world,
                        dict(parts=parts, seed=0), timeout=240)
        assert len({r["digest"] for r in res}) == 1
        splits = res[0]["splits"]
        assert splits and all(len(s.ranks) == parts for s in splits.values())
        forms |= {s.form for s in splits.values()}
        for r in res:
            torch.testing.assert_close(r["out"], want[r["rank"]], rtol=0, atol=2e-4)
        # bytes only where a rank has parts
        assert all((r["stats"]["by_kind"].get("split", [0, 0])[0] > 0) == (r["parts"] > 0)
                   for r in res)
    assert forms == {"b", "ay"}


def test_split_units_run_a_per_step_schedule():
    """DeepSeek-V4's hybrid schedule (10 steps: 8 of 'simple', then 2 settling ones) on units
    cut into 2 parts: each step's (a, b, c) is the whole unit's.  Tolerance as in
    test_split_units_equal_whole_ns_in_fp32: the summation order differs in the same way,
    simple's steps amplify a perturbation by at most |a| = 3.4 on small singular values and
    contract it near 1 (slope -0.7 there), the settling steps have slope 0 at 1; a step
    run with another step's triple is O(1) off."""
    world = 4
    want = reference(world, seed=0, steps=10, coefficients="deepseekv4")
    res = run_ranks("megatron_muon.testing.split_workers:split_run", world,
                    dict(parts=2, seed=0, steps=10, coefficients="deepseekv4"), timeout=240)
    assert res[0]["splits"]
    for r in res:
        torch.testing.assert_close(r["out"], want[r["rank"]], rtol=0, atol=2e-4)


def test_ranks_without_a_part_exchange_nothing():
    """The split all-reduces are point to point among each unit's ranks: with one unit cut
    in 2 on 4 ranks (``names``: only the 34 x 7 matrix), a rank without a
    part makes no call at all (an all-to-all over the group would make 2 + 2 x 5 on every
    rank, most of them empty), each rank with parts makes exactly the 2 halves of the norm's
    and of the 5 NS steps' all-reduces, and the result is the whole-unit NS's (tolerance as
    in test_split_units_equal_whole_ns_in_fp32)."""
    world, names = 4, ("tall",)
    want = reference(world, seed=2, names=names)
    res = run_ranks("megatron_muon.testing.split_workers:split_run", world,
                    dict(parts=2, seed=2, names=names), timeout=240)
    assert len(res[0]["splits"]) == 1
    holders = {r for s in res[0]["splits"].values() for r in s.ranks}
    assert 2 <= len(holders) < world, res[0]["splits"]
    for r in res:
        torch.testing.assert_close(r["out"], want[r["rank"]], rtol=0, atol=2e-4)
        calls = r["stats"]["by_kind"].get("split", [0, 0, 0])[2]
        assert (r["parts"] > 0) == (r["rank"] in holders)
        assert calls == (2 * (1 + 5) if r["parts"] else 0), (r["rank"], r["stats"])


def test_split_units_at_the_default_bf16_precision():
    """bf16 NS (Megatron's default 'medium' precision), where the planner uses form 'b'
    only.  The split rounds each part's Gram matrix to bf16 before the fp32 sum where the
    reference rounds the whole Gram once (k roundings of relative 2^-9 instead of one), so
    the split is as far from fp32 NS as bf16 NS is, give or take a few bf16 roundings: we
    require its distance from fp32 NS to be within 2.5x bf16 reference NS's own distance
    (measured: 1.3-1.5x; form 'ay' in bf16 was 3-5x, a dropped or doubled part is O(1))."""
    world = 4
    want16 = reference(world, seed=1, dtype=torch.bfloat16)
    want32 = reference(world, seed=1)
    own = max((want16[r] - want32[r]).abs().max().item() for r in range(world))
    for parts in (2, 4):
        res = run_ranks("megatron_muon.testing.split_workers:split_run", world,
                        dict(parts=parts, seed=1, dtype="bfloat16"), timeout=240)
        assert {s.form for s in res[0]["splits"].values()} == {"b"}
        err = max((r["out"] - want32[r["rank"]]).abs().max().item() for r in res)
        assert err <= 2.5 * own, (err, own)


def test_planner_splits_only_where_it_pays():
    """The planner splits the units that cost more than the mean load when their parts are
    then cheaper, counting the all-reduce's bytes at ``flops_per_byte``: never at small
    sizes (the all-reduce costs more than the flops it saves), and with many more ranks
    than units it balances the NS flops."""
    cost = flops_cost(5)

    def llama(layers, h, ffn, kv):
        return [UnitTask(f"l{l}.{i}", s, cost(s), 4 * s[0] * s[1]) for l in range(layers)
                for i, s in enumerate([(h, h), (kv, h), (kv, h), (h, h), (ffn, h), (ffn, h),
                                       (h, ffn)])]

    tiny = llama(2, 64, 256, 16)
    assert not plan_owners(tiny, 8, split=SplitPolicy(5)).splits
    big = llama(32, 4096, 14336, 1024)  # Llama-3-8B's units on 1024 ranks
    whole = plan_owners(big, 1024)
    split = plan_owners(big, 1024, split=SplitPolicy(5, flops_per_byte=500))
    assert whole.imbalance > 5 and split.splits
    assert split.compute_imbalance <= 0.25 and split.imbalance <= 0.25, split.summary()
    assert all(len(set(s.ranks)) == len(s.ranks) for s in split.splits.values())
    # fewer ranks than the plan can balance without splitting: nothing is split
    assert not plan_owners(big, 64, split=SplitPolicy(5)).splits
    with pytest.raises(ValueError, match="parts"):
        plan_owners(tiny, 2, split=SplitPolicy(5, parts=3))


def test_dmuon_splits_only_where_the_split_describes_the_step():
    """``dmuon_split='auto'`` plans splits for plain Muon with standard NS in flops; matrix
    placement, a second moment, Gram NS and tuner costs never split (their units stay
    whole), and bf16 NS never uses form 'ay'."""
    from megatron_muon.megatron.config import make_optimizer_config
    from megatron_muon.megatron.dmuon import split_policy

    def policy(**kw):
        return split_policy(make_optimizer_config("dmuon", **kw))

    assert policy(muon_fp32_matmul_prec="highest").ay
    assert not policy().ay  # the default, bf16 NS
    assert policy(dmuon_split_parts=3).parts == 3
    for kw in (dict(dmuon_split="off"), dict(dmuon_placement="matrix"),
               dict(dmuon_moment2="normuon"), dict(muon_ns_method="gram"),
               dict(dmuon_plan_cost="tuner")):
        assert policy(**kw) is None, kw
