"""Owner-centric distributed Newton-Schulz (docs/design.md#exchange), framework-free.

The group (a pipeline stage's DP x TP ranks) holds a set of logical matrices, each cut
into *pieces*: a piece is a flat range ``[start, end)`` of one TP shard, held by one group
rank at ``local_offset`` of that rank's flat buffer.  The executor

1. gathers every unit's pieces on the unit's owner (one all-to-all per bucket),
2. runs batched NS on the owner's units, grouped by shape, times the Muon scale,
3. scatters each holder's pieces of the result back (one all-to-all per bucket).

``replicate=True`` is the naive baseline: every rank receives every unit and
orthogonalises all of them, then keeps its own pieces (no scatter).

The exchange is described by blocks: strided 2-D views of the flat buffers, a handful per
piece and unit, computed from the flat ranges by arithmetic (``core.flat_blocks.
piece_unit_blocks``: no index of the matrix's size) once; a step is block copies /
all_to_all / bmm, and a piece that already sits on its unit's owner is copied there
directly.  ``megatron_muon.testing.exchange_oracle`` builds the same blocks element by
element, as the exchange first did: the tests' oracle.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_muon.distributed.comm import CommStats, all_to_all_flat
from megatron_muon.core.newton_schulz import (muon_scale, newton_schulz,
                                              newton_schulz_in_workspace, ns_workspace_numel)
from megatron_muon.core.plan import OwnerPlan
from megatron_muon.distributed.trace import span
from megatron_muon.core.flat_blocks import piece_unit_blocks
from megatron_muon.core.units import Unit, split_unit
from megatron_muon.distributed.split_ns import SplitNS

__all__ = ["Piece", "ShardedMatrix", "OwnerCentricNS", "NS_BATCH_SHARE"]

#: An owner's NS batch (same-shape units, run as one batched call) holds at most this share
#: of the rank's owned elements (a unit larger than that is a batch of its own).  NS's
#: workspace grows with the batch, and it is the step's largest transient after the flat
#: buffer and the owned units: measured at TP2 x DP2 on the 8 x 512 GPT, whole-shape
#: batches put DMuon's step peak 28 MiB above those buffers and above the backward's peak
#: (docs/memory.md).  A share (not a fixed size) keeps batches large where units are many
#: and small relative to what a rank owns, which is where batching pays on a GPU.  With the
#: torch NS every batch runs in one workspace of ``ns_workspace_numel`` elements (two
#: iterates and two Gram-sized products per matrix, at most 4 x the largest batch, in the NS
#: dtype), allocated once per step (``OwnerCentricNS.orthogonalize``).
NS_BATCH_SHARE = 4


def _starts_at(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``view`` begins where ``base`` begins (same storage, same offset).  Not by
    ``data_ptr``: a view with no elements has ``data_ptr() == 0`` (torch >= 2.13), and a
    rank whose shard holds no Muon element has exactly such a ``local``."""
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() and \
        view.storage_offset() == base.storage_offset()


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
    bucket: Hashable = 0  # exchange key: matrices of one bucket move in one all-to-all

    def unit_key(self, i: int) -> str:
        return f"{self.key}#{i}"


# A block moves h x w elements between two flat buffers, row by row, as the strided views
# (h, w) with row strides ``a_stride`` / ``b_stride`` at offsets ``a`` / ``b``: a tuple
# (a, b, h, w, a_stride, b_stride).  Side a is the holder's flat buffer, side b the owner's
# unit buffer.  Elements within a block are in canonical order (row by row).
Block = tuple


def _view(buf: torch.Tensor, offset: int, h: int, w: int, stride: int) -> torch.Tensor:
    return buf.as_strided((h, w), (stride, 1), buf.storage_offset() + offset)


def _numel(blocks) -> int:
    return sum(h * w for _, _, h, w, _, _ in blocks)


