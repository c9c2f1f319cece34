"""DMuon on a real Megatron-Core GPT (gloo ranks) against the single-process reference.

Every layout sees the same global batch (4 microbatches per step), so the reference is one
process that takes all of them; parameters must agree after several steps.
"""

import math

import pytest
import torch

from megatron_muon.megatron.params import is_muon_matrix
from megatron_muon.testing.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# adam_eps 1e-3 (Megatron's default is 1e-8): AdamW's update m / (sqrt(v) + eps) turns an
# absolute gradient error dg into an update error up to lr dg / eps, so a small eps makes
# the comparison ill-conditioned (gradient elements near zero); see ADAM_ATOL.
OPT = dict(muon_fp32_matmul_prec="highest", muon_nesterov=True, lr=2e-3, adam_eps=1e-3)
STEPS = 5

# ---- tolerances, from the arithmetic --------------------------------------------------
# fp32 layouts vs the reference.  A layout adds the same numbers as the single-process
# reference in another order: every gradient element is fed by at most K = 4 + 128
# additions whose order differs (the 4 microbatch / data-parallel partial gradients, and
# the inner products that TP splits or MoE expert parallelism regroups: at most ffn = 128,
# also the 2 x 16 x 4 = 128 tokens of a step).  Two orders of a K-term fp32 sum differ by
# at most 2 K EPS32 sum|terms|: each is within K EPS32 sum|terms| of the exact sum (the
# typical difference is sqrt(2 K) = 16x smaller: the rounding errors have random signs).
EPS32 = 2.0 ** -23  # one fp32 ULP at 1.0 (the unit roundoff is half of it)
K = 4 + 128
# Muon matrices: Newton-Schulz sees M / ||M||_F, so only the relative error of the momentum
# counts, at most 2 K EPS32 (the worst case, which also leaves room for Newton-Schulz
# amplifying the smallest singular directions beyond the typical error).  The update
# lr * sqrt(max(m, n)) * O has |O_ij| <= sigma_max(O) <= 1.2 and max(m, n) <= 128 here;
# each of the STEPS steps adds its error, so a parameter differs by at most
MUON_ATOL = STEPS * OPT["lr"] * math.sqrt(128) * 1.2 * 2 * K * EPS32  # = 4.3e-6
# AdamW parameters: u = lr m / (sqrt(v) + eps) moves by at most lr |dg| / eps through m and
# as much through v (the slope at a gradient element ~0), with |dg| ~ sqrt(2 K) EPS32 G:
# G = 0.1 is the largest gradient element of an AdamW parameter here (the embedding's;
# from the reference run, set by the model and the seed, not the machine).  Slope and G
# are already worst cases (the elements near 0 are not the largest), so the typical sum
# error; the worst case 2 K would give 6e-5.
ADAM_G = 0.1
ADAM_ATOL = STEPS * 2 * OPT["lr"] * math.sqrt(2 * K) * EPS32 * ADAM_G / OPT["adam_eps"]  # 3.9e-6

# Weight decay that the comparisons can see.  OPT keeps make_optimizer_config's
# weight_decay = 0.01: over STEPS steps W (1 - lr wd) moves a weight by ~STEPS lr wd |w| =
# 1e-4 |w|, at most 7e-6..9e-6 per matrix here (max |w| = 0.067..0.091), 1.6..2.1x
# MUON_ATOL and below it for all but the largest weights: a decay missing on every matrix
# fails only just (2.0x), one missed in 2 of the 5 steps (0.8x) passes.  One case
# of each layout family (DP, TP, PP, matrix placement) runs with WD_OPT (wd = 0.1), whose
# decay moves every matrix by >= 5x MUON_ATOL (decay_is_visible; measured 16..21x).  The
# tolerances are unchanged: both sides scale W by the same 1 - lr wd <= 1 (the same op),
# which shrinks an earlier difference and adds at most a rounding of |w| <= 0.09 per step
# (5 x 0.09 x EPS32 = 5e-8, 1% of MUON_ATOL).
WD_OPT = dict(OPT, weight_decay=0.1)


def fp32_atol(name, param):
    """What the arithmetic allows a layout's ``name`` to differ from the reference by."""
    return MUON_ATOL if is_muon_matrix(name, param) else ADAM_ATOL


def worst_excess(full, ref) -> tuple:
    """(max over parameters of max |full - ref| / fp32_atol, that parameter): < 1 passes."""
    return max(((full[n] - ref[n]).abs().max().item() / fp32_atol(n, ref[n]), n) for n in ref)


