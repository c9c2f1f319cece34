"""Newton-Schulz of one unit on several ranks (docs/design.md#split-ns), framework-free.

When a group has more ranks than the owner plan can balance, the planner cuts the costliest
units along their long side into parts (``core.plan.SplitUnit``, ``core.units.split_unit``),
one per rank.  With X the unit oriented wide (s x L, s the short side) and X_j part j
(s x w_j), every NS step needs only the s x s Gram matrix A = X X^T = sum_j X_j X_j^T:

    A = allreduce_j(X_j X_j^T);   X_j <- a X_j + B X_j,  B = b A + c A^2      (form 'b')
                                  X_j <- a X_j + b A X_j + c A (A X_j)          (form 'ay')

and the Frobenius norm that NS starts with is sqrt(allreduce_j ||X_j||^2).  Both forms are
the NS polynomial; 'ay' skips the s x s product A A (cheaper for parts narrower than s),
and is used in fp32 only (``plan.SplitPolicy.ay``).  The planner chooses the form and the
part widths (``plan.split_costs``).

The all-reduces run point to point among each unit's ranks (``comm.exchange_p2p``; a rank
with no part takes no part): a reduce-scatter, in which the rank of part c sums chunk c of
every part's Gram matrix in part order (in fp32), then an all-gather of the sums.  One
batch of sends and receives per half serves every split unit this rank has a part of, one
message per peer.  (The first version ran both halves as all-to-alls over the whole group,
which at 1024 ranks cost every rank a latency per peer for each of the 2 + 2 x steps
exchanges of a step, most of them empty.)  The sum is taken once, in a fixed order, so
every rank of a unit gets the same A bit for bit.  Only the upper triangle of each (symmetric) Gram matrix travels, in the NS
dtype: bf16 by default, half fp32's bytes
for the same numbers, since a part's ``X_j X_j^T`` is a bf16 GEMM's output either way and
the fp32 sum is rounded to bf16 for the next product, as the whole unit's A is.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_muon.core.newton_schulz import ns_step_scalars, resolve_coefficients
from megatron_muon.core.units import long_axis
from megatron_muon.distributed.comm import exchange_p2p

__all__ = ["SplitNS", "Round"]


@dataclass(frozen=True)
class _Part:
    key: str  # the split unit's key
    ranks: tuple  # the group ranks of its parts, in part order
    index: int  # which part this rank has
    offset: int  # where it sits in the owner's unit buffer
    shape: tuple  # the part's (rows, cols) as the exchange lays it out
    unit_shape: tuple  # the whole unit's
    form: str

    @property
    def tall(self) -> bool:  # NS works on the transpose (long side = rows)
        return long_axis(self.unit_shape) == 0

    @property
    def s(self) -> int:
        return min(self.unit_shape)


class Round:
    """One all-reduce of a payload per split unit (the same size on each of its ranks), as
    a reduce-scatter and an all-gather; the send / receive counts of both are fixed."""

    def __init__(self, parts: list, size, me: int, world: int):
        self.parts, self.size, self.me = parts, size, me
        rs_send, rs_recv, ag = [0] * world, [0] * world, [0] * world
        for p in parts:
            b = self.bounds(p)
            for c, r in enumerate(p.ranks):
                if r != me:
                    rs_send[r] += b[c + 1] - b[c]  # chunk c of my payload to its summer
                    rs_recv[r] += b[p.index + 1] - b[p.index]  # my chunk of theirs
                    ag[r] += b[c + 1] - b[c]  # their sum of chunk c, to me
        self.rs = (rs_send, rs_recv)
        # all-gather: my sum of my chunk to each other rank of the unit; theirs to me
        self.ag = ([sum(self._chunk(p, p.index) for p in parts if r in p.ranks and r != me)
                    for r in range(world)], ag)

    def bounds(self, p: _Part) -> list:
        n, k = self.size(p), len(p.ranks)
        return [n * c // k for c in range(k + 1)]

    def _chunk(self, p: _Part, c: int) -> int:
        b = self.bounds(p)
        return b[c + 1] - b[c]

    @staticmethod
    def _exchange(send: list, counts: tuple, group, stats, kind: str, dtype, device) -> list:
        """``send[j]`` (tensors) to group rank j, point to point with the unit's other
        ranks only (``counts``: send, receive per peer); what came from each peer."""
        return exchange_p2p([torch.cat(per) if per else None for per in send], counts[1],
                            group, stats, kind, dtype, device)

    def run(self, payloads: list, group, stats, kind: str, device,
            dtype: torch.dtype = torch.float32) -> list:
        """``payloads[i]``: flat payload of ``parts[i]`` on this rank (``dtype``) -> its sum
        over the unit's ranks (in part order, accumulated in fp32, returned in ``dtype``),
        the same on each of them."""
        me, world = self.me, len(self.rs[0])
        bounds = [self.bounds(p) for p in self.parts]
        send = [[] for _ in range(world)]
        for p, x, b in zip(self.parts, payloads, bounds):
            for c, r in enumerate(p.ranks):
                if r != me:
                    send[r].append(x[b[c]: b[c + 1]])
        recv = self._exchange(send, self.rs, group, stats, kind, dtype, device)
        cursor = [0] * world
        sums = []
        for p, x, b in zip(self.parts, payloads, bounds):
            lo, hi = b[p.index], b[p.index + 1]
            acc = None
            for r in p.ranks:  # part order: the same sum wherever it is taken
                if r == me:
                    v = x[lo:hi]
                else:
                    v = recv[r][cursor[r]: cursor[r] + hi - lo]
                    cursor[r] += hi - lo
                acc = v.to(torch.float32, copy=True) if acc is None else acc.add_(v)
            sums.append(acc.to(dtype))
        send = [[] for _ in range(world)]
        for p, acc in zip(self.parts, sums):
            for r in p.ranks:
                if r != me:
                    send[r].append(acc)
        recv = self._exchange(send, self.ag, group, stats, kind, dtype, device)
        cursor = [0] * world
        out = []
        for p, acc, b in zip(self.parts, sums, bounds):
            full = torch.empty(b[-1], dtype=dtype, device=device)
            for c, r in enumerate(p.ranks):
                if r == me:
                    full[b[c]: b[c + 1]] = acc
                else:
                    n = b[c + 1] - b[c]
                    full[b[c]: b[c + 1]] = recv[r][cursor[r]: cursor[r] + n]
                    cursor[r] += n
            out.append(full)
        return out


class SplitNS:
    """This rank's parts of the group's split units, and the NS that runs on them.

    ``splits``: the plan's {unit key: ``SplitUnit``}; ``shapes``: {unit key: unit shape};
    ``offset``: where this rank's parts start in its unit buffer (after its whole units).
    Only the ranks with a part exchange anything in ``run`` (point to point with the
    other ranks of their units)."""

    def __init__(self, engine, splits: dict, shapes: dict, offset: int):
        self.engine = engine
        self.active = bool(splits)
        me, world = engine.rank, engine.world
        self.parts: list = []
        self.offsets: dict = {}  # part key (unit key/j) -> offset in the unit buffer
        off = offset
        for key in sorted(splits):
            sp = splits[key]
            if len(set(sp.ranks)) != len(sp.ranks):
                raise ValueError(f"split unit {key}: two parts on one rank ({sp.ranks})")
            if me not in sp.ranks:
                continue
            j = sp.ranks.index(me)
            m, n = shapes[key]
            w = sp.widths[j]
            shape = (w, n) if long_axis((m, n)) == 0 else (m, w)
            self.parts.append(_Part(key, tuple(sp.ranks), j, off, shape, (m, n), sp.form))
            self.offsets[f"{key}/{j}"] = off
            off += shape[0] * shape[1]
        self.numel = off - offset
        self.norm_round = Round(self.parts, lambda p: 1, me, world)
        # A is symmetric: its upper triangle (diagonal included) is what travels
        self.gram_round = Round(self.parts, lambda p: p.s * (p.s + 1) // 2, me, world)
        # s -> flat (row-major) indices of the s x s upper triangle, diagonal included: index
        # ops with them need no device-to-host sync (a boolean mask counts its elements)
        self._upper: dict = {}

    def rounds(self) -> list:
        """``[(name, round)]``: the exchanges of a step (each round is two), for the
        engine's construction-time check of the counts."""
        if not self.active:
            return []
        return [("split norm", self.norm_round), ("split gram", self.gram_round)]

    @torch.no_grad()
    def run(self, owned: torch.Tensor, out: torch.Tensor, write) -> None:
        """NS on this rank's parts of ``owned`` -> ``out`` (``write(o, dst, m, n)`` scales
        and stores a result as the whole units' are)."""
        if not self.active:
            return
        e = self.engine
        # the matmul precision whole units run under (TF32 with muon_fp32_matmul_prec='high')
        context = getattr(e.ns_fn, "matmul_context", None)
        with context(e.device) if context is not None else contextlib.nullcontext():
            self._run(owned, out, write)

    def _run(self, owned: torch.Tensor, out: torch.Tensor, write) -> None:
        e = self.engine
        dt, dev = e.ns_dtype, e.device
        group, stats = e.group, e.stats
        xs = []
        for p in self.parts:
            x = owned[p.offset: p.offset + p.shape[0] * p.shape[1]].view(p.shape).to(dt)
            xs.append(x.t() if p.tall else x)
        squares = [x.float().square().sum().reshape(1) for x in xs]
        norms = self.norm_round.run(squares, group, stats, "split", dev)
        # as newton_schulz: the norm in the NS dtype, X / (norm + eps) in it
        xs = [x / (n.sqrt().to(dt) + e.eps) for x, n in zip(xs, norms)]
        coeffs = resolve_coefficients(e.coefficients, e.ns_steps)
        for (a, b, c), (bb, cc, aa, alpha) in zip(coeffs, ns_step_scalars(coeffs, dt)):
            # each part's Gram in the NS dtype (a GEMM with fp32 accumulation, rounded once),
            # summed in fp32, rounded back: as the whole unit's A is rounded once
            grams = [torch.mm(x, x.t()).view(-1).index_select(0, self._upper_index(p.s, dev))
                     for p, x in zip(self.parts, xs)]
            sums = self.gram_round.run(grams, group, stats, "split", dev, dtype=dt)
            for i, (p, g) in enumerate(zip(self.parts, sums)):
                A, x = self._symmetric(g, p.s, dev), xs[i]
                if p.form == "b":  # the whole unit's step, on its rescaled iterate
                    B = torch.addmm(A, A, A, beta=bb, alpha=cc) if c != 0.0 else A * bb
                    xs[i] = torch.addmm(x, B, x, beta=aa, alpha=alpha)
                else:
                    Y = torch.mm(A, x)
                    Z = torch.addmm(Y, A, Y, beta=b, alpha=c) if c != 0.0 else Y * b
                    xs[i] = torch.add(Z, x, alpha=a)
        for p, x in zip(self.parts, xs):
            o = x.t() if p.tall else x
            dst = out[p.offset: p.offset + p.shape[0] * p.shape[1]].view(p.shape)
            write(o, dst, *p.unit_shape)

    def _upper_index(self, s: int, device) -> torch.Tensor:
        if s not in self._upper:
            rows, cols = torch.triu_indices(s, s, device=device)
            self._upper[s] = rows * s + cols  # row by row, as a boolean mask would take them
        return self._upper[s]

    def _symmetric(self, upper: torch.Tensor, s: int, device) -> torch.Tensor:
        """The s x s symmetric matrix whose upper triangle (row by row) is ``upper``."""
        A = torch.zeros(s, s, dtype=upper.dtype, device=device)
        A.view(-1).index_copy_(0, self._upper_index(s, device), upper)
        return A + A.triu(1).t()  # adds zeros to the upper part: exact

    def check(self, post: Optional[object]) -> None:
        if post is not None and self.active:
            raise RuntimeError("DMuon: a second moment (dmuon_moment2) cannot run on units "
                               "split across ranks; the planner must not split with it")
