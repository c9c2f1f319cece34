"""Owner-centric distributed Newton-Schulz (SPEC section 2, steps 2-4), framework-free.

The group (a pipeline stage's DP x TP ranks) holds a set of logical matrices, each cut
into *pieces*: a piece is a flat range ``[start, end)`` of one TP shard, held by one group
rank at ``local_offset`` of that rank's flat buffer.  The executor

1. gathers every unit's pieces on the unit's owner (one all-to-all per bucket),
2. runs batched NS on the owner's units, grouped by shape, times the Muon scale,
3. scatters each holder's pieces of the result back (one all-to-all per bucket).

``replicate=True`` is the naive baseline: every rank receives every unit and
orthogonalises all of them, then keeps its own pieces (no scatter).

Index tables are built once; a step is index_select / all_to_all / bmm / index_copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .comm import CommStats, all_to_all_flat
from .newton_schulz import muon_scale, newton_schulz
from .plan import OwnerPlan
from .trace import span
from .units import Unit, unit_positions

__all__ = ["Piece", "ShardedMatrix", "OwnerCentricNS"]


@dataclass(frozen=True)
class Piece:
    rank: int  # group rank holding it
    tp_rank: int  # which TP shard (or which replica, for TP-replicated matrices)
    start: int  # flat range inside that TP shard
    end: int
    local_offset: int  # where the holder keeps it in its flat buffer
    source: bool = True  # gathers read it (one replica of TP-replicated matrices)


@dataclass(frozen=True)
class ShardedMatrix:
    key: str
    shape: tuple[int, int]  # full, TP-unsharded
    units: tuple[Unit, ...]
    tp_dim: Optional[int]  # None: every TP rank holds a full replica
    tp_size: int
    pieces: tuple[Piece, ...]
    bucket: int = 0

    def unit_key(self, i: int) -> str:
        return f"{self.key}#{i}"

    def full_flat_index(self, piece: Piece) -> torch.Tensor:
        """Full-matrix flat index of every element of ``piece`` (in local order)."""
        m, n = self.shape
        local = torch.arange(piece.start, piece.end, dtype=torch.int64)
        if self.tp_dim is None:
            return local
        ml, nl = (m // self.tp_size, n) if self.tp_dim == 0 else (m, n // self.tp_size)
        r, c = local // nl, local % nl
        if self.tp_dim == 0:
            r = r + piece.tp_rank * ml
        else:
            c = c + piece.tp_rank * nl
        return r * n + c


@dataclass
class _Table:
    """Per bucket: this rank's send index (into its flat buffer) and receive positions."""

    send_index: torch.Tensor
    send_counts: list[int]
    recv_pos: torch.Tensor  # positions in the owned-units buffer, in receive order
    recv_counts: list[int]