@dataclass
class _Table:
    """One exchange of one bucket, as this rank sees it.  ``src`` / ``dst`` say which side of
    the blocks this rank reads (sends) and writes (receives): ``'a'`` (its flat buffer) or
    ``'b'`` (its unit buffer).  ``local`` blocks never cross the wire: both sides are here."""

    send: list  # per peer rank: blocks whose src side this rank sends, in canonical order
    recv: list  # per peer rank: blocks whose dst side this rank fills, in canonical order
    local: list  # blocks copied from src to dst on this rank
    src: str
    dst: str

    # the blocks are fixed once the engine is built: count them once, not in every exchange
    @functools.cached_property
    def send_counts(self) -> list:
        return [_numel(b) for b in self.send]

    @functools.cached_property
    def recv_counts(self) -> list:
        return [_numel(b) for b in self.recv]

    def blocks(self) -> int:
        return sum(map(len, self.send)) + sum(map(len, self.recv)) + len(self.local)

    def side(self, block, which: str) -> tuple:
        a, b, h, w, sa, sb = block
        return (a, h, w, sa) if which == "a" else (b, h, w, sb)


@dataclass(frozen=True)
class _Counts:
    """Send / receive element counts per peer of one all-to-all (``_check_exchange``)."""

    send_counts: list
    recv_counts: list


