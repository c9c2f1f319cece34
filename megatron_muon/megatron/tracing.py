"""Megatron side of the per-rank timeline (``megatron_muon.trace``).

``enable_tracing(model_chunks, optimizer)`` wraps, on this process only:

* the pipeline schedules' ``forward_step`` / ``backward_step`` (one span per microbatch),
* every DDP bucket group's grad reduce-scatter launch / wait and param all-gather,
* ``optimizer.step``;

DMuon's own spans (speculate, gather, NS, scatter) come from the optimizer and the
executor.  ``save_trace(directory)`` writes ``trace_rank<R>.json``.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch.distributed as dist

from .. import trace

__all__ = ["enable_tracing", "save_trace"]


def _wrap(obj, name: str, span_name: str, cat: str) -> None:
    inner = getattr(obj, name)
    if getattr(inner, "_megatron_muon_traced", False):
        return

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        with trace.span(span_name, cat):
            return inner(*args, **kwargs)

    wrapped._megatron_muon_traced = True
    setattr(obj, name, wrapped)


def enable_tracing(model_chunks, optimizer, label: str = "") -> trace.Timeline:
    """Start this rank's timeline and instrument Megatron; returns the timeline."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    rank = dist.get_rank() if dist.is_initialized() else 0
    if not label and ps.model_parallel_is_initialized():
        label = (f"rank {rank} (pp {ps.get_pipeline_model_parallel_rank()}, "
                 f"dp {ps.get_data_parallel_rank()}, tp {ps.get_tensor_model_parallel_rank()})")
    tl = trace.active() or trace.start(rank, label)
    _wrap(schedules, "forward_step", "forward", "compute")
    _wrap(schedules, "backward_step", "backward", "compute")
    for chunk in model_chunks:
        for bg in list(getattr(chunk, "bucket_groups", [])) + list(
                getattr(chunk, "expert_parallel_bucket_groups", [])):
            _wrap(bg, "start_grad_sync", "grad.reduce_scatter_launch", "comm")
            _wrap(bg, "finish_grad_sync", "grad.reduce_scatter_wait", "comm")
            _wrap(bg, "start_param_sync", "param.gather_launch", "comm")
            _wrap(bg, "finish_param_sync", "param.gather_wait", "comm")
    _wrap(optimizer, "step", "optimizer.step", "optimizer")
    return tl


def save_trace(directory: str, timeline: Optional[trace.Timeline] = None) -> Optional[str]:
    tl = timeline or trace.active()
    if tl is None:
        return None
    return tl.save(os.path.join(directory, f"trace_rank{tl.rank}.json"))
