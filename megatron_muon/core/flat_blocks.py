"""A flat range of a row-major tensor as a few rectangular blocks.

Megatron's distributed optimizer gives each DP rank one contiguous flat range of every
parameter; checkpoints store tensors as rectangular blocks at offsets of the whole tensor.
``flat_range_blocks`` maps one to the other without touching data: every block is a
contiguous run of the flat range, so the flat shard's slice ``[lo - start, lo - start + n)``
viewed as the block's shape is the block itself.
"""

from __future__ import annotations

from math import prod

__all__ = ["flat_range_blocks"]


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
