"""examples/pretrain_gpt.py: clear errors on bad input, and an exact save/resume.

The bad-input checks call the script's ``main()`` in this process (they fail before any
rank starts) plus one real command line; the end-to-end test trains 4 gloo ranks
(TP2 x DP2, dmuon) for 4 iterations, then 2 + save + resume 2, and compares losses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "pretrain_gpt.py"


@pytest.fixture(scope="module")
def pretrain():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_launcher_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _error(pretrain, capsys, *argv) -> str:
    code = pretrain.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.timeout(120)
def test_missing_data_path(pretrain, capsys, no_launcher_env, tmp_path):
    err = _error(pretrain, capsys, "--data-path", str(tmp_path / "nope.txt"))
    assert "--data-path" in err and "no such file or directory" in err


@pytest.mark.timeout(120)
def test_corrupt_data(pretrain, capsys, no_launcher_env, tmp_path):
    (tmp_path / "junk.bin").write_bytes(os.urandom(512))
    (tmp_path / "junk.idx").write_bytes(os.urandom(512))
    err = _error(pretrain, capsys, "--data-path", str(tmp_path / "junk"))
    assert "corrupt or unreadable Megatron dataset" in err
    binary = tmp_path / "blob.dat"
    binary.write_bytes(b"\x7fELF\x00\x01\x02" * 100)
    assert "not a text file" in _error(pretrain, capsys, "--data-path", str(binary))
    (tmp_path / "empty").mkdir()
    assert "no non-empty text files" in _error(pretrain, capsys, "--data-path",
                                               str(tmp_path / "empty"))


@pytest.mark.timeout(120)
def test_tp_pp_must_divide_world(pretrain, capsys, no_launcher_env):
    err = _error(pretrain, capsys, "--nproc", "4", "--tensor-model-parallel-size", "3")
    assert "TP x PP = 3 x 1 = 3 does not divide the world size 4" in err
    err = _error(pretrain, capsys, "--nproc", "6", "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2")
    assert "does not divide the world size 6" in err


@pytest.mark.timeout(120)
def test_unknown_optimizer_and_bad_muon_values(pretrain, capsys, no_launcher_env):
    err = _error(pretrain, capsys, "--optimizer", "lion")
    assert "argument --optimizer: invalid choice: 'lion'" in err
    err = _error(pretrain, capsys, "--muon-coefficient-type", "bogus")
    assert "--muon-coefficient-type 'bogus' is unknown" in err
    err = _error(pretrain, capsys, "--global-batch-size", "6")
    assert "--global-batch-size 6 must be a positive multiple" in err


@pytest.mark.timeout(120)
def test_command_line_error_is_one_line():
    """The real CLI: exit code 2, one line on stderr, no traceback, nothing started."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, str(SCRIPT), "--tensor-model-parallel-size", "3"],
                         capture_output=True, text=True, timeout=110, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: TP x PP = 3 x 1 = 3 does not divide the world size 4 "
        "(DP = world / (TP x PP) must be a whole number)"], out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_stdlib_corpus_is_there(pretrain):
    root, files = pretrain.stdlib_files()
    assert len(files) > 100 and sum(f.stat().st_size for f in files) > 2_000_000
    assert not any("/test/" in str(f) for f in files)
    assert pretrain.ByteTokenizer.eod == 0 and pretrain.ByteTokenizer.vocab_size == 256


# --------------------------------------------------------------------------- end to end
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr-warmup-iters", "1", "--lr-decay-iters", "4",
         "--log-interval", "1", "--tensor-model-parallel-size", "2", "--nproc", "4",
         "--optimizer", "dmuon"]


def _run(tmp, *argv, name):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    log = tmp / f"{name}.json"
    out = subprocess.run([sys.executable, str(SCRIPT), *SMALL, "--data-cache-dir",
                          str(tmp / "cache"), "--log-json", str(log), *argv],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, f"{name}: {out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return {r["iter"]: r["loss"] for r in json.loads(log.read_text())["steps"]}, out.stdout


@pytest.mark.timeout(600)
def test_save_and_resume_match_an_uninterrupted_run(tmp_path):
    """The README's pair, twice: a run that stops at --exit-interval, a resume that saves
    again and stops, and a second resume to the end, against one uninterrupted run of the
    same --train-iters schedule.  Equal losses: same layout, every tensor restored bit for
    bit, the same data order (the sample position follows from the iteration alone)."""
    full, out = _run(tmp_path, "--train-iters", "6", name="full")
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and "summary: dmuon, TP2 x PP1 x DP2" in out
    assert "forward-backward" in out and "optimizer step" in out

    ckpt = tmp_path / "ckpt"
    first, out = _run(tmp_path, "--train-iters", "6", "--save", str(ckpt), "--exit-interval",
                      "2", name="first")
    assert "exiting at iteration 2" in out and (ckpt / "latest").read_text().strip() == "2"
    second, out = _run(tmp_path, "--train-iters", "6", "--load", str(ckpt), "--save", str(ckpt),
                       "--exit-interval", "4", name="second")
    assert "resumed from" in out and (ckpt / "latest").read_text().strip() == "4"
    third, out = _run(tmp_path, "--train-iters", "6", "--load", str(ckpt), "--save", str(ckpt),
                      name="third")
    assert (ckpt / "latest").read_text().strip() == "6" and "LR schedule" not in out
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4] and sorted(third) == [5, 6]
    assert {**first, **second, **third} == full


@pytest.mark.timeout(300)
def test_resume_with_another_schedule_needs_a_flag(tmp_path):
    """Megatron-LM's rule: a changed LR schedule on resume is an error unless
    --use-checkpoint-opt-param-scheduler or --override-opt-param-scheduler says which wins;
    with the flag, one line says which schedule is used."""
    ckpt = tmp_path / "ckpt"
    _run(tmp_path, "--train-iters", "2", "--save", str(ckpt), name="first")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base = [sys.executable, str(SCRIPT), *SMALL, "--data-cache-dir", str(tmp_path / "cache"),
            "--train-iters", "3", "--lr-decay-iters", "6", "--load", str(ckpt)]
    bad = subprocess.run(base, capture_output=True, text=True, timeout=240, env=env)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert "error: cannot load checkpoint" in bad.stderr
    assert "--lr-decay-iters 6 (checkpoint: 4)" in bad.stderr
    ok, out = _run(tmp_path, "--train-iters", "3", "--lr-decay-iters", "6", "--load", str(ckpt),
                   "--use-checkpoint-opt-param-scheduler", name="ok")
    assert sorted(ok) == [3]
    assert "LR schedule: using the checkpoint's, not the command line's: --lr-decay-iters 4 " \
           "(command line: 6)" in out
