"""The owner exchange's bookkeeping: element maps compressed into strided blocks."""

import torch

from megatron_muon.distributed.owner_centric import joint_blocks
from megatron_muon.core.units import qkv_units, unit_positions


def _expand(blocks):
    a, b = [], []
    for a0, b0, h, w, sa, sb in blocks:
        for r in range(h):
            a += range(a0 + r * sa, a0 + r * sa + w)
            b += range(b0 + r * sb, b0 + r * sb + w)
    return torch.tensor(a, dtype=torch.int64), torch.tensor(b, dtype=torch.int64)


def test_blocks_reproduce_the_element_map_exactly():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # random piecewise maps: runs with random lengths and jumps
        a, b, xa, xb = [], [], 0, 0
        for _ in range(int(torch.randint(1, 12, (1,), generator=g))):
            n = int(torch.randint(1, 9, (1,), generator=g))
            a += range(xa, xa + n)
            b += range(xb, xb + n)
            xa += n + int(torch.randint(0, 4, (1,), generator=g))
            xb += n + int(torch.randint(0, 4, (1,), generator=g))
        a, b = torch.tensor(a), torch.tensor(b)
        ea, eb = _expand(joint_blocks(a, b))
        assert torch.equal(ea, a) and torch.equal(eb, b)
    assert joint_blocks(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)) == []


def test_a_column_shard_and_a_qkv_unit_are_one_block_each():
    # TP shard 1 of 2 of a 64 x 32 row-parallel weight (columns 16..31), whole: one block
    m, n, nl = 64, 32, 16
    local = torch.arange(m * nl)
    full = (local // nl) * n + local % nl + nl
    (blk,) = joint_blocks(local, full)
    assert blk == (0, nl, m, nl, nl, n)
    # the K unit of a fused QKV weight (4 groups): its rows, one per group, in one block
    shape = (4 * (2 * 8 + 2 * 8), 16)
    k = qkv_units(shape, num_query_groups=4, heads_per_group=2, head_dim=8)[1]
    idx = torch.arange(shape[0] * shape[1])
    pos = unit_positions(k, idx)
    sel = pos >= 0
    blocks = joint_blocks(torch.nonzero(sel).squeeze(1), pos[sel])
    assert len(blocks) == 1 and blocks[0][2] == 4  # 4 groups of 8 contiguous rows
