"""A per-rank timeline written as Chrome trace JSON (opens in Perfetto / chrome://tracing).

Framework-free: ``span(name)`` is a context manager that records a complete event when a
timeline is active and costs one attribute check when none is.  The Megatron adapter
(``megatron_muon.megatron.tracing``) decides what to wrap; benchmarks read the events
back with ``events()``.

The timeline reads the host clock: on CPU that is the work, on GPUs it is mostly the kernel
launches (the kernels run later, asynchronously).  So every span is also a
``torch.profiler.record_function`` range of the same name whenever a torch profiler (or
``emit_nvtx``) is recording: under ``torch.profiler.profile`` the ranges group the GPU
kernels they launched, which is the trace to read on GPUs.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
import time
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
from torch.profiler import record_function

__all__ = ["Timeline", "active", "span", "start", "stop"]


#: events a timeline keeps (the most recent; ~200 bytes each): a long run's trace stays
#: bounded in host memory, and ``dropped`` counts what fell out
MAX_EVENTS = 500_000


class Timeline:
    """Complete ("X") events of one process; times in microseconds since ``start``.  Keeps
    the last ``max_events`` of them."""

    def __init__(self, rank: int = 0, label: str = "", max_events: int = MAX_EVENTS):
        self.rank, self.label = rank, label
        self.t0 = time.perf_counter()
        self._events: deque = deque(maxlen=max_events)
        self.dropped = 0
        self._lock = threading.Lock()

    def now_us(self) -> float:
        return (time.perf_counter() - self.t0) * 1e6

    def add(self, name: str, cat: str, start_us: float, end_us: float, **args) -> None:
        ev = dict(name=name, cat=cat, ph="X", ts=round(start_us, 3),
                  dur=round(max(end_us - start_us, 0.0), 3), pid=self.rank,
                  tid=threading.get_ident() % 100_000)
        if args:
            ev["args"] = args
        with self._lock:
            self.dropped += len(self._events) == self._events.maxlen
            self._events.append(ev)

    def events(self, name: Optional[str] = None) -> list[dict]:
        with self._lock:
            return [e for e in self._events if name is None or e["name"] == name]

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self.dropped = 0

    def save(self, path: str) -> str:
        label = self.label or f"rank {self.rank}"
        if self.dropped:
            label += f" (the first {self.dropped} events dropped: max_events)"
        meta = [dict(name="process_name", ph="M", pid=self.rank, args=dict(name=label))]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + self.events(), "displayTimeUnit": "ms"}, f)
        return path


_ACTIVE: Optional[Timeline] = None


def start(rank: int = 0, label: str = "") -> Timeline:
    """Make a new timeline the active one for this process and return it."""
    global _ACTIVE
    _ACTIVE = Timeline(rank, label)
    return _ACTIVE


def stop() -> Optional[Timeline]:
    global _ACTIVE
    tl, _ACTIVE = _ACTIVE, None
    return tl


def active() -> Optional[Timeline]:
    return _ACTIVE


_NO_RANGE = nullcontext()


@contextmanager
def span(name: str, cat: str = "dmuon", **args):
    """A timeline event ``name`` (when a timeline is active) and a profiler range ``name``
    (when a torch profiler is recording) around the body."""
    tl = _ACTIVE
    with record_function(name) if torch.autograd._profiler_enabled() else _NO_RANGE:
        if tl is None:
            yield
            return
        t = tl.now_us()
        try:
            yield
        finally:
            tl.add(name, cat, t, tl.now_us(), **args)
