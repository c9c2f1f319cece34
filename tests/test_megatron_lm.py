"""Megatron-LM's own training loop with ``--optimizer dmuon``, on CPU, end to end.

The installed megatron-core 0.19.2 wheel ships Megatron-LM's ``megatron/training``
(unpatched).  The test copies site-packages' ``megatron/`` tree to a temporary folder,
applies ``patches/megatron-lm-dmuon.patch`` there (the venv is never touched), and runs
``megatron_muon/testing/mlm_gpt.py`` - which calls ``megatron.training.pretrain`` the way
Megatron-LM's ``pretrain_gpt.py`` does (config container, mock data) - through
``python -m megatron_muon.megatron.cpu_run`` on 4 gloo ranks.  All trainings share one
launch (``MLM_GPT_RUNS``; the imports dominate a tiny run): adam; dmuon at DP4, TP2 x DP2
and PP2 x DP2; matrix placement; ZeRO-3 at DP4 and PP2 x DP2; save -> resume -> save with
``--ckpt-format torch_dist`` and Megatron-LM's default checkpoint flags; DP4 checkpoints
(dmuon, ZeRO-3) resumed on TP2 x DP2 with those flags; full activation recompute with
dmuon (and dropout) and with ZeRO-3; the legacy ``model_provider`` (``get_model``) path with
matrix placement; split Newton-Schulz (``--dmuon-split-parts 2``) with Megatron's overlap
flags, and resumed at TP2 x DP2.  Those comparisons run Newton-Schulz in fp32
(``--muon-fp32-matmul-prec highest``), where TOLERANCE's derivation holds; one more run
trains at Megatron's default precision (bf16 Newton-Schulz).

A second launch (``peft_runs``) runs the PEFT lifecycle: dmuon pretraining -> LoRA + sMuon
fine-tuning from it (``--load --finetune``, adapter-only checkpoints) -> resume (same layout
and TP2) -> held-out evaluation -> ``python -m megatron_muon.peft.merge`` -> the merged
checkpoint evaluated with no LoRA flag.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.megatron.cpu_run import with_cpu_defaults
from megatron_muon.testing import families
from megatron_muon.testing.mlm_env import (checkpoint_tensors, failure_report,
                                            installed_training_dir, launch_mlm_runs,
                                            patched_megatron)

REPO = Path(__file__).resolve().parents[1]


MEGATRON = installed_training_dir().parent if installed_training_dir() else None
needs_training = pytest.mark.skipif(
    MEGATRON is None, reason="this megatron-core ships no megatron/training (0.16.x); "
                             "runs in the megatron-core 0.19.2 lane")

# the model, the 6 iterations and the checkpoint format every run shares (with the families)
STEPS, SAVE_AT, COMMON = families.STEPS, families.SAVE_AT, families.COMMON

# Matrix placement / ZeRO-3 vs default DMuon, and TP2 x DP2 vs DP4: the same model and data,
# only the fp32 summation order differs (gloo's reduce-scatter sums each gradient element
# in an order that depends on where the bucket layout puts it; TP adds partial products).
# Bound: each gradient element carries <= 3 more roundings, relative 3 x 2^-24 ~ 1.8e-7.
# Newton-Schulz (5 quintic steps, slope a = 3.4445 at 0) amplifies a relative input error
# by at most a^5 ~ 485, so the orthogonal factor is off by <= 8.7e-5 relative.  A Muon
# update has RMS entry lr (spectral scale), i.e. Frobenius norm lr sqrt(N) with N ~ 1e5
# Muon entries here: <= 8.7e-5 x 1e-3 x 316 ~ 2.7e-5 per step, 1.4e-4 over the 5 updates
# before the last loss (AdamW's element-wise update adds far less).  The loss moves by at
# most |grad| x |delta| with |grad| <= 1.5 (Megatron logs 1.1 - 1.5): 2.1e-4.  With 1.5x
# for the linearisation: 3e-4 (observed: <= 2.4e-7, two fp32 ulps of the loss).  This
# holds for fp32 Newton-Schulz only, which is why the compared runs set
# --muon-fp32-matmul-prec highest: at Megatron's default ('medium', bf16
# NS) a reordered fp32 sum can flip the bf16 rounding of an NS input or of any product in
# it, an error of 2^-8 relative in that entry that NS amplifies like any other, and no
# bound from the arithmetic survives the next step (test_dmuon.py's
# test_default_precision_equals_reference: one step at bf16, where it does).
TOLERANCE = 3e-4


def _spec(out: Path) -> dict:
    # fp32 Newton-Schulz for the runs compared under TOLERANCE (its derivation above)
    dm = ["--optimizer", "dmuon", "--muon-fp32-matmul-prec", "highest"]
    matrix = dm + ["--dmuon-placement", "matrix"]
    zero3 = matrix + ["--dmuon-zero3", "--overlap-grad-reduce"]
    recon = ["--optimizer", "muon_naive", "--muon-fp32-matmul-prec", "highest",
             "--dmuon-zero3", "--overlap-grad-reduce"]
    tp2, pp2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
    untied = ["--untie-embeddings-and-output-weights"]  # ZeRO-3 with PP needs them untied
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    split = ["--dmuon-split-parts", "2"]
    bf16 = ["--bf16"]
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    dropout = ["--hidden-dropout", "0.1"]  # recompute must replay the forward's masks
    save = lambda d: ["--save", str(out / d), "--save-interval", str(SAVE_AT)]  # noqa: E731
    load = lambda d: ["--load", str(out / d), "--ckpt-step", str(SAVE_AT)]  # noqa: E731
    # every checkpoint below is saved with Megatron-LM's default flags (under dmuon they
    # reshard: megatron_muon.megatron.arguments.reshardable_checkpoints)
    return {"out": str(out), "runs": [
        ["adam", ["--optimizer", "adam"]],
        ["dmuon", dm + save("ck_dmuon")],
        ["dmuon_resume", dm + load("ck_dmuon") + save("ck_resume")],
        ["dmuon_tp2_resume", dm + tp2 + load("ck_dmuon")],
        ["dmuon_tp2", dm + tp2],
        ["dmuon_pp2", dm + pp2],
        ["matrix", matrix],
        ["matrix_pp2", matrix + pp2 + untied],
        ["zero3", zero3 + save("ck_zero3")],
        ["zero3_pp2", zero3 + pp2 + untied],
        ["zero3_tp2_resume", zero3 + tp2 + load("ck_zero3")],
        ["zero3_recompute", zero3 + recompute],
        ["dmuon_dropout", dm + dropout],
        ["dmuon_recompute", dm + dropout + recompute],
        ["legacy_matrix_tp2", matrix + tp2 + ["--legacy-model-provider"]],
        # every unit's Newton-Schulz split over 2 ranks (point-to-point Gram all-reduces),
        # with Megatron's grad-reduce / param-gather overlap, and resumed at TP2 x DP2 from the
        # unsplit DP4 checkpoint
        ["dmuon_split", dm + split + overlap],
        ["dmuon_split_tp2_resume", dm + split + tp2 + load("ck_dmuon")],
        # Megatron's default precision: bf16 Newton-Schulz
        ["dmuon_default_prec", ["--optimizer", "dmuon"]],
        # the reconstruction baseline: ZeRO-3 on Megatron's even shards, muon_naive's step
        ["recon_zero3", recon + save("ck_recon")],
        ["recon_zero3_resume", recon + load("ck_recon")],
        # --bf16 under ZeRO-3 (Float16Module between DDP and the model), saved and resumed
        ["zero3_bf16", zero3 + bf16 + save("ck_zero3_bf16")],
        ["zero3_bf16_resume", zero3 + bf16 + load("ck_zero3_bf16")],
        ["recon_bf16", recon + bf16 + save("ck_recon_bf16")],
        ["recon_bf16_resume", recon + bf16 + load("ck_recon_bf16")],
    ]}


def _launch(tmp_path_factory, make_spec, timeout: int = 780):
    """Copy and patch the wheel's megatron/ tree, run ``make_spec(out)``'s trainings in one
    launch of ``mlm_gpt.py`` on 4 CPU ranks; ``(out, {run name: its .json})``."""
    if MEGATRON is None:
        pytest.skip("no megatron/training in this env")
    root = patched_megatron(tmp_path_factory.mktemp("mlm"))
    out = tmp_path_factory.mktemp("runs")
    spec = make_spec(out)
    code, results, stderr = launch_mlm_runs(root, out, spec["runs"], COMMON, timeout,
                                            record_batches=spec.get("record_batches", ()))
    if code != 0 or len(results) != len(spec["runs"]):
        pytest.fail(failure_report(out, spec["runs"], results, code, stderr))
    return out, results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _launch(tmp_path_factory, _spec)


def _close(a: list, b: list, tol: float = TOLERANCE) -> float:
    assert len(a) == len(b)
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst < tol, (a, b, worst)
    return worst


# The first test to ask for ``runs`` pays the launch (about 2-3 minutes on 2 cores).
LAUNCH = [needs_training, pytest.mark.distributed, pytest.mark.timeout(900)]


def launched(fn):
    for mark in LAUNCH:
        fn = mark(fn)
    return fn


@launched
def test_adam_and_dmuon_train_in_megatron_lm(runs, capsys):
    _, r = runs
    adam, dmuon = r["adam"]["losses"], r["dmuon"]["losses"]
    with capsys.disabled():
        print("\nMegatron-LM pretrain, GPT 2 x 64, 4 CPU ranks, lm loss per iteration:")
        for name in ("adam", "dmuon", "dmuon_tp2", "dmuon_pp2", "matrix", "zero3"):
            print(f"  {name:10s} " + " ".join(f"{x:.6f}" for x in r[name]["losses"]))
    for losses in (adam, dmuon):
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0] - 0.1
    assert adam[0] == dmuon[0]  # the same model and batch before the first update
    assert dmuon[-1] < adam[-1]  # Muon makes faster progress here (5.26 vs 5.30)


@launched
def test_dmuon_layouts(runs):
    """TP2 x DP2 is TP-invariant DMuon: the DP4 losses within fp32 tolerance.  PP2 x DP2
    initialises each stage with its own seed (Megatron-LM), so only its progress is checked."""
    _, r = runs
    _close(r["dmuon_tp2"]["losses"], r["dmuon"]["losses"])
    pp = r["dmuon_pp2"]["losses"]
    assert len(pp) == STEPS and all(math.isfinite(x) for x in pp) and pp[-1] < pp[0] - 0.1


@launched
def test_matrix_placement_and_zero3_reach_the_dmuon_loss(runs):
    _, r = runs
    dmuon = r["dmuon"]["losses"]
    for name in ("matrix", "zero3"):
        assert r[name]["losses"][0] == dmuon[0], name  # no update yet: bitwise the same
        _close(r[name]["losses"], dmuon)
    # the legacy model_provider path (get_model) with matrix placement, at TP2 x DP2
    _close(r["legacy_matrix_tp2"]["losses"], r["dmuon_tp2"]["losses"])


@launched
def test_save_resume_save_equals_the_uninterrupted_run(runs):
    """Megatron-LM's --save / --load (torch_dist, its default checkpoint flags; under dmuon
    the AdamW subset is then fully reshardable): the resumed run's losses and its final checkpoint (model and optimizer) are
    the uninterrupted run's, bit for bit."""
    import torch

    out, r = runs
    assert r["dmuon_resume"]["first_iteration"] == SAVE_AT + 1
    assert r["dmuon_resume"]["losses"] == r["dmuon"]["losses"][SAVE_AT:]
    last = f"iter_{STEPS:07d}"
    whole = checkpoint_tensors(out / "ck_dmuon" / last)
    resumed = checkpoint_tensors(out / "ck_resume" / last)
    assert set(whole) == set(resumed)
    # DMuon's momentum is in it (model space; no chained_N prefix in the fully reshardable
    # format, where every key names its parameter)
    assert any(k.startswith("optimizer.state.momentum_buffer.") for k in whole), sorted(whole)
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k


