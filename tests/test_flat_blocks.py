"""``core.flat_blocks``: a flat range of a row-major tensor as rectangular blocks (the
checkpoint format's pieces, docs/memory.md). Exact integer checks, no tolerance."""

import random

import pytest
import torch

from megatron_muon.core.flat_blocks import flat_range_blocks


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 3, 2, 3), (6, 1), ()])
def test_blocks_are_the_flat_range_in_order_and_views(shape):
    n = int(torch.tensor(shape).prod()) if shape else 1
    t = torch.arange(n).reshape(shape)
    ranges = [(a, b) for a in range(n + 1) for b in range(a, n + 1)]
    random.Random(0).shuffle(ranges)
    for a, b in ranges[:200]:
        blocks = flat_range_blocks(shape, a, b)
        assert len(blocks) <= max(1, 2 * len(shape) - 1)
        covered = []
        for lo, offset, bshape in blocks:
            assert len(offset) == len(bshape) == len(shape)
            m = int(torch.tensor(bshape).prod()) if bshape else 1
            block = t[tuple(slice(o, o + s) for o, s in zip(offset, bshape))]
            # the block of the whole tensor is the flat range's contiguous run [lo, lo + m)
            assert torch.equal(block.reshape(-1), torch.arange(lo, lo + m))
            covered += range(lo, lo + m)
        assert covered == list(range(a, b))


def test_range_outside_the_tensor_is_an_error():
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        flat_range_blocks((3, 4), 5, 13)
