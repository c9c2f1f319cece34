"""Run a Python function on N torch.distributed ranks (subprocesses), with a hard timeout.

``run_ranks("pkg.module:function", world_size=4, kwargs={...}, timeout=300)`` starts
``world_size`` Python processes; each initialises ``torch.distributed`` (gloo on CPU,
NCCL on GPUs), turns on the Megatron CPU mode when CUDA is absent, calls
``function(**kwargs)`` and saves its return value.  The parent returns the list of per-rank
results, or raises ``RankFailure`` naming the failing rank, its exit code or signal and its
output tail -- it never hangs: past ``timeout`` every rank is killed and the call fails.

The ranks are started and stopped by the library's launcher (``megatron_muon.distributed.launch``:
``start_ranks`` / ``supervise``, re-exported here with its other names).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from megatron_muon.distributed.launch import describe_exit, rank_env, rendezvous_store, start_ranks, supervise

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
              env: Optional[dict] = None, threads_per_rank: int = 1, workdir: Optional[str] = None
              ) -> list[Any]:
    """Run ``target`` ("module:function") on ``world_size`` ranks; return per-rank results."""
    import torch

    kwargs = kwargs or {}
    own_dir = workdir is None  # a directory of our own is removed once the run succeeded
    tmp = Path(workdir or tempfile.mkdtemp(prefix="mmuon_ranks_"))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "kwargs.pt").unlink(missing_ok=True)
    torch.save(kwargs, tmp / "kwargs.pt")
    logs = [tmp / f"rank{r}.log" for r in range(world_size)]
    procs = start_ranks([sys.executable, "-m", "megatron_muon.testing.launch", target, str(tmp),
                         str(timeout)], world_size, logs=logs,
                        env={**(env or {}), "OMP_NUM_THREADS": str(threads_per_rank)})
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