@launched
def test_checkpoints_reshard_from_dp4_to_tp2dp2_with_default_flags(runs):
    """Saved with Megatron-LM's default checkpoint flags at DP4, resumed at TP2 x DP2 (it
    refused with "(TP, PP) mismatch after resume ... dp_reshardable" before dmuon chose the
    fully reshardable format for its AdamW subset)."""
    _, r = runs
    for resumed, whole in (("dmuon_tp2_resume", "dmuon"), ("zero3_tp2_resume", "zero3"),
                           ("dmuon_split_tp2_resume", "dmuon")):  # split NS at TP2 x DP2
        assert r[resumed]["first_iteration"] == SAVE_AT + 1
        _close(r[resumed]["losses"], r[whole]["losses"][SAVE_AT:])


@launched
def test_split_newton_schulz_reaches_the_dmuon_loss(runs):
    """``--dmuon-split-parts 2`` (with Megatron's overlap flags): each unit's Newton-Schulz
    runs on 2 ranks, which all-reduce its Gram matrix point to point.  In fp32 NS (these
    runs) the map is the same and only the rounding moves: the Gram matrix's fp32 sum is
    taken part by part across ranks, and form 'ay' associates A (A X_j) where the whole
    unit computes (A A) X; a few roundings per NS step, each relative 2^-24, fewer than the
    input error TOLERANCE's derivation lets NS amplify (and an error entering at a later NS
    step is amplified by fewer steps), so TOLERANCE bounds the losses.  Its resume at
    TP2 x DP2 is checked with the other reshards
    (test_checkpoints_reshard_from_dp4_to_tp2dp2_with_default_flags)."""
    _, r = runs
    dmuon = r["dmuon"]["losses"]
    assert r["dmuon_split"]["losses"][0] == dmuon[0]  # no update yet: bitwise the same
    _close(r["dmuon_split"]["losses"], dmuon)


