"""Peak memory per rank by optimizer phase: where a variant's steady-state peak is reached.

    python tools/memory_phases.py dmuon --nproc 2 --num-layers 6

Runs ``tools/bench_memory.py``'s worker (same model, same variants) with the optimizer's
methods wrapped: at every entry and exit of ``train_step``, ``ChainedOptimizer.step``, the
``DistributedOptimizer`` phases, torch's ``AdamW.step``, ``ShardedMuonStep.step`` and
``OwnerCentricNS.gather / orthogonalize / scatter`` it records the resident set (VmRSS) and
the peak since the previous event (VmHWM, then reset).  Printed per rank for the last
training step.  CPU only (the peak reset is Linux's ``/proc/self/clear_refs``).  ``--trim``
calls glibc's ``malloc_trim(0)`` after each inner optimizer step, which tells memory the C
heap keeps apart from live tensors (docs/memory.md).  ``--heap`` also prints, per event,
glibc's ``mallinfo2`` (MiB: heap arenas, of which in use and free, and mmapped blocks) and
the bytes of live tensors (every CPU tensor storage the garbage collector reaches, once):
resident = what the heap keeps + mmapped blocks + the rest of the process, so a gap
between two variants can be put on live tensors, on other allocations (library caches)
or on freed heap memory glibc keeps.  ``ShardedMuonStep``'s phases show as
``OwnerCentricNS._gather_over / orthogonalize / _scatter_over`` (the step's arena).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import bench_memory as bm  # noqa: E402

_LOG: list = []
_HEAP = [False]


def _heap() -> str:
    """glibc's heap counters and the live tensor bytes, MiB (``--heap``)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc (>= 2.33)
        return "heap: -"
    fn.restype = MallInfo2
    m, mib = fn(), 2 ** 20
    return (f"heap {m.arena // mib:5d} (in use {m.uordblks // mib:5d}, free "
            f"{m.fordblks // mib:5d}) mmapped {m.hblkhd // mib:5d} live tensors "
            f"{bm.held_bytes() // mib:5d}")


def _event(name: str) -> None:
    rss, peak = bm._status_kib("VmRSS") // 1024, bm._status_kib("VmHWM") // 1024
    _LOG.append((name, rss, peak, _heap() if _HEAP[0] else ""))
    bm.reset_peak()  # after the census, which allocates a little


def _wrap(owner, meth: str, label: str) -> None:
    f = getattr(owner, meth)

    @functools.wraps(f)
    def g(*a, **k):
        _event(f"> {label}")
        r = f(*a, **k)
        _event(f"< {label}")
        return r

    setattr(owner, meth, g)


def _trim_after(owner, meth: str) -> None:
    """After ``owner.meth`` returns, hand the heap's free memory back to the OS (glibc's
    ``malloc_trim``): separates tensors still alive from memory the allocator keeps."""
    import ctypes

    libc, f = ctypes.CDLL("libc.so.6"), getattr(owner, meth)

    @functools.wraps(f)
    def g(*a, **k):
        r = f(*a, **k)
        libc.malloc_trim(0)
        return r

    setattr(owner, meth, g)


def worker(trim: bool = False, heap: bool = False, **kw) -> list:
    import torch
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    import megatron_muon.testing.gpt as gpt
    from megatron_muon.distributed.owner_centric import OwnerCentricNS
    from megatron_muon.megatron.dmuon import ShardedMuonStep

    _HEAP[0] = heap
    _wrap(gpt, "train_step", "train_step")
    _wrap(ChainedOptimizer, "step", "ChainedOptimizer.step")
    for m in ("prepare_grads", "get_grad_norm", "step_with_ready_grads",
              "_copy_main_params_to_model_params"):
        _wrap(DistributedOptimizer, m, f"DistributedOptimizer.{m}")
    if trim:
        _trim_after(torch.optim.AdamW, "step")
        _trim_after(ShardedMuonStep, "step")
    _wrap(torch.optim.AdamW, "step", "AdamW.step")
    _wrap(ShardedMuonStep, "step", "ShardedMuonStep.step")
    for m in ("gather", "orthogonalize", "scatter", "_gather_over", "_scatter_over"):
        _wrap(OwnerCentricNS, m, f"OwnerCentricNS.{m}")
    bm.worker(**kw)
    last = max(i for i, e in enumerate(_LOG) if e[0] == "> train_step")
    return _LOG[last: next(i for i in range(last, len(_LOG)) if _LOG[i][0] == "< train_step") + 1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", choices=bm.VARIANTS)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--ffn-hidden-size", type=int, default=4096)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--trim", action="store_true",
                   help="malloc_trim(0) after each optimizer's inner step (CPU heap retention)")
    p.add_argument("--heap", action="store_true",
                   help="also print glibc's heap counters and the live tensor bytes per event")
    a = p.parse_args(argv)
    from megatron_muon.testing.launch import run_ranks

    cfg = dict(num_layers=a.num_layers, hidden_size=a.hidden_size,
               ffn_hidden_size=a.ffn_hidden_size, num_attention_heads=a.num_attention_heads,
               num_query_groups=None, vocab_size=a.vocab_size, seq_length=64,
               micro_batch_size=1, num_microbatches=1)
    with tempfile.TemporaryDirectory(prefix="memory_phases_") as tmp:
        logs = run_ranks("tools.memory_phases:worker", a.nproc,
                         dict(cfg=cfg, tp=a.tp, variant=a.variant, steps=1, save_dir=tmp,
                              trim=a.trim, heap=a.heap),
                         timeout=1800, env={"PYTHONPATH": os.getcwd()})
    for rank, log in enumerate(logs):
        print(f"# rank {rank} ({a.variant}): event, VmRSS MiB, peak MiB since the previous event")
        for name, rss, peak, extra in log:
            print(f"{name:56s} {rss:7d} {peak:7d}  {extra}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
