"""Faults: what a run does when something breaks (one clear line, a non-zero exit, no hang)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ checkpoints
# One save-heavy run of the example per module (2 ranks, tiny model, a checkpoint after
# every iteration) is SIGKILLed on one rank after it completed a checkpoint or two; its
# checkpoint directory is what the other tests copy and damage.

_CKPT_SCRIPT = REPO / "examples" / "pretrain_gpt.py"
_CKPT_TINY = ["--nproc", "2", "--tensor-model-parallel-size", "1", "--hidden-size", "64",
              "--num-layers", "2", "--seq-length", "32", "--global-batch-size", "4",
              "--micro-batch-size", "2", "--lr-warmup-iters", "1", "--log-interval", "1"]
_CKPT_PROMPT_S = 240  # far below the 10-minute collective timeout that a hang would take


def _ckpt_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _ckpt_cmd(cache: Path, *argv) -> list:
    return [sys.executable, str(_CKPT_SCRIPT), *_CKPT_TINY, "--data-cache-dir", str(cache), *argv]


def _ckpt_run(cache: Path, *argv, timeout: float = _CKPT_PROMPT_S):
    t0 = time.monotonic()
    out = subprocess.run(_ckpt_cmd(cache, *argv), capture_output=True, text=True,
                         timeout=timeout, env=_ckpt_env())
    return out, time.monotonic() - t0


def _ckpt_latest(directory: Path) -> int:
    return int((directory / "latest").read_text().strip())


@pytest.fixture(scope="module")
def _ckpt_killed_save(tmp_path_factory):
    """Run with --save-interval 1, SIGKILL rank 1 once `latest` says 2 or more."""
    import psutil

    tmp = tmp_path_factory.mktemp("ckpt")
    cache, save = tmp / "cache", tmp / "ckpt"
    log = open(tmp / "killed.log", "w+")
    launcher = subprocess.Popen(_ckpt_cmd(cache, "--train-iters", "1000", "--save", str(save),
                                          "--save-interval", "1"),
                                stdout=log, stderr=subprocess.STDOUT, env=_ckpt_env())
    ranks, killed = [], None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and launcher.poll() is None:
            try:
                if _ckpt_latest(save) >= 2:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        assert launcher.poll() is None, "the save run ended before it was killed"
        assert _ckpt_latest(save) >= 2, "no checkpoint after 300 s"
        ranks = [p for p in psutil.Process(launcher.pid).children()
                 if str(_CKPT_SCRIPT) in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        by_rank = {p.environ().get("RANK"): p for p in ranks}
        killed = by_rank.get("1", ranks[-1])
        killed.kill()  # SIGKILL: no handler, no cleanup, maybe in the middle of a save
        code = launcher.wait(timeout=120)  # the launcher stops the other rank itself
    finally:
        for p in [launcher, *ranks]:  # only what this fixture started
            try:
                p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        log.seek(0)
        output = log.read()
        log.close()
    assert code != 0, output[-3000:]
    return dict(cache=cache, save=save, output=output)


def _ckpt_copy(saved: dict, tmp_path: Path) -> tuple[Path, int, Path]:
    """A private copy of the checkpoint directory: (directory, latest step, iter dir)."""
    d = tmp_path / "ckpt"
    shutil.copytree(saved["save"], d)
    step = _ckpt_latest(d)
    return d, step, d / f"iter_{step:07d}"


def _ckpt_assert_one_line_error(out, elapsed: float, *needles: str) -> str:
    text = out.stdout + out.stderr
    errors = [line for line in text.splitlines() if "error:" in line]
    assert out.returncode not in (0, 124), text[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: cannot load checkpoint "), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert " iter " not in text, "training went on after the failed load"
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert elapsed < _CKPT_PROMPT_S
    return errors[0]


@pytest.mark.timeout(600)
def test_killed_save_keeps_latest_on_a_complete_checkpoint_and_resumes(_ckpt_killed_save,
                                                                       tmp_path):
    from megatron_muon.megatron.checkpoint import checkpoint_problem

    d, step, path = _ckpt_copy(_ckpt_killed_save, tmp_path)
    assert step >= 2
    assert checkpoint_problem(str(path)) is None  # every file there, full length
    # Resume from it and keep saving into the same directory (over the interrupted save).
    out, _ = _ckpt_run(_ckpt_killed_save["cache"], "--train-iters", str(step + 2),
                       "--load", str(d), "--save", str(d), "--save-interval", "1")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert f"resumed from {d} at iteration {step}" in out.stdout
    assert f"iter {step + 1:5d}/" in out.stdout and "summary:" in out.stdout
    assert _ckpt_latest(d) == step + 2
    assert checkpoint_problem(str(d / f"iter_{step + 2:07d}")) is None


@pytest.mark.timeout(600)
def test_truncated_checkpoint_file_is_one_line_error(_ckpt_killed_save, tmp_path):
    d, step, path = _ckpt_copy(_ckpt_killed_save, tmp_path)
    victim = sorted(path.glob("*.distcp"))[-1]
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size // 3)
    out, elapsed = _ckpt_run(_ckpt_killed_save["cache"], "--train-iters", str(step + 2),
                             "--load", str(d))
    err = _ckpt_assert_one_line_error(out, elapsed, str(path), victim.name, "on rank ",
                                      "truncated")
    assert err.startswith(f"error: cannot load checkpoint {path} on rank 0: file {victim.name}")


@pytest.mark.timeout(600)
def test_deleted_checkpoint_file_is_one_line_error(_ckpt_killed_save, tmp_path):
    d, step, path = _ckpt_copy(_ckpt_killed_save, tmp_path)
    (path / ".metadata").unlink()  # common.pt exists only before megatron-core 0.17
    out, elapsed = _ckpt_run(_ckpt_killed_save["cache"], "--train-iters", str(step + 2),
                             "--load", str(d))
    _ckpt_assert_one_line_error(out, elapsed, str(path), "file .metadata is missing", "on rank ")


@pytest.mark.timeout(600)
def test_missing_load_dir_warns_and_starts_from_scratch(_ckpt_killed_save, tmp_path):
    missing = tmp_path / "nope"
    out, _ = _ckpt_run(_ckpt_killed_save["cache"], "--train-iters", "2", "--load", str(missing))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert f"WARNING: --load {missing}: no such directory; starting from scratch" in out.stdout
    assert "iter     2/2" in out.stdout and "summary:" in out.stdout
    from megatron_muon.megatron.checkpoint import no_checkpoint_reason

    assert no_checkpoint_reason(str(tmp_path)).startswith("no 'latest' file")  # the other case


def _ckpt_damage(path: Path, name: str, how: str) -> None:
    f = path / name
    if how == "deleted":
        f.unlink()
    else:
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)


def _ckpt_load_error(directory: Path):
    """load_checkpoint in this process (a 1-rank gloo group): the CheckpointLoadError."""
    import torch.distributed as dist

    from megatron_muon.megatron.checkpoint import CheckpointLoadError, load_checkpoint

    own = not dist.is_initialized()
    if own:
        store = directory.parent / f"_ckpt_store_{directory.name}"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointLoadError) as info:
            load_checkpoint(str(directory), model=None, optimizer=None)  # fails before using them
    finally:
        if own:
            dist.destroy_process_group()
    assert isinstance(info.value, RuntimeError) and info.value.all_ranks
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_every_checkpoint_file_is_checked_before_loading(_ckpt_killed_save, tmp_path, how):
    """Each file dist_checkpointing needs, truncated or deleted: named before anything loads."""
    from megatron_muon.megatron.checkpoint import checkpoint_problem

    src, step, _ = _ckpt_copy(_ckpt_killed_save, tmp_path / "src")
    names = sorted(os.listdir(src / f"iter_{step:07d}"))
    assert {".metadata", "metadata.json"} <= set(names)  # + common.pt before mcore 0.17
    assert any(n.endswith(".distcp") for n in names)
    for name in names:
        d = tmp_path / f"{how}-{name}"
        shutil.copytree(src, d)
        path = d / f"iter_{step:07d}"
        _ckpt_damage(path, name, how)
        problem = checkpoint_problem(str(path))
        assert problem is not None and problem.startswith(f"file {name} is "), (name, problem)
        assert ("missing" if how == "deleted" else "truncated or corrupt") in problem
        err = _ckpt_load_error(d)
        assert str(err) == f"cannot load checkpoint {path} on rank 0: {problem}"


@pytest.mark.timeout(300)
def test_bad_latest_is_an_error_not_a_restart(_ckpt_killed_save, tmp_path):
    d, step, _ = _ckpt_copy(_ckpt_killed_save, tmp_path)
    (d / "latest").write_text("garbage\n")
    assert "'latest' file does not hold an iteration number" in str(_ckpt_load_error(d))
    (d / "latest").write_text(str(step + 100))
    err = _ckpt_load_error(d)
    assert str(err).startswith(f"cannot load checkpoint {d / f'iter_{step + 100:07d}'} on rank 0: "
                               "no such directory")


def test_latest_is_written_atomically(tmp_path, monkeypatch):
    from megatron_muon.megatron import checkpoint

    target = tmp_path / "latest"
    target.write_text("3")
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(checkpoint.os, "replace",
                        lambda a, b: (seen.append((Path(a).read_text(), target.read_text())),
                                      real_replace(a, b)))
    checkpoint._write_atomically(str(target), "4")
    assert seen == [("4", "3")] and target.read_text() == "4"
    assert os.listdir(tmp_path) == ["latest"]
