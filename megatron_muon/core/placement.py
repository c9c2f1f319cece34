"""MatrixFSDP placement: every Muon unit whole on one data-parallel rank.

See docs/design.md#matrix-placement-and-zero-3.

Framework-free planner.  A *bucket* of a flat buffer is cut into ``world`` equal shards
(Megatron's reduce-scatter / all-gather geometry); the planner decides which rank's shard
each matrix lives in, packs small non-matrix tensors ("fillers") into the gaps, and pads
the rest.  Then the ordinary gradient reduce-scatter leaves every matrix's full gradient
on its owner, and the Muon step needs no data-parallel communication.

Assignment: matrices sorted by size, largest first, each to the rank with the smallest
combined load ``bytes / total_bytes + cost / total_cost`` (LPT on both), so that both the
byte imbalance (padding) and the Newton-Schulz cost imbalance stay bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

__all__ = ["Item", "BucketPlacement", "place_bucket", "permute_shards"]


@dataclass(frozen=True)
class Item:
    key: Hashable
    numel: int
    cost: float = 0.0  # NS cost (matrices); 0 for fillers


@dataclass
class BucketPlacement:
    world: int
    shard_numel: int  # S: every rank's shard of the bucket is [r S, (r + 1) S)
    offsets: dict = field(default_factory=dict)  # key -> start within the bucket
    owner: dict = field(default_factory=dict)  # key -> rank (matrices and placed fillers)
    matrix_numel: list = field(default_factory=list)  # per rank
    filler_numel: list = field(default_factory=list)  # per rank
    cost: list = field(default_factory=list)  # per rank
    leftover: list = field(default_factory=list)  # fillers that did not fit a gap

    @property
    def numel(self) -> int:
        return self.world * self.shard_numel

    @property
    def padding(self) -> int:
        return self.numel - sum(self.matrix_numel) - sum(self.filler_numel)

    @property
    def byte_imbalance(self) -> float:
        """max / mean - 1 of the matrix elements per rank."""
        mean = sum(self.matrix_numel) / self.world
        return max(self.matrix_numel) / mean - 1.0 if mean else 0.0

    @property
    def cost_imbalance(self) -> float:
        mean = sum(self.cost) / self.world
        return max(self.cost) / mean - 1.0 if mean else 0.0

    def summary(self) -> str:
        return (f"{self.world} shards of {self.shard_numel} elements: matrices "
                f"{self.matrix_numel}, fillers {self.filler_numel}, padding {self.padding} "
                f"({100 * self.padding / max(self.numel, 1):.1f}%), byte imbalance "
                f"{100 * self.byte_imbalance:.1f}%, NS-cost imbalance "
                f"{100 * self.cost_imbalance:.1f}%")


def place_bucket(matrices: Sequence[Item], fillers: Sequence[Item], world: int,
                 align: int = 1, slack: float = 0.02,
                 carry: Optional[list] = None, place_all: bool = False) -> BucketPlacement:
    """Place whole ``matrices`` on ranks and pack ``fillers`` around them.

    Fillers go, largest first, to the rank with the fewest elements, as long as it stays
    within ``(1 + slack)`` x the even share (or the largest matrix load, if larger); the
    ones that do not fit are returned in ``leftover`` for the caller to shard as usual (with
    ``place_all`` they go to the least-loaded rank anyway and the shards grow).
    ``carry``: per-rank (elements, cost) already placed in earlier buckets; LPT continues
    from them so that the NS load balances over the whole model, and is updated in place.
    Deterministic (ties broken by input order), so every rank computes the same layout.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    keys = [m.key for m in matrices] + [f.key for f in fillers]
    position = {k: i for i, k in enumerate(keys)}
    if len(position) != len(keys):
        raise ValueError("duplicate keys in a bucket placement")
    def fp(n: int) -> int:  # footprint: every tensor starts ``align``-aligned
        return -(-n // align) * align

    tot_b = sum(m.numel for m in matrices) or 1
    tot_c = sum(m.cost for m in matrices) or 1.0
    loads_b, loads_c = [0] * world, [0.0] * world
    prior = carry if carry is not None else [(0, 0.0)] * world
    mine: list[list[Item]] = [[] for _ in range(world)]
    order = sorted(range(len(matrices)), key=lambda i: (-matrices[i].numel, -matrices[i].cost, i))
    for i in order:
        m = matrices[i]
        r = min(range(world), key=lambda q: ((loads_b[q] + m.numel) / tot_b
                                             + (loads_c[q] + m.cost) / tot_c,
                                             prior[q][1] + loads_c[q], q))
        mine[r].append(m)
        loads_b[r] += m.numel
        loads_c[r] += m.cost
    foot = [sum(fp(m.numel) for m in ms) for ms in mine]
    total = sum(foot) + sum(fp(f.numel) for f in fillers)
    bound = max(max(foot), -(-total // world)) * (1.0 + slack)
    fill: list[list[Item]] = [[] for _ in range(world)]
    sizes = list(foot)
    leftover = []
    for i in sorted(range(len(fillers)), key=lambda i: (-fillers[i].numel, i)):
        f = fillers[i]
        r = min(range(world), key=lambda q: (sizes[q], q))
        if sizes[r] + fp(f.numel) > bound and not place_all:
            leftover.append(f)
            continue
        fill[r].append(f)
        sizes[r] += fp(f.numel)
    shard = fp(max(sizes + [1]))
    if carry is not None:
        carry[:] = [(prior[q][0] + loads_b[q], prior[q][1] + loads_c[q]) for q in range(world)]
    pl = BucketPlacement(world=world, shard_numel=shard, matrix_numel=loads_b,
                         filler_numel=[sum(f.numel for f in fs) for fs in fill], cost=loads_c,
                         leftover=sorted(leftover, key=lambda f: position[f.key]))
    for r in range(world):
        pos = r * shard
        # matrices in their input order (backward order for Megatron), then the fillers
        for item in sorted(mine[r], key=lambda m: position[m.key]) + fill[r]:
            pl.offsets[item.key] = pos
            pl.owner[item.key] = r
            pos += fp(item.numel)
    return pl


def permute_shards(pl: BucketPlacement, held: list) -> BucketPlacement:
    """Hand the bucket's shards to the ranks so that the fullest shard goes to the rank that
    holds the fewest elements so far (``held``, per rank, updated in place).

    ZeRO-3 stores on each rank only what it owns, so what matters is the total over all
    buckets; permuting whole shards keeps each bucket as balanced (as little padded) as
    ``place_bucket`` made it and balances the totals.  Deterministic."""
    world, shard = pl.world, pl.shard_numel
    used = [pl.matrix_numel[q] + pl.filler_numel[q] for q in range(world)]
    slots = sorted(range(world), key=lambda q: (-used[q], q))
    ranks = sorted(range(world), key=lambda q: (held[q], q))
    to = dict(zip(slots, ranks))
    out = BucketPlacement(world=world, shard_numel=shard, leftover=list(pl.leftover),
                          matrix_numel=[0] * world, filler_numel=[0] * world, cost=[0.0] * world)
    for src, dst in to.items():
        out.matrix_numel[dst] = pl.matrix_numel[src]
        out.filler_numel[dst] = pl.filler_numel[src]
        out.cost[dst] = pl.cost[src]
        held[dst] += used[src]
    for key, off in pl.offsets.items():
        src = pl.owner[key]
        out.owner[key] = to[src]
        out.offsets[key] = off - src * shard + to[src] * shard
    return out
