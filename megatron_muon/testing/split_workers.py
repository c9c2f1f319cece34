"""Rank workers for the split Newton-Schulz (``distributed.split_ns``), and the geometry
they share with the test process, which computes the single-process reference."""

from __future__ import annotations

import random
from typing import Optional

import torch
import torch.distributed as dist

from megatron_muon.core.units import gate_up_units, qkv_units, whole_units
from megatron_muon.distributed.owner_centric import Piece, ShardedMatrix

#: (name, full shape, tp_dim, units) of the matrices of ``split_case``: tall and wide,
#: QKV with GQA (row units), gate / up, a row-parallel (column-sharded) matrix, a
#: TP-replicated one, odd sizes.
SHAPES = [
    ("qkv", (48, 20), 0, lambda s: qkv_units(s, 2, 2, 6)),
    ("fc1", (40, 12), 0, gate_up_units),
    ("fc2", (12, 36), 1, whole_units),
    ("tall", (34, 7), 0, whole_units),
    ("rep", (9, 26), None, whole_units),
    ("sq", (16, 16), 1, whole_units),
]
TP = 2


def split_case(world: int, seed: int = 0, names: Optional[tuple] = None) -> tuple:
    """``(matrices, full tensors)``: every matrix's TP shards cut into random flat ranges
    held by random ranks of a ``world``-rank group (local offsets packed per rank); the
    full fp32 matrices drawn from ``seed``.  Deterministic: every process builds the same.
    ``names``: only these of ``SHAPES``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    mats, fulls, offset = [], {}, [0] * world
    shapes = [s for s in SHAPES if names is None or s[0] in names]
    for bucket, (name, (m, n), tp_dim, units) in enumerate(shapes):
        tp = 1 if tp_dim is None else TP
        shard = m * n // tp
        pieces = []
        if tp_dim is None:  # every rank holds a whole replica; rank 0's is the one gathered
            for r in range(world):
                pieces.append(Piece(r, 0, 0, shard, offset[r], source=r == 0))
                offset[r] += shard
        for t in range(tp if tp_dim is not None else 0):
            edges = sorted({0, shard, *(rng.randrange(1, shard) for _ in range(3))})
            for lo, hi in zip(edges, edges[1:]):
                r = rng.randrange(world)
                pieces.append(Piece(r, t, lo, hi, offset[r]))
                offset[r] += hi - lo
        mats.append(ShardedMatrix(name, (m, n), tuple(units((m, n))), tp_dim, tp,
                                  tuple(pieces), bucket=bucket % 2))
        fulls[name] = torch.randn(m, n, generator=gen)
    return mats, fulls, offset


def shard_of(full: torch.Tensor, tp_dim: Optional[int], tp: int, t: int) -> torch.Tensor:
    if tp_dim is None:
        return full.reshape(-1)
    return full.chunk(tp, dim=tp_dim)[t].reshape(-1)


def local_input(mats, fulls, me: int, numel: int) -> torch.Tensor:
    x = torch.zeros(numel)
    for mat in mats:
        for p in mat.pieces:
            if p.rank == me:
                x[p.local_offset: p.local_offset + p.end - p.start] = \
                    shard_of(fulls[mat.key], mat.tp_dim, mat.tp_size, p.tp_rank)[p.start: p.end]
    return x


def split_run(parts: Optional[int] = None, flops_per_byte: float = 2500.0, seed: int = 0,
              dtype: str = "float32", steps: int = 5, coefficients: str = "quintic",
              names: Optional[tuple] = None) -> dict:
    """One engine step on this rank with units split into ``parts`` (None: the planner's
    choice at ``flops_per_byte``), on ``split_case(..., names)``; returns this rank's output
    pieces, the plan, the bytes the split all-reduces moved."""
    from megatron_muon.core.plan import SplitPolicy, UnitTask, flops_cost, plan_owners
    from megatron_muon.distributed.owner_centric import OwnerCentricNS

    world, me = dist.get_world_size(), dist.get_rank()
    mats, fulls, offset = split_case(world, seed, names)
    cost = flops_cost(steps)
    tasks = [UnitTask(m.unit_key(i), u.shape, cost(u.shape), 4 * u.numel)
             for m in mats for i, u in enumerate(m.units)]
    plan = plan_owners(tasks, world, split=SplitPolicy(steps, flops_per_byte, parts=parts,
                                                        ay=dtype == "float32"))
    engine = OwnerCentricNS(mats, plan, dist.group.WORLD, ns_steps=steps,
                            coefficients=coefficients, scale_mode="spectral",
                            extra_scale_factor=1.0, ns_dtype=getattr(torch, dtype),
                            device=torch.device("cpu"), local_numel=offset[me])
    out = engine.run(local_input(mats, fulls, me, offset[me]))
    return dict(rank=me, out=out, splits=plan.splits, digest=plan.digest,
                stats=engine.stats.as_dict(), parts=len(engine.split.parts))
