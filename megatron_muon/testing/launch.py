"""Launch N torch.distributed ranks as subprocesses, with a hard timeout.

``run_ranks("pkg.module:function", world_size=4, kwargs={...}, timeout=300)`` starts
``world_size`` Python processes; each initialises ``torch.distributed`` (gloo on CPU,
NCCL on GPUs), turns on the Megatron CPU mode when CUDA is absent, calls
``function(**kwargs)`` and saves its return value.  The parent returns the list of per-rank
results, or raises ``RankFailure`` with the failing rank's output tail -- it never hangs:
past ``timeout`` every rank is killed and the call fails.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["run_ranks", "RankFailure", "free_port", "start_ranks", "supervise"]


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n:]


def start_ranks(cmd: list, nproc: int, *, threads: Optional[int] = None,
                env: Optional[dict] = None, logs: Optional[list] = None) -> list:
    """Start ``nproc`` copies of ``cmd`` with torchrun's environment variables (a tiny torchrun).

    ``logs[r]`` (a path, or None for the terminal) receives rank r's output.
    """
    port = free_port()
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    procs = []
    for rank in range(nproc):
        e = dict(os.environ)
        e.update(env or {})
        e.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                 LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
    return procs


def supervise(procs: list, timeout: Optional[float] = None) -> tuple:
    """Wait for every rank; returns ``(code, rank)``: 0 when all succeeded, else the first
    failing rank's exit code (124 on timeout, 130 on Ctrl-C).  Never leaves a rank behind:
    when one fails the others would block in a collective, so they are killed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    code, rank = 0, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                code, rank = codes[bad[0]], bad[0]
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                code = 124
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        code = 130
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    return code, rank


def run_ranks(target: str, world_size: int, kwargs: Optional[dict] = None, timeout: float = 300,
              env: Optional[dict] = None, threads_per_rank: int = 1, workdir: Optional[str] = None
              ) -> list[Any]:
    """Run ``target`` ("module:function") on ``world_size`` ranks; return per-rank results."""
    import torch

    kwargs = kwargs or {}
    tmp = Path(workdir or tempfile.mkdtemp(prefix="mmuon_ranks_"))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "kwargs.pt").unlink(missing_ok=True)
    torch.save(kwargs, tmp / "kwargs.pt")
    logs = [tmp / f"rank{r}.log" for r in range(world_size)]
    procs = start_ranks([sys.executable, "-m", "megatron_muon.testing.launch", target, str(tmp),
                         str(timeout)], world_size, logs=logs,
                        env={**(env or {}), "OMP_NUM_THREADS": str(threads_per_rank)})
    code, failed = supervise(procs, timeout)
    if code == 124:
        raise RankFailure(f"{target} on {world_size} ranks timed out after {timeout:.0f}s; "
                          f"rank 0 log tail:\n{_tail(logs[0])}")
    if code != 0:
        failed = 0 if failed is None else failed
        raise RankFailure(f"{target}: rank {failed} exited with code {code}; log tail:\n"
                          f"{_tail(logs[failed])}")
    return [torch.load(tmp / f"result{r}.pt", weights_only=False) for r in range(world_size)]


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