@launched
def test_default_precision_trains_through_megatron_lm(runs):
    """``--optimizer dmuon`` with no precision flag runs Newton-Schulz in bf16 (Megatron's
    default 'medium').  Its equality with the reference is test_dmuon.py's
    test_default_precision_equals_reference (one step, the bound derived there; beyond one
    step no bound from the arithmetic holds, TOLERANCE's comment says why).  Here, through
    Megatron-LM's loop: the first loss is the fp32 run's bit for bit (no update yet), the
    second is not (bf16 NS ran: its update differs from fp32 NS's by ~2^-8 relative, which
    moves the loss by ~1e-5 here, far above fp32's ~1e-7), and it trains as fp32 NS does:
    every later loss within 1% of the fp32 run's drop from the first loss, a check of
    training, not an equality (observed: <= 2.1e-5 absolute, 1e-4 of the drop)."""
    _, r = runs
    bf16, fp32 = r["dmuon_default_prec"]["losses"], r["dmuon"]["losses"]
    assert len(bf16) == STEPS and all(math.isfinite(x) for x in bf16)
    assert bf16[0] == fp32[0]
    assert bf16[1] != fp32[1]
    for b, f in zip(bf16[1:], fp32[1:]):
        assert abs(b - f) <= 0.01 * (fp32[0] - f), (bf16, fp32)