def ulp(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """One unit in the last place of each element of ``x`` (fp16: 10 mantissa bits, bf16:
    7): 2^-mantissa_bits x 2^floor(log2 |x|), at least that of the smallest normal number
    (2^-14 for fp16, 2^-126 for bf16)."""
    tiny = 2.0 ** (-14 if mantissa_bits == 10 else -126)
    return torch.exp2(torch.floor(torch.log2(x.abs().float().clamp(min=tiny))) - mantissa_bits)


LAYOUTS = {  # name: (tp, pp, world, microbatches per DP rank)
    "dp4": (1, 1, 4, 1),
    "tp2dp2": (2, 1, 4, 2),
    "pp2dp2": (1, 2, 4, 2),
    "tp2pp2dp2": (2, 2, 8, 2),
}
_CACHE = {}


def train(name, optimizer="dmuon", opt=None, steps=STEPS, cfg_extra=None, **extra):
    key = (name, optimizer, repr(opt), steps, repr(cfg_extra), repr(extra))
    if key not in _CACHE:
        tp, pp, world, m = LAYOUTS[name]
        _CACHE[key] = run_ranks("megatron_muon.testing.workers:train_megatron", world,
                                dict(cfg={"num_microbatches": m, **(cfg_extra or {})}, tp=tp, pp=pp,
                                     optimizer=optimizer, opt=opt or OPT, steps=steps, **extra),
                                timeout=420)
    return _CACHE[key]


def merged_params(results):
    full = {}
    for r in results:
        if r["layout"]["dp"] == 0 and r["layout"]["tp"] == 0:
            full.update(r["params"])
    return full


def reference(opt=None, steps=STEPS):
    key = ("reference", repr(opt), steps)
    if key not in _CACHE:
        _CACHE[key] = run_ranks("megatron_muon.testing.reference:reference_train", 1,
                                dict(cfg={"num_microbatches": 4}, dp_size=1, steps=steps,
                                     opt=opt or OPT), timeout=300)[0]
    return _CACHE[key]


def assert_matches(full, ref):
    assert set(full) == set(ref["params"])
    excess, name = worst_excess(full, ref["params"])
    assert excess < 1, f"{name}: {excess:.2f} x its tolerance"
    init = reference(steps=0)["params"]
    moved = max((init[n] - ref["params"][n]).abs().max().item()
                for n in full if is_muon_matrix(n, init[n]))
    assert moved > 100 * MUON_ATOL, "the Muon matrices barely moved: a vacuous comparison"


def decay_is_visible(opt):
    """``opt``'s decay moves each Muon matrix's largest weight by STEPS lr wd |w| (to first
    order; |w| changes by ~1e-2 of itself over the run): >= 5x MUON_ATOL, so that dropping
    or doubling it fails the comparison."""
    init = reference(steps=0)["params"]
    lr_wd = opt["lr"] * opt.get("weight_decay", 0.01)
    smallest = min((STEPS * lr_wd * init[n].abs().max().item(), n)
                   for n in init if is_muon_matrix(n, init[n]))
    assert smallest[0] > 5 * MUON_ATOL, smallest


def plain_dmuon(layout):
    """DMuon with WD_OPT, and its exchange geometry: one launch per layout, shared by the
    tests below (train's cache)."""
    return train(layout, opt=WD_OPT, exchange_geometry=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dmuon_equals_reference(layout):
    decay_is_visible(WD_OPT)
    assert_matches(merged_params(plain_dmuon(layout)), reference(opt=WD_OPT))


@pytest.mark.parametrize("layout,parts,overlap", [("dp4", 3, False), ("tp2dp2", 2, False),
                                                  ("pp2dp2", 2, False), ("dp4", 2, True)])
def test_split_units_equal_reference(layout, parts, overlap):
    """Every unit's Newton-Schulz split across ``parts`` ranks of its stage's group
    (``dmuon_split_parts``; form 'b' where a part is at least as wide as the short side, else
    'ay') equals the reference, within MUON_ATOL: the split changes only the order of the
    fp32 sums in X X^T (k partial GEMMs plus k - 1 adds, the same number of terms: within
    the 2 K EPS32 of the momentum's order, K >= 128 > the long side here) and, in form 'ay',
    reassociates B X, whose difference is of the same order (distributed/split_ns.py's own
    tests measure 4e-6 on O(1) outputs, which the update scales by lr = 2e-3).  With the
    overlap on, the speculation runs the split's all-to-alls inside the backward pass."""
    opt = dict(WD_OPT, dmuon_split_parts=parts, dmuon_overlap="on" if overlap else "off")
    res = train(layout, opt=opt, **(dict(ddp=dict(overlap_grad_reduce=True)) if overlap else {}))
    if overlap:
        assert all(r["dmuon_stats"]["overlap"]["speculated"] > 0 for r in res)
    assert all(r["dmuon_stats"]["split_parts"] > 0 for r in res)  # every rank has parts
    assert_matches(merged_params(res), reference(opt=WD_OPT))


def test_gram_newton_schulz_equals_the_gram_reference():
    """``muon_ns_method='gram'``: DMuon at TP2 x DP2 (batched Gram NS on the owners) equals
    the single-process reference Muon with Gram NS, within the same derived tolerance
    (both run the same Gram iteration; only the summation order of the gradients differs).
    The Gram reference is not the standard one bit for bit: the option is not ignored."""
    opt = dict(OPT, muon_ns_method="gram")
    ref = reference(opt)
    assert_matches(merged_params(train("tp2dp2", opt=opt)), ref)
    std = reference()["params"]
    assert any(not torch.equal(ref["params"][n], std[n]) for n in std)


def test_interleaved_pipeline_equals_reference():
    """PP2 x VPP2 (Megatron's interleaved schedule), DMuon with the overlap on."""
    res = run_ranks("megatron_muon.testing.workers:train_megatron", 2,
                    dict(cfg={"num_microbatches": 4}, pp=2, vpp=2, optimizer="dmuon", opt=OPT,
                         steps=STEPS, ddp=dict(overlap_grad_reduce=True)), timeout=300)
    assert len({n for r in res for n in r["params"]}) == len(reference()["params"])
    assert_matches({n: t for r in res for n, t in r["params"].items()}, reference())


def test_tp1_and_tp2_give_the_same_update():
    a, b = merged_params(plain_dmuon("dp4")), merged_params(plain_dmuon("tp2dp2"))
    assert worst_excess(a, b)[0] < 1, worst_excess(a, b)


def test_muon_naive_equals_reference_and_moves_more_bytes():
    naive = train("tp2dp2", optimizer="muon_naive", opt=WD_OPT)
    assert_matches(merged_params(naive), reference(opt=WD_OPT))
    dm = plain_dmuon("tp2dp2")
    n_recv = max(r["dmuon_stats"]["comm"]["bytes_received"] for r in naive)
    d_recv = max(r["dmuon_stats"]["comm"]["bytes_received"] for r in dm)
    assert n_recv > 2 * d_recv


def exchange_elements(geometry: dict) -> dict:
    """The elements each all-to-all of one step must move for this rank, counted from the
    plan (each unit's owner) and the geometry (which group rank holds which flat range of
    which TP shard), independently of the engine's exchange tables: a unit's elements held
    by a rank other than its owner cross the wire twice, to the owner (gather) and back
    (scatter); those the owner holds itself do not move.  Per matrix, a full-matrix index
    grid is cut into its TP shards (the full matrix is the shards concatenated in TP order
    along tp_dim) and a piece [start, end) of shard t is those flat elements of it."""
    me = geometry["rank"]
    n = dict(gather_sent=0, gather_received=0, scatter_sent=0, scatter_received=0)
    for mat in geometry["matrices"]:
        m, k = mat["shape"]
        idx = torch.arange(m * k).view(m, k)
        shards = ([idx.reshape(-1)] * mat["tp_size"] if mat["tp_dim"] is None else
                  [t.reshape(-1) for t in idx.chunk(mat["tp_size"], dim=mat["tp_dim"])])
        masks = []
        for dim, blocks in mat["units"]:
            mask = torch.zeros(m, k, dtype=torch.bool)
            for start, length in blocks:
                mask.narrow(dim, start, length).fill_(True)
            masks.append(mask.reshape(-1))
        # units tile the matrix; each TP shard's pieces tile it once
        assert bool((torch.stack(masks).sum(0) == 1).all()), mat["key"]
        for t, shard in enumerate(shards):
            cover = torch.zeros(shard.numel(), dtype=torch.int32)
            for _, tp_rank, start, end, _ in mat["pieces"]:
                if tp_rank == t:
                    cover[start:end] += 1
            assert bool((cover == 1).all()), (mat["key"], t)
        for rank, tp_rank, start, end, source in mat["pieces"]:
            held = shards[tp_rank][start:end]
            for mask, owner in zip(masks, mat["owners"]):
                c = int(mask[held].sum())
                if rank == owner:
                    continue
                if rank == me:  # my piece of another rank's unit
                    n["gather_sent"] += c * source
                    n["scatter_received"] += c
                elif owner == me:  # another rank's piece of my unit
                    n["gather_received"] += c * source
                    n["scatter_sent"] += c
    n["buckets"] = len({mat["bucket"] for mat in geometry["matrices"]})
    return n


@pytest.mark.parametrize("layout", ["dp4", "tp2dp2", "tp2pp2dp2"])
def test_traffic_and_state_per_rank(layout):
    """Exactly the bytes and all-to-alls the owner plan and the geometry imply
    (exchange_elements), within 2 (N-1)/N^2 of the stage's Muon bytes per rank; state sums
    to 1x, ~1/N each."""
    results = plain_dmuon(layout)
    by_stage = {}
    for r in results:
        by_stage.setdefault(r["layout"]["pp"], []).append(r)
    for ranks in by_stage.values():
        n = len(ranks)
        muon_bytes = 4 * ranks[0]["dmuon_stats"]["muon_numel"]  # fp32 gradients
        bound = 2 * (n - 1) / n**2 * muon_bytes * STEPS
        moved = 0
        for r in ranks:
            c = r["dmuon_stats"]["comm"]
            e = exchange_elements(r["exchange"])
            assert r["exchange"]["world"] == n
            # one gather and one scatter all-to-all per bucket and step (one bucket here:
            # Megatron's default bucket_size=None without overlap_grad_reduce), nothing else
            assert e["buckets"] == 1
            assert c["by_kind"]["gather"][2] == c["by_kind"]["scatter"][2] == STEPS * e["buckets"]
            assert c["calls"] == 2 * STEPS * e["buckets"]
            # bytes: 4 per fp32 element, every step
            assert c["by_kind"]["gather"][:2] == [4 * STEPS * e["gather_sent"],
                                                  4 * STEPS * e["gather_received"]], (c, e)
            assert c["by_kind"]["scatter"][:2] == [4 * STEPS * e["scatter_sent"],
                                                   4 * STEPS * e["scatter_received"]], (c, e)
            assert c["bytes_sent"] == 4 * STEPS * (e["gather_sent"] + e["scatter_sent"])
            assert c["bytes_received"] == 4 * STEPS * (e["gather_received"] + e["scatter_received"])
            assert c["bytes_sent"] <= bound and c["bytes_received"] <= bound, (c, bound)
            moved += e["gather_sent"]
        assert moved > 0  # the plan is not all-local (DP4 and TP2: most pieces move)
        state = [r["dmuon_stats"]["state_bytes"] for r in ranks]
        assert sum(state) == muon_bytes  # every element's momentum lives exactly once
        assert max(state) <= 1.5 * muon_bytes / n
        # exchange bookkeeping: a few blocks per piece, not an index per element (an int64
        # table per shard element would be 2x the fp32 momentum on its own)
        for r in ranks:
            assert r["dmuon_stats"]["index_bytes"] <= 0.1 * r["dmuon_stats"]["state_bytes"], \
                r["dmuon_stats"]


@pytest.mark.parametrize("layout", ["dp4", "tp2dp2"])
def test_step_working_set_per_rank(layout):
    """What DMuon's step allocates beside the flat buffer and the owned units, per rank, on
    a real build (docs/memory.md): the NS working set is one workspace of at most 4 x the
    NS batch cap (two iterates and two Gram-sized products per matrix, in the NS dtype,
    fp32 here), whatever the number of batches; and with one bucket the gather receives
    into the dead flat buffer (no receive buffer).  A build whose owners fell back to NS
    with per-batch temporaries (no workspace) fails here; the bytes of those temporaries
    are counted in tests/test_exchange.py."""
    for r in plain_dmuon(layout):
        st, geo = r["dmuon_stats"], r["exchange"]
        owned = []
        for mat in geo["matrices"]:
            m, n = mat["shape"]
            for (dim, blocks), owner in zip(mat["units"], mat["owners"]):
                length = sum(l for _, l in blocks)
                if owner == geo["rank"]:
                    owned.append(length * (n if dim == 0 else m))
        assert sum(owned) == st["owned_numel"]
        ws = st["ns_workspace_bytes"]
        assert ws is not None and 0 < ws <= 4 * 4 * max(st["ns_batch_numel"], max(owned)), st
        assert st["gather_into_input"], st
        # the step's one arena: flat pieces + owned units + the largest phase's staging
        # (gather sends, NS workspace, scatter sends), so at most ws or a shard above them
        arena = st["step_arena_bytes"]
        base = 4 * (st["shard_numel"] + st["owned_numel"])
        assert base + ws <= arena <= base + max(ws, 4 * st["shard_numel"], 4 * st["owned_numel"])


def test_global_clipping_matches_reference():
    opt = dict(OPT, clip_grad=0.05)
    results = train("pp2dp2", opt=opt)
    assert all(g is not None and g > 0.05 for g in results[-1]["grad_norms"])  # clipping active
    assert_matches(merged_params(results), reference(opt=opt))


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def saved_dp4(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("dmuon_ckpt"))
    full = train("dp4", steps=4, checkpoint=dict(save=d, save_at=2))
    return d, merged_params(full), full


def test_resume_is_bitwise_identical(saved_dp4):
    d, full, _ = saved_dp4
    resumed = merged_params(train("dp4", steps=4, checkpoint=dict(load=d)))
    for n in full:
        assert torch.equal(full[n], resumed[n]), n


def test_save_before_the_first_step_resumes_bitwise(tmp_path):
    """A checkpoint written before any optimizer step (``--train-iters 0 --save``, an exit
    signal, fp16 steps all skipped) holds the zero state the first step starts from; it
    raised ``KeyError: 'momentum_buffer'`` before.  Resumed, it trains bitwise as a run
    that never saved (both AdamW and DMuon state are zeros at step 0, step counters 0)."""
    d = str(tmp_path)
    train("dp4", steps=0, checkpoint=dict(save=d, save_at=0))
    resumed = merged_params(train("dp4", steps=2, checkpoint=dict(load=d)))
    whole = merged_params(train("dp4", steps=2))
    for n in whole:
        assert torch.equal(whole[n], resumed[n]), n


def test_checkpoint_stores_each_ranks_own_range_once(saved_dp4):
    """The optimizer state is written as each DP rank's own blocks, never densified: every
    element of every state tensor is stored exactly once, and a parameter split over DP
    ranks is stored as several chunks (the old format stored whole TP-local tensors)."""
    import glob
    import os

    from torch.distributed.checkpoint import FileSystemReader

    d, _, _ = saved_dp4
    path = sorted(glob.glob(os.path.join(d, "iter_*")))[-1]
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    keys = [k for k in md if "optimizer.state." in k]  # chained_<i>.optimizer.state...
    assert any(".momentum_buffer." in k for k in keys) and any(".exp_avg." in k for k in keys)
    split = 0
    for k in keys:
        cover = torch.zeros(tuple(md[k].size), dtype=torch.int32)
        for c in md[k].chunks:
            cover[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] += 1
        assert bool((cover == 1).all()), k
        split += len(md[k].chunks) > 1
    assert split > 0


@pytest.mark.parametrize("layout", ["tp2dp2"])
def test_checkpoint_reshards_to_another_dp_and_tp(saved_dp4, layout):
    d, full, _ = saved_dp4
    resumed = merged_params(train(layout, steps=4, checkpoint=dict(load=d)))
    assert worst_excess(resumed, full)[0] < 1, worst_excess(resumed, full)


# --------------------------------------------------------------------------- mixed precision
def test_fp16_found_inf_skips_the_step_and_training_continues():
    res = train("tp2dp2", opt=dict(OPT, initial_loss_scale=1024.0), steps=4, inf_at_step=2,
                params_each_step=True, cfg_extra={"fp16": True})
    r = res[0]
    assert r["updated"] == [True, True, False, True]
    before, skipped, after = r["history"][1], r["history"][2], r["history"][3]
    assert all(torch.equal(before[n], skipped[n]) for n in before)  # nothing moved
    assert max((skipped[n] - after[n]).abs().max().item() for n in before) > 1e-3
    assert all(l == l for l in r["losses"] if l is not None)


def test_bf16_params_dmuon_equals_naive():
    """bf16 model params, fp32 main params: owners compute what every rank would.

    Both orthogonalise the same gathered units; only the batch of units a rank runs
    Newton-Schulz on differs (its owned units vs all of them), which a batched matmul may
    round differently (a GPU library may pick its kernel by batch count).  So the fp32 main
    params may differ by rounding, at most MUON_ATOL (its K >= the NS matmuls' inner
    dimension), and their bf16 copies by that plus one bf16 ULP (each cast is within half a
    ULP; a value next to a rounding boundary may land on either side).  One step: after it,
    a bf16 value that rounded the other way would change the next forward pass, and from
    there the runs diverge by more than any ULP count (as test_zero3_fp16_... explains).
    """
    a = merged_params(train("tp2dp2", steps=1, cfg_extra={"bf16": True}))
    b = merged_params(train("tp2dp2", optimizer="muon_naive", steps=1, cfg_extra={"bf16": True}))
    init = reference(steps=0)["params"]
    for n in a:
        tol = ulp(torch.maximum(a[n].abs(), b[n].abs()), 7) + MUON_ATOL
        assert bool(((a[n].float() - b[n].float()).abs() <= tol).all()), n
    assert max((a[n].float() - init[n]).abs().max().item() for n in a) > 1e-3  # it moved


# --------------------------------------------------------------------------- model families
# The families users train, in the harness's tiny GPT (4 layers, hidden 64, ffn 128: the same
# K and matrix sizes MUON_ATOL is derived for): Llama (GQA + SwiGLU), Qwen3 (+ q/k layer
# norms, TP-replicated weights whose gradients Megatron sums over TP) and DeepSeek-V3 style
# multi-latent attention (q and kv LoRA down / up projections, each its own Muon unit), also
# with its q/kv latent norms (qk_layernorm, as DeepSeek-V3 ships; they go to AdamW).  MoE:
# test_moe_experts_equal_reference.
FAMILIES = {
    "llama": dict(swiglu=True, num_query_groups=2),
    "qwen3": dict(swiglu=True, num_query_groups=2, extra={"qk_layernorm": True}),
    "mla": dict(swiglu=True, multi_latent_attention=True),
    "mla_qkln": dict(swiglu=True, multi_latent_attention=True, extra={"qk_layernorm": True}),
}


def family_reference(family):
    key = ("family_reference", family)
    if key not in _CACHE:
        _CACHE[key] = run_ranks("megatron_muon.testing.reference:reference_train", 1,
                                dict(cfg={"num_microbatches": 4, **FAMILIES[family]},
                                     dp_size=1, steps=STEPS, opt=OPT), timeout=300)[0]
    return _CACHE[key]


@pytest.mark.parametrize("family,layout", [(f, lay) for f in FAMILIES
                                           for lay in ("dp4", "tp2dp2")])
def test_model_families_equal_reference(family, layout):
    """MLA at TP2 is compared with muon_naive at TP2 (every rank gathers every matrix and
    runs the reference's NS on it) instead of the single-process run: Megatron's local-spec
    MLA computes a TP-dependent gradient there.  Its rotary key rows of
    ``linear_kv_down_proj`` (the last ``qk_pos_emb_head_dim``) are shared by all heads, and
    at TP > 1 each rank's gradient for them holds only its own heads' part (Megatron's own
    AdamW after one step: 1e-5 off the TP1 run in those rows, 4e-9 at TP1)."""
    import megatron.core
    from packaging.version import Version

    mla = family.startswith("mla")
    if mla and Version(megatron.core.__version__) < Version("0.19"):
        pytest.skip("megatron-core 0.16's MLA asks isinstance(linear_proj, TELinear) with "
                    "TELinear None when Transformer Engine is absent; the 0.19 lane runs it")
    if mla and layout == "tp2dp2":
        ref = merged_params(train(layout, optimizer="muon_naive", cfg_extra=FAMILIES[family]))
    else:
        ref = family_reference(family)["params"]
    full = merged_params(train(layout, cfg_extra=FAMILIES[family]))
    assert set(full) == set(ref)
    excess, name = worst_excess(full, ref)
    assert excess < 1, f"{name}: {excess:.2f} x its tolerance"
    if mla:  # each of MLA's matrices is a Muon unit, its latent norms are not
        muon = {n.split(".self_attention.")[1] for n in ref if ".self_attention." in n and
                is_muon_matrix(n, ref[n])}
        assert muon == {f"{m}.weight" for m in ("linear_q_down_proj", "linear_q_up_proj",
                                                "linear_kv_down_proj", "linear_kv_up_proj",
                                                "linear_proj")}, muon


# Head-wise orthogonalisation (dmuon_qkv_split='head'): one Newton-Schulz unit per query
# head, per query group of K and V, per head of MLA's up-projections; gated attention's
# fused QKV carries a gate block per head as well (Qwen3-Next style).
HEAD_CASES = {
    "llama": FAMILIES["llama"], "mla": FAMILIES["mla"],
    "gated": dict(swiglu=True, num_query_groups=2, extra={"attention_output_gate": True}),
}
HEAD_OPT = dict(OPT, dmuon_qkv_split="head")


@pytest.mark.parametrize("family,layout", [("mla", "dp4"), ("gated", "tp2dp2")])
def test_head_wise_qkv_split_equals_reference(family, layout):
    """dmuon with per-head units equals the single-process reference with the same units
    (gated attention: Llama's GQA and SwiGLU plus a gate block per head)
    (MUON_ATOL's derivation holds: the units are smaller, not longer sums), at DP4 and at
    TP2 x DP2 (the heads of a TP rank's shard are whole units of the full matrix).  And the
    split is real: the attention weights differ from the per-matrix Q / K / V run's by far
    more than the tolerance."""
    import megatron.core
    from packaging.version import Version

    if family == "mla" and Version(megatron.core.__version__) < Version("0.19"):
        pytest.skip("megatron-core 0.16's MLA needs Transformer Engine (as above)")
    cfg = {"num_microbatches": 4, **HEAD_CASES[family]}
    ref = run_ranks("megatron_muon.testing.reference:reference_train", 1,
                    dict(cfg=cfg, dp_size=1, steps=STEPS, opt=HEAD_OPT), timeout=300)[0]["params"]
    full = merged_params(train(layout, opt=HEAD_OPT, cfg_extra=HEAD_CASES[family]))
    assert set(full) == set(ref)
    excess, name = worst_excess(full, ref)
    assert excess < 1, f"{name}: {excess:.2f} x its tolerance"
    per_matrix = run_ranks("megatron_muon.testing.reference:reference_train", 1,
                           dict(cfg=cfg, dp_size=1, steps=STEPS, opt=OPT), timeout=300)[0]["params"]
    attention = [n for n in ref if n.endswith(("linear_qkv.weight", "up_proj.weight"))]
    assert attention and worst_excess({n: per_matrix[n] for n in attention},
                                      {n: ref[n] for n in attention})[0] > 100


# --------------------------------------------------------------------------- MoE
MOE = {"num_moe_experts": 2, "num_microbatches": 2,
       "extra": {"moe_token_dispatcher_type": "allgather"}}  # alltoall: gloo wants list splits


def assert_moe_equals_reference(model: dict, world: int, microbatches: int, expert: str,
                                sp: bool = False, **train_kwargs) -> None:
    """``train_megatron`` of the MoE ``model`` on ``world`` ranks, ``microbatches`` per DP
    rank (``sp``: sequence parallelism), equals the single-process reference of the same
    global batch (cached per model and batch), every expert included (a parameter named
    ``expert`` must be there)."""
    dp = world // train_kwargs.get("tp", 1)
    key = ("moe_reference", repr(sorted(model.items())), dp * microbatches)
    if key not in _CACHE:
        _CACHE[key] = run_ranks("megatron_muon.testing.reference:reference_train", 1,
                                dict(cfg=dict(model, num_microbatches=dp * microbatches),
                                     dp_size=1, steps=4, opt=OPT), timeout=300)[0]["params"]
    ref = _CACHE[key]
    cfg = dict(model, num_microbatches=microbatches,
               extra=dict(model.get("extra", {}), sequence_parallel=sp))
    res = run_ranks("megatron_muon.testing.workers:train_megatron", world,
                    dict(cfg=cfg, optimizer="dmuon", steps=4, **train_kwargs), timeout=300)
    full = {}
    for r in res:
        full.update(r["params"])
    assert set(full) == set(ref)
    assert any(expert in n for n in full)
    assert worst_excess(full, ref)[0] < 1, worst_excess(full, ref)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_experts_equal_reference(ep):
    """One unit per expert, planned over the expert-data-parallel group (EP1: 2 ranks share
    the experts' work; EP2: each rank owns its local experts)."""
    assert_moe_equals_reference(MOE, 2, 2, "local_experts.1.", ep=ep, opt=OPT)


# expert TP > 1: the experts' TP shards are pieces like dense TP shards, exchanged over the
# expert TP x expert DP group (8 ranks at EP2: two groups of 4 that dmuon makes; TP2 x EP2
# on 4 ranks: the expert TP group).  The same model and global batch (8 microbatches) at
# every layout (layout_invariant_init), so one reference serves them all
MOE_ETP = dict(MOE, swiglu=True, num_moe_experts=4)
ETP_LAYOUTS = {"ep2-etp2-dp8": dict(world=8, tp=1, etp=2, ep=2, num_microbatches=1),
               # MoE with TP: Megatron wants sequence parallelism
               "tp2sp-ep2-etp2": dict(world=4, tp=2, etp=2, ep=2, num_microbatches=4, sp=True),
               "matrix-ep2-etp2-dp8": dict(world=8, tp=1, etp=2, ep=2, num_microbatches=1,
                                           placement="matrix")}


@pytest.mark.parametrize("layout", list(ETP_LAYOUTS))
def test_expert_tensor_parallel_equals_reference(layout):
    """Expert TP 2 (fc1 a GLU, cut by expert TP like a dense GLU fc1): exact against the
    single-process reference, with the optimizer state of every expert piece in the plan."""
    lay = dict(ETP_LAYOUTS[layout])
    opt = dict(OPT, dmuon_placement=lay.pop("placement", "dmuon"))
    assert_moe_equals_reference(MOE_ETP, lay.pop("world"), lay.pop("num_microbatches"),
                                "local_experts.3.linear_fc1", opt=opt, **lay)


# --------------------------------------------------------------------------- MatrixFSDP placement
MATRIX = dict(OPT, dmuon_placement="matrix")


def dp_peers_in_muon_step(results):
    """Per rank: the other-DP-rank peers of every collective the Muon step issued."""
    out = {}
    for r in results:
        lay = r["layout"]
        tp_group = {q["rank"] for q in results
                    if q["layout"]["dp"] == lay["dp"] and q["layout"]["pp"] == lay["pp"]}
        peers = set()
        for _, ranks, _ in r["muon_collectives"]:
            peers |= set(ranks) - tp_group
        out[r["rank"]] = peers
    return out


@pytest.mark.parametrize("layout", ["dp4", "tp2dp2"])
def test_matrix_placement_equals_reference_with_no_dp_collective(layout):
    results = train(layout, opt=dict(MATRIX, weight_decay=WD_OPT["weight_decay"]),
                    record_muon_collectives=True)
    assert_matches(merged_params(results), reference(opt=WD_OPT))
    assert all(not peers for peers in dp_peers_in_muon_step(results).values())
    for r in results:
        st = r["dmuon_stats"]
        if r["layout"]["tp_size"] == 1:  # the whole Muon step is local
            assert st["comm"]["calls"] == 0 and not r["muon_collectives"]
        else:  # only the TP exchange that joins a unit's two TP shards
            assert st["comm"]["bytes_sent"] > 0
            assert all(len(g) == 2 for _, g, _ in r["muon_collectives"])
    # every unit is orthogonalised exactly once, by a rank of the DP rank that holds it
    ref = reference()["params"]
    total = sum(p.numel() for n, p in ref.items() if is_muon_matrix(n, p))
    assert sum(r["dmuon_stats"]["owned_numel"] for r in results) == total


def test_collective_counter_sees_dp_traffic_of_plain_dmuon():
    """The counter can fail: default placement sends pieces to owners on other DP ranks."""
    results = train("dp4", record_muon_collectives=True)
    assert any(peers for peers in dp_peers_in_muon_step(results).values())


def test_dmuon_checkpoint_loads_into_matrix_placement(saved_dp4):
    """Model-space checkpoints reshard across placements as well as DP / TP sizes."""
    d, full, _ = saved_dp4
    resumed = merged_params(train("tp2dp2", opt=MATRIX, steps=4, checkpoint=dict(load=d)))
    assert worst_excess(resumed, full)[0] < 1, worst_excess(resumed, full)


# --------------------------------------------------------------------------- blockwise opt-in
@pytest.mark.parametrize("placement", ["dmuon", "matrix"])
def test_blockwise_tp_mode_equals_per_shard_reference_and_is_labelled(placement):
    """dmuon_tp_mode='blockwise': NS per TP shard (Megatron's blockwise), no TP exchange."""
    key = ("reference_blockwise2",)
    if key not in _CACHE:
        _CACHE[key] = run_ranks("megatron_muon.testing.reference:reference_train", 1,
                                dict(cfg={"num_microbatches": 4}, dp_size=1, steps=STEPS,
                                     opt=OPT, tp_blockwise=2), timeout=300)[0]
    ref = _CACHE[key]
    opt = dict(OPT, dmuon_tp_mode="blockwise", dmuon_placement=placement)
    results = train("tp2dp2", opt=opt, record_muon_collectives=True)
    full = merged_params(results)
    assert worst_excess(full, ref["params"])[0] < 1, worst_excess(full, ref["params"])
    # not TP-invariant: it is not the exact (whole-unit) update
    exact = reference()["params"]
    assert max((full[n] - exact[n]).abs().max().item() for n in full) > 100 * MUON_ATOL
    for r in results:  # never a collective within the TP group
        tp_peers = {q["rank"] for q in results
                    if q["layout"]["dp"] == r["layout"]["dp"]} - {r["rank"]}
        assert not any(set(g) & tp_peers for _, g, _ in r["muon_collectives"])
        if placement == "matrix":
            assert not r["muon_collectives"]


# --------------------------------------------------------------------------- ZeRO-3
ZERO3 = dict(MATRIX, dmuon_zero3=True)
# several buckets per stage; Megatron's param-gather hooks on (ZeRO-3 turns them into no-ops)
ZERO3_DDP = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=20000)


@pytest.mark.parametrize("layout", ["dp4", "tp2dp2", "pp2dp2"])
def test_zero3_equals_reference_and_stores_each_parameter_once(layout):
    results = train(layout, opt=ZERO3, ddp=ZERO3_DDP, record_muon_collectives=True)
    assert_matches(merged_params(results), reference())
    assert all(not peers for peers in dp_peers_in_muon_step(results).values())
    stage = {}
    for r in results:
        z = r["zero3"]
        assert z["bytes_of_others"] == 0  # nothing of a parameter another rank owns
        assert all(s["gathers"] > 0 and s["reductions"] > 0 for s in z["stats"])
        if r["layout"]["tp_size"] == 1:
            assert not r["muon_collectives"]  # the Muon step is local
        lay = r["layout"]
        stage.setdefault((lay["tp"], lay["pp"]), []).append((set(z["owned"]), set(r["params"])))
    for ranks in stage.values():  # the DP ranks of one (TP, PP) position split the stage
        owned = [o for o, _ in ranks]
        assert sum(len(o) for o in owned) == len(set().union(*owned)) == len(ranks[0][1])
        assert set().union(*owned) == ranks[0][1]


@pytest.mark.parametrize("layout", ["dp4", "pp2dp2"])
def test_zero3_with_biases_equals_zero1(layout):
    """Megatron's linear layers return their bias (skip_bias_add) for the bias-dropout-add
    that runs after the module: when the module is the last of its bucket to run its forward,
    ZeRO-3 frees the gather buffer the bias lives in before the bias is read.  Through
    Megatron-LM at PP2 this was a SIGSEGV on rank 0.  Same model and data as ZeRO-1 DMuon
    with matrix placement; only the summation order of the per-microbatch reduce-scatters
    differs, so the fp32 tolerance of the reference comparisons applies."""
    bias = {"add_bias_linear": True}
    zero3 = merged_params(train(layout, opt=ZERO3, ddp=ZERO3_DDP, cfg_extra=bias))
    zero1 = merged_params(train(layout, opt=MATRIX, cfg_extra=bias))
    assert any(n.endswith("linear_fc2.bias") for n in zero3)
    assert set(zero3) == set(zero1)
    assert worst_excess(zero3, zero1)[0] < 1, worst_excess(zero3, zero1)


def test_zero3_memory_per_rank_is_near_even_sharding():
    """Persistent parameter and gradient bytes per rank vs model bytes / DP (tiny model:
    a 4-layer GPT with a 128 x 64 embedding; the 12-layer figure is in the benchmark)."""
    for r in train("dp4", opt=ZERO3, ddp=ZERO3_DDP, record_muon_collectives=True):
        m = r["zero3"]["memory"]
        even = m["model_params"] / m["world"]
        assert m["params"] <= 1.15 * even, (m["params"], even)
        assert m["grads"] <= 1.15 * m["model_grads"] / m["world"]


def test_zero3_checkpoint_resumes_bitwise_and_reshards(tmp_path):
    d = str(tmp_path)
    saved = train("dp4", opt=ZERO3, ddp=ZERO3_DDP, steps=4, checkpoint=dict(save=d, save_at=2))
    # each owner wrote its own parameters: no rank gathered a bucket to save
    assert [r["zero3"]["gathers_in_save"] for r in saved] == [0] * 4
    full = merged_params(saved)
    loaded = train("dp4", opt=ZERO3, ddp=ZERO3_DDP, steps=4, checkpoint=dict(load=d))
    assert [r["zero3"]["gathers_in_load"] for r in loaded] == [0] * 4  # each reads its own
    same = merged_params(loaded)
    for n in full:
        assert torch.equal(full[n], same[n]), n
    # to DP2 x TP2 under ZeRO-3, and to the default DMuon placement at DP4
    other = merged_params(train("tp2dp2", opt=ZERO3, ddp=ZERO3_DDP, steps=4,
                                checkpoint=dict(load=d)))
    plain = merged_params(train("dp4", steps=4, checkpoint=dict(load=d)))
    for resumed in (other, plain):
        assert worst_excess(resumed, full)[0] < 1, worst_excess(resumed, full)


def test_zero3_interleaved_pipeline_equals_reference(tmp_path):
    """PP2 x VPP2 x DP2: two model chunks per rank, each with its own ZeRO-3 buckets; a
    checkpoint of both chunks, written and read by the owners, resumes bitwise."""
    def run(**ckpt):
        return run_ranks("megatron_muon.testing.workers:train_megatron", 4,
                         dict(cfg={"num_microbatches": 2}, pp=2, vpp=2, optimizer="dmuon",
                              opt=ZERO3, steps=STEPS, ddp=ZERO3_DDP, checkpoint=ckpt),
                         timeout=300)
    res = run(save=str(tmp_path), save_at=2)  # saving does not change the run
    assert_matches(merged_params(res), reference())
    resumed = run(load=str(tmp_path))
    assert [r["zero3"]["gathers_in_save"] for r in res] == [0] * 4
    assert [r["zero3"]["gathers_in_load"] for r in resumed] == [0] * 4
    full, again = merged_params(res), merged_params(resumed)
    for n in full:
        assert torch.equal(full[n], again[n]), n


def test_zero3_tied_embeddings_equal_reference():
    """The output layer reads the embedding weight (Megatron-LM's default): its bucket must
    stay gathered until the output layer has run."""
    cfg = {"num_microbatches": 1, "tie_embeddings": True}
    ref = run_ranks("megatron_muon.testing.reference:reference_train", 1,
                    dict(cfg=dict(cfg, num_microbatches=4), dp_size=1, steps=STEPS, opt=OPT),
                    timeout=300)[0]
    res = run_ranks("megatron_muon.testing.workers:train_megatron", 4,
                    dict(cfg=cfg, optimizer="dmuon", opt=ZERO3, steps=STEPS, ddp=ZERO3_DDP),
                    timeout=300)
    assert "output_layer.weight" not in ref["params"]
    assert set(res[0]["params"]) == set(ref["params"])
    assert worst_excess(res[0]["params"], ref["params"])[0] < 1, \
        worst_excess(res[0]["params"], ref["params"])


def test_zero3_fp16_clip_and_found_inf_equal_zero1():
    """fp16 with a loss scaler: clipping forced at step 1 and an Inf at step 2 (skipped;
    steps counted from 0) give bitwise the same parameters as matrix placement under
    ZeRO-1, after every step.

    Bitwise by construction: ZeRO-1 runs with the same DDP buckets as ZeRO-3 and with one
    microbatch per DP rank, so both reduce-scatter the same bucket of the same gradients
    (times the same powers of two, 1/DP and 1/loss scale), the gradient norm adds the
    same per-parameter terms in the same order, and the steps are the same operations.

    Why ZeRO-3 and ZeRO-1 differed before (by one fp16 ULP at step 1, 2^-16 at |x| in
    [2^-6, 2^-5), and by ~1.5e-4, hundreds of ULPs, at step 3; with adam_eps 1e-5): not
    the summation order of ZeRO-3's per-microbatch reduce-scatters (zero3.py: the owner
    adds each microbatch's reduced shard) against one reduce-scatter of the accumulated
    gradient.  Those sums are of fp16 gradients in fp32 and exact unless their terms span
    more than 2^(24 - 11); with the same buckets the two were bitwise equal with 2
    microbatches per DP rank as well.  The cause was the buckets: ZeRO-1 had Megatron's
    default (one bucket) and ZeRO-3 bucket_size=20000, so the gradient norm summed its
    per-parameter squares in another order and differed in the last bit
    (0.002608591094767474 vs 0.0026085911819308753 at step 0, even with one microbatch);
    the forced clipping at step 1 scales every gradient by max_norm / norm, so ~400
    elements rounded to the other fp16 neighbour, and those changed the next forward
    pass: the runs diverge from there, which no ULP count bounds.
    """
    common = dict(steps=4, inf_at_step=2, clip_at_steps=(1,), params_each_step=True,
                  cfg_extra={"fp16": True, "num_microbatches": 1})
    z3 = train("tp2dp2", opt=dict(ZERO3, initial_loss_scale=1024.0), ddp=ZERO3_DDP, **common)
    z1 = train("tp2dp2", opt=dict(MATRIX, initial_loss_scale=1024.0), ddp=ZERO3_DDP, **common)
    assert z3[0]["updated"] == z1[0]["updated"] == [True, True, False, True]
    for r3, r1 in zip(z3, z1):
        for step, (h3, h1) in enumerate(zip(r3["history"], r1["history"])):
            for n in h3:
                assert torch.equal(h3[n], h1[n]), (step, n)


@pytest.mark.parametrize("layout", ["dp4", "pp2dp2"])
def test_zero3_prefetch_changes_nothing_but_when_buckets_arrive(layout):
    """Prefetch (the default) starts the next bucket's all-gather ahead of its use: the same
    collectives on the same values, so the parameters equal those without it bitwise (by
    construction), and it did prefetch: in every step after the first (which records the
    order), on every rank whose stage has more than one bucket."""
    on = train(layout, opt=ZERO3, ddp=ZERO3_DDP, record_muon_collectives=True)
    off = train(layout, opt=dict(ZERO3, dmuon_zero3_prefetch=False), ddp=ZERO3_DDP,
                record_muon_collectives=True)
    a, b = merged_params(on), merged_params(off)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    for r_on, r_off in zip(on, off):
        assert all(s["prefetches"] == 0 for s in r_off["zero3"]["stats"])
        if r_on["zero3"]["memory"]["buckets"] > 1:
            assert sum(s["prefetches"] for s in r_on["zero3"]["stats"]) >= STEPS - 1
        # a prefetch replaces a gather at its use: no extra gathers
        assert sum(s["gathers"] for s in r_on["zero3"]["stats"]) == \
            sum(s["gathers"] for s in r_off["zero3"]["stats"])


# Even shards: Megatron's own buffer layout under ZeRO-3 (every rank stores a 1/DP slice of
# every bucket).  With muon_naive it is the reconstruction baseline (each step gathers every
# matrix on every rank, orthogonalises it, keeps its slice); with dmuon the owners' exchange.
EVEN_ZERO3 = dict(OPT, dmuon_zero3=True)


@pytest.mark.parametrize("optimizer,layout", [("muon_naive", "dp4"), ("muon_naive", "tp2dp2"),
                                              ("dmuon", "dp4"), ("muon_naive", "pp2dp2")])
def test_even_zero3_equals_reference_and_holds_a_slice_of_every_bucket(optimizer, layout):
    """Same fp32 tolerance as every reference comparison here: only the summation order of
    the gradient reductions (per microbatch under ZeRO-3) differs from the reference."""
    results = train(layout, optimizer=optimizer, opt=EVEN_ZERO3, ddp=ZERO3_DDP,
                    record_muon_collectives=True)
    assert_matches(merged_params(results), reference())
    for r in results:
        z = r["zero3"]
        assert z["bytes_of_others"] == 0 and z["owned"] == []  # no parameter stored whole
        m = z["memory"]
        # a 1/DP slice of every bucket: the model over DP plus Megatron's padding (each
        # parameter's start to 64 elements, each bucket to lcm(DP, 128)): ~1% of this model
        even = m["model_params"] / m["world"]
        assert even <= m["params"] <= 1.05 * even, (m["params"], even)
        for s in z["stats"]:
            assert s["gathers"] > 0 and s["reductions"] > 0
            assert s["gather_bytes"] > 0 and s["reduce_bytes"] > 0
        if optimizer == "muon_naive":  # the step gathers the matrices over data parallel
            assert r["muon_collectives"]
    assert any(peers for peers in dp_peers_in_muon_step(results).values())


def test_even_zero3_checkpoint_resumes_bitwise(tmp_path):
    """Even-shard ZeRO-3 saves Megatron's replicas (the buckets gathered, DP rank 0 writes)
    and each rank keeps its slice of what it loads: the resumed run equals the unbroken
    one bitwise (the same operations on the same values), and the checkpoint loads into
    MatrixFSDP ZeRO-3 within the reference tolerance (other buckets, other sum order)."""
    d = str(tmp_path)
    saved = train("dp4", optimizer="muon_naive", opt=EVEN_ZERO3, ddp=ZERO3_DDP, steps=4,
                  checkpoint=dict(save=d, save_at=2))
    full = merged_params(saved)
    loaded = merged_params(train("dp4", optimizer="muon_naive", opt=EVEN_ZERO3, ddp=ZERO3_DDP,
                                 steps=4, checkpoint=dict(load=d)))
    for n in full:
        assert torch.equal(full[n], loaded[n]), n
    matrix = merged_params(train("dp4", opt=ZERO3, ddp=ZERO3_DDP, steps=4,
                                 checkpoint=dict(load=d)))
    assert worst_excess(matrix, full)[0] < 1, worst_excess(matrix, full)


@pytest.mark.parametrize("ddp,placement,lr,match", [
    (dict(overlap_grad_reduce=False), True, None, "overlap_grad_reduce=True"),
    (ZERO3_DDP, False, None, "matrix_placement_for"),
    # Megatron's NaN check of each bucket's local norm, once per step (lr 1e30: NaN at step 2)
    (dict(ZERO3_DDP, check_for_nan_in_grad=True), True, 1e30, "found NaN in local grad norm"),
])
def test_zero3_clear_errors(ddp, placement, lr, match):
    from megatron_muon.testing.launch import RankFailure

    with pytest.raises(RankFailure, match=match):
        run_ranks("megatron_muon.testing.workers:train_megatron", 2,
                  dict(cfg={}, optimizer="dmuon", opt=dict(ZERO3, lr=lr or OPT["lr"]), steps=3,
                       ddp=ddp, matrix_placement=placement), timeout=120)


def test_even_zero3_refuses_a_model_built_under_matrix_placement():
    """Even shards need Megatron's own buffer layout; buffers laid out by matrix placement
    (``matrix_layout`` set) are refused before any bucket is built, and so is a model
    without them under ``even=False`` (checked without ranks: the test is the layout
    check, which runs first)."""
    from types import SimpleNamespace

    from megatron_muon.megatron.zero3 import shard_model

    placed = SimpleNamespace(buffers=[SimpleNamespace(matrix_layout=object(), matrix_whole=True)])
    with pytest.raises(ValueError, match="needs Megatron's own buffer layout"):
        shard_model([placed], even=True)
    plain = SimpleNamespace(buffers=[SimpleNamespace()])
    with pytest.raises(ValueError, match="matrix_placement_for"):
        shard_model([plain], even=False)


# --------------------------------------------------------------------------- default precision
# muon_fp32_matmul_prec's default, 'medium': Newton-Schulz in bf16, in DMuon and in the
# reference alike (every other test here runs it in fp32, 'highest').
DEFAULT_PREC = {k: v for k, v in OPT.items() if k != "muon_fp32_matmul_prec"}


@pytest.mark.parametrize("layout", ["dp4", "tp2dp2"])
def test_default_precision_equals_reference(layout):
    """DMuon at the default precision (bf16 Newton-Schulz) equals the reference at the same
    precision, one step.

    Tolerance.  The two NS inputs differ only by the fp32 summation order (2 K EPS32
    relative, as in MUON_ATOL); each run's bf16 NS result then differs from the exact (fp32)
    NS of its input by its bf16 error E, so by the triangle inequality
    |DMuon - ref| <= E_dmuon + E_ref + the fp32 bound (MUON_ATOL / STEPS: one step).  E_ref
    is measured here, per parameter, as |ref(medium) - ref(highest)| (the 'highest'
    reference is exact NS up to fp32 rounding, ~1e-6 relative, 1e3x below E); E_dmuon is
    the same bf16 NS (the same function on the same values up to that fp32 order; CPU
    bf16 bmm gives each matrix of a batch bitwise its unbatched result), of the same size,
    so the bound is 2 E_ref.  Why not a constant from bf16's unit roundoff u = 2^-8: the
    first step's momenta are nearly low-rank, and NS multiplies errors along small singular
    directions by up to its slope at 0, prod(a) = 490 for quintic; measured: layer 2's
    linear_proj differs by 0.08 = 20 u between bf16 and fp32 NS, 1.3e-3 after the step.
    AdamW parameters: their first step does not depend on NS, ADAM_ATOL / STEPS.
    Why one step: from step 2 on the parameters differ by step 1's bf16 difference, the
    gradients with them, and NS amplifies that again (measured: 5.5e-5 after step 1 at
    DP4, 1.3e-3 after step 2), so no bound from the arithmetic holds beyond one step; the
    momentum is checked over 5 steps in fp32 (test_dmuon_equals_reference), where the
    precision changes nothing."""
    from megatron_muon.testing.workers import make_optimizer_config

    assert make_optimizer_config("dmuon", **DEFAULT_PREC).muon_fp32_matmul_prec == "medium"
    full = merged_params(train(layout, opt=DEFAULT_PREC, steps=1))
    ref = reference(opt=DEFAULT_PREC, steps=1)["params"]
    exact = reference(steps=1)["params"]
    init = reference(steps=0)["params"]
    assert set(full) == set(ref)
    worst = []
    for n, r in ref.items():
        err = (full[n] - r).abs().max().item()
        if not is_muon_matrix(n, r):
            assert err < ADAM_ATOL / STEPS, (n, err)
            continue
        e_ref = (r - exact[n]).abs().max().item()
        tol = 2 * e_ref + MUON_ATOL / STEPS
        worst.append((err / tol, n))
        # the bound is not vacuous: a step moves every matrix by more than twice it (a lost,
        # doubled or misplaced update fails)
        assert (r - init[n]).abs().max().item() > 2 * tol, n
    excess, name = max(worst)
    print(f"default precision {layout}: worst {excess:.3f} x tolerance ({name})")
    assert excess < 1, f"{name}: {excess:.2f} x its tolerance"
    # and bf16 NS it is: DMuon is nearer the bf16 reference than the fp32 one (a DMuon that
    # ran fp32 NS would be ~1e-6 from the fp32 reference and E_ref from the other)
    far = max((full[n] - exact[n]).abs().max().item() for n in ref if is_muon_matrix(n, ref[n]))
    near = max((full[n] - ref[n]).abs().max().item() for n in ref if is_muon_matrix(n, ref[n]))
    assert near < far / 2, (near, far)


def test_triton_ns_backend_inside_a_dmuon_run():
    """``dmuon_ns_backend='triton'`` built and stepped inside a DMuon run (Triton's
    interpreter on CPU: fresh rank processes with TRITON_INTERPRET=1, set before triton
    reads it) equals the torch backend's run at TP2 x DP2.  Same gradients, same exchange;
    only the NS kernels' fp32 summation order differs, which the fp32 reference tolerance
    (MUON_ATOL: summation-order differences amplified by NS) covers over STEPS steps, so
    over the 2 steps run here (the interpreter is slow) too."""
    pytest.importorskip("triton")
    tp, pp, world, m = LAYOUTS["tp2dp2"]

    def run(backend):
        return merged_params(run_ranks(
            "megatron_muon.testing.workers:train_megatron", world,
            dict(cfg={"num_microbatches": m, "num_layers": 1}, tp=tp, pp=pp,
                 optimizer="dmuon", opt=dict(OPT, dmuon_ns_backend=backend), steps=2),
            timeout=600, start="spawn", env={"TRITON_INTERPRET": "1"}))

    triton, torch_run = run("triton"), run("torch")
    assert worst_excess(triton, torch_run)[0] < 1, worst_excess(triton, torch_run)
    # the Triton kernels ran: they round differently from torch's bmm somewhere
    assert any(not torch.equal(triton[n], torch_run[n]) for n in triton)
