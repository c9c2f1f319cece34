"""Megatron side of the per-rank timeline (``megatron_muon.distributed.trace``).

``enable_tracing(model_chunks, optimizer)`` observes, on this process only, through
``megatron_muon.megatron.hooks``:

* the pipeline schedules' ``forward_step`` / ``backward_step`` (one span per microbatch),
* every DDP bucket group's grad reduce-scatter launch / wait and param all-gather,
* ``optimizer.step``;

each span covers the effective call: under ZeRO-3 its own reduce and gather (which replace
Megatron's), whether tracing was enabled before or after ZeRO-3 was set up.  DMuon's own
spans (speculate, gather, NS, scatter) come from the optimizer and the executor.
``save_trace(directory)`` writes ``trace_rank<R>.json``; ``disable_tracing()`` removes every
hook again.  ``trace_run(model_chunks, optimizer, directory)`` (what the factory uses for
``dmuon_trace_dir``) is ``enable_tracing`` with a handle whose ``close()`` removes only what
that call hooked - a hook two calls share stays until both are closed - and saves the trace
then instead of at exit.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch.distributed as dist

from megatron_muon.distributed import trace
from megatron_muon.megatron import hooks

__all__ = ["enable_tracing", "disable_tracing", "save_trace", "trace_run", "TraceRun"]

# (id(obj), method) -> [obj, hooks.Registration, users]; holding obj keeps its id unique;
# users: how many enable_tracing calls asked for this hook (``TraceRun.close`` counts down)
_REGISTRATIONS: dict = {}


def _observe(obj, name: str, span_name: str, cat: str) -> tuple:
    key = (id(obj), name)
    if key in _REGISTRATIONS:
        _REGISTRATIONS[key][2] += 1
    else:
        _REGISTRATIONS[key] = [obj, hooks.observe(obj, name,
                                                  functools.partial(trace.span, span_name, cat)), 1]
    return key


def _enable(model_chunks, optimizer, label: str) -> tuple:
    """(timeline, the keys of ``_REGISTRATIONS`` this call asked for)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    rank = dist.get_rank() if dist.is_initialized() else 0
    if not label and ps.model_parallel_is_initialized():
        label = (f"rank {rank} (pp {ps.get_pipeline_model_parallel_rank()}, "
                 f"dp {ps.get_data_parallel_rank()}, tp {ps.get_tensor_model_parallel_rank()})")
    tl = trace.active() or trace.start(rank, label)
    keys = [_observe(schedules, "forward_step", "forward", "compute"),
            _observe(schedules, "backward_step", "backward", "compute")]
    for chunk in model_chunks:
        for bg in list(getattr(chunk, "bucket_groups", [])) + list(
                getattr(chunk, "expert_parallel_bucket_groups", [])):
            keys += [_observe(bg, "start_grad_sync", "grad.reduce_scatter_launch", "comm"),
                     _observe(bg, "finish_grad_sync", "grad.reduce_scatter_wait", "comm"),
                     _observe(bg, "start_param_sync", "param.gather_launch", "comm"),
                     _observe(bg, "finish_param_sync", "param.gather_wait", "comm")]
    keys.append(_observe(optimizer, "step", "optimizer.step", "optimizer"))
    return tl, keys


def enable_tracing(model_chunks, optimizer, label: str = "") -> trace.Timeline:
    """Start this rank's timeline and instrument Megatron; returns the timeline."""
    return _enable(model_chunks, optimizer, label)[0]


class TraceRun:
    """What one ``trace_run`` hooked; ``close()`` takes it back (and saves the trace)."""

    def __init__(self, timeline: trace.Timeline, keys: list, directory: Optional[str]):
        self.timeline, self._keys, self.directory = timeline, keys, directory
        self._saver = None
        if directory:
            import atexit

            self._saver = functools.partial(save_trace, directory, timeline)
            atexit.register(self._saver)

    def close(self) -> None:
        """Remove this run's hooks (those another run still uses stay); with a directory,
        write the trace now and drop the write at exit.  Idempotent."""
        for key in self._keys:
            reg = _REGISTRATIONS.get(key)
            if reg is None:  # disable_tracing() took it already
                continue
            reg[2] -= 1
            if reg[2] <= 0:
                reg[1].remove()
                del _REGISTRATIONS[key]
        self._keys = []
        if self._saver is not None:
            import atexit

            atexit.unregister(self._saver)
            self._saver()
            self._saver = None


def trace_run(model_chunks, optimizer, directory: Optional[str] = None,
              label: str = "") -> TraceRun:
    """``enable_tracing`` with a teardown: the trace is written to ``directory`` at exit, or
    at ``close()``, which also removes exactly the hooks this call added."""
    return TraceRun(*_enable(model_chunks, optimizer, label), directory)


def disable_tracing() -> None:
    """Remove every tracing hook of this process (the timeline itself stays)."""
    for _, r, _ in _REGISTRATIONS.values():
        r.remove()
    _REGISTRATIONS.clear()


def save_trace(directory: str, timeline: Optional[trace.Timeline] = None) -> Optional[str]:
    tl = timeline or trace.active()
    if tl is None:
        return None
    return tl.save(os.path.join(directory, f"trace_rank{tl.rank}.json"))
