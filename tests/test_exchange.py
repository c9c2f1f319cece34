"""The owner exchange's bookkeeping: element maps compressed into strided blocks."""

import torch

from megatron_muon.core.units import qkv_units
from megatron_muon.testing.exchange_oracle import joint_blocks, unit_positions


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


def _whole_on_one_rank(shapes) -> tuple:
    """``(matrices, elements)``: one ``ShardedMatrix`` per shape, each held whole by rank 0,
    packed back to back."""
    from megatron_muon.core.units import whole_units
    from megatron_muon.distributed.owner_centric import Piece, ShardedMatrix

    mats, off = [], 0
    for k, shape in enumerate(shapes):
        n = shape[0] * shape[1]
        mats.append(ShardedMatrix(f"w{k}", shape, tuple(whole_units(shape)), None, 1,
                                  (Piece(0, 0, 0, n, off),)))
        off += n
    return mats, off


def test_ns_batches_are_capped_and_give_the_same_result():
    """One rank, group None: same-shape units are batched up to ``ns_batch_numel`` elements
    (a larger unit alone; default a quarter of the owned elements), and capping the batches changes no result.  The tolerance is
    exact equality: on every device a batched NS applies the same per-matrix operations,
    and only the batch count differs (checked here on the CPU; torch's CPU bmm runs one
    GEMM per matrix)."""
    from megatron_muon.distributed.owner_centric import OwnerCentricNS
    from megatron_muon.core.plan import UnitTask, plan_owners

    shapes = [(16, 8)] * 5 + [(8, 32)] * 3 + [(64, 64)]
    mats, off = _whole_on_one_rank(shapes)

    def engine(cap):
        plan = plan_owners([UnitTask(m.unit_key(0), m.shape, 1.0) for m in mats], 1)
        return OwnerCentricNS(mats, plan, None, ns_steps=5, coefficients="quintic",
                              scale_mode="spectral", extra_scale_factor=1.0,
                              ns_dtype=torch.float32, device=torch.device("cpu"),
                              ns_batch_numel=cap)

    whole, capped, default = engine(1 << 22), engine(2 * 128), engine(None)
    # the default cap: a quarter of the owned elements (5504 // 4: every shape fits whole)
    assert default.ns_batch_numel == (5 * 128 + 3 * 256 + 64 * 64) // 4
    assert default.batches == whole.batches
    assert sorted(b[1:] for b in whole.batches) == sorted([(5, 16, 8), (1, 64, 64), (3, 8, 32)])
    counts = sorted(b[1:] for b in capped.batches)
    assert counts == sorted([(2, 16, 8), (2, 16, 8), (1, 16, 8), (1, 64, 64),
                             (1, 8, 32), (1, 8, 32), (1, 8, 32)])
    assert sum(len(k) for k in capped.batch_keys) == len(shapes)
    x = torch.randn(off, generator=torch.Generator().manual_seed(0))
    assert torch.equal(whole.run(x.clone()), capped.run(x.clone()))


def _allocated_bytes(fn):
    """``(fn(), bytes of every tensor storage created while it ran)``: each op's outputs
    that share no storage with its inputs (views, ``out=`` results) count as new, however
    briefly they live; a CPU stand-in for the allocator counters."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    total = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                    total[0] += t.untyped_storage().nbytes()
            return out

    with Count():
        result = fn()
    return result, total[0]


def test_owner_ns_runs_in_one_bounded_workspace():
    """The owners' torch NS runs every batch in one workspace (``ns_workspace_bytes``: two
    iterates and two Gram-sized products per matrix of the largest batch, <= 4 x the batch
    cap in the NS dtype) and writes each result straight into the owned units: everything
    ``orthogonalize`` allocates is that workspace (and a norm per matrix).  The NS that
    allocates its temporaries per call (the backends' path) allocates 6-7.5x the workspace
    here (a copy, the normalised X, A, B and the next X every step, the result).  The
    result is bitwise the same (same ops on the same values in the same layouts; tall,
    wide and square units, fp32 and bf16, batched and capped)."""
    from megatron_muon.core.newton_schulz import newton_schulz
    from megatron_muon.core.plan import UnitTask, plan_owners
    from megatron_muon.distributed.owner_centric import OwnerCentricNS

    shapes = [(16, 8)] * 5 + [(8, 32)] * 3 + [(64, 64), (96, 24)]
    mats, off = _whole_on_one_rank(shapes)
    plan = plan_owners([UnitTask(m.unit_key(0), m.shape, 1.0) for m in mats], 1)

    def per_call_ns(x, **kw):  # newton_schulz without ``in_workspace``: the backends' path
        return newton_schulz(x, **kw)

    for dtype, esize in ((torch.float32, 4), (torch.bfloat16, 2)):
        def engine(ns_fn):
            return OwnerCentricNS(mats, plan, None, ns_steps=5, coefficients="quintic",
                                  scale_mode="spectral", extra_scale_factor=1.0,
                                  ns_dtype=dtype, device=torch.device("cpu"), ns_fn=ns_fn,
                                  ns_batch_numel=3 * 128)
        ws_eng, old_eng = engine(None), engine(per_call_ns)
        assert old_eng.ns_workspace_bytes() is None
        ws = ws_eng.ns_workspace_bytes()
        cap = max(ws_eng.ns_batch_numel, max(m * n for m, n in shapes))
        assert ws == esize * max(c * (2 * min(m, n) * max(m, n) + 2 * min(m, n) ** 2)
                                 for _, c, m, n in ws_eng.batches) <= 4 * esize * cap
        x = torch.randn(off, generator=torch.Generator().manual_seed(1))
        a, got = _allocated_bytes(lambda: ws_eng.orthogonalize(x.clone(), out=None))
        b, old = _allocated_bytes(lambda: old_eng.orthogonalize(x.clone(), out=None))
        assert torch.equal(a, b)
        norms = 2 * 4 * len(shapes)  # ||X|| and ||X|| + eps per matrix, fp32 at most
        # the result buffer (out=None: a new one), the input's clone, the workspace
        assert got <= 2 * 4 * off + ws + norms, (got, ws)
        assert old - 2 * 4 * off > 4 * ws, (old, ws)
        # the whole step in one arena (ShardedMuonStep's): flat pieces, owned units, NS
        # workspace; nothing else of their size is allocated, and the result is the same
        arena = torch.empty(ws_eng.arena_numel())
        assert ws_eng.arena_numel() == off + ws_eng.owned_numel + -(-ws // 4)
        flat = arena[:off]
        flat.copy_(x)
        c, got = _allocated_bytes(lambda: ws_eng.run(flat, out=flat, arena=arena))
        assert torch.equal(c, old_eng.run(x.clone())) and c.data_ptr() == arena.data_ptr()
        assert got <= norms, got
