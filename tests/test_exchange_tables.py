"""The exchange's blocks by arithmetic (``core.flat_blocks.piece_unit_blocks``) against the
element-wise construction they replaced (an int64 index per element, kept here as the
oracle), on the geometries the tests use and on random ones."""

import random

import pytest

from megatron_muon.core.flat_blocks import piece_unit_blocks
from megatron_muon.core.units import (Unit, expert_units, extract_unit, gate_up_units, insert_unit,
                                      long_axis, qkv_units, split_unit, unit_flat_indices,
                                      whole_units)
from megatron_muon.distributed.owner_centric import Piece, ShardedMatrix
from megatron_muon.testing.exchange_oracle import oracle_blocks


def element_map(blocks) -> list:
    """(a, b) of every element, in the blocks' order (the order both sides pack)."""
    out = []
    for a, b, h, w, sa, sb in blocks:
        for i in range(h):
            out.extend(zip(range(a + i * sa, a + i * sa + w), range(b + i * sb, b + i * sb + w)))
    return out


def check(mat: ShardedMatrix) -> int:
    blocks = 0
    for piece in mat.pieces:
        for unit in mat.units:
            mine = piece_unit_blocks(mat.shape, mat.tp_dim, mat.tp_size, piece.tp_rank,
                                     piece.start, piece.end, piece.local_offset, unit)
            want = oracle_blocks(mat, piece, unit)
            got_map, want_map = element_map(mine), element_map(want)
            # the same elements, each to the same place of the unit ...
            assert sorted(got_map) == sorted(want_map), (mat.key, piece, unit)
            # ... in flat order of the piece, except where one rectangle of the piece meets
            # several column blocks of the unit (rows interleave there)
            if unit.dim == 0 or len(unit.blocks) == 1:
                assert got_map == want_map, (mat.key, piece, unit)
            assert len(mine) <= max(len(want), 3 * len(unit.blocks)), (mine, want)
            blocks += len(mine)
    return blocks


def pieces_cut_anywhere(rng, shard_numel: int, tp_size: int, cuts: int) -> tuple:
    """Every TP shard cut into random flat ranges, held by random ranks (offsets packed)."""
    pieces, offset = [], {}
    for t in range(tp_size):
        edges = sorted({0, shard_numel, *(rng.randrange(1, shard_numel) for _ in range(cuts)
                                            if shard_numel > 1)})
        for lo, hi in zip(edges, edges[1:]):
            rank = rng.randrange(4)
            pieces.append(Piece(rank, t, lo, hi, offset.get(rank, 0)))
            offset[rank] = offset.get(rank, 0) + hi - lo
    return tuple(pieces)


def geometry(rng, kind: str):
    tp = rng.choice([1, 2, 4])
    if kind == "qkv":  # GQA: q heads per group x head dim, K and V one head each per group
        groups, per, hd = rng.choice([(2, 2, 4), (4, 1, 3), (1, 4, 2), (tp * 2, 3, 5)])
        groups = groups if groups % tp == 0 else tp
        m, n = groups * (per + 2) * hd, rng.randrange(3, 17)
        return (m, n), tuple(qkv_units((m, n), groups, per, hd)), 0, tp
    m, n = rng.randrange(1, 9) * tp, rng.randrange(1, 9) * tp
    if kind == "row":  # column-parallel (rows split over TP), optionally gate / up
        units = gate_up_units((2 * m, n)) if rng.random() < 0.5 else whole_units((2 * m, n))
        return (2 * m, n), tuple(units), 0, tp
    if kind == "col":  # row-parallel (columns split over TP)
        return (m, n), tuple(whole_units((m, n))), 1, tp
    if kind == "experts":  # experts side by side along either dimension, per-shard units
        e = rng.choice([1, 2, 3])
        dim = rng.choice([0, 1])
        shape = (m * e, n) if dim == 0 else (m, n * e)
        return shape, tuple(expert_units(shape, e, dim)), None, 1
    return (m, n), tuple(whole_units((m, n))), None, tp  # replicated over TP


KINDS = ["qkv", "row", "col", "experts", "replicated"]


