"""A tiny torchrun: start N local ranks of a command, supervise them, leave nothing behind.

``start_ranks(cmd, nproc)`` + ``supervise(procs, timeout)`` are what the example training
jobs and ``python -m megatron_muon.megatron.cpu_run`` launch their ranks with when not
started by torchrun; the test harness (``megatron_muon.testing.launch.run_ranks``) runs a
Python function on N ranks on top of them.

* rendezvous without a port race: the parent hosts the ``TCPStore`` on a port the OS picks
  and keeps it bound for the whole run; the ranks join it as clients, as under torchrun
  (``TORCHELASTIC_USE_AGENT_STORE=True``), so concurrent launches cannot collide;
* nothing left behind: each rank runs in its own session (process group), and however the
  launch ends -- success, a failed or killed rank, the timeout, Ctrl-C / SIGTERM / SIGHUP on
  the parent -- every rank's whole process group (its multiprocessing workers and resource
  tracker too, also of a rank that already died) is killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

__all__ = ["start_ranks", "supervise", "rendezvous_store", "rank_env", "describe_exit",
           "single_process_group"]

# Signals that stop a launch cleanly while ``supervise`` waits (exit status 128 + signal).
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP")
                      if hasattr(signal, n))


class Ranks(list):
    """The rank processes of one launch (``start_ranks``), with the rendezvous store that
    they join; ``supervise`` ends the launch and releases the store."""

    store = None


def rendezvous_store(host: str = "127.0.0.1"):
    """A ``TCPStore`` server on a port the OS picks (``store.port``), for ranks to join as
    clients (see ``rank_env``).  Keep it alive until the ranks are done: the port stays bound
    from the moment it is chosen, so no other job can take it (no choose-then-bind race)."""
    from torch.distributed import TCPStore

    return TCPStore(host, 0, is_master=True, wait_for_workers=False)


@contextlib.contextmanager
def single_process_group():
    """A one-rank gloo world for the duration of the block, for single-process tools that
    call Megatron's collective code (dist-checkpointing); nothing is done where a process
    group already exists.  Its store is a file in a fresh temporary folder (no port)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="megatron-muon-pg-") as folder:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 1),
                                rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def rank_env(rank: int, nproc: int, store) -> dict:
    """torchrun's environment variables for ``rank`` of ``nproc`` local ranks that rendezvous
    at ``store`` (from ``rendezvous_store``): ``init_process_group`` (``env://``) then builds a
    client of that store instead of hosting one on rank 0."""
    return dict(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=store.host,
                MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")


def describe_exit(returncode: int) -> str:
    """``"was killed by signal SIGKILL"`` or ``"exited with code 1"`` (a Popen returncode)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with code {returncode}"


def start_ranks(cmd: list, nproc: int, *, threads: Optional[int] = None,
                env: Optional[dict] = None, logs: Optional[list] = None) -> Ranks:
    """Start ``nproc`` copies of ``cmd`` with torchrun's environment variables (a tiny torchrun).

    This process hosts the rendezvous store (``rendezvous_store``) and the ranks join it as
    clients.  Each rank runs in a new session, so a Ctrl-C on the terminal reaches only this
    process: always follow with ``supervise``, which waits for the ranks, stops them and
    releases the store.  ``logs[r]`` (a path, or None for the terminal) receives rank r's output.
    """
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    procs = Ranks()
    procs.store = rendezvous_store()
    try:
        for rank in range(nproc):
            e = dict(os.environ)
            e.update(env or {})
            e.update(rank_env(rank, nproc, procs.store))
            e.setdefault("OMP_NUM_THREADS", str(threads))
            log = logs[rank] if logs else None
            out = open(log, "w") if log else None
            try:
                procs.append(subprocess.Popen(cmd, env=e, stdout=out,
                                              stderr=subprocess.STDOUT if out else None,
                                              start_new_session=True))
            finally:
                if out:
                    out.close()
    except BaseException:
        _stop(procs)
        raise
    return procs


def _peek(p: subprocess.Popen) -> Optional[int]:
    """``p``'s returncode if it has exited, else None -- without reaping it where the OS
    allows: its zombie keeps its pid, hence its process group id, reserved until ``_stop``."""
    if p.returncode is not None or not hasattr(os, "waitid"):
        return p.poll()
    try:
        info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return p.poll()
    if info is None:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return -info.si_status
    return info.si_status


def _live_members(pgids: set) -> set:
    """Pids of the processes (not zombies) in the process groups ``pgids``; empty without
    /proc (SIGKILL cannot be caught, so the groups die anyway)."""
    pids = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) in pgids:
            pids.add(int(entry))
    return pids


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list, grace: float = 10.0) -> int:
    """SIGKILL every rank's process group (a rank that already exited too: its children may
    live on), reap the ranks and wait up to ``grace`` s until no member is left.  Returns how
    many ranks were still running."""
    running = sum(_peek(p) is None for p in procs)
    groups = {p.pid for p in procs}  # start_new_session: each rank leads its own group
    for g in groups:
        _killpg(g)
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:  # stuck in the kernel; SIGKILL is pending
            pass
    deadline = time.monotonic() + grace
    while groups and time.monotonic() < deadline:
        alive = _live_members(groups)
        if not alive:
            break
        for g in groups:
            _killpg(g)
        time.sleep(0.02)
    return running


def supervise(procs: list, timeout: Optional[float] = None, *, report: bool = True) -> tuple:
    """Wait for every rank of ``start_ranks``; returns ``(code, rank)``.

    ``code`` is 0 when all ranks succeeded; else the first failing rank's exit code (128 + N
    when signal N killed it, e.g. 137 for SIGKILL) and ``rank`` its number; or, with ``rank``
    None, 124 on timeout and 128 + N when signal N reached this process (Ctrl-C: 130,
    SIGTERM: 143, SIGHUP: 129; handled while it waits, in the main thread).  When a rank
    fails the others would block in a collective, so they are stopped.  Never leaves a
    process behind: at the end every rank's process group is killed (see ``_stop``).  With
    ``report``, one line on stderr says why the launch stopped early where no rank could say
    it (``error: rank 2 was killed by signal SIGKILL; stopping the other ranks``, a timeout,
    ``interrupted: stopped 4 ranks``); a rank that exits with an error code has said why.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if report else (lambda msg: None)
    code, rank, caught = 0, None, None
    stopping = []  # the first stop signal raises _Stop; later ones (during cleanup) are ignored

    def on_signal(signum, frame):
        if not stopping:
            stopping.append(signum)
            raise _Stop(signum)

    previous, stopped = {}, 0
    try:
        try:
            if threading.current_thread() is threading.main_thread():
                for s in _STOP_SIGNALS:
                    previous[s] = signal.signal(s, on_signal)
            while True:
                codes = [_peek(p) for p in procs]
                bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    # a rank killed by a signal first: the others usually fail because of it
                    rank = min(bad, key=lambda r: (codes[r] >= 0, r))
                    code = 128 - codes[rank] if codes[rank] < 0 else codes[rank]
                    if codes[rank] < 0:  # a rank that exits with a code has said why
                        say(f"error: rank {rank} {describe_exit(codes[rank])}; "
                            "stopping the other ranks")
                    break
                if all(c == 0 for c in codes):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    code = 124
                    say(f"error: timed out after {timeout:.0f} s; stopping the ranks")
                    break
                time.sleep(0.05)
        except _Stop as stop:
            caught = stop.signum
        except KeyboardInterrupt:  # SIGINT under a handler of this process's own
            caught = signal.SIGINT
    finally:  # on any exit, an exception (a test's timeout) included
        stopping.append(None)
        stopped = _stop(procs)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if isinstance(procs, Ranks):
            procs.store = None  # the ranks are gone: release the rendezvous port
    if caught is not None:
        code, rank = 128 + caught, None
        name = "" if caught == signal.SIGINT else f" by {signal.Signals(caught).name}"
        say(f"interrupted{name}: stopped {stopped} rank{'s' if stopped != 1 else ''}")
    return code, rank


class _Stop(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