@launched
def test_reconstruction_baseline_reaches_the_dmuon_loss_and_resumes(runs):
    """``--optimizer muon_naive --dmuon-zero3`` with the default placement: ZeRO-3 on
    Megatron's even shards, every matrix gathered on every rank in the step.  The same
    update as DMuon (only the fp32 summation order differs: TOLERANCE), and its save ->
    resume gives the uninterrupted run's losses bit for bit."""
    _, r = runs
    dmuon, recon = r["dmuon"]["losses"], r["recon_zero3"]["losses"]
    assert recon[0] == dmuon[0]  # no update yet: bitwise the same
    _close(recon, dmuon)
    assert r["recon_zero3_resume"]["first_iteration"] == SAVE_AT + 1
    assert r["recon_zero3_resume"]["losses"] == recon[SAVE_AT:]


@launched
def test_zero3_bf16_saves_and_resumes_bitwise(runs):
    """``--bf16`` puts Float16Module between DDP and the model, and Megatron-LM's
    save_checkpoint asks the unwrapped model for its sharded state dict: ZeRO-3 must gather
    there too (it did not: the save read freed gather buffers, SIGSEGV).  MatrixFSDP and
    the even-shard reconstruction baseline (whose bf16 main params are built from the
    gathered buckets) both train, save, and resume to the uninterrupted losses bit for bit."""
    _, r = runs
    for name in ("zero3_bf16", "recon_bf16"):
        full, resumed = r[name]["losses"], r[f"{name}_resume"]["losses"]
        assert len(full) == STEPS and all(math.isfinite(x) for x in full)
        assert full[-1] < full[0] - 0.1, name
        assert r[f"{name}_resume"]["first_iteration"] == SAVE_AT + 1
        assert resumed == full[SAVE_AT:], name


