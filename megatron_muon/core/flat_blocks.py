"""A flat range of a row-major tensor as a few rectangular blocks.

Megatron's distributed optimizer gives each DP rank one contiguous flat range of every
parameter; checkpoints store tensors as rectangular blocks at offsets of the whole tensor.
``flat_range_blocks`` maps one to the other without touching data: every block is a
contiguous run of the flat range, so the flat shard's slice ``[lo - start, lo - start + n)``
viewed as the block's shape is the block itself.
"""

from __future__ import annotations

from math import prod

__all__ = ["flat_range_blocks", "piece_unit_blocks"]


def flat_range_blocks(shape: tuple, start: int, end: int) -> list:
    """[(flat start, offset, block shape)] covering ``[start, end)`` of a row-major tensor
    of ``shape``, in flat order, each block a full hyper-rectangle (at most 2 ndim - 1 of
    them: a ragged head, the whole rows between, a ragged tail, recursively)."""
    shape = tuple(int(d) for d in shape)
    if not 0 <= start <= end <= prod(shape):
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of shape {shape}")
    out: list = []
    _blocks(shape, start, end, 0, (), out)
    return out


def _blocks(shape, start, end, base, prefix, out) -> None:
    if start >= end:
        return
    if not shape:  # a 0-d tensor: one element
        out.append((base, prefix, (1,) * len(prefix)))
        return
    row = prod(shape[1:])
    first, last = -(-start // row), end // row  # whole rows [first, last)
    if first > last:  # inside one row
        i = start // row
        _blocks(shape[1:], start - i * row, end - i * row, base + i * row, prefix + (i,), out)
        return
    if start < first * row:  # ragged head
        i = first - 1
        _blocks(shape[1:], start - i * row, row, base + i * row, prefix + (i,), out)
    if last > first:
        out.append((base + first * row, prefix + (first,) + (0,) * (len(shape) - 1),
                    (1,) * len(prefix) + (last - first,) + shape[1:]))
    if end > last * row:  # ragged tail
        _blocks(shape[1:], 0, end - last * row, base + last * row, prefix + (last,), out)


def piece_unit_blocks(shape: tuple, tp_dim, tp_size: int, tp_rank: int, start: int, end: int,
                      local_offset: int, unit) -> list:
    """The exchange blocks between one piece of a matrix and one unit, by arithmetic.

    The piece is the flat range ``[start, end)`` of TP shard ``tp_rank`` (row-major; the
    whole matrix when ``tp_dim`` is None) of a matrix of full shape ``shape``, kept at
    ``local_offset`` of its holder's flat buffer; ``unit`` (``core.units.Unit``) is a set of
    row or column blocks of the full matrix, laid out row-major in the owner's unit buffer.
    Returns ``[(a, b, h, w, a_stride, b_stride)]``: h x w element blocks at offset ``a`` of
    the holder's buffer and ``b`` of the unit's, rows ``a_stride`` / ``b_stride`` apart.

    Work and memory are O(unit blocks): the piece is at most three rectangles of its shard
    (``flat_range_blocks``), and each meets a unit block in one rectangle.  The element-wise
    construction (an index per element, as the exchange was first built) is the tests'
    oracle; both give the same element map.  Blocks come in flat order of their first
    element; a block whose rows are contiguous on both sides is one row, and consecutive
    rows that continue each other on both sides are merged.
    """
    m, n = int(shape[0]), int(shape[1])
    if tp_dim is None:
        (ml, nl), roff, coff = (m, n), 0, 0
    elif tp_dim == 0:
        (ml, nl), roff, coff = (m // tp_size, n), tp_rank * (m // tp_size), 0
    else:
        (ml, nl), roff, coff = (m, n // tp_size), 0, tp_rank * (n // tp_size)
    lengths = [int(l) for _, l in unit.blocks]
    width = sum(lengths)  # the unit's columns, for a column unit
    unit_starts = [sum(lengths[:i]) for i in range(len(lengths))]
    out = []
    x0, xl = unit.cross_range()  # the unit's range along the other dimension
    for _, (r0, c0), (h, w) in flat_range_blocks((ml, nl), start, end):
        R0, C0 = r0 + roff, c0 + coff  # in the full matrix
        if unit.dim == 0:  # restrict the rectangle's columns to the unit's cross range
            c_lo, c_hi = max(C0, x0), min(C0 + w, x0 + xl)
            if c_lo >= c_hi:
                continue
            c0, C0, w = c0 + c_lo - C0, c_lo, c_hi - c_lo
        else:  # ... or its rows
            r_lo, r_hi = max(R0, x0), min(R0 + h, x0 + xl)
            if r_lo >= r_hi:
                continue
            r0, R0, h = r0 + r_lo - R0, r_lo, r_hi - r_lo
        for (s, l), u0 in zip(unit.blocks, unit_starts):
            lo, hi = ((max(R0, s), min(R0 + h, s + l)) if unit.dim == 0
                      else (max(C0, s), min(C0 + w, s + l)))
            if lo >= hi:
                continue
            if unit.dim == 0:
                a = (lo - roff) * nl + c0
                b = (u0 + lo - s) * xl + C0 - x0
                block = [a, b, hi - lo, w, nl, xl]
            else:
                a = r0 * nl + lo - coff
                b = (R0 - x0) * width + u0 + lo - s
                block = [a, b, h, hi - lo, nl, width]
            block[0] += local_offset - start
            out.append(block)
    out.sort(key=lambda blk: blk[0])
    merged: list = []
    for a, b, h, w, sa, sb in out:
        if h == 1 or (sa == w and sb == w):  # contiguous rows on both sides: one row
            h, w, sa, sb = 1, h * w, h * w, h * w
        if merged and merged[-1][2] == 1 and h == 1 and \
                a == merged[-1][0] + merged[-1][3] and b == merged[-1][1] + merged[-1][3]:
            merged[-1][3] += w
            merged[-1][4] = merged[-1][5] = merged[-1][3]
            continue
        merged.append([a, b, h, w, sa, sb])
    return [tuple(blk) for blk in merged]
