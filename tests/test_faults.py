"""Faults: what a run does when something breaks (one clear line, a non-zero exit, no hang).

One section per area: the launcher, checkpoints, non-finite values and bad shapes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ launcher
# megatron_muon.testing.launch (the tiny torchrun under run_ranks and the examples): a rank
# killed by a signal is named, Ctrl-C / SIGTERM on the launcher stop every rank, nothing of a
# job survives (checked in /proc by process group), and concurrent launches do not race for
# the rendezvous port.  Deadlines poll for a condition, so the tests pass on a loaded machine.

_LAUNCH_REPO = Path(__file__).resolve().parents[1]
_LAUNCH_RANK = [sys.executable, "-m", "megatron_muon.testing.launch_workers"]  # + pid_dir


def _launch_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(_LAUNCH_REPO), env.get("PYTHONPATH", "")])
    return env


def _launch_live(pgids: set, pids: set = frozenset()) -> set:
    """Live (non-zombie) processes that are in ``pgids`` or are one of ``pids``."""
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    live = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z" and (int(fields[2]) in pgids or int(entry) in pids):
            live.add(int(entry))
    return live


def _launch_assert_gone(pgids: set, pids: set = frozenset(), within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while (live := _launch_live(pgids, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live, f"processes of the job survived: {sorted(live)}"


def _launch_wait_pids(pid_dir: Path, nranks: int, within: float = 240.0) -> dict:
    """{rank: [rank pid, its children's pids]} once every rank has written its pid file."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        files = [pid_dir / f"rank{r}.pids" for r in range(nranks)]
        if all(f.exists() for f in files):
            return {r: [int(x) for x in f.read_text().split()] for r, f in enumerate(files)}
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not start within {within:.0f} s")


def _launch_kill_later(pid_dir: Path, nranks: int, victim: int, box: dict):
    """A thread that SIGKILLs rank ``victim`` once every rank runs (pids and time in ``box``)."""
    import threading

    def run():
        try:
            box["pids"] = _launch_wait_pids(pid_dir, nranks)
        except AssertionError as err:
            box["error"] = err
            return
        box["killed_at"] = time.monotonic()
        os.kill(box["pids"][victim][0], signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(420)
def test_launch_killed_rank_is_named_and_nothing_of_the_job_survives(tmp_path, capfd):
    from megatron_muon.testing.launch import start_ranks, supervise

    procs = start_ranks([*_LAUNCH_RANK, str(tmp_path)], 3, env=_launch_env())
    pgids = {p.pid for p in procs}
    box: dict = {}
    killer = _launch_kill_later(tmp_path, 3, 1, box)
    code, rank = supervise(procs, timeout=300)  # the timeout only guards the test
    killer.join(5)
    assert "error" not in box, box.get("error")
    stop_s = time.monotonic() - box["killed_at"]
    err = capfd.readouterr().err
    assert (code, rank) == (128 + signal.SIGKILL, 1), err
    lines = [line for line in err.splitlines() if "rank" in line]
    assert lines == ["error: rank 1 was killed by signal SIGKILL; stopping the other ranks"], err
    assert "Traceback" not in err
    assert stop_s < 60, f"the other ranks took {stop_s:.0f} s to stop"
    # the killed rank's own children (spawn worker, resource tracker) die with the others
    _launch_assert_gone(pgids, {pid for pids in box["pids"].values() for pid in pids})


@pytest.mark.timeout(420)
def test_launch_run_ranks_names_the_killed_rank(tmp_path):
    from megatron_muon.testing.launch import RankFailure, run_ranks

    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    box: dict = {}
    killer = _launch_kill_later(pid_dir, 2, 1, box)
    with pytest.raises(RankFailure) as failure:
        run_ranks("megatron_muon.testing.launch_workers:stall_with_child", 2,
                  dict(pid_dir=str(pid_dir)), timeout=300, workdir=str(tmp_path / "job"))
    killer.join(5)
    assert "error" not in box, box.get("error")
    message = str(failure.value)
    assert "rank 1 was killed by signal SIGKILL" in message and "log tail" in message, message
    pids = {pid for pids in box["pids"].values() for pid in pids}
    _launch_assert_gone({pids_[0] for pids_ in box["pids"].values()}, pids)


class _LaunchOutput:
    """A subprocess's merged output, read by a thread (so waiting for a line has a deadline)."""

    def __init__(self, proc: subprocess.Popen):
        import threading

        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, predicate, within: float) -> None:
        deadline = time.monotonic() + within
        while not predicate(self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.thread.join(5)
                raise AssertionError("launcher ended or timed out early:\n" +
                                     "".join(self.lines)[-4000:])
            time.sleep(0.1)

    def text(self) -> str:
        self.thread.join(30)  # EOF: nothing holds the pipe any more
        assert not self.thread.is_alive(), "a process of the job still holds the output pipe"
        return "".join(self.lines)


def _launch_children(pid: int) -> set:
    children = set()
    for entry in os.listdir("/proc"):
        try:
            fields = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError, ValueError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:
            children.add(int(entry))
    return children


_LAUNCHER = ("import sys\n"
             "from megatron_muon.testing.launch import start_ranks, supervise\n"
             "procs = start_ranks([sys.executable, '-m', 'megatron_muon.testing.launch_workers', "
             "sys.argv[1]], 2)\n"
             "sys.exit(supervise(procs)[0])\n")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("sig,code,line", [
    (signal.SIGINT, 130, "interrupted: stopped 2 ranks"),
    (signal.SIGTERM, 143, "interrupted by SIGTERM: stopped 2 ranks"),
], ids=["SIGINT", "SIGTERM"])
def test_launch_signal_on_launcher_stops_every_rank(tmp_path, sig, code, line):
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)], env=_launch_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = _LaunchOutput(proc)
        out.wait_for(lambda lines: sum(l.startswith("ready rank") for l in lines) == 2, 300)
        pids = _launch_wait_pids(tmp_path, 2, 10)
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == code, "".join(out.lines)
        text = out.text()
    finally:
        proc.kill()
    assert line in text.splitlines() and "Traceback" not in text, text
    _launch_assert_gone({p[0] for p in pids.values()}, {x for p in pids.values() for x in p})


@pytest.mark.timeout(600)
def test_launch_ctrl_c_on_pretrain_example(tmp_path):
    """Ctrl-C on ``examples/pretrain_gpt.py`` (the terminal's SIGINT reaches only the launcher:
    the ranks run in their own sessions) ends with 130, one ``interrupted`` line, no tracebacks
    and no rank left."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(os.__file__).read_text() * 4)
    cmd = [sys.executable, str(_LAUNCH_REPO / "examples" / "pretrain_gpt.py"),
           "--train-iters", "1000", "--log-interval", "1", "--nproc", "2",
           "--tensor-model-parallel-size", "1", "--hidden-size", "64", "--num-layers", "2",
           "--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2",
           "--data-path", str(corpus), "--data-cache-dir", str(tmp_path / "cache")]
    proc = subprocess.Popen(cmd, env=_launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out = _LaunchOutput(proc)
        out.wait_for(lambda lines: any(" iter " in l for l in lines), 480)
        ranks = _launch_children(proc.pid)
        assert len(ranks) == 2, ranks
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, "".join(out.lines)[-4000:]
        text = out.text()
    finally:
        proc.kill()
    assert "interrupted: stopped 2 ranks" in text.splitlines(), text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    _launch_assert_gone(ranks, ranks)


@pytest.mark.timeout(600)
def test_launch_concurrent_jobs_do_not_race_for_ports():
    import errno
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from megatron_muon.testing.launch import run_ranks, start_ranks, supervise

    # the rendezvous port stays bound by the launcher from the moment it is chosen
    procs = start_ranks([sys.executable, "-c", "pass"], 1)
    port = procs.store.port
    with socket.socket() as s, pytest.raises(OSError) as taken:
        s.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    assert supervise(procs, timeout=120) == (0, None)

    jobs = 4
    with ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run_ranks, "megatron_muon.testing.launch_workers:rank_sum", 2,
                               timeout=400) for _ in range(jobs)]
        results = [f.result(timeout=500) for f in futures]
    assert results == [[1, 1]] * jobs


# ------------------------------------------------------------------ checkpoints
# One save-heavy run of the example per module (2 ranks, tiny model, a checkpoint after
# every iteration) is SIGKILLed on one rank after it completed a checkpoint or two; its
# checkpoint directory is what the other tests copy and damage.

_CKPT_SCRIPT = REPO / "examples" / "pretrain_gpt.py"
_CKPT_TINY = ["--nproc", "2", "--tensor-model-parallel-size", "1", "--hidden-size", "64",
              "--num-layers", "2", "--seq-length", "32", "--global-batch-size", "4",
              "--micro-batch-size", "2", "--lr-warmup-iters", "1", "--log-interval", "1",
              "--lr-decay-iters", "1000"]  # one schedule for the saving and resuming runs
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
def test_unknown_optimizer_sharding_type_is_refused_before_anything_is_written(tmp_path):
    from megatron_muon.megatron.checkpoint import save_checkpoint

    with pytest.raises(ValueError, match="optim_sharding_type must be one of fully_reshardable, "
                                         "dp_reshardable, fully_sharded_model_space, got 'dp'"):
        save_checkpoint(str(tmp_path), [], None, 1, optim_sharding_type="dp")
    assert list(tmp_path.iterdir()) == []


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
    # DMuon finds it on rank 1 only; the ranks agree first and every rank raises the same
    # error (naming rank 1), so whichever reports first says the same
    ("shard", ["--dmuon-check-finite"], "error: iteration 2: rank "),
], ids=["ddp-check", "grad-norm", "dmuon-check-finite-one-rank"])
def test_nan_gradient_on_one_rank(where, flags, expect):
    code, out, err, seconds = _run(*TINY, "--train-iters", "4", *flags, poison=f"{where}:1:2")
    line = _one_error(code, out, err)
    assert line.startswith(expect), line
    if flags:
        assert ": DMuon: non-finite (NaN/Inf) Muon gradient or momentum (found on rank 1)" \
            in line, line
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


# ------------------------------------------------------------------ rank-local failures
# A check that fails on one rank inside a sequence of collectives must fail on every rank
# (the same error), or the others wait in the next collective until the NCCL timeout.  On
# gloo a peer left waiting times out too (the harness's timeout bounds it), so "no hang" is
# "every rank returned the error within the timeout".
@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [{}, dict(dmuon_placement="matrix", dmuon_tp_mode="blockwise")],
                         ids=["exchange", "no_exchange"])
def test_check_finite_on_one_rank_raises_the_same_error_on_every_rank(extra):
    """``dmuon_check_finite``: a NaN in rank 1's momentum shard only.  Every rank of the
    exchange group raises the same FloatingPointError at the same step, naming rank 1.
    Matrix placement with blockwise TP has no exchange (a group of one rank): the ranks then
    agree over the DP group whose param all-gather follows (regression: rank 1 raised alone
    and rank 0 waited in that all-gather until the timeout)."""
    from megatron_muon.testing.launch import run_ranks

    res = run_ranks("megatron_muon.testing.workers:check_finite_one_rank", 2,
                    dict(cfg={"num_layers": 2}, opt=dict(lr=2e-3, **extra), poison_rank=1,
                         poison_step=1), timeout=120)
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors, errors
    (err,) = errors
    assert err.startswith("DMuon: non-finite (NaN/Inf) Muon gradient or momentum (found on "
                          "rank 1);"), err
    assert "dmuon_check_finite" in err
    assert [r["steps"] for r in res] == [1, 1]  # step 0 ran, step 1 raised everywhere


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,expect", [
    ("bucket", "DMuon exchange: ranks disagree on the all-to-alls of a step: all-to-all #2 is "
               "the scatter of bucket 0 on rank 0 but the gather of bucket 7 on rank {bad} "
               "(4 and 6 all-to-alls)"),
    ("count", "DMuon exchange: the gather of bucket 1 disagrees across ranks: rank {bad} sends "
              "28 elements to rank {owner}, which expects 32;"),
])
def test_exchange_mismatch_on_one_rank_fails_on_every_rank_naming_the_bucket(kind, expect):
    """One rank of four builds the exchange from another geometry (w1 in another bucket, or
    a shorter piece of w1): construction fails on every rank with the same message naming
    the bucket (and the ranks and counts) instead of an all-to-all that hangs or mixes up
    the data."""
    from megatron_muon.testing.launch import run_ranks

    res = run_ranks("megatron_muon.testing.workers:exchange_mismatch", 4, dict(kind=kind),
                    timeout=120)
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors, errors
    want = expect.format(bad=res[0]["bad_rank"], owner=res[0]["owner_of_w1"])
    assert next(iter(errors)).startswith(want), (errors, want)


@pytest.mark.timeout(300)
def test_exchange_check_passes_an_agreeing_geometry():
    """The same four ranks without a mismatch: the engine builds and runs (the check only
    reads counts)."""
    from megatron_muon.testing.launch import run_ranks

    res = run_ranks("megatron_muon.testing.workers:exchange_mismatch", 4, dict(kind=None),
                    timeout=120)
    assert all(r["error"] is None and r["out"].isfinite().all() for r in res)
