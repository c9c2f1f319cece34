"""Rank functions of tests/test_engine_properties.py: the owner exchange on random layouts.

``random_layout(seed, dp, tp)`` draws, identically on every rank, what Megatron's
distributed optimizer would hand DMuon: a few buckets, each a run of matrices (TP-sharded on
rows, on columns, or replicated) and of non-Muon fillers (embeddings, norms), every bucket
cut into ``dp`` contiguous ranges at random points (so a rank may hold no Muon element, or
nothing at all, and a unit may span several ranks).  ``engine_matches_reference`` builds the
owner-centric engine over that layout on the group of ``dp x tp`` ranks, runs its step (in
one arena and without), and compares every rank's pieces with the single-process reference
(``core.muon.muon_update_direction`` on each whole matrix), within ``TOLERANCE``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_muon.core.muon import muon_update_direction
from megatron_muon.core.plan import UnitTask, plan_owners
from megatron_muon.core.units import gate_up_units, whole_units
from megatron_muon.distributed.owner_centric import OwnerCentricNS, Piece, ShardedMatrix

NS = dict(ns_steps=5, coefficients="quintic", scale_mode="spectral", extra_scale_factor=1.0)
MAX_DIM = 24  # random_layout's matrices are at most 12 tp x 12 tp, tp <= 2
# The engine and the reference run the same NS polynomial on bit-identical inputs (the
# exchange only moves bits); the owner's unit is a contiguous copy where the reference's may
# be a strided view, so a GEMM may sum its <= MAX_DIM terms in another order: <= 2 MAX_DIM
# EPS32 relative per product, 15 products (5 steps x 3), on |O| <= 1.2 (quintic's sigma
# max), times the spectral scale sqrt(MAX_DIM).  Observed: <= 2.3e-6 (a few fp32 ULPs).
EPS32 = 2.0 ** -23
TOLERANCE = MAX_DIM ** 0.5 * 1.2 * 15 * 2 * MAX_DIM * EPS32  # 5.0e-4


def _draw(g: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def random_layout(seed: int, dp: int, tp: int) -> dict:
    """``{"matrices": [(key, shape, tp_dim, units)], "buckets": [[entry, ...]], "cuts":
    [[dp + 1 cut points] per bucket]}``; an entry is ``("m", index)`` or ``("f", size)``
    (``size`` elements of a TP rank's buffer that no unit covers)."""
    g = torch.Generator().manual_seed(seed)
    matrices, buckets = [], []
    for b in range(_draw(g, 1, 3)):
        entries = []
        for _ in range(_draw(g, 0, 4)):
            if _draw(g, 0, 3) == 0:
                entries.append(("f", _draw(g, 1, 40)))
                continue
            m, n = tp * _draw(g, 1, 12), tp * _draw(g, 1, 12)
            tp_dim = (None, 0, 1)[_draw(g, 0, 2)] if tp > 1 else None
            units = gate_up_units((m, n)) if m % 2 == 0 and _draw(g, 0, 2) == 0 \
                else whole_units((m, n))
            matrices.append((f"b{b}.w{len(matrices)}", (m, n), tp_dim, units))
            entries.append(("m", len(matrices) - 1))
        buckets.append(entries)
    cuts = []
    for entries in buckets:
        size = sum(_local_numel(matrices[v], tp) if k == "m" else v for k, v in entries)
        inner = sorted(_draw(g, 0, size) for _ in range(dp - 1))
        cuts.append([0] + inner + [size])
    return {"matrices": matrices, "buckets": buckets, "cuts": cuts}


def _local_numel(mat, tp: int) -> int:
    _, (m, n), tp_dim, _ = mat
    return m * n // (tp if tp_dim is not None else 1)


def _tp_shard(full: torch.Tensor, tp_dim, tp: int, t: int) -> torch.Tensor:
    if tp_dim is None:
        return full
    return full.chunk(tp, dim=tp_dim)[t].contiguous()


def build_matrices(layout: dict, dp: int, tp: int) -> tuple[list, list]:
    """``(ShardedMatrix list, per group rank: flat buffer size)``; group rank r is DP rank
    ``r // tp`` and TP rank ``r % tp``."""
    mats = layout["matrices"]
    pieces = {i: [] for i in range(len(mats))}
    sizes = [0] * (dp * tp)
    base = [0] * dp  # where each DP rank's range of the current bucket starts in its buffer
    for entries, cut in zip(layout["buckets"], layout["cuts"]):
        pos = 0
        for kind, v in entries:
            n = _local_numel(mats[v], tp) if kind == "m" else v
            for d in range(dp):
                lo, hi = max(cut[d], pos), min(cut[d + 1], pos + n)
                if kind == "m" and lo < hi:
                    for t in range(tp):
                        pieces[v].append(Piece(d * tp + t, t, lo - pos, hi - pos,
                                               base[d] + lo - cut[d],
                                               source=mats[v][2] is not None or t == 0))
            pos += n
        for d in range(dp):
            base[d] += cut[d + 1] - cut[d]
    for r in range(dp * tp):
        sizes[r] = base[r // tp]
    out = []
    for i, (key, shape, tp_dim, units) in enumerate(mats):
        bucket = int(key.split(".")[0][1:])
        out.append(ShardedMatrix(key, shape, tuple(units), tp_dim, tp if tp_dim is not None
                                 else 1, tuple(pieces[i]), bucket=bucket))
    return out, sizes


def engine_matches_reference(seed: int, tp: int = 1) -> dict:
    """Run the engine on this rank's pieces of random gradients; compare with the
    reference.  Returns what the test asserts on (``max_diff`` over every piece of every
    matrix, with and without the arena; ``zeros``: what no unit covers is exactly zero)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // tp
    layout = random_layout(seed, dp, tp)
    mats, sizes = build_matrices(layout, dp, tp)
    g = torch.Generator().manual_seed(seed + 1)
    fulls = [torch.randn(shape, generator=g) for _, shape, _, _ in layout["matrices"]]
    # the reference: one process, whole matrices
    refs = [muon_update_direction(G, list(units), coefficient_type=NS["coefficients"],
                                  ns_steps=NS["ns_steps"], scale_mode=NS["scale_mode"],
                                  extra_scale_factor=NS["extra_scale_factor"])
            for G, (_, _, _, units) in zip(fulls, layout["matrices"])]
    tasks = [UnitTask(m.unit_key(i), u.shape, float(u.numel)) for m in mats
             for i, u in enumerate(m.units)]
    plan = plan_owners(tasks, world)
    engine = OwnerCentricNS(mats, plan, dist.group.WORLD, ns_dtype=torch.float32,
                            device=torch.device("cpu"), local_numel=sizes[rank], **NS)

    def local_of(tensors) -> torch.Tensor:
        flat = torch.full((sizes[rank],), float("nan"))  # fillers: never read
        for mat, t in zip(mats, tensors):
            for p in mat.pieces:
                if p.rank == rank:
                    shard = _tp_shard(t, mat.tp_dim, mat.tp_size, p.tp_rank).view(-1)
                    flat[p.local_offset: p.local_offset + p.end - p.start] = shard[p.start:p.end]
        return flat

    expected = local_of(refs)
    filler = expected.isnan()  # what no unit covers comes back zero
    expected = expected.nan_to_num(0.0)
    plain = engine.run(local_of(fulls).nan_to_num(0.0))
    arena = torch.empty(engine.arena_numel())
    local = arena[: sizes[rank]]
    local.copy_(local_of(fulls).nan_to_num(0.0))
    in_arena = engine.run(local, out=local, arena=arena)
    muon = sum(p.end - p.start for m in mats for p in m.pieces if p.rank == rank)
    owned = sum(1 for k, r in plan.owners.items() if r == rank)
    diff = [float((o - expected).abs().max()) if expected.numel() else 0.0
            for o in (plain, in_arena)]
    return {"max_diff": max(diff),
            "zeros": bool((plain[filler] == 0).all() and (in_arena[filler] == 0).all()),
            "muon_elements": muon, "local": sizes[rank], "owned_units": owned,
            "units": len(tasks)}


def engine_cases(seeds: list, tp: int = 1) -> list:
    """``engine_matches_reference`` for each seed, in one launch."""
    return [engine_matches_reference(s, tp) for s in seeds]
