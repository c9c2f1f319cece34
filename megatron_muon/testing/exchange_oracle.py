"""The exchange's blocks built element by element: the oracle of its arithmetic.

The owner-centric exchange first built its tables from an int64 index per element of every
piece (``full_flat_index``), each element's place in its unit (``unit_positions``) and a
compression of that element map into blocks (``joint_blocks``): work and memory in
proportion to the matrix (seconds and hundreds of MiB for one 70B-class unit).  The library
now computes the blocks from the flat ranges directly
(``megatron_muon.core.flat_blocks.piece_unit_blocks``); the tests check it against this.
"""

from __future__ import annotations

import torch

__all__ = ["full_flat_index", "unit_positions", "joint_blocks", "oracle_blocks"]


def full_flat_index(mat, piece) -> torch.Tensor:
    """Full-matrix flat index of every element of ``piece`` (in local order)."""
    m, n = mat.shape
    local = torch.arange(piece.start, piece.end, dtype=torch.int64)
    if mat.tp_dim is None:
        return local
    ml, nl = (m // mat.tp_size, n) if mat.tp_dim == 0 else (m, n // mat.tp_size)
    r, c = local // nl, local % nl
    if mat.tp_dim == 0:
        r = r + piece.tp_rank * ml
    else:
        c = c + piece.tp_rank * nl
    return r * n + c


def unit_positions(unit, full_flat: torch.Tensor) -> torch.Tensor:
    """Position inside the (flattened) unit of each parameter flat index; -1 if outside.

    Inverse of ``unit_flat_indices`` without materialising a table of the parameter's size.
    """
    m, n = unit.param_shape
    r, c = full_flat // n, full_flat % n
    along = r if unit.dim == 0 else c
    starts = torch.tensor([s for s, _ in unit.blocks], dtype=torch.int64)
    lengths = torch.tensor([l for _, l in unit.blocks], dtype=torch.int64)
    order = torch.argsort(starts)
    starts, lengths = starts[order], lengths[order]
    before = torch.cumsum(torch.tensor([l for _, l in unit.blocks], dtype=torch.int64), 0)
    unit_start = (before - torch.tensor([l for _, l in unit.blocks], dtype=torch.int64))[order]
    b = torch.searchsorted(starts, along, right=True) - 1
    valid = b >= 0
    b = b.clamp(min=0)
    offset = along - starts[b]
    valid &= offset < lengths[b]
    k = unit_start[b] + offset  # row (dim 0) or column (dim 1) inside the unit
    x0, xl = unit.cross_range()  # a part of a split unit: one range of the other dimension
    across = (c if unit.dim == 0 else r) - x0
    valid &= (across >= 0) & (across < xl)
    if unit.dim == 0:
        pos = k * xl + across
    else:
        pos = across * int(lengths.sum()) + k
    return torch.where(valid, pos, torch.full_like(pos, -1))


def joint_blocks(a_index: torch.Tensor, b_index: torch.Tensor) -> list:
    """Compress an element map (element k: ``a_index[k]`` <-> ``b_index[k]``) into blocks.

    Maximal runs in which both indices advance by one become rows; equal-length rows at
    constant strides on both sides merge into one 2-D block.  A whole TP shard of a
    row- or column-parallel matrix, or a QKV unit's blocks of rows, is one block, so the
    bookkeeping is proportional to the number of pieces, not elements.
    """
    n = a_index.numel()
    if n == 0:
        return []
    brk = ((a_index[1:] - a_index[:-1]) != 1) | ((b_index[1:] - b_index[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(brk).squeeze(1) + 1])
    lengths = torch.diff(starts, append=torch.tensor([n])).tolist()
    ra, rb = a_index[starts].tolist(), b_index[starts].tolist()
    blocks, i, runs = [], 0, len(lengths)
    while i < runs:
        a, b, w, h = ra[i], rb[i], lengths[i], 1
        sa = sb = w
        if i + 1 < runs and lengths[i + 1] == w and ra[i + 1] - a >= w and rb[i + 1] - b >= w:
            sa, sb, h = ra[i + 1] - a, rb[i + 1] - b, 2
            while (i + h < runs and lengths[i + h] == w and ra[i + h] - ra[i + h - 1] == sa
                   and rb[i + h] - rb[i + h - 1] == sb):
                h += 1
        blocks.append((a, b, h, w, sa, sb))
        i += h
    return blocks


def oracle_blocks(mat, piece, unit) -> list:
    """The blocks between ``piece`` of ``mat`` (an ``owner_centric.ShardedMatrix``) and
    ``unit``, element by element (offsets in the unit's own buffer)."""
    pos = unit_positions(unit, full_flat_index(mat, piece))
    sel = pos >= 0
    return joint_blocks(torch.nonzero(sel).squeeze(1) + piece.local_offset, pos[sel])
