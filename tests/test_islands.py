"""DiLoCo / IsoLoCo islands over Megatron (docs/design.md#isoloco-and-islands, distributed part).

Two launches of 4 gloo ranks: ``islands_suite`` runs every layout below one after the other
(K = 1 with TP2 x DP2 against a plain Megatron run; 4 islands x 1 rank with DiLoCo, IsoLoCo
svd + a checkpoint resume, IsoLoCo ns momentum-first; 2 islands x TP2, x PP2 and x DP2; and
2 islands x TP2 and x PP2 inner-trained with dmuon, against the same 2 islands emulated as
1-rank islands in one process), and
``islands_fault`` runs the fault mode with island 3 stalled past the timeout. The outer step
is checked against ``megatron_muon.islands.isoloco.OuterOptimizer`` fed the islands' parameters.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatron_muon.islands.isoloco import OUTER_DEFAULTS, OuterOptimizer, mean_pseudo_gradient
from megatron_muon.islands.runtime import (
    OuterArgumentError,
    add_outer_args,
    outer_kwargs_from_args,
    validate_outer_args,
)
from megatron_muon.testing.launch import run_ranks

SUITE_KW = {  # outer-optimizer settings of islands_suite (island_workers.py)
    "k4_diloco": dict(method="diloco"),
    "k4_isoloco_svd": dict(method="isoloco", iso_mode="svd"),
    "k4_isoloco_ns_mf": dict(method="isoloco", iso_mode="ns", order="momentum_first"),
    "tp2": dict(method="isoloco", iso_mode="svd"),
    "pp2": dict(method="isoloco", iso_mode="ns"),
    "dp2": dict(method="isoloco", iso_mode="svd", order="momentum_first"),
    # dmuon inner optimizer (island_workers.INNER_DMUON), DiLoCo outer step
    "tp2_dmuon": dict(method="diloco"),
    "pp2_dmuon": dict(method="diloco"),
}
FP64_DELTAS = {"k4_isoloco_svd", "k4_isoloco_ns_mf"}  # see test_outer_step_matches_reference


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    d = tmp_path_factory.mktemp("islands")
    res = run_ranks("megatron_muon.testing.island_workers:islands_suite", 4,
                    dict(workdir=str(d)), timeout=240, workdir=str(d / "launch"))
    return sorted(res, key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def fault(tmp_path_factory):
    d = tmp_path_factory.mktemp("islands_fault")
    return run_ranks("megatron_muon.testing.island_workers:islands_fault", 4, {}, timeout=150,
                     workdir=str(d))


def _merge(dicts) -> dict:
    out = {}
    for d in dicts:
        out.update(d)
    return out


def _heads(recs) -> dict:
    """island -> records of its TP rank 0 / DP rank 0 ranks (one per pipeline stage)."""
    islands = sorted({r["island"] for r in recs})
    return {k: [r for r in recs if r["island"] == k and r["tp"] == 0 and r["dp"] == 0]
            for k in islands}


# ----------------------------------------------------------------------------- K = 1
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_one_island_lr1_no_momentum_reproduces_inner_run(suite):
    for r in suite:
        isl, plain = r["k1"], r["k1_plain"]
        assert isl["losses"] == plain["losses"]  # bitwise, all 4 inner steps
        final = isl["rounds"][-1]["after"]
        assert final.keys() == plain["params"].keys()
        for name, t in final.items():
            assert torch.equal(t, plain["params"][name]), name
        assert [x["report"]["participants"] for x in isl["rounds"]] == [[0], [0]]


# ----------------------------------------------------------------------------- layouts
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_islands_are_separate_megatron_layouts(suite):
    coords = {key: sorted((r[key]["island"], r[key]["tp"], r[key]["pp"], r[key]["dp"])
                          for r in suite) for key in SUITE_KW}
    assert coords["k4_diloco"] == [(k, 0, 0, 0) for k in range(4)]
    assert coords["tp2"] == [(0, 0, 0, 0), (0, 1, 0, 0), (1, 0, 0, 0), (1, 1, 0, 0)]
    assert coords["pp2"] == [(0, 0, 0, 0), (0, 0, 1, 0), (1, 0, 0, 0), (1, 0, 1, 0)]
    assert coords["dp2"] == [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1)]
    for key in SUITE_KW:
        recs = [r[key] for r in suite]
        heads = _heads(recs)
        for rnd in range(len(recs[0]["rounds"])):
            before = {k: _merge(h["rounds"][rnd]["before"] for h in hs) for k, hs in heads.items()}
            # the islands trained apart (different data, island-local gradient reduction) ...
            name = "output_layer.weight"
            assert not torch.equal(before[0][name], before[1][name]), (key, rnd)
            # ... and leave every outer step with the same global parameters, bitwise
            after0 = _merge(h["rounds"][rnd]["after"] for h in heads[0])
            for r in recs:
                for n, t in r["rounds"][rnd]["after"].items():
                    assert torch.equal(t, after0[n]), (key, rnd, n)
    # the DP replicas of an island agree before the outer step (Megatron DDP inside it)
    dp = [r["dp2"] for r in suite]
    for k in (0, 1):
        a, b = [r for r in dp if r["island"] == k]
        for n, t in a["rounds"][0]["before"].items():
            assert torch.equal(t, b["rounds"][0]["before"][n]), n


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", sorted(SUITE_KW))
def test_outer_step_matches_reference(suite, key):
    """Distributed outer step == OuterOptimizer fed the islands' parameters.

    The 4-island IsoLoCo runs all-reduce fp64 pseudo-gradients (``delta_dtype``): with
    fp32, gloo's ring sums 4 values in another order than the reference, and Iso-C of this
    tiny model's nearly rank-deficient attention-projection deltas (singular values down to
    1e-6 of the largest) turns those last-bit differences into 1e-4 .. 1e-3 differences.
    Two islands sum in one (commutative) step, so fp32 is exact there.
    """
    recs = [r[key] for r in suite]
    heads = _heads(recs)
    islands = sorted(heads)
    theta0 = _merge(h["theta0"] for h in heads[islands[0]])
    ref = OuterOptimizer(theta0, **SUITE_KW[key])
    dtype = torch.float64 if key in FP64_DELTAS else None
    n_rounds = len(recs[0]["rounds"])
    assert n_rounds == 2
    for rnd in range(n_rounds):
        before = [_merge(h["rounds"][rnd]["before"] for h in heads[k]) for k in islands]
        ref.step(mean_pseudo_gradient(ref.params, before, dtype=dtype))
        for r in recs:
            after = r["rounds"][rnd]["after"]
            assert after, key
            for name, t in after.items():
                torch.testing.assert_close(t, ref.params[name], atol=1e-6, rtol=1e-6,
                                           msg=lambda m: f"{key} round {rnd} {name}: {m}")
    moved = max((ref.params[n] - theta0[n]).abs().max().item() for n in theta0)
    assert moved > 1e-3  # the comparison is not vacuous


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_each_iso_c_computed_once_and_bytes_counted(suite):
    r = suite[0]
    n_params = sum(t.numel() for t in r["k4_diloco"]["theta0"].values())
    st = r["k4_diloco"]["stats"]["by_kind"]
    # 2 rounds of one ring all-reduce of fp32 deltas over 4 islands: 2 * 3/4 * 4 bytes each
    assert st == {"outer_all_reduce": [2 * round(1.5 * 4 * n_params)] * 2 + [2]}
    iso = r["k4_isoloco_svd"]["stats"]["by_kind"]["iso_broadcast"]
    mats = sum(t.numel() for t in r["k4_isoloco_svd"]["theta0"].values() if t.ndim == 2)
    # every Iso-C result crosses the islands once (fp64 here): a broadcast of 3/4 x 8 bytes
    assert iso[0] == 2 * round(0.75 * 8 * mats)
    assert "tp_gather" in suite[0]["tp2"]["stats"]["by_kind"]
    assert "island_dp_broadcast" in suite[0]["dp2"]["stats"]["by_kind"]
    # each matrix's Iso-C is computed by one rank of the world per round, no more
    for key in ("k4_isoloco_svd", "k4_isoloco_ns_mf", "tp2", "pp2", "dp2"):
        recs = [x[key] for x in suite]
        n_mats = sum(t.ndim == 2 for t in _merge(h["theta0"] for h in _heads(recs)[0]).values())
        assert sum(x["iso_computed"] for x in recs) == 2 * n_mats, key  # 2 rounds
        assert sum(x["iso_computed"] > 0 for x in recs) > 1, key  # spread over owners
    assert suite[0]["k4_diloco"]["iso_computed"] == 0


# ----------------------------------------------------------------------------- dmuon islands
def dmuon_island_bounds(grad_max: float, rounds: int = 2, H: int = 2) -> list:
    """[(bound before the outer step, bound after it)] per round: how far TP2 / PP2 islands
    may drift from the 1-rank islands, from the arithmetic (as tests/test_dmuon.py).

    One inner step: TP splits inner products of length <= ffn = 64 and the weight gradients
    sum 2 x 8 = 16 tokens, so at most K = 64 + 16 additions per element run in another order;
    two orders of a K-term fp32 sum differ by <= 2 K EPS32 sum|terms|. Muon matrices (Newton-
    Schulz sees M / ||M||_F, only the relative error counts): the update lr sqrt(max(m, n)) O,
    |O_ij| <= 1.2, max(m, n) = 64, moves by <= lr 8 1.2 2 K EPS32. AdamW parameters (embedding,
    output layer, norms): lr m / (sqrt(v) + eps) moves by <= lr |dg| / eps through m and as
    much through v, |dg| ~ sqrt(2 K) EPS32 G with G the largest AdamW gradient element, taken
    from the 1-rank run (``adam_grad_max``). A start error is carried through H inner steps as
    is (the step is a bounded-slope map of the start point at this lr), each step adds e.
    The DiLoCo outer step (lr 0.7, Nesterov mu 0.9) then gives, for errors E of theta, dD of
    mean D and dm of the momentum: dD_r = E_{r-1} + H e, dm_r = mu dm_{r-1} + dD_r,
    E_r = E_{r-1} + lr (dD_r + mu dm_r).
    """
    eps32, lr, eps_adam = 2.0 ** -23, 2e-3, 1e-3  # island_workers.INNER_DMUON
    K = 64 + 16
    e = max(lr * math.sqrt(64) * 1.2 * 2 * K * eps32,
            2 * lr * math.sqrt(2 * K) * eps32 * grad_max / eps_adam)
    lr_o, mu = OUTER_DEFAULTS["diloco"]["lr"], OUTER_DEFAULTS["diloco"]["momentum"]
    out, E, dm = [], 0.0, 0.0
    for _ in range(rounds):
        dD = E + H * e
        dm = mu * dm + dD
        out.append((dD, E + lr_o * (dD + mu * dm)))
        E = out[-1][1]
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["tp2_dmuon", "pp2_dmuon"])
def test_dmuon_islands_match_one_rank_islands(suite, key):
    """2 islands of TP2 (or PP2) inner-trained with dmuon, DiLoCo outer step, against the same
    2 islands of 1 rank at equal tokens (each island reads the same samples), emulated in one
    process with the library's OuterOptimizer: the island parameters before each outer step
    and the global parameters after it agree within ``dmuon_island_bounds`` (measured:
    TP2 <= 1.7e-7, PP2 bitwise, on megatron-core 0.16.1)."""
    ref = suite[0]["ref1_dmuon"]
    for r in suite[1:]:  # the emulation is the same on every rank
        for rnd, x in enumerate(r["ref1_dmuon"]["rounds"]):
            for n, t in x["after"].items():
                assert torch.equal(t, ref["rounds"][rnd]["after"][n]), n
    recs = [r[key] for r in suite]
    heads = _heads(recs)
    theta0 = _merge(h["theta0"] for h in heads[0])
    assert set(theta0) == set(ref["theta0"])
    for n, t in theta0.items():  # layout-invariant initialisation
        assert torch.equal(t, ref["theta0"][n]), n
    bounds = dmuon_island_bounds(ref["adam_grad_max"], rounds=len(ref["rounds"]))
    for rnd, (tol_before, tol_after) in enumerate(bounds):
        for k in sorted(heads):
            before = _merge(h["rounds"][rnd]["before"] for h in heads[k])
            for n, t in before.items():
                err = (t - ref["rounds"][rnd]["before"][k][n]).abs().max().item()
                assert err <= tol_before, (key, rnd, k, n, err, tol_before)
        for r in recs:  # every rank holds the same global parameters after the outer step
            for n, t in r["rounds"][rnd]["after"].items():
                err = (t - ref["rounds"][rnd]["after"][n]).abs().max().item()
                assert err <= tol_after, (key, rnd, n, err, tol_after)
    moved = max((ref["rounds"][-1]["after"][n] - theta0[n]).abs().max().item() for n in theta0)
    assert moved > 100 * bounds[-1][1], (moved, bounds)  # the comparison is not vacuous


# ----------------------------------------------------------------------------- checkpoint
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_checkpoint_resume_is_exact(suite):
    """Saved before the last outer step; a fresh model/optimizer/outer step resumes from the
    files, redoes that step and one more inner round: bitwise the uninterrupted run."""
    for r in suite:
        rec = r["k4_isoloco_svd"]
        last = rec["rounds"][-1]
        for name, t in last["before"].items():
            assert torch.equal(rec["resumed_before"][name], t), name
        for name, t in last["after"].items():
            assert torch.equal(rec["resumed_after"][name], t), name
        assert rec["resumed_losses"] == rec["continued_losses"]
        # the resumed run saved again; a run resumed from that one stays bitwise on track
        assert rec["resumed_again_losses"] == rec["continued_again_losses"]
        for name, t in rec["continued_again_params"].items():
            assert torch.equal(rec["resumed_again_params"][name], t), name


# ----------------------------------------------------------------------------- fault mode
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fault_mode_stalled_island(fault):
    by_island = {r["island"]: r for r in fault}
    late = by_island[3]
    assert late["stalled"]
    skipped = [x["report"]["skipped_rounds"] for x in late["rounds"]]
    missed = sorted(n for s in skipped for n in s)
    assert missed and missed[0] == 1  # left out from the round it stalled in ...
    assert any("missed outer round 1" in m for m in late["messages"])
    assert any("left out islands [3]" in m for m in by_island[0]["messages"])
    rejoin = next(x for x in late["rounds"] if x["report"]["skipped_rounds"])
    assert rejoin["report"]["stale"] == [3]  # ... and back, with zero weight, next time
    assert max(r["seconds"] for r in fault) < 60  # never waited for the stalled island
    # every island ends with the same parameters (the late one was reset)
    for k in (1, 2, 3):
        for name, t in by_island[0]["final"].items():
            assert torch.equal(by_island[k]["final"][name], t), (k, name)
    # replay with the single-process reference: mean over the up-to-date participants
    ref = OuterOptimizer(by_island[0]["theta0"], method="isoloco", iso_mode="svd")
    rounds = {}
    for r in fault:
        for x in r["rounds"]:
            rounds.setdefault(x["report"]["round"], {})[r["island"]] = x
    assert sorted(rounds) == list(range(6))
    for n in sorted(rounds):
        reps = rounds[n]
        report = next(iter(reps.values()))["report"]
        assert sorted(reps) == report["participants"]
        fresh = [k for k in report["participants"] if k not in report["stale"]]
        ref.step(mean_pseudo_gradient(ref.params, [reps[k]["before"] for k in fresh],
                                      dtype=torch.float64))
        for k, x in reps.items():
            for name, t in x["after"].items():
                torch.testing.assert_close(t, ref.params[name], atol=1e-6, rtol=1e-6)
    assert any(len(rounds[n]) == 3 for n in rounds)


# ----------------------------------------------------------------------------- flags
def _parse(*argv):
    return add_outer_args(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.mark.timeout(30)
def test_flags_parse_and_build_kwargs():
    args = _parse("--outer-optimizer", "isoloco", "--diloco-islands", "4",
                  "--diloco-inner-steps", "30", "--outer-lr", "1.8", "--outer-momentum", "0.8",
                  "--isoloco-mode", "ns")
    validate_outer_args(args, world_size=8, model_parallel_size=2)
    kw = outer_kwargs_from_args(args)
    assert kw["method"] == "isoloco" and kw["iso_mode"] == "ns" and kw["lr"] == 1.8
    assert kw["momentum"] == 0.8 and kw["order"] == "iso_first" and not kw["fault_tolerant"]
    args = _parse("--outer-optimizer", "diloco")
    validate_outer_args(args, world_size=4)
    assert outer_kwargs_from_args(args)["lr"] is None  # OuterOptimizer default (0.7)
    validate_outer_args(_parse(), world_size=4)  # islands off


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, world, mp, flag", [
    (["--outer-optimizer", "diloco", "--diloco-islands", "3"], 8, 1, "--diloco-islands"),
    (["--outer-optimizer", "diloco", "--diloco-islands", "4"], 4, 2, "TP x PP"),
    (["--outer-optimizer", "diloco", "--diloco-islands", "0"], 4, 1, "--diloco-islands"),
    (["--outer-optimizer", "diloco", "--diloco-inner-steps", "0"], 4, 1, "--diloco-inner-steps"),
    (["--outer-optimizer", "diloco", "--outer-lr", "-1"], 4, 1, "--outer-lr"),
    (["--outer-optimizer", "diloco", "--outer-momentum", "1.0"], 4, 1, "--outer-momentum"),
    (["--outer-optimizer", "diloco", "--isoloco-mode", "ns"], 4, 1, "--isoloco-mode"),
    (["--diloco-islands", "2"], 4, 1, "--outer-optimizer"),
    (["--outer-optimizer", "isoloco", "--diloco-fault-tolerant"], 4, 1, "--diloco-islands >= 2"),
    (["--outer-optimizer", "isoloco", "--diloco-islands", "2", "--diloco-fault-tolerant",
      "--diloco-island-timeout", "0"], 4, 1, "--diloco-island-timeout"),
])
def test_flags_clear_errors(argv, world, mp, flag):
    with pytest.raises(OuterArgumentError, match=flag.replace("+", r"\+")):
        validate_outer_args(_parse(*argv), world_size=world, model_parallel_size=mp)


@pytest.mark.timeout(30)
def test_flags_reject_bad_choice():
    with pytest.raises(SystemExit):
        _parse("--outer-optimizer", "adam")
    with pytest.raises(SystemExit):
        _parse("--outer-optimizer", "isoloco", "--isoloco-mode", "qr")


# ----------------------------------------------------------------------------- iso_results
@pytest.mark.timeout(30)
@pytest.mark.parametrize("order", ["iso_first", "momentum_first"])
def test_outer_optimizer_accepts_precomputed_iso_c(order):
    """What the distributed step relies on: step(D, iso_results=iso_c(iso_inputs(D))) is the
    plain step, bitwise."""
    from megatron_muon.islands.isoloco import iso_c

    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(12, 8, generator=g), "b": torch.randn(8, generator=g)}
    a = OuterOptimizer(params, "isoloco", order=order)
    b = OuterOptimizer(params, "isoloco", order=order)
    for _ in range(3):
        d = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in params.items()}
        a.step(d)
        inputs = b.iso_inputs(d)
        assert sorted(inputs) == ["w"]
        b.step(d, iso_results={k: iso_c(x) for k, x in inputs.items()})
        for k in params:
            assert torch.equal(a.params[k], b.params[k])
    with pytest.raises(ValueError, match="iso_results keys"):
        b.step(d, iso_results={})
    with pytest.raises(ValueError, match="shape"):
        b.step(d, iso_results={"w": torch.zeros(8, 12)})
