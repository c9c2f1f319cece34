"""Records which process groups the collectives of chosen code paths run on (tests only)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

__all__ = ["CollectiveRecorder"]

_NAMES = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor",
          "reduce_scatter_tensor", "broadcast", "all_gather_object", "broadcast_object_list",
          "send", "recv", "isend", "irecv", "barrier", "reduce", "scatter", "gather")


class CollectiveRecorder:
    """While a watched method runs, every ``torch.distributed`` collective is recorded as
    ``(name, global ranks of its group, bytes of its tensor arguments)``."""

    def __init__(self):
        self.records: list = []
        self._depth = 0
        self._saved = {}

    def install(self) -> "CollectiveRecorder":
        for name in _NAMES:
            fn = getattr(dist, name, None)
            if fn is None or name in self._saved:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._recording(name, fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}

    def _recording(self, name, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if self._depth:
                group = kwargs.get("group")
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None \
                    else tuple(range(dist.get_world_size()))
                nbytes = sum(a.numel() * a.element_size() for a in list(args) + list(kwargs.values())
                             if torch.is_tensor(a))
                self.records.append((name, ranks, nbytes))
            return fn(*args, **kwargs)
        return wrapped

    def watch(self, obj, method: str) -> None:
        inner = getattr(obj, method)

        @functools.wraps(inner)
        def watched(*args, **kwargs):
            self._depth += 1
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1

        setattr(obj, method, watched)