@launched
def test_zero3_with_pipeline_parallelism(runs):
    """ZeRO-3 at PP2 x DP2 through Megatron-LM's loop (rank 0 died of SIGSEGV before the
    fix: a linear layer's returned bias read from a freed gather buffer) equals matrix
    placement without ZeRO-3 at the same layout (same initialisation: both PP2)."""
    _, r = runs
    assert r["zero3_pp2"]["losses"][0] == r["matrix_pp2"]["losses"][0]
    _close(r["zero3_pp2"]["losses"], r["matrix_pp2"]["losses"])


@launched
def test_activation_recompute(runs):
    """Full recompute re-runs each layer's forward in the backward: DMuon (with dropout, so
    the recomputed masks must be the forward's) and ZeRO-3 (whose hooks then see a layer's
    forward twice) reach the losses without recompute."""
    _, r = runs
    _close(r["dmuon_recompute"]["losses"], r["dmuon_dropout"]["losses"])
    _close(r["zero3_recompute"]["losses"], r["zero3"]["losses"])
    # the dropout is real: it changes the trajectory by far more than the tolerance
    assert max(abs(a - b) for a, b in zip(r["dmuon_dropout"]["losses"][1:],
                                          r["dmuon"]["losses"][1:])) > 10 * TOLERANCE


# --------------------------------------------------------------------------- PEFT
# One launch: the whole LoRA lifecycle through Megatron-LM's loop (the config container's
# pre-wrap hooks; the legacy model_provider path once), with sMuon on the adapters:
# pretrain with dmuon -> --load --finetune with LoRA + sMuon (adapter-only checkpoints at
# iterations 3 and 6) -> resume from iteration 3 (same layout, and at TP2) -> evaluate the
# base and the fine-tuned model -> merge (python -m megatron_muon.peft.merge) -> evaluate the
# merged checkpoint with no LoRA flag.  About 2 minutes on 2 cores.
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
SMUON = ["--optimizer", "smuon", *LORA, "--lr", "3e-3", "--lr-decay-style", "constant"]
EVAL = ["--skip-train", "--eval-iters", "2"]
RELORA = ["--relora-interval", "2", "--relora-reset", "prune"]  # restarts at steps 2, 4, 6
# Merged (W0 + gamma B A, rounded once to fp32) vs unmerged (x W0^T + gamma (x A^T) B^T):
# the same function, only the fp32 rounding differs.  Per adapted matmul (inner size
# n <= 256, + r = 4 for the branch) the output's relative error is <= (n + r) u in the worst
# case and ~ sqrt(n + r) u = 16 x 2^-24 ~ 1e-6 for independent roundings; 8 adapted
# matmuls in sequence (2 layers x qkv, proj, fc1, fc2), with norms and softmax of Lipschitz
# ~1 between them: ~ 1e-5 relative on the logits (|z| <= 10 here: ~ 1e-4 absolute at
# worst).  Cross-entropy moves by at most max |dz| per token (its gradient in z has L1 norm
# <= 2, and half of it is one entry): 1e-4.  Observed: identical to 7 digits.
MERGE_TOL = 1e-4


