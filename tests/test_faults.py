"""Reliability: faults and interruptions end cleanly, with a clear message (one section per area)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


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
