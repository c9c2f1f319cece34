"""Run a Python function on N torch.distributed ranks (subprocesses), with a hard timeout.

``run_ranks("pkg.module:function", world_size=4, kwargs={...}, timeout=300)`` starts
``world_size`` Python processes; each initialises ``torch.distributed`` (gloo on CPU,
NCCL on GPUs), turns on the Megatron CPU mode when CUDA is absent, calls
``function(**kwargs)`` and saves its return value.  The parent returns the list of per-rank
results, or raises ``RankFailure`` naming the failing rank, its exit code or signal and its
output tail -- it never hangs: past ``timeout`` every rank is killed and the call fails.

The ranks are started and stopped by the library's launcher (``megatron_muon.distributed.launch``:
``start_ranks`` / ``supervise``, re-exported here with its other names).

``start='fork'`` (the test suite's default, ``MEGATRON_MUON_RANK_START`` in
``tests/conftest.py``) forks the ranks from this process after importing the target's module
once, instead of starting fresh interpreters: importing torch and Megatron-Core costs each
rank ~7 CPU seconds, which on a 2-core CI machine was most of a test launch.  A forked rank
is the same as a started one from ``init_process_group`` on: it resets the inherited
logging handlers, signal handlers and output streams, runs in its own session, and is
supervised and killed the same way.  It falls back to starting interpreters where forking
is unsafe (no ``os.fork``, other threads running, CUDA or ``torch.distributed`` already
initialised here).
Benchmarks keep ``'spawn'``: a forked rank's resident memory includes the pages it inherits.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from megatron_muon.distributed.launch import (Ranks, describe_exit, rank_env, rendezvous_store,
                                              start_ranks, supervise)

__all__ = ["run_ranks", "RankFailure", "start_ranks", "supervise", "rendezvous_store",
           "rank_env", "describe_exit"]


class RankFailure(RuntimeError):
    pass


def _tail(path: Path, n: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n:]


def run_ranks(target: str, world_size: int, kwargs: Optional[dict] = None, timeout: float = 300,
              env: Optional[dict] = None, threads_per_rank: int = 1, workdir: Optional[str] = None,
              start: Optional[str] = None) -> list[Any]:
    """Run ``target`` ("module:function") on ``world_size`` ranks; return per-rank results.

    ``start``: 'spawn' (fresh interpreters) or 'fork' (module docstring); default the
    environment's ``MEGATRON_MUON_RANK_START``, else 'spawn'.
    """
    import torch

    kwargs = kwargs or {}
    own_dir = workdir is None  # a directory of our own is removed once the run succeeded
    tmp = Path(workdir or tempfile.mkdtemp(prefix="mmuon_ranks_"))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "kwargs.pt").unlink(missing_ok=True)
    torch.save(kwargs, tmp / "kwargs.pt")
    logs = [tmp / f"rank{r}.log" for r in range(world_size)]
    rank_vars = {**(env or {}), "OMP_NUM_THREADS": str(threads_per_rank)}
    start = start or os.environ.get("MEGATRON_MUON_RANK_START", "spawn")
    if start not in ("spawn", "fork"):
        raise ValueError(f"start={start!r}: use 'spawn' or 'fork'")
    if start == "fork" and _fork_is_safe():
        procs = _fork_ranks(target, tmp, timeout, world_size, logs, rank_vars)
    else:
        procs = start_ranks([sys.executable, "-m", "megatron_muon.testing.launch", target,
                             str(tmp), str(timeout)], world_size, logs=logs, env=rank_vars)
    code, failed = supervise(procs, timeout, report=False)
    if code == 124:
        raise RankFailure(f"{target} on {world_size} ranks timed out after {timeout:.0f}s; "
                          f"rank 0 log tail:\n{_tail(logs[0])}")
    if code != 0 and failed is None:  # a signal reached this process: the ranks are stopped
        signal.raise_signal(code - 128)  # now act on it as this process otherwise would
        raise RankFailure(f"{target}: interrupted by signal {signal.Signals(code - 128).name}")
    if code != 0:
        raise RankFailure(f"{target}: rank {failed} {describe_exit(procs[failed].returncode)}; "
                          f"log tail:\n{_tail(logs[failed])}")
    results = [torch.load(tmp / f"result{r}.pt", weights_only=False) for r in range(world_size)]
    if own_dir:  # a failed run keeps its rank logs for the error above to point at
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _fork_is_safe() -> bool:
    """Forking copies only the calling thread: with other threads alive (concurrent launches,
    a reader thread) a lock one of them holds would stay held in the rank forever."""
    import threading

    import torch

    return (hasattr(os, "fork") and threading.active_count() == 1
            and not torch.distributed.is_initialized() and not torch.cuda.is_initialized())


class _ForkedRank:
    """What ``supervise`` needs of a ``subprocess.Popen``, for a forked rank."""

    def __init__(self, pid: int, args: str):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


def _fork_ranks(target: str, tmp: Path, timeout: float, world_size: int, logs: list,
                rank_vars: dict) -> Ranks:
    """Fork ``world_size`` ranks of ``_worker`` (module docstring).  The rendezvous store is
    created after the forks, so that no rank inherits its server thread; each rank reads its
    environment (the store's port included) from a pipe."""
    importlib.import_module(target.split(":")[0])  # once here, not once per rank
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    procs, pipes = Ranks(), []
    try:
        for rank in range(world_size):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the rank: never returns
                for fd in pipes + [w]:
                    os.close(fd)
                _forked_rank(r, logs[rank], target, str(tmp), timeout)
            os.close(r)
            pipes.append(w)
            procs.append(_ForkedRank(pid, f"fork {target} rank {rank}"))
        procs.store = rendezvous_store()
        for rank in range(world_size):
            env = {**rank_vars, **rank_env(rank, world_size, procs.store)}
            msg = repr(env).encode()
            w = pipes.pop(0)  # no longer ours to close on failure, whatever happens next
            try:
                os.write(w, len(msg).to_bytes(8, "little") + msg)
            finally:
                os.close(w)
    except BaseException:
        for w in pipes:
            os.close(w)
        supervise(procs, 0, report=False)  # stops and reaps what was forked
        raise
    return procs


def _read_exactly(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _forked_rank(env_pipe: int, log: Path, target: str, tmp: str, timeout: float) -> None:
    code = 1
    try:
        os.setsid()  # its own session and process group, as start_ranks gives a rank
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
            signal.signal(s, signal.SIG_DFL)
        import logging

        logging.root.handlers.clear()  # the parent's (pytest's capture) handlers
        msg = _read_exactly(env_pipe, 8)
        if len(msg) < 8:  # the parent failed before the rendezvous: nothing to run
            os._exit(1)
        msg = _read_exactly(env_pipe, int.from_bytes(msg, "little"))
        os.close(env_pipe)
        os.environ.update(ast.literal_eval(msg.decode()))
        _worker(target, tmp, timeout)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _worker(target: str, tmp: str, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    from megatron_muon.megatron.cpu_mode import default_backend, enable_cpu_mode

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    enable_cpu_mode()
    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group(backend=default_backend(),
                            timeout=datetime.timedelta(seconds=max(30.0, timeout)))
    module_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    kwargs = torch.load(Path(tmp) / "kwargs.pt", weights_only=False)
    result = fn(**kwargs)
    torch.save(result, Path(tmp) / f"result{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("tmp")
    p.add_argument("timeout", type=float)
    a = p.parse_args()
    sys.path.insert(0, os.getcwd())
    _worker(a.target, a.tmp, a.timeout)