class OwnerCentricNS:
    """Distributed "NS per unit on one owner" over a process group."""

    def __init__(self, matrices: Sequence[ShardedMatrix], plan: Optional[OwnerPlan],
                 group: Optional[dist.ProcessGroup], *, ns_steps: int, coefficients,
                 scale_mode: str, extra_scale_factor: float, ns_dtype: torch.dtype,
                 device: torch.device, replicate: bool = False, eps: float = 1e-7,
                 ns_fn: Optional[Callable] = None, local_numel: Optional[int] = None,
                 ns_batch_numel: Optional[int] = None, check_exchange: bool = True):
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

        splits = {} if replicate or plan is None else plan.splits

        def items_of(mat: ShardedMatrix) -> list:
            """``[(key, unit, owners, whole)]``: what the exchange moves for ``mat``; a split
            unit (``plan.splits``) is its parts, key ``unit key/j``, one owner each."""
            out = []
            for i, u in enumerate(mat.units):
                key = mat.unit_key(i)
                if key in splits:
                    sp = splits[key]
                    out.extend((f"{key}/{j}", part, [r], False) for j, (part, r) in
                               enumerate(zip(split_unit(u, sp.widths), sp.ranks)))
                else:
                    out.append((key, u, list(range(self.world)) if replicate
                                else [plan.owners[key]], True))
            return out

        items = {mat.key: items_of(mat) for mat in self.matrices}
        # Units this rank orthogonalises whole, grouped by shape so a batch is one view; then
        # its parts of split units (``split_ns.SplitNS``), in plan order.
        mine = [(mat, key, u) for mat in self.matrices for key, u, o, whole in items[mat.key]
                if whole and self.rank in o]
        mine.sort(key=lambda t: (t[2].shape, t[0].key, t[1]))
        if ns_batch_numel is None:  # default: a share of what this rank owns
            ns_batch_numel = sum(u.numel for _, _, u in mine) // NS_BATCH_SHARE
        self.ns_batch_numel = ns_batch_numel
        self.unit_offset: dict[str, int] = {}
        self.batches: list[tuple[int, int, int, int]] = []  # (offset, count, m, n)
        self.batch_keys: list[list[str]] = []  # the unit keys of each batch, in order
        off = 0
        for mat, key, u in mine:
            self.unit_offset[key] = off
            m, n = u.shape
            if self.batches and self.batches[-1][2:] == (m, n) and \
                    (self.batches[-1][1] + 1) * m * n <= max(ns_batch_numel, m * n):
                o, c, _, _ = self.batches[-1]
                self.batches[-1] = (o, c + 1, m, n)
                self.batch_keys[-1].append(key)
            else:
                self.batches.append((off, 1, m, n))
                self.batch_keys.append([key])
            off += m * n
        # The torch standard NS runs every batch in one workspace (``orthogonalize``); other
        # backends (tuner, Triton, Gram) allocate their own temporaries per batch.
        self.ns_in_workspace = newton_schulz_in_workspace if ns_fn is None else \
            getattr(ns_fn, "in_workspace", None)
        self.ns_workspace_numel = max((ns_workspace_numel(c, m, n) for _, c, m, n in
                                       self.batches), default=0)
        shapes = {mat.unit_key(i): u.shape for mat in self.matrices
                  for i, u in enumerate(mat.units)}
        self.split = SplitNS(self, splits, shapes, off)
        off += self.split.numel
        for key, o in self.split.offsets.items():
            self.unit_offset[key] = o
        self.owned_numel = off
        self.local_numel = local_numel if local_numel is not None else max(
            [p.local_offset + p.end - p.start for mat in self.matrices for p in mat.pieces
             if p.rank == self.rank] or [0])

        # Canonical order, identical on both sides of every exchange: matrices in order,
        # units in order, pieces in order, elements in local flat order.  Both sides
        # compress the same element map, so they cut it into the same blocks.
        world = range(self.world)
        gather: dict[Hashable, _Table] = {}
        scatter: dict[Hashable, _Table] = {}
        self.local_copy: list = []  # naive mode: this rank's pieces of its own results
        for mat in self.matrices:
            g = gather.setdefault(mat.bucket, _Table([[] for _ in world], [[] for _ in world],
                                                     [], src="a", dst="b"))
            s = scatter.setdefault(mat.bucket, _Table([[] for _ in world], [[] for _ in world],
                                                      [], src="b", dst="a"))
            i_own_some = any(self.rank in o for _, _, o, _ in items[mat.key])
            for piece in mat.pieces:
                if piece.rank != self.rank and not i_own_some:
                    continue
                for key, unit, owners, _ in items[mat.key]:
                    if piece.rank != self.rank and self.rank not in owners:
                        continue
                    blocks = piece_unit_blocks(mat.shape, mat.tp_dim, mat.tp_size, piece.tp_rank,
                                               piece.start, piece.end, piece.local_offset, unit)
                    if not blocks:
                        continue
                    base = self.unit_offset.get(key, 0)
                    blocks = [(a, b + base, h, w, sa, sb) for a, b, h, w, sa, sb in blocks]
                    held = piece.rank == self.rank
                    for owner in owners:
                        mine_too = owner == self.rank
                        if piece.source:
                            if held and mine_too:
                                g.local.extend(blocks)
                            elif held:  # I send this to the owner
                                g.send[owner].extend(blocks)
                            elif mine_too:  # I receive it from the holder
                                g.recv[piece.rank].extend(blocks)
                        if replicate:
                            continue
                        if held and mine_too:
                            s.local.extend(blocks)
                        elif mine_too:  # I send the result back to the holder
                            s.send[piece.rank].extend(blocks)
                        elif held:  # I receive my piece of the result
                            s.recv[owner].extend(blocks)
                    if replicate and held:
                        self.local_copy.extend(blocks)

        self.gather_tables = dict(sorted(gather.items()))
        # Scatter: the owner sends from its unit buffer, the holder writes its flat buffer.
        self.scatter_tables = {} if replicate else dict(sorted(scatter.items()))
        # Do the exchanges write every element of the owned buffer / of the flat output?
        # (Units tile their matrices and pieces tile the shards, so normally yes; then the
        # step allocates them without a zero-fill.)  Blocks never overlap, so counting
        # elements decides it.
        self.gather_covers = sum(_numel(b) for t in self.gather_tables.values()
                                 for b in t.recv + [t.local]) == self.owned_numel
        written = (_numel(self.local_copy) if replicate else
                   sum(_numel(b) for t in self.scatter_tables.values() for b in t.recv + [t.local]))
        self.scatter_covers = written == self.local_numel
        # ``run(local, out=local)`` (the caller's U is dead once gathered): pack every
        # bucket's gather first, then receive each bucket into ``local`` itself, which
        # saves the receive buffers where the packed sends together are no larger than one
        # bucket's send + receive staging (always with one bucket) and every bucket's
        # receive fits (docs/memory.md).
        sent = [sum(t.send_counts) for t in self.gather_tables.values()]
        got = [sum(t.recv_counts) for t in self.gather_tables.values()]
        self.gather_into_input = bool(sent) and not replicate and \
            max(got) <= self.local_numel and sum(sent) <= max(map(sum, zip(sent, got)))
        if check_exchange:  # False only where nothing is sent (tools/bench_scale.py's fake group)
            self._check_exchange()

    # ------------------------------------------------------------------ validation
    def _exchanges(self) -> list:
        """``[(kind, bucket key, table)]``: every exchange of a step, in the order it runs
        (the buckets' all-to-alls, then the split units' point-to-point halves)."""
        split = [(f"{name} {'reduce-scatter' if half == 'rs' else 'all-gather'}", None,
                  _Counts(*getattr(r, half)))
                 for name, r in self.split.rounds() for half in ("rs", "ag")]
        return ([("gather", k, t) for k, t in self.gather_tables.items()]
                + [("scatter", k, t) for k, t in self.scatter_tables.items()] + split)

    def _check_exchange(self) -> None:
        """Once, at construction: every rank of the group runs the same all-to-alls (same
        buckets, in the same order) and what rank j will send this rank in each equals what
        this rank expects to receive from j.  Each rank builds its tables from its own view
        of the geometry; where views differ, NCCL's all-to-all hangs or silently corrupts
        the update.  Counts only: a digest of the bucket keys (one all-gather of one
        integer), each rank's send counts to each peer (one all-to-all of buckets x world
        integers) and one agreement all-reduce; every rank raises the same error, naming
        the bucket."""
        if self.group is None or self.world == 1:
            return
        names = [kind if kind.startswith("split") else f"{kind} of bucket {key!r}"
                 for kind, key, _ in self._exchanges()]
        self._check_buckets(names)
        tables = [t for _, _, t in self._exchanges()]
        send = torch.tensor([[t.send_counts[j] for t in tables] for j in range(self.world)],
                            dtype=torch.int64, device=self.device).reshape(-1)
        want = torch.tensor([[t.recv_counts[j] for t in tables] for j in range(self.world)],
                            dtype=torch.int64).reshape(self.world, -1)
        got = torch.empty_like(send)
        if send.numel():
            dist.all_to_all_single(got, send, group=self.group)
        got = got.cpu().reshape(self.world, -1)  # got[j, b]: what j sends here in exchange b
        # the first disagreement (exchange, receiver, sender), encoded so that MIN picks one
        none = len(tables) * self.world * self.world
        code = none
        for j, b in torch.nonzero(got != want).tolist():
            code = min(code, (b * self.world + self.rank) * self.world + j)
        first = torch.tensor([code], dtype=torch.int64, device=self.device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.group)
        code = int(first.item())
        if code == none:
            return
        b, rest = divmod(code, self.world * self.world)
        receiver, sender = divmod(rest, self.world)
        counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        if self.rank == receiver:
            counts[0], counts[1] = int(got[sender, b]), int(want[sender, b])
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.group)
        raise RuntimeError(
            f"DMuon exchange: the {names[b]} disagrees across ranks: rank "
            f"{dist.get_global_rank(self.group, sender)} sends {int(counts[0])} elements to "
            f"rank {dist.get_global_rank(self.group, receiver)}, which expects "
            f"{int(counts[1])}; the ranks of a pipeline stage must build the same model, DDP "
            "buckets and dmuon_* settings")

    def _check_buckets(self, names: list) -> None:
        """Every rank of the group has the same exchanges (kind and bucket key, in order):
        an all-gather of a 63-bit digest; on a mismatch, the names themselves (only then)."""
        h = hashlib.blake2b(repr(names).encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(h, "little") >> 1], dtype=torch.int64,
                            device=self.device)
        digests = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(digests, mine, group=self.group)
        if len({int(d.item()) for d in digests}) == 1:
            return
        every = [None] * self.world
        dist.all_gather_object(every, names, group=self.group)
        first = next(r for r in range(self.world) if every[r] != every[0])
        a, b = every[0], every[first]
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        def which(x: list) -> str:
            return f"the {x[i]}" if i < len(x) else "missing"

        raise RuntimeError(
            f"DMuon exchange: ranks disagree on the all-to-alls of a step: all-to-all #{i} is "
            f"{which(a)} on rank {dist.get_global_rank(self.group, 0)} but {which(b)} on rank "
            f"{dist.get_global_rank(self.group, first)} ({len(a)} and {len(b)} all-to-alls); "
            "the ranks of a pipeline stage must build the same model, DDP buckets and dmuon_* "
            "settings")

    # ------------------------------------------------------------------ step
    def ns_workspace_bytes(self) -> Optional[int]:
        """Bytes of the one NS workspace ``orthogonalize`` allocates per step (the whole
        NS working set of the units this rank owns whole, beside the owned units
        themselves), or None where the NS backend allocates its own (tuner, Triton,
        Gram)."""
        if self.ns_in_workspace is None:
            return None
        return self.ns_workspace_numel * torch.finfo(self.ns_dtype).bits // 8

    def index_bytes(self) -> int:
        """Bytes of exchange bookkeeping: six integers per block (their int64 size)."""
        tabs = list(self.gather_tables.values()) + list(self.scatter_tables.values())
        return 48 * (sum(t.blocks() for t in tabs) + len(self.local_copy))

    def _exchange(self, t: _Table, src: torch.Tensor, dst: torch.Tensor, kind: str,
                  async_op: bool):
        """Blocks of ``src`` -> their peers' ``dst`` (one all-to-all; pieces that stay on this
        rank are copied directly); a handle for ``finish`` if async."""
        return self._send(t, [self._pack(t, src, dst)], dst, kind, async_op)

    @staticmethod
    def _pack(t: _Table, src: torch.Tensor, dst: torch.Tensor,
              into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The send staging buffer of ``t`` (its blocks of ``src`` in canonical order; in
        ``into``, of ``sum(t.send_counts)`` elements, if given), and the blocks that stay on
        this rank copied from ``src`` into ``dst``: after this, the exchange no longer reads
        ``src``."""
        views = [_view(src, *t.side(b, t.src)).reshape(-1) for blocks in t.send for b in blocks]
        if into is not None:
            send = torch.cat(views, out=into) if views else into
        else:
            send = torch.cat(views) if views else src.new_empty(0)
        for b in t.local:
            _view(dst, *t.side(b, t.dst)).copy_(_view(src, *t.side(b, t.src)))
        return send

    def _send(self, t: _Table, box: list, dst: torch.Tensor, kind: str, async_op: bool):
        """Start the all-to-all of ``t`` from the packed send buffer ``box[0]`` (taken out of
        ``box``, so that it is freed once sent) and, unless ``async_op``, unpack into ``dst``."""
        send = box.pop()
        recv, work = all_to_all_flat(send, t.send_counts, t.recv_counts, self.group,
                                     self.stats, kind, async_op=async_op)
        handle = (t, recv, work)
        if async_op:
            return handle
        del send  # sent: free the staging copy before unpacking what arrived
        self.finish(handle, dst)

    @staticmethod
    def finish(handle, dst: torch.Tensor) -> None:
        """Wait for an asynchronous gather / scatter and write what arrived into ``dst``."""
        t, recv, work = handle
        if work is not None:
            work.wait()
        off = 0
        for blocks in t.recv:
            for b in blocks:
                _, h, w, _ = view = t.side(b, t.dst)
                _view(dst, *view).copy_(recv[off: off + h * w].view(h, w))
                off += h * w

    def gather(self, local: torch.Tensor, bucket: Hashable, owned: torch.Tensor,
               async_op: bool = False):
        """Pieces of this bucket's units -> their owners' unit buffers."""
        return self._exchange(self.gather_tables[bucket], local, owned, "gather", async_op)

    def orthogonalize(self, owned: torch.Tensor, out: Optional[torch.Tensor] = None,
                      post: Optional[Callable] = None,
                      workspace: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Batched NS (times the Muon scale) on this rank's units, in batches of one shape
        (at most ``ns_batch_numel`` elements each, a larger unit alone).

        ``out``: where the results go (``owned`` itself is allowed: each batch reads only its
        own units before overwriting them); default a new buffer.  With the torch NS
        (``ns_in_workspace``) every batch runs in one workspace of ``ns_workspace_numel``
        elements, allocated here and freed on return, with ``out=`` ops, and its result is
        converted and scaled straight into ``out``: the NS working set is that workspace
        (``ns_workspace_bytes``), whatever the number of batches, and no per-batch
        temporaries are allocated.  Other backends release each batch's temporaries before
        the next batch runs.  ``post(keys, o)``: applied to each batch's raw NS output ``o``
        ([count, m, n], units ``keys``) before the scale, returns the result (DMuon's
        AdaMuon / NorMuon second moment, which lives with the owner).  ``workspace``: a
        1-D fp32 buffer of at least ``ns_workspace_bytes() / 4`` elements to hold the NS
        workspace (``run``'s arena) instead of a new one.
        """
        if out is None:
            out = torch.empty_like(owned)
        self.split.check(post)
        ws = None
        if self.ns_in_workspace is not None and self.batches:
            if workspace is not None:  # the NS dtype's elements over the fp32 buffer
                ws = workspace[: -(-self.ns_workspace_bytes() // 4)].view(self.ns_dtype)
                ws = ws[: self.ns_workspace_numel]
            else:
                ws = torch.empty(self.ns_workspace_numel, dtype=self.ns_dtype,
                                 device=owned.device)
        for (off, count, m, n), keys in zip(self.batches, self.batch_keys):
            x = owned[off: off + count * m * n].view(count, m, n)
            if ws is not None:
                o = self.ns_in_workspace(x, ws, steps=self.ns_steps,
                                         coefficients=self.coefficients, eps=self.eps,
                                         dtype=self.ns_dtype)
            else:
                o = self.ns_fn(x, steps=self.ns_steps, coefficients=self.coefficients,
                               eps=self.eps, dtype=self.ns_dtype)
            if post is not None:
                o = post(keys, o.float())
            self._write(o, out[off: off + count * m * n].view(count, m, n), m, n)
            del x, o
        del ws
        self.split.run(owned, out, self._write)  # parts of split units (every rank takes part)
        return out

    def _write(self, o: torch.Tensor, dst: torch.Tensor, m: int, n: int) -> None:
        """NS output ``o`` of (units of shape) m x n, times the Muon scale, into ``dst``."""
        scale = muon_scale(m, n, self.scale_mode, self.extra_scale_factor)
        if o.dtype == dst.dtype:  # one pass; the same fp32 multiply as copy + mul_
            torch.mul(o, scale, out=dst)
        else:  # round to fp32 first, then scale in fp32 (as the reference does)
            dst.copy_(o).mul_(scale)

    def scatter(self, result: torch.Tensor, bucket: Hashable, local_out: torch.Tensor,
                async_op: bool = False):
        """Owners' results -> every holder's pieces of this bucket."""
        return self._exchange(self.scatter_tables[bucket], result, local_out, "scatter",
                              async_op)

    def keep_local(self, result: torch.Tensor, out: torch.Tensor) -> None:
        """Naive mode: every rank computed every unit; keep this rank's pieces."""
        for a, b, h, w, sa, sb in self.local_copy:
            _view(out, a, h, w, sa).copy_(_view(result, b, h, w, sb))

    def to_owners(self, local: torch.Tensor) -> torch.Tensor:
        """Every bucket's gather: this rank's flat pieces -> a new buffer of its owned units
        (not zero-filled when the gathers write all of it, ``gather_covers``)."""
        owned = (torch.empty if self.gather_covers else torch.zeros)(
            self.owned_numel, dtype=torch.float32, device=local.device)
        for b in self.gather_tables:
            self.gather(local, b, owned)
        return owned

    def _gather_over(self, local: torch.Tensor, owned: torch.Tensor,
                     staging: Optional[torch.Tensor] = None) -> None:
        """Every bucket's gather into ``owned`` for a caller that no longer needs ``local``.
        With ``gather_into_input``: every bucket's send buffer is packed (and the pieces
        that stay here copied) first, then each bucket's all-to-all receives into
        ``local``'s storage, which holds nothing needed any more, and is unpacked before the
        next one.  Otherwise bucket by bucket (send, then receive).  ``staging``: where the
        send (and, bucket by bucket, receive) buffers go (``arena_numel``); default new
        buffers."""
        tables = list(self.gather_tables.values())

        def room(off: int, numel: int) -> Optional[torch.Tensor]:
            return None if staging is None else staging[off: off + numel]

        if self.gather_into_input:
            sends, off = [], 0
            for t in tables:
                sends.append(self._pack(t, local, owned, into=room(off, sum(t.send_counts))))
                off += sum(t.send_counts)
            for t in tables:  # popped: each send buffer is freed once sent
                send = sends.pop(0)
                recv, _ = all_to_all_flat(send, t.send_counts, t.recv_counts, self.group,
                                          self.stats, "gather",
                                          out=local[: sum(t.recv_counts)])
                del send
                self.finish((t, recv, None), owned)
            return
        for t in tables:
            sent = sum(t.send_counts)
            send = self._pack(t, local, owned, into=room(0, sent))
            recv, _ = all_to_all_flat(send, t.send_counts, t.recv_counts, self.group,
                                      self.stats, "gather", out=room(sent, sum(t.recv_counts)))
            del send
            self.finish((t, recv, None), owned)

    def arena_numel(self) -> Optional[int]:
        """fp32 elements of the one buffer a synchronous step can run in (``run(...,
        arena=)``): this rank's flat pieces, its owned units, then a staging region that
        takes, phase by phase, the gather's send (and receive) buffers, the NS workspace
        and the scatter's send buffers (its receive buffers go into the owned units, dead
        by then, where they fit).  The region is the largest of the three, so the arena is
        the step's working set at its peak, counted here: nothing else of that size is
        allocated during the step (docs/memory.md).  None in naive mode."""
        if self.replicate:
            return None
        g = [(sum(t.send_counts), sum(t.recv_counts)) for t in self.gather_tables.values()]
        gather = sum(a for a, _ in g) if self.gather_into_input else \
            max((a + b for a, b in g), default=0)
        sc = [(sum(t.send_counts), sum(t.recv_counts)) for t in self.scatter_tables.values()]
        recv = max((b for _, b in sc), default=0)
        scatter = sum(a for a, _ in sc) + (recv if recv > self.owned_numel else 0)
        ws = -(-(self.ns_workspace_bytes() or 0) // 4)
        return self.local_numel + self.owned_numel + max(gather, ws, scatter)

    def _scatter_over(self, owned: torch.Tensor, out: torch.Tensor,
                      staging: torch.Tensor) -> None:
        """``scatter_owned`` in an arena: every bucket's send buffer packed into
        ``staging``, then each bucket received into the owned units (dead once packed)
        where it fits, else after the sends."""
        if not self._scatter_prologue(owned, out):
            return
        tables = list(self.scatter_tables.values())
        sends, off = [], 0
        for t in tables:
            sends.append(self._pack(t, owned, out, into=staging[off: off + sum(t.send_counts)]))
            off += sum(t.send_counts)
        for t, send in zip(tables, sends):
            r = sum(t.recv_counts)
            room = owned[:r] if r <= owned.numel() else staging[off: off + r]
            recv, _ = all_to_all_flat(send, t.send_counts, t.recv_counts, self.group,
                                      self.stats, "scatter", out=room)
            self.finish((t, recv, None), out)

    def to_holders(self, result: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every bucket's scatter (naive mode: the local copy): owned units -> ``out``, this
        rank's flat pieces (elements no unit covers are zeroed, unless there are none:
        ``scatter_covers``)."""
        if self._scatter_prologue(result, out):
            for b in self.scatter_tables:
                self.scatter(result, b, out)
        return out

    def _scatter_prologue(self, result: torch.Tensor, out: torch.Tensor) -> bool:
        """Zero what no unit covers; in naive mode keep this rank's pieces (the whole
        scatter).  Whether the all-to-alls remain to be done."""
        if not self.scatter_covers:
            out.zero_()
        if self.replicate:
            self.keep_local(result, out)
            return False
        return True

    def run(self, local: torch.Tensor, out: Optional[torch.Tensor] = None,
            post: Optional[Callable] = None,
            arena: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``local``: this rank's flat momentum-updated pieces -> its flat scaled NS pieces.

        ``out``: where the pieces go, default a new buffer.  ``out=local`` is allowed (the
        caller no longer needs its input): every gather has finished reading ``local``
        before it is zeroed and written, and the gathers then receive into ``local`` itself
        (``gather_into_input``).  NS runs in place on the owned units, so a step holds
        ``local``, the owned units and the gather's send buffers (or one bucket's send and
        receive buffers), then the NS workspace; the owned units are freed once the
        scatter's send buffers are packed.

        ``arena``: ``arena_numel()`` fp32 elements whose first ``local_numel`` are
        ``local`` (and ``out``): the whole step then runs in it (owned units, staging, NS
        workspace; ``arena_numel``), allocating nothing of their size.
        """
        if local.numel() != self.local_numel:
            raise ValueError(f"flat buffer has {local.numel()} elements, expected {self.local_numel}")
        if arena is not None:
            return self._run_in(arena, local, out, post)
        with span("dmuon.gather"):
            if out is local:
                owned = (torch.empty if self.gather_covers else torch.zeros)(
                    self.owned_numel, dtype=torch.float32, device=local.device)
                self._gather_over(local, owned)
            else:
                owned = self.to_owners(local)
        with span("dmuon.ns"):
            self.orthogonalize(owned, out=owned, post=post)
        if out is None:
            out = torch.empty_like(local)  # to_holders zeroes what no unit covers
        box = [owned]
        del owned
        return self.scatter_owned(box, out)

    def _run_in(self, arena: torch.Tensor, local: torch.Tensor, out, post) -> torch.Tensor:
        """``run`` in ``arena`` (see there)."""
        n, o = self.local_numel, self.owned_numel
        if self.replicate or arena.numel() != self.arena_numel() or out is None or \
                not _starts_at(out, arena) or not _starts_at(local, arena) or \
                arena.dtype != torch.float32:
            raise ValueError("run(arena=): arena must be arena_numel() fp32 elements starting "
                             "with local, and out must be local (not in naive mode)")
        owned, staging = arena[n: n + o], arena[n + o:]
        with span("dmuon.gather"):
            if not self.gather_covers:
                owned.zero_()
            self._gather_over(local, owned, staging)
        with span("dmuon.ns"):
            self.orthogonalize(owned, out=owned, post=post, workspace=staging)
        with span("dmuon.scatter"):
            self._scatter_over(owned, local, staging)
        return local

    def scatter_owned(self, box: list, out: torch.Tensor) -> torch.Tensor:
        """Every bucket's scatter of the owned results ``box[0]`` into ``out`` (this rank's
        flat pieces), synchronously; ``box`` is emptied, so that the owned units are freed
        as soon as their send buffers are packed (the caller keeps no other reference)."""
        with span("dmuon.scatter"):
            if not self._scatter_prologue(box[0], out):  # naive mode: nothing to send
                box.clear()
                return out
            # Pack every bucket's send buffer (and copy the pieces that stay here) first,
            # then free the owned units before the all-to-alls: the scatter then holds the
            # output, the packed results and one bucket's receive buffer, not the owned
            # units as well (with one bucket: 4 x owned elements fewer bytes at its peak).
            tables = list(self.scatter_tables.values())
            sends = [self._pack(t, box[0], out) for t in tables]
            box.clear()
            for t in tables:  # popped: each send buffer is freed once sent
                self._send(t, [sends.pop(0)], out, "scatter", async_op=False)
        return out