def _peft_spec(out: Path) -> dict:
    save = lambda d, every: ["--save", str(out / d), "--save-interval", str(every)]  # noqa: E731
    load = lambda d: ["--load", str(out / d)]  # noqa: E731
    return {"out": str(out), "record_batches": ["ft"], "runs": [
        ["pre", ["--optimizer", "dmuon"] + save("ck_pre", STEPS)],
        ["ft", SMUON + load("ck_pre") + ["--finetune"] + save("ck_ft", SAVE_AT)],
        ["ft_resume", SMUON + load("ck_ft") + ["--ckpt-step", str(SAVE_AT), "--lora-save-base"]
         + save("ck_resume", SAVE_AT)],
        ["ft_tp2_resume", SMUON + load("ck_ft") + ["--ckpt-step", str(SAVE_AT),
                                                    "--tensor-model-parallel-size", "2"]],
        ["relora", SMUON + RELORA + load("ck_pre") + ["--finetune"] + save("ck_relora", SAVE_AT)],
        ["relora_resume", SMUON + RELORA + load("ck_relora") + ["--ckpt-step", str(SAVE_AT)]
         + save("ck_relora_resume", SAVE_AT)],
        ["ft_adam", ["--optimizer", "adam", *LORA, "--lr", "1e-2", "--lr-decay-style",
                     "constant"] + load("ck_pre") + ["--finetune"]],
        ["ft_pp2", SMUON + load("ck_pre") + ["--finetune", "--pipeline-model-parallel-size", "2"]],
        ["base_eval", EVAL + load("ck_pre")],
        ["ft_eval", EVAL + LORA + load("ck_ft")],
        ["ft_eval_legacy", EVAL + LORA + load("ck_ft") + ["--legacy-model-provider"]],
        ["merge", {"merge": {"adapters": str(out / "ck_ft"), "out": str(out / "ck_merged")}}],
        ["merged_eval", EVAL + load("ck_merged")],
    ]}


@pytest.fixture(scope="module")
def peft_runs(tmp_path_factory):
    return _launch(tmp_path_factory, _peft_spec, timeout=600)


@launched
def test_lora_smuon_finetunes_a_dmuon_checkpoint(peft_runs, capsys):
    """--load (dmuon checkpoint) --finetune with LoRA + sMuon: the base weights stay bitwise
    the pretrained ones (frozen: nothing writes them), the adapters move (B starts at exactly
    0), the held-out loss falls, the frozen base has no optimizer state, and the checkpoint
    holds the adapters only."""
    import torch

    out, r = peft_runs
    with capsys.disabled():
        print("\nMegatron-LM LoRA r4 + sMuon fine-tuning of a dmuon checkpoint, lm loss:")
        for name in ("pre", "ft", "ft_resume", "ft_tp2_resume", "base_eval", "ft_eval",
                     "merged_eval"):
            print(f"  {name:14s} " + " ".join(f"{x:.6f}" for x in r[name]["losses"]))
    ft = r["ft"]["losses"]
    assert r["ft"]["first_iteration"] == 1 and len(ft) == STEPS  # --finetune: iteration 0
    assert all(math.isfinite(x) for x in ft)
    # An untrained adapter (B = 0) adds exactly 0, so any drop is training; observed 0.06.
    base_eval, ft_eval = r["base_eval"]["losses"], r["ft_eval"]["losses"]
    assert sum(ft_eval) / len(ft_eval) < sum(base_eval) / len(base_eval) - 100 * MERGE_TOL
    last = f"iter_{STEPS:07d}"
    pre = checkpoint_tensors(out / "ck_pre" / last)
    full = checkpoint_tensors(out / "ck_resume" / last)  # --lora-save-base: adapters, base
    base_keys = [k for k in pre if not k.startswith("optimizer.")]
    assert base_keys and all(torch.equal(full[k], pre[k]) for k in base_keys)
    adapters = checkpoint_tensors(out / "ck_ft" / last)
    mid = checkpoint_tensors(out / "ck_ft" / f"iter_{SAVE_AT:07d}")
    model_keys = [k for k in adapters if not k.startswith("optimizer.")]
    assert model_keys and all(".lora." in k for k in model_keys)  # adapter-only checkpoint
    assert all(k.startswith("optimizer.lora.") for k in adapters if k.startswith("optimizer."))
    for k in model_keys:
        if k.endswith(".lora.B"):
            assert adapters[k].abs().max() > 0, k  # it was initialised to exactly 0
        assert not torch.equal(adapters[k], mid[k]), k


