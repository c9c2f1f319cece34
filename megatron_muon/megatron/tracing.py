"""Megatron side of the per-rank timeline (``megatron_muon.distributed.trace``).

``enable_tracing(model_chunks, optimizer)`` observes, on this process only, through
``megatron_muon.megatron.hooks``:

* the pipeline schedules' ``forward_step`` / ``backward_step`` (one span per microbatch),
* every DDP bucket group's grad reduce-scatter launch / wait and param all-gather,
* ``optimizer.step``;

each span covers the effective call: under ZeRO-3 its own reduce and gather (which replace
Megatron's), whether tracing was enabled before or after ZeRO-3 was set up.  DMuon's own
spans (speculate, gather, NS, scatter) come from the optimizer and the executor.
``save_trace(directory)`` writes ``trace_rank<R>.json``; ``disable_tracing()`` removes the
hooks again.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch.distributed as dist

from megatron_muon.distributed import trace
from megatron_muon.megatron import hooks

__all__ = ["enable_tracing", "disable_tracing", "save_trace"]

# (id(obj), method) -> (obj, hooks.Registration); holding obj keeps its id unique
_REGISTRATIONS: dict = {}


def _observe(obj, name: str, span_name: str, cat: str) -> None:
    key = (id(obj), name)
    if key in _REGISTRATIONS:
        return
    _REGISTRATIONS[key] = (obj, hooks.observe(obj, name,
                                              functools.partial(trace.span, span_name, cat)))


def enable_tracing(model_chunks, optimizer, label: str = "") -> trace.Timeline:
    """Start this rank's timeline and instrument Megatron; returns the timeline."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    rank = dist.get_rank() if dist.is_initialized() else 0
    if not label and ps.model_parallel_is_initialized():
        label = (f"rank {rank} (pp {ps.get_pipeline_model_parallel_rank()}, "
                 f"dp {ps.get_data_parallel_rank()}, tp {ps.get_tensor_model_parallel_rank()})")
    tl = trace.active() or trace.start(rank, label)
    _observe(schedules, "forward_step", "forward", "compute")
    _observe(schedules, "backward_step", "backward", "compute")
    for chunk in model_chunks:
        for bg in list(getattr(chunk, "bucket_groups", [])) + list(
                getattr(chunk, "expert_parallel_bucket_groups", [])):
            _observe(bg, "start_grad_sync", "grad.reduce_scatter_launch", "comm")
            _observe(bg, "finish_grad_sync", "grad.reduce_scatter_wait", "comm")
            _observe(bg, "start_param_sync", "param.gather_launch", "comm")
            _observe(bg, "finish_param_sync", "param.gather_wait", "comm")
    _observe(optimizer, "step", "optimizer.step", "optimizer")
    return tl


def disable_tracing() -> None:
    """Remove every tracing hook of this process (the timeline itself stays)."""
    for _, r in _REGISTRATIONS.values():
        r.remove()
    _REGISTRATIONS.clear()


def save_trace(directory: str, timeline: Optional[trace.Timeline] = None) -> Optional[str]:
    tl = timeline or trace.active()
    if tl is None:
        return None
    return tl.save(os.path.join(directory, f"trace_rank{tl.rank}.json"))