@pytest.mark.parametrize("kind", KINDS)
def test_random_geometries_equal_the_element_wise_tables(kind):
    rng = random.Random(KINDS.index(kind))  # seeded: the same geometries on every machine
    for trial in range(60):
        shape, units, tp_dim, tp = geometry(rng, kind)
        tp_size = 1 if tp_dim is None else tp
        local = shape[0] * shape[1] // tp_size
        mat = ShardedMatrix(f"{kind}{trial}", shape, units, tp_dim, tp_size,
                            pieces_cut_anywhere(rng, local, tp_size, rng.randrange(0, 6)))
        check(mat)


def random_widths(rng, length: int) -> list:
    """``length`` cut into 1..4 positive widths at random places."""
    cuts = sorted(rng.sample(range(1, length), min(length - 1, rng.randrange(0, 4))))
    return [b - a for a, b in zip([0, *cuts], [*cuts, length])]


@pytest.mark.parametrize("kind", KINDS)
def test_parts_of_split_units_equal_the_element_wise_tables(kind):
    """The parts of units whose Newton-Schulz is split across ranks (``split_unit``: ranges
    of the long side, along the unit's own blocks or across them) by arithmetic, against
    the oracle, on the same random geometries."""
    rng = random.Random(100 + KINDS.index(kind))
    for trial in range(40):
        shape, units, tp_dim, tp = geometry(rng, kind)
        parts = tuple(p for u in units
                      for p in split_unit(u, random_widths(rng, u.shape[long_axis(u.shape)])))
        tp_size = 1 if tp_dim is None else tp
        local = shape[0] * shape[1] // tp_size
        mat = ShardedMatrix(f"{kind}{trial}", shape, parts, tp_dim, tp_size,
                            pieces_cut_anywhere(rng, local, tp_size, rng.randrange(0, 6)))
        check(mat)


def test_split_unit_parts_tile_the_unit_along_its_long_side():
    """Parts are consecutive ranges of the unit's long side (rows of a tall unit, else
    columns) with the whole short side: concatenated they are the unit, and extract /
    insert / flat indices agree on each."""
    import torch
    rng = random.Random(7)
    for units in (qkv_units((24, 5), 2, 2, 3), gate_up_units((12, 5)), whole_units((5, 9)),
                  whole_units((9, 5)), expert_units((6, 8), 2, 1),
                  [Unit((6, 8), 1, ((0, 2), (4, 2)))]):
        for u in units:
            param = torch.randn(u.param_shape)
            axis = long_axis(u.shape)
            widths = random_widths(rng, u.shape[axis])
            parts = split_unit(u, widths)
            assert [p.shape[axis] for p in parts] == widths
            assert all(p.shape[1 - axis] == u.shape[1 - axis] for p in parts)
            whole = extract_unit(param, u)
            assert torch.equal(torch.cat([extract_unit(param, p) for p in parts], axis), whole)
            for p in parts:
                assert torch.equal(param.reshape(-1)[unit_flat_indices(p)],
                                   extract_unit(param, p).reshape(-1))
                out = torch.zeros_like(param)
                insert_unit(out, p, extract_unit(param, p))
                assert torch.equal(out.reshape(-1)[unit_flat_indices(p)],
                                   extract_unit(param, p).reshape(-1))
    with pytest.raises(ValueError, match="do not tile"):
        split_unit(whole_units((4, 6))[0], [2, 2])


def test_column_units_with_several_blocks():
    """Blockwise TP units of a row-parallel matrix are column blocks; a unit may also take
    several column blocks (experts of a transposed layout, the ``dim=1`` units)."""
    rng = random.Random(3)
    for trial in range(40):
        m, n = rng.randrange(1, 7), 4 * rng.randrange(1, 5)
        q = n // 4
        units = (Unit((m, n), 1, ((0, q), (2 * q, q))), Unit((m, n), 1, ((3 * q, q), (q, q))))
        for tp_dim, tp in ((None, 1), (1, 2), (0, 1)):
            local = m * n // tp
            mat = ShardedMatrix(f"c{trial}", (m, n), units, tp_dim, tp,
                                pieces_cut_anywhere(rng, local, tp, rng.randrange(0, 5)))
            check(mat)


def test_whole_shards_are_one_block_each():
    """A TP shard held whole is one block per unit block, whichever TP dimension."""
    m, n = 8, 6
    for tp_dim in (0, 1):
        pieces = tuple(Piece(t, t, 0, m * n // 2, 0) for t in range(2))
        mat = ShardedMatrix("w", (m, n), tuple(whole_units((m, n))), tp_dim, 2, pieces)
        assert check(mat) == 2