class OwnerCentricNS:
    """Distributed "NS per unit on one owner" over a process group."""

    def __init__(self, matrices: Sequence[ShardedMatrix], plan: Optional[OwnerPlan],
                 group: Optional[dist.ProcessGroup], *, ns_steps: int, coefficients,
                 scale_mode: str, extra_scale_factor: float, ns_dtype: torch.dtype,
                 device: torch.device, replicate: bool = False, eps: float = 1e-7,
                 ns_fn: Optional[Callable] = None, local_numel: Optional[int] = None):
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.matrices = list(matrices)
        self.replicate = replicate
        self.ns_steps, self.coefficients, self.eps = ns_steps, coefficients, eps
        self.scale_mode, self.extra_scale_factor = scale_mode, extra_scale_factor
        self.ns_dtype, self.device = ns_dtype, device
        self.ns_fn = ns_fn or newton_schulz
        self.stats = CommStats()
        self.plan = plan

        def owners_of(mat: ShardedMatrix, i: int) -> list[int]:
            if replicate:
                return list(range(self.world))
            return [plan.owners[mat.unit_key(i)]]

        # Units this rank orthogonalises, grouped by shape so a batch is one view.
        mine = [(mat, i, u) for mat in self.matrices for i, u in enumerate(mat.units)
                if self.rank in owners_of(mat, i)]
        mine.sort(key=lambda t: (t[2].shape, t[0].key, t[1]))
        self.unit_offset: dict[str, int] = {}
        self.batches: list[tuple[int, int, int, int]] = []  # (offset, count, m, n)
        off = 0
        for mat, i, u in mine:
            self.unit_offset[mat.unit_key(i)] = off
            m, n = u.shape
            if self.batches and self.batches[-1][2:] == (m, n):
                o, c, _, _ = self.batches[-1]
                self.batches[-1] = (o, c + 1, m, n)
            else:
                self.batches.append((off, 1, m, n))
            off += m * n
        self.owned_numel = off
        self.local_numel = local_numel if local_numel is not None else max(
            [p.local_offset + p.end - p.start for mat in self.matrices for p in mat.pieces
             if p.rank == self.rank] or [0])

        # Canonical order, identical on both sides of every exchange: matrices in order,
        # units in order, pieces in order, elements in local flat order.
        gather: dict[int, tuple[list, list]] = {}
        scatter: dict[int, tuple[list, list]] = {}
        local_copy_src, local_copy_dst = [], []
        for mat in self.matrices:
            g = gather.setdefault(mat.bucket, ([[] for _ in range(self.world)],
                                               [[] for _ in range(self.world)]))
            s = scatter.setdefault(mat.bucket, ([[] for _ in range(self.world)],
                                                [[] for _ in range(self.world)]))
            unit_owners = [owners_of(mat, i) for i in range(len(mat.units))]
            i_own_some = any(self.rank in o for o in unit_owners)
            for piece in mat.pieces:
                if piece.rank != self.rank and not i_own_some:
                    continue
                full = mat.full_flat_index(piece)
                for i, unit in enumerate(mat.units):
                    owners = unit_owners[i]
                    if piece.rank != self.rank and self.rank not in owners:
                        continue
                    pos = unit_positions(unit, full)
                    sel = pos >= 0
                    if not bool(sel.any()):
                        continue
                    local_idx = torch.nonzero(sel).squeeze(1) + piece.local_offset
                    upos = pos[sel]
                    mine_pos = (upos + self.unit_offset[mat.unit_key(i)]
                                if self.rank in owners else None)
                    for owner in owners:
                        if piece.source:
                            if piece.rank == self.rank:  # I send this to the owner
                                g[0][owner].append(local_idx)
                            if owner == self.rank:  # I receive it from the holder
                                g[1][piece.rank].append(mine_pos)
                        if replicate:
                            continue
                        if owner == self.rank:  # I send the result back to the holder
                            s[0][piece.rank].append(mine_pos)
                        if piece.rank == self.rank:  # I receive my piece of the result
                            s[1][owner].append(local_idx)
                    if replicate and piece.rank == self.rank:
                        local_copy_src.append(mine_pos)
                        local_copy_dst.append(local_idx)

        def cat(xs):
            return torch.cat(xs) if xs else torch.empty(0, dtype=torch.int64)

        def build(per_dest_send, per_src_recv):
            send = [cat(x) for x in per_dest_send]
            recv = [cat(x) for x in per_src_recv]
            return _Table(send_index=cat(send).to(device), send_counts=[t.numel() for t in send],
                          recv_pos=cat(recv).to(device), recv_counts=[t.numel() for t in recv])

        self.gather_tables = {b: build(v[0], v[1]) for b, v in sorted(gather.items())}
        # Scatter: the owner sends from its owned buffer, the holder writes into its flat buffer.
        self.scatter_tables = {} if replicate else {
            b: build(v[0], v[1]) for b, v in sorted(scatter.items())}
        self.local_copy = (cat(local_copy_src).to(device), cat(local_copy_dst).to(device))

    # ------------------------------------------------------------------ step
    def index_bytes(self) -> int:
        tabs = list(self.gather_tables.values()) + list(self.scatter_tables.values())
        n = sum(t.send_index.numel() + t.recv_pos.numel() for t in tabs)
        return 8 * (n + self.local_copy[0].numel() + self.local_copy[1].numel())

    def _exchange(self, t: _Table, src: torch.Tensor, dst: torch.Tensor, kind: str,
                  async_op: bool):
        """src[t.send_index] -> all_to_all -> dst[t.recv_pos]; a handle for ``finish`` if async."""
        recv, work = all_to_all_flat(src.index_select(0, t.send_index), t.send_counts,
                                     t.recv_counts, self.group, self.stats, kind,
                                     async_op=async_op)
        handle = (t, recv, work)
        if async_op:
            return handle
        self.finish(handle, dst)

    @staticmethod
    def finish(handle, dst: torch.Tensor) -> None:
        """Wait for an asynchronous gather / scatter and write what arrived into ``dst``."""
        t, recv, work = handle
        if work is not None:
            work.wait()
        dst.index_copy_(0, t.recv_pos, recv)

    def gather(self, local: torch.Tensor, bucket: int, owned: torch.Tensor,
               async_op: bool = False):
        """Pieces of this bucket's units -> their owners' unit buffers."""
        return self._exchange(self.gather_tables[bucket], local, owned, "gather", async_op)

    def orthogonalize(self, owned: torch.Tensor) -> torch.Tensor:
        """Batched NS (times the Muon scale) on this rank's units, one batch per shape."""
        out = torch.empty_like(owned)
        for off, count, m, n in self.batches:
            x = owned[off: off + count * m * n].view(count, m, n)
            o = self.ns_fn(x, steps=self.ns_steps, coefficients=self.coefficients, eps=self.eps,
                           dtype=self.ns_dtype)
            scale = muon_scale(m, n, self.scale_mode, self.extra_scale_factor)
            out[off: off + count * m * n].view(count, m, n).copy_(o).mul_(scale)
        return out

    def scatter(self, result: torch.Tensor, bucket: int, local_out: torch.Tensor,
                async_op: bool = False):
        """Owners' results -> every holder's pieces of this bucket."""
        return self._exchange(self.scatter_tables[bucket], result, local_out, "scatter",
                              async_op)

    def keep_local(self, result: torch.Tensor, out: torch.Tensor) -> None:
        """Naive mode: every rank computed every unit; keep this rank's pieces."""
        out.index_copy_(0, self.local_copy[1], result.index_select(0, self.local_copy[0]))

    def run(self, local: torch.Tensor) -> torch.Tensor:
        """``local``: this rank's flat momentum-updated pieces -> its flat scaled NS pieces."""
        if local.numel() != self.local_numel:
            raise ValueError(f"flat buffer has {local.numel()} elements, expected {self.local_numel}")
        owned = torch.zeros(self.owned_numel, dtype=torch.float32, device=local.device)
        with span("dmuon.gather"):
            for b in self.gather_tables:
                self.gather(local, b, owned)
        with span("dmuon.ns"):
            result = self.orthogonalize(owned)
        out = torch.zeros_like(local)
        with span("dmuon.scatter"):
            if self.replicate:
                self.keep_local(result, out)
            else:
                for b in self.scatter_tables:
                    self.scatter(result, b, out)
        return out
