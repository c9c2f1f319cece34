"""MatrixFSDP placement planner (framework-free): whole matrices per rank, gaps filled."""

import random

import pytest

from megatron_muon.core.placement import Item, permute_shards, place_bucket


def check_layout(pl, matrices, fillers):
    spans = []
    for item in list(matrices) + [f for f in fillers if f not in pl.leftover]:
        start = pl.offsets[item.key]
        r = pl.owner[item.key]
        end = start + item.numel
        spans.append((start, end))
        if item in matrices:  # a matrix lies inside its owner's shard
            assert r * pl.shard_numel <= start and end <= (r + 1) * pl.shard_numel
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "overlapping tensors"
    assert spans[-1][1] <= pl.numel
    placed = sum(e - s for s, e in spans)
    assert pl.padding == pl.numel - placed


def gpt_layer_items(layers, h, f):
    mats, fills = [], []
    for i in range(layers):
        for name, (m, n) in (("qkv", (3 * h, h)), ("proj", (h, h)), ("fc1", (f, h)), ("fc2", (h, f))):
            mats.append(Item(f"{i}.{name}", m * n, cost=m * n * min(m, n)))
        fills += [Item(f"{i}.ln1", h), Item(f"{i}.ln2", h)]
    return mats, fills


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_gpt_layers_place_whole_and_balanced(world):
    mats, fills = gpt_layer_items(12, 256, 1024)
    pl = place_bucket(mats, fills, world)
    check_layout(pl, mats, fills)
    assert len(pl.leftover) == 0  # the norms fit in the gaps
    # 48 matrices of 4 sizes on <= 8 ranks: LPT keeps both imbalances small
    assert pl.byte_imbalance < 0.10 and pl.cost_imbalance < 0.15, pl.summary()
    assert pl.padding / pl.numel < 0.10, pl.summary()


def test_fillers_that_do_not_fit_are_left_over_and_order_is_deterministic():
    mats = [Item("a", 100, 1.0), Item("b", 100, 1.0)]
    fills = [Item("big", 500), Item("small", 3)]
    pl = place_bucket(mats, fills, 2)
    assert [f.key for f in pl.leftover] == ["big"]
    assert pl.owner["a"] != pl.owner["b"]
    check_layout(pl, mats, fills)
    assert place_bucket(mats, fills, 2).offsets == pl.offsets
    forced = place_bucket(mats, fills, 2, place_all=True)  # the shards grow instead
    assert not forced.leftover and forced.shard_numel >= 500
    check_layout(forced, mats, fills)


def test_random_sizes_never_split_a_matrix():
    rng = random.Random(0)
    for trial in range(20):
        world = rng.choice([2, 3, 4, 8])
        mats = [Item(f"m{i}", rng.randint(1, 5000), rng.random()) for i in range(rng.randint(1, 40))]
        fills = [Item(f"f{i}", rng.randint(1, 300)) for i in range(rng.randint(0, 30))]
        pl = place_bucket(mats, fills, world, align=8)
        assert pl.shard_numel % 8 == 0 and all(o % 8 == 0 for o in pl.offsets.values())
        check_layout(pl, mats, fills)
        assert pl.shard_numel >= max(m.numel for m in mats)


def test_bad_inputs():
    with pytest.raises(ValueError, match="world"):
        place_bucket([Item("a", 1)], [], 0)
    with pytest.raises(ValueError, match="duplicate"):
        place_bucket([Item("a", 1)], [Item("a", 2)], 2)


def test_carry_balances_load_across_buckets():
    """One matrix per bucket: without carried loads every bucket would pick rank 0."""
    carry = [(0, 0.0)] * 4
    owners = [place_bucket([Item(f"m{i}", 100, 1.0)], [], 4, carry=carry).owner[f"m{i}"]
              for i in range(8)]
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [c[0] for c in carry] == [200] * 4


@pytest.mark.parametrize("world", [2, 4, 8])
def test_permuted_shards_balance_what_each_rank_stores(world):
    """ZeRO-3: buckets of two GPT layers each; handing each bucket's shards to the ranks
    that hold least so far balances the totals, while every bucket keeps its layout."""
    held = [0] * world
    plain_held = [0] * world
    total = 0
    for b in range(6):
        mats, fills = gpt_layer_items(2, 256, 1024)
        mats = [Item(f"{b}.{m.key}", m.numel, m.cost) for m in mats]
        fills = [Item(f"{b}.{f.key}", f.numel) for f in fills]
        pl = place_bucket(mats, fills, world, place_all=True)
        out = permute_shards(pl, held)
        check_layout(out, mats, fills)
        assert out.shard_numel == pl.shard_numel and out.padding == pl.padding
        assert sorted(out.matrix_numel) == sorted(pl.matrix_numel)
        for key, r in pl.owner.items():  # same position inside the (moved) shard
            assert out.offsets[key] - out.owner[key] * out.shard_numel == \
                pl.offsets[key] - r * pl.shard_numel
        for q in range(world):
            plain_held[q] += pl.matrix_numel[q] + pl.filler_numel[q]
        total += sum(pl.matrix_numel) + sum(pl.filler_numel)
    assert sum(held) == total
    assert max(held) <= max(plain_held)
    assert max(held) / (total / world) - 1 < 0.10, held