@launched
def test_lora_save_resume_save_is_exact(peft_runs):
    """Adapter-only checkpoint at iteration 3 (+ the base it records) -> resume: the losses and
    the adapters + sMuon state at iteration 6 are the uninterrupted run's, bit for bit (same
    layout, the same ops in the same order).  At TP2 the adapters and sMuon's full-size
    state reshard; only the fp32 summation order differs (TOLERANCE's derivation: sMuon's
    Newton-Schulz runs the same quintic steps on its 2r x 2r core)."""
    import torch

    out, r = peft_runs
    ft = r["ft"]["losses"]
    assert r["ft_resume"]["first_iteration"] == SAVE_AT + 1
    assert r["ft_resume"]["losses"] == ft[SAVE_AT:]
    last = f"iter_{STEPS:07d}"
    whole = checkpoint_tensors(out / "ck_ft" / last)
    resumed = checkpoint_tensors(out / "ck_resume" / last)
    assert any(k.endswith(".momentum_buffer") for k in whole)
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
    assert r["ft_tp2_resume"]["first_iteration"] == SAVE_AT + 1
    _close(r["ft_tp2_resume"]["losses"], ft[SAVE_AT:])


@launched
def test_merged_checkpoint_loads_without_lora_flags(peft_runs):
    """python -m megatron_muon.peft.merge writes a release checkpoint that Megatron-LM loads
    with no LoRA flag; it evaluates to the unmerged model's loss (MERGE_TOL's derivation).
    The legacy model_provider path (get_model) builds the same LoRA model."""
    out, r = peft_runs
    assert (out / "ck_merged" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert r["merged_eval"]["first_iteration"] == 1  # a release checkpoint: iteration 0
    _close(r["merged_eval"]["losses"], r["ft_eval"]["losses"], MERGE_TOL)
    _close(r["ft_eval_legacy"]["losses"], r["ft_eval"]["losses"], MERGE_TOL)


@launched
def test_relora_adam_and_pp2_in_megatron_lm(peft_runs):
    """ReLoRA (restarts every 2 steps, pruned state; its checkpoints hold the merged base)
    resumes bit for bit; LoRA with Megatron's own Adam on the adapters and LoRA + sMuon at
    PP2 start from the same function (B = 0: the first loss is the base model's) and train."""
    import torch

    out, r = peft_runs
    assert r["relora_resume"]["first_iteration"] == SAVE_AT + 1
    assert r["relora_resume"]["losses"] == r["relora"]["losses"][SAVE_AT:]
    last = f"iter_{STEPS:07d}"
    whole = checkpoint_tensors(out / "ck_relora" / last)
    resumed = checkpoint_tensors(out / "ck_relora_resume" / last)
    assert set(whole) == set(resumed) and any(".lora." not in k for k in whole)  # with base
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
    pre = checkpoint_tensors(out / "ck_pre" / last)
    moved = [k for k in pre if not k.startswith("optimizer.") and k in whole
             and k.endswith("linear_qkv.weight")]
    assert moved and all(not torch.equal(pre[k], whole[k]) for k in moved)  # merged into base
    ft = r["ft"]["losses"]
    for name in ("relora", "ft_adam", "ft_pp2"):
        losses = r[name]["losses"]
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), name
    assert r["relora"]["losses"][:2] == ft[:2]  # identical until the first restart
    assert r["ft_adam"]["losses"][0] == ft[0]
    _close(r["ft_pp2"]["losses"][:1], ft[:1])
    assert r["ft_adam"]["losses"][1:] != ft[1:]


