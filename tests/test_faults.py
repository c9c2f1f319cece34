"""Faults a user can run into: each ends the run with one clear line and a non-zero code."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "pretrain_gpt.py"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# ------------------------------------------------------------------ non-finite values and bad shapes
TINY = ["--nproc", "2", "--tensor-model-parallel-size", "1", "--hidden-size", "64",
        "--num-layers", "2", "--seq-length", "32", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--log-interval", "1", "--lr-warmup-iters", "1"]
DIVERGE = ["--lr", "1e6", "--min-lr", "0", "--lr-warmup-iters", "0"]  # NaN by iteration ~3

# The ranks of examples/pretrain_gpt.py, with NaN written into rank POISON_RANK's gradients
# at iteration POISON_ITER, either before Megatron DDP reduces them ("local": what a bad
# microbatch on one rank looks like) or after ("shard": only that rank's reduced shard).
_POISONED_RANK = r"""
import importlib.util, math, os, sys
spec = importlib.util.spec_from_file_location("pretrain_gpt", os.environ["SCRIPT"])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
where, rank, it = os.environ["POISON"].split(":")
build_model = m.build_model

def poisoned_build_model(args):
    model = build_model(args)
    config, calls = model[0].config, [0]
    finalize = config.finalize_model_grads_func

    def poison():
        if os.environ["RANK"] == rank and calls[0] == int(it):
            for p in model[0].parameters():
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.fill_(math.nan)

    def finalize_model_grads(*a, **k):  # once per iteration, after the last backward
        calls[0] += 1
        if where == "local":
            poison()
        finalize(*a, **k)
        if where == "shard":
            poison()
    config.finalize_model_grads_func = finalize_model_grads
    return model

m.build_model = poisoned_build_model
m.exit_with(m.main())
"""
_LAUNCH_POISONED = r"""
import os, sys
from megatron_muon.testing.launch import start_ranks, supervise
procs = start_ranks([sys.executable, "-c", os.environ["RANK_CODE"], *sys.argv[1:]], 2, threads=1)
sys.exit(supervise(procs, timeout=float(os.environ["TIMEOUT"]))[0])
"""


def _run(*argv, poison=None, timeout=240):
    """(exit code, stdout, stderr, seconds) of the example (or its poisoned ranks)."""
    if poison is None:
        cmd, env = [sys.executable, str(SCRIPT), *argv], _env()
    else:
        cmd = [sys.executable, "-c", _LAUNCH_POISONED, *argv]
        env = _env(SCRIPT=str(SCRIPT), POISON=poison, RANK_CODE=_POISONED_RANK,
                   TIMEOUT=str(timeout - 20))
    t = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, out.stdout, out.stderr, time.monotonic() - t


def _one_error(code, stdout, stderr, *, expect_code=1) -> str:
    """The single ``error:`` line, last on stderr; no traceback anywhere.  (Megatron's own
    warnings may come before it: megatron-core 0.19 logs GPTModel's deprecation.)"""
    assert code == expect_code, f"exit code {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr[-3000:]
    assert errors[0].startswith("error: "), stderr[-3000:]
    return errors[0]


@pytest.mark.timeout(300)
def test_nan_loss_stops_the_run_with_one_line():
    """--lr 1e6 diverges: the first non-finite loss stops the run (Megatron-LM's default
    --check-for-nan-in-loss-and-grad), once per job, naming the iteration; exit code 1."""
    err = _one_error(*_run(*TINY, *DIVERGE, "--train-iters", "30")[:3])
    assert " loss is NaN on rank " in err and err.startswith("error: iteration "), err
    assert "lower --lr (now 1e+06)" in err and "--no-check-for-nan-in-loss-and-grad" in err
    iteration = int(err.split()[2].rstrip(":"))
    assert 2 <= iteration < 30, err


@pytest.mark.timeout(300)
def test_dmuon_check_finite_is_one_line():
    """--dmuon-check-finite's FloatingPointError, raised on every rank (NaN everywhere):
    one line, not one traceback per rank.  --no-check-for-nan-in-loss-and-grad turns the
    script's own checks off, so the NaN gets as far as the DMuon step."""
    err = _one_error(*_run(*TINY, *DIVERGE, "--train-iters", "30",
                           "--no-check-for-nan-in-loss-and-grad", "--dmuon-check-finite")[:3])
    assert err.startswith("error: iteration ") and ": rank " in err, err
    assert "DMuon: non-finite (NaN/Inf) Muon gradient or momentum" in err, err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where,flags,expect", [
    # Megatron DDP's check_for_nan_in_grad: rank 1 stops before the reduce-scatter that
    # rank 0 is waiting in
    ("local", [], "error: iteration 2: gradient is NaN on rank 1 (bucket #0, before the "
                  "data-parallel reduction); the training diverged"),
    # the global grad norm from optimizer.step(): NaN on every rank
    ("shard", [], "error: iteration 2: gradient norm is NaN; the training diverged"),
    # DMuon raises on rank 1 only; rank 0 waits in the owners' all-to-all
    ("shard", ["--dmuon-check-finite"], "error: iteration 2: rank 1: DMuon: non-finite"),
], ids=["ddp-check", "grad-norm", "dmuon-check-finite-one-rank"])
def test_nan_gradient_on_one_rank(where, flags, expect):
    code, out, err, seconds = _run(*TINY, "--train-iters", "4", *flags, poison=f"{where}:1:2")
    line = _one_error(code, out, err)
    assert line.startswith(expect), line
    assert " iter     1/4 " in out and " iter     2/4 " not in out


def _usage_error(*argv) -> str:
    code, out, err, _ = _run(*argv, timeout=120)
    return _one_error(code, out, err, expect_code=2)


@pytest.mark.timeout(120)
def test_odd_head_dim_is_a_usage_error():
    err = _usage_error(*TINY, "--hidden-size", "66", "--num-attention-heads", "2")
    assert err == ("error: --hidden-size 66 / --num-attention-heads 2 = head dim 33, but rotary "
                   "position embeddings need an even head dim"), err


@pytest.mark.timeout(120)
def test_ffn_size_must_split_over_tp():
    err = _usage_error(*TINY, "--tensor-model-parallel-size", "2", "--ffn-hidden-size", "129")
    assert err == "error: --ffn-hidden-size 129 must be a positive multiple of TP (2)", err
