"""Communication: how DMuon's bytes move.  One all-to-all per exchange, on gloo and NCCL;
point-to-point among a few ranks of a large group (``exchange_p2p``).

Knows nothing of Megatron; the caller supplies flat buffers, split sizes and the group.
``CommStats`` counts what crossed the wire so tests can assert traffic bounds.
``failed_ranks`` lets a check that can differ by rank end in the same error on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["CommStats", "all_to_all_flat", "exchange_p2p", "failed_ranks"]


@dataclass
class CommStats:
    """Bytes this rank sent to / received from *other* ranks, and collective calls made."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    by_kind: dict = field(default_factory=dict)

    def add(self, kind: str, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.calls += 1
        k = self.by_kind.setdefault(kind, [0, 0, 0])
        k[0] += sent
        k[1] += received
        k[2] += 1

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.calls = 0
        self.by_kind = {}

    def as_dict(self) -> dict:
        return dict(bytes_sent=self.bytes_sent, bytes_received=self.bytes_received,
                    calls=self.calls, by_kind={k: list(v) for k, v in self.by_kind.items()})


def all_to_all_flat(send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                    group: Optional[dist.ProcessGroup], stats: Optional[CommStats] = None,
                    kind: str = "all_to_all", async_op: bool = False,
                    out: Optional[torch.Tensor] = None):
    """Exchange a flat buffer: ``send[sum(send_counts[:j]) : ...]`` goes to group rank j.

    Returns ``(recv, work)``; ``work`` is None unless ``async_op``.  ``out``: where to
    receive (1-D, ``sum(recv_counts)`` elements, not overlapping ``send``); default a new
    buffer.  A group of one rank (or no group) is a local copy.  Byte counts exclude the
    part a rank keeps for itself.
    """
    world = dist.get_world_size(group) if group is not None else 1
    numel = int(sum(recv_counts))
    if out is None:
        recv = torch.empty(numel, dtype=send.dtype, device=send.device)
    elif out.ndim != 1 or out.numel() != numel or out.dtype != send.dtype:
        raise ValueError(f"all_to_all_flat: out must be 1-D {send.dtype} with {numel} "
                         f"elements, got {tuple(out.shape)} {out.dtype}")
    else:
        recv = out
    if world == 1:
        recv.copy_(send)
        return recv, None
    me = dist.get_rank(group)
    if stats is not None:
        el = send.element_size()
        stats.add(kind, (int(sum(send_counts)) - int(send_counts[me])) * el,
                  (int(sum(recv_counts)) - int(recv_counts[me])) * el)
    work = dist.all_to_all_single(recv, send, output_split_sizes=list(map(int, recv_counts)),
                                  input_split_sizes=list(map(int, send_counts)), group=group,
                                  async_op=async_op)
    return recv, (work if async_op else None)


def exchange_p2p(send: Sequence[Optional[torch.Tensor]], recv_counts: Sequence[int],
                 group: Optional[dist.ProcessGroup], stats: Optional[CommStats] = None,
                 kind: str = "p2p", dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> list:
    """``send[j]`` (1-D; None or empty: nothing) to group rank j, ``recv_counts[j]``
    elements from group rank j, as one batch of point-to-point sends and receives with the
    peers that have something to exchange (``dist.batch_isend_irecv``), waited on.

    Returns what came from each group rank (an empty tensor for this rank and for peers that
    sent nothing).  Unlike an all-to-all, a rank with nothing to send or receive makes no
    call at all, and a rank's cost grows with its peers, not with the group: the exchange
    for a handful of ranks of a 1024-rank group.  Both sides must agree on the counts (the
    caller checks them once, ``OwnerCentricNS._check_exchange``).  Peers are addressed by
    their global rank (``dist.get_global_rank``), so any subgroup works on gloo and NCCL.
    On NCCL a batch reuses the group's communicator, but only once the group has run a
    collective in which all its ranks took part (before that, every rank must join the
    batch); ``_check_exchange``'s collectives at construction are that first call.
    """
    world = dist.get_world_size(group) if group is not None else 1
    me = dist.get_rank(group) if group is not None else 0
    recv = [torch.empty(int(c) if j != me else 0, dtype=dtype, device=device)
            for j, c in enumerate(recv_counts)]
    if world == 1:
        return recv
    pg = group if group is not None else dist.group.WORLD
    ops, sent = [], 0
    for j in range(world):
        if j == me:
            continue
        peer = dist.get_global_rank(pg, j)
        if send[j] is not None and send[j].numel():
            ops.append(dist.P2POp(dist.isend, send[j].contiguous(), peer, pg))
            sent += send[j].numel()
        if recv[j].numel():
            ops.append(dist.P2POp(dist.irecv, recv[j], peer, pg))
    if not ops:
        return recv
    if stats is not None:
        el = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else \
            torch.iinfo(dtype).bits // 8
        stats.add(kind, sent * el, sum(r.numel() for r in recv) * el)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv


def failed_ranks(failed: bool, group: Optional[dist.ProcessGroup],
                 device: Optional[torch.device] = None) -> list[int]:
    """The global ranks of ``group`` on which ``failed`` is true: the same list on every rank.

    A rank-local check (a non-finite value, a validation whose input differs by rank) that
    raises inside a sequence of collectives leaves its peers waiting in the next collective
    until the backend's timeout (NCCL's: minutes, then an abort that names no cause).  Each
    rank calls this with its own verdict instead - one all-reduce (MAX) of one flag per rank
    over the group that takes part in the following collectives - and every rank raises if
    the list is not empty, with a message that can name the ranks.  ``group=None``: this
    process alone (no collective).
    """
    if group is None or dist.get_world_size(group) == 1:
        me = dist.get_rank() if dist.is_initialized() else 0
        return [me] if failed else []
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device)
    flags[dist.get_rank(group)] = int(bool(failed))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [dist.get_global_rank(group, i) for i in torch.nonzero(flags).flatten().tolist()]
