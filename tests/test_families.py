"""The model families users train, through Megatron-LM's own loop: every pair of (family,
layout, mode, precision) in one case, and the lifecycle of a checkpoint per family.

Families (``megatron_muon/testing/families.py``): dense GPT, Llama (GQA, SwiGLU, RMSNorm,
RoPE), Qwen3 (+ qk-layernorm), Qwen3-MoE, DeepSeek-MoE (shared expert), DeepSeek-V3 / Kimi-K2
style (multi-latent attention with a q LoRA, MoE with a shared expert, one MTP layer).
Layouts: DP4, TP2, TP2 with sequence parallelism, PP2 with VPP, EP2, TP2 x EP2.  Modes:
dmuon, matrix placement, ZeRO-3, split Newton-Schulz, muon_naive.  Precision: fp32, bf16.
``ci_plan`` picks the cases (a greedy all-pairs cover of the allowed product) and which of
them are resumed at the same layout (bitwise: losses and the final checkpoint) and at another
layout (fp32: within TOLERANCE of the uninterrupted run, test_megatron_lm.py's derivation).
The runs go through ``mlm_gpt.py`` on 4 CPU ranks, all in one launch (the 0.19 lane: it
needs the wheel's ``megatron/training``).  ``python tools/sweep_families.py`` runs the whole product.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from megatron_muon.testing import families as F
from megatron_muon.testing.mlm_env import (checkpoint_tensors, failure_report,
                                            installed_training_dir, launch_in_chunks,
                                            patched_megatron)

COMMON = F.COMMON
TOLERANCE = F.RESHARD_TOLERANCE  # its derivation: families.py

needs_training = pytest.mark.skipif(
    installed_training_dir() is None,
    reason="this megatron-core ships no megatron/training (0.16.x); runs in the 0.19.2 lane")


def test_the_ci_cases_cover_every_pair_and_every_family_lifecycle():
    """Every pair of values of two dimensions that some allowed case holds is in a CI case;
    every family is resumed at its own and at another layout; what is left out is what
    Megatron or dmuon refuses (families.allowed)."""
    cases, follow = F.ci_plan()
    dims = list(F.DIMENSIONS)
    def pairs(c):
        values = dict(zip(dims, (c.family, c.layout, c.mode, c.precision)))
        return {((a, values[a]), (b, values[b])) for a, b in itertools.combinations(dims, 2)}
    wanted = set().union(*map(pairs, F.all_cases()))
    assert wanted <= set().union(*map(pairs, cases))
    assert all(F.allowed(c) for c in cases)
    for family in F.FAMILIES:
        done = [kind for c in cases if c.family == family for kind in follow.get(c.name, [])]
        assert {"resume", "reshard"} <= set(done), family
    assert not F.allowed(F.Case("gpt", "ep2", "dmuon", "fp32"))  # no experts to place
    assert not F.allowed(F.Case("qwen3_moe", "tp2", "dmuon", "fp32"))  # Megatron: needs SP
    assert F.allowed(F.Case("deepseek_v3", "tp2ep2", "split", "bf16"))


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    if installed_training_dir() is None:
        pytest.skip("no megatron/training in this env")
    cases, follow = F.ci_plan()
    out = tmp_path_factory.mktemp("families")
    groups = [F.case_runs(c, str(out), follow.get(c.name, ())) for c in cases]
    root = patched_megatron(tmp_path_factory.mktemp("mlm"))
    code, results, stderr, runs = launch_in_chunks(root, out, groups, COMMON, timeout=900)
    if code != 0:
        pytest.fail(failure_report(out, runs, results, code, stderr))
    return out, cases, follow, results


LAUNCHED = [needs_training, pytest.mark.distributed, pytest.mark.timeout(1800)]


def launched(fn):
    for mark in LAUNCHED:
        fn = mark(fn)
    return fn


@launched
def test_every_case_trains_through_megatron_lm(family_runs, capsys):
    _, cases, _, r = family_runs
    with capsys.disabled():
        print(f"\nMegatron-LM pretrain, {len(cases)} cases, lm loss at iterations 1 and "
              f"{F.STEPS}:")
        for c in cases:
            losses = r[c.name]["losses"]
            print(f"  {c.name:36s} {losses[0]:.6f} -> {losses[-1]:.6f}")
    for c in cases:
        losses = r[c.name]["losses"]
        assert len(losses) == F.STEPS and all(math.isfinite(x) for x in losses), c.name
        assert losses[-1] < losses[0] - 0.05, (c.name, losses)


@launched
def test_resume_is_bitwise_the_uninterrupted_run(family_runs):
    """save -> resume -> save: the resumed losses and the final checkpoint (model and
    optimizer, every tensor) are the uninterrupted run's, bit for bit."""
    out, cases, follow, r = family_runs
    resumed = [c for c in cases if "resume" in follow.get(c.name, ())]
    assert {c.family for c in resumed} == set(F.FAMILIES)
    last = f"iter_{F.STEPS:07d}"
    for c in resumed:
        n = c.name
        assert r[f"{n}.resume"]["first_iteration"] == F.SAVE_AT + 1, n
        assert r[f"{n}.resume"]["losses"] == r[n]["losses"][F.SAVE_AT:], n
        whole = checkpoint_tensors(Path(out) / f"ck_{n}" / last)
        again = checkpoint_tensors(Path(out) / f"ck_{n}.resume" / last)
        assert set(whole) == set(again), n
        assert any(k.startswith("optimizer.state.momentum_buffer.") for k in whole), n
        for k in whole:
            assert whole[k].equal(again[k]), (n, k)


