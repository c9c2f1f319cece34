"""Tiny per-rank targets for the launcher's own tests (``tests/test_faults.py``); no Megatron.

``python -m megatron_muon.testing.launch_workers PID_DIR [SECONDS]`` runs ``stall_with_child``
without ``torch.distributed`` (a rank for ``start_ranks`` that needs no rendezvous).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

__all__ = ["rank_sum", "stall_with_child"]


def rank_sum() -> int:
    """The sum of the ranks' numbers by all_reduce: a trivial job that needs the rendezvous."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return int(t.item())


def stall_with_child(pid_dir: str, seconds: float = 600.0) -> None:
    """A long-running rank with processes of its own, as real jobs have: a multiprocessing
    spawn worker and its resource tracker.  Once they run it writes ``rank<r>.pids`` (its pid,
    then theirs) into ``pid_dir`` and prints ``ready rank <r>``, then sleeps ``seconds``."""
    import multiprocessing as mp
    from multiprocessing import resource_tracker

    rank = int(os.environ["RANK"])
    child = mp.get_context("spawn").Process(target=time.sleep, args=(seconds,))
    child.start()  # starts the resource tracker too (spawn)
    pids = [os.getpid(), child.pid]
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    if tracker:
        pids.append(tracker)
    path = Path(pid_dir) / f"rank{rank}.pids"
    path.with_suffix(".tmp").write_text(" ".join(map(str, pids)))
    os.replace(path.with_suffix(".tmp"), path)
    print(f"ready rank {rank}", flush=True)
    time.sleep(seconds)


if __name__ == "__main__":
    stall_with_child(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 600.0)