@launched
def test_lora_smuon_equals_the_single_process_harness(peft_runs, tmp_path):
    """The fine-tuning through Megatron-LM's loop (4 DP ranks: DDP's gradient all-reduce,
    Megatron's loss normalisation, scheduler, clipping and optimizer plumbing) against
    ``megatron_muon.testing.lora_replay``: the same base checkpoint, adapter seed and batches
    (the ones each rank read, recorded), trained in one process by ``LoRAOptimizer`` with no
    Megatron-LM loop, DDP or reduction.  Only the fp32 summation order differs, so
    TOLERANCE's derivation holds (sMuon's Newton-Schulz runs the same quintic steps on its
    2r x 2r core)."""
    import torch

    out, r = peft_runs
    res = tmp_path / "replay.json"
    done = subprocess.run([sys.executable, "-m", "megatron_muon.testing.lora_replay",
                           "--adapters", str(out / "ck_ft"), "--batches", str(out / "ft.batches"),
                           "--out", str(res)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    replay = json.loads(res.read_text())
    assert replay["ranks"] == 4 and replay["micro_per_rank"] == 1
    _close(replay["losses"], r["ft"]["losses"])
    # the adapters at the end (the checkpoint's full fp32 masters): the same within
    # TOLERANCE relative to their size
    factors = torch.load(res.with_suffix(".pt"))
    saved = checkpoint_tensors(out / "ck_ft" / f"iter_{STEPS:07d}")
    assert len(factors) == 8  # 2 layers x qkv, proj, fc1, fc2
    for name, (A, B) in factors.items():
        for factor, t in (("A", A), ("B", B)):
            ck = saved[f"optimizer.lora.{name}.{factor}.param"]
            assert (ck - t).abs().max() <= TOLERANCE * ck.abs().max(), (name, factor)


# --------------------------------------------------------------------------- the runner
def test_cpu_defaults_are_added_only_when_missing():
    argv = ["--vocab-size", "256", "--transformer-impl", "transformer_engine",
            "--distributed-backend=nccl", "--data-path", "x", "--eval-iters", "5"]
    out = with_cpu_defaults(argv)
    assert out[:len(argv)] == argv
    added = out[len(argv):]
    for flag in ("--transformer-impl", "--distributed-backend", "--mock-data", "--eval-iters",
                 "--no-load-rng"):
        assert flag not in added, flag
    for flag in ("--no-persist-layer-norm", "--inference-rng-tracker", "--use-cpu-initialization",
                 "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                 "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion"):
        assert added.count(flag) == 1, flag
    assert added[added.index("--tokenizer-type") + 1] == "NullTokenizer"
    plain = with_cpu_defaults(["--vocab-size", "8", "--load", "ck"])
    assert plain.count("--no-load-rng") == 1 and "--mock-data" in plain
    assert plain[plain.index("--distributed-backend") + 1] == "gloo"
    assert with_cpu_defaults(plain) == plain  # idempotent
    with pytest.raises(SystemExit, match="needs --vocab-size"):
        with_cpu_defaults([])


def test_cpu_run_usage_errors():
    out = subprocess.run([sys.executable, "-m", "megatron_muon.megatron.cpu_run", "no_such.py"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and "no such script: no_such.py" in out.stderr


def test_dataset_helpers_build_for_the_running_interpreter(tmp_path, monkeypatch):
    """A Megatron-LM checkout's Makefile takes the extension suffix from ``python3-config``
    on PATH; under pyenv its ``.python-version`` (3.12) points that at another interpreter,
    and the helper is built under a name this one cannot import (issue: a fresh checkout's
    README try-out died with "No module named ...helpers_cpp").  PATH here leads to such a
    wrong ``python3-config`` and to a ``python3`` without pybind11; the build must still give
    a module that this interpreter imports."""
    import importlib
    import sysconfig

    pytest.importorskip("pybind11")
    from megatron_muon.megatron.cpu_run import build_dataset_helpers

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3-config").write_text("#!/bin/sh\necho .cpython-312-x86_64-linux-gnu.so\n")
    (fake / "python3").write_text("#!/bin/sh\nexit 1\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    # the Makefile's shape, as a checkout's (suffix and includes from PATH's interpreter)
    (pkg / "Makefile").write_text(
        "CXXFLAGS += -O0 -shared -std=c++17 -fPIC\n"
        "CPPFLAGS += $(shell python3 -m pybind11 --includes)\n"
        "LIBEXT = $(shell python3-config --extension-suffix)\n"
        "OUT = helpers_cpp$(LIBEXT)\n"
        "default: $(OUT)\n"
        "$(OUT): helpers.cpp\n\t$(CXX) $(CXXFLAGS) $(CPPFLAGS) $< -o $@\n")
    (pkg / "helpers.cpp").write_text(
        "#include <pybind11/pybind11.h>\n"
        "PYBIND11_MODULE(helpers_cpp, m) { m.def(\"answer\", []() { return 42; }); }\n")
    build_dataset_helpers(pkg)
    assert (pkg / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}").is_file()
    monkeypatch.syspath_prepend(str(pkg))
    assert importlib.import_module("helpers_cpp").answer() == 42