@launched
def test_resume_at_another_layout_continues_the_run(family_runs):
    """The checkpoint of each family's fp32 case resumed at another layout (TP <-> PP <->
    DP, EP2 <-> TP2 x EP2): the losses of the uninterrupted run, within TOLERANCE."""
    _, cases, follow, r = family_runs
    for c in cases:
        if "reshard" not in follow.get(c.name, ()):
            continue
        other = r[f"{c.name}.at_{F.reshard_layout(c)}"]
        assert other["first_iteration"] == F.SAVE_AT + 1, c.name
        worst = max(abs(a - b) for a, b in zip(other["losses"], r[c.name]["losses"][F.SAVE_AT:]))
        assert worst < TOLERANCE, (c.name, worst)


@launched
def test_warm_start_from_adamw_and_lora_fine_tune(family_runs):
    """A dmuon run started from Megatron's own AdamW checkpoint of the same model
    (``--no-load-optim --finetune``) begins at the AdamW run's trained loss, not at the
    untrained one, and trains on; a LoRA + sMuon fine-tune from the family's dmuon checkpoint
    (the adapters start at zero: the checkpoint's function) begins below the untrained loss
    and stays finite (on mock data there is nothing more to learn in 6 steps; its equality
    with the single-process replay is test_megatron_lm.py's)."""
    _, cases, follow, r = family_runs
    warm = [c for c in cases if "warm" in follow.get(c.name, ())]
    lora = [c for c in cases if "lora" in follow.get(c.name, ())]
    assert {c.family for c in warm} == set(F.CI_WARM)
    assert {c.family for c in lora} == set(F.CI_LORA)
    for c in warm:
        adam, start = r[f"{c.name}.adam"]["losses"], r[f"{c.name}.from_adam"]["losses"]
        assert all(math.isfinite(x) for x in adam + start), c.name
        assert start[0] < adam[0] - 0.05 and start[-1] < start[0], (c.name, adam, start)
    for c in lora:
        ft = r[f"{c.name}.lora"]["losses"]
        assert all(math.isfinite(x) for x in ft), c.name
        assert len(ft) == F.STEPS and ft[0] < r[c.name]["losses"][0] - 0.05, (c.name, ft)
