"""The emulated shard geometry (``megatron_muon.megatron.geometry``) equals what a real
Megatron-Core DDP model and DMuon optimizer build.

Each launch builds the tiny GPT under Megatron DDP and DMuon on gloo ranks (nothing is
trained) for several layouts and bucket sizes; every rank returns its parameters, the bucket
size DDP resolved, and per DMuon optimizer its ``ShardedMatrix`` list (keys, full shapes,
units, TP dims, pieces: which group rank holds which flat range at which offset, buckets),
flat buffer size and plan digest.  The test rebuilds all of it from the parameter list alone
and compares, rank by rank.  A launch past its timeout fails (``run_ranks`` kills the ranks),
it never hangs.
"""

from types import SimpleNamespace

import pytest

from megatron_muon.megatron.geometry import (ddp_bucket_size, dmuon_part, gpt_param_specs,
                                             stage_matrices)
from megatron_muon.testing.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

BUCKETS = dict(overlap_grad_reduce=True, bucket_size=20000)  # several buckets per stage
LAUNCHES = {
    4: {
        # tied embeddings (PP1: no output layer), gated fc1, ~10 buckets
        "dp4-buckets-tied": dict(cfg=dict(swiglu=True, tie_embeddings=True), ddp=BUCKETS),
        # TP-split and replicated shards, fc1 split into gate / up units across TP shards
        "tp2dp2-buckets-gate-up": dict(tp=2, cfg=dict(swiglu=True), opt=dict(dmuon_split_fc1=True),
                                       ddp=dict(BUCKETS, bucket_size=30000)),
        "tp2dp2-blockwise": dict(tp=2, opt=dict(dmuon_tp_mode="blockwise")),  # one bucket
        # stage 1 has no bucketing (Megatron's DDP), stage 0 has
        "pp2dp2-buckets": dict(pp=2, ddp=BUCKETS),
        # experts in their own buffer over the expert-DP group (EP2: 2 ranks), router dense
        "ep2dp4-experts": dict(ep=2, cfg=dict(num_moe_experts=4), ddp=BUCKETS),
    },
    2: {
        "dp2-buckets-nccl-pad": dict(ddp=dict(BUCKETS, pad_buckets_for_high_nccl_busbw=True)),
        "dp2-one-bucket": dict(),
    },
}
_CACHE: dict = {}


def launch(world: int) -> list:
    """Per rank, per variant of ``LAUNCHES[world]`` (in order): what the worker returned."""
    if world not in _CACHE:
        variants = list(LAUNCHES[world].values())
        _CACHE[world] = run_ranks("megatron_muon.testing.geometry_workers:dmuon_geometry",
                                  world, dict(variants=variants), timeout=480)
    return _CACHE[world]


def _config(v: dict):
    from megatron_muon.testing.gpt import TinyGPTConfig
    from megatron_muon.testing.workers import make_optimizer_config

    return TinyGPTConfig(**v.get("cfg", {})), make_optimizer_config("dmuon", **v.get("opt", {}))


def check_rank(v: dict, world: int, r: dict) -> None:
    from megatron_muon.megatron.dmuon import _unit_cost, plan_matrices

    g, ocfg = _config(v)
    tp, pp, ep = v.get("tp", 1), v.get("pp", 1), v.get("ep", 1)
    dp = world // (tp * pp)
    lay = r["layout"]
    assert (lay["tp_size"], lay["pp_size"], lay["dp_size"]) == (tp, pp, dp)
    specs = gpt_param_specs(
        num_layers=g.num_layers, hidden_size=g.hidden_size, ffn_hidden_size=g.ffn_hidden_size,
        num_attention_heads=g.num_attention_heads, num_query_groups=g.num_query_groups,
        vocab_size=g.vocab_size, gated_linear_unit=g.swiglu, num_moe_experts=g.num_moe_experts,
        share_embeddings_and_output_weights=g.tie_embeddings, tp=tp, pp=pp, pp_rank=lay["pp"],
        ep=ep)
    # the parameter list: names, TP-local shapes, TP dims, buffer kind, in registration order
    assert [(s.name, s.shape, s.tp_dim, not s.expert, s.shared_embedding) for s in specs] == \
        [tuple(x) for x in r["params"][0]]
    ddp = {"overlap_grad_reduce": False, **v.get("ddp", {})}
    size = ddp_bucket_size(ddp.get("bucket_size"), dp, overlap_grad_reduce=ddp["overlap_grad_reduce"])
    assert size == r["ddp_bucket_size"]
    assert r["bucket_sizes"][0] == (size if lay["pp"] == 0 else None)
    model_config = SimpleNamespace(num_attention_heads=g.num_attention_heads,
                                   num_query_groups=g.num_query_groups, kv_channels=None,
                                   hidden_size=g.hidden_size, gated_linear_unit=g.swiglu)
    blockwise = ocfg.dmuon_tp_mode == "blockwise"
    pad = dict(pad_for_high_nccl_busbw=ddp.get("pad_buckets_for_high_nccl_busbw", False))
    want = []
    dense = dmuon_part([specs], dp_size=dp, bucket_size=size, pp_rank=lay["pp"], **pad)
    t = 1 if blockwise else tp
    want.append((False, dense, t, dp * t, lay["dp"] * t + (0 if blockwise else lay["tp"])))
    if g.num_moe_experts and ep > 1:
        edp = world // (pp * ep)
        experts = dmuon_part([specs], dp_size=edp, bucket_size=size, expert=True,
                             pp_rank=lay["pp"], **pad)
        want.append((True, experts, 1, edp, lay["edp"]))
    assert [p["expert"] for p in r["parts"]] == [w[0] for w in want]
    for part, (expert, geo, tsize, gworld, grank) in zip(r["parts"], want):
        mats = stage_matrices(geo, tp_size=tsize, model_config=model_config, cfg=ocfg,
                              expert=expert, real_tp_size=tp)
        assert (part["world"], part["rank"]) == (gworld, grank)
        assert part["local_numel"] == geo.local_numel[grank // tsize]
        assert [m.key for m in part["matrices"]] == [m.key for m in mats]
        for real, emulated in zip(part["matrices"], mats):
            assert real == emulated, real.key  # shape, units, TP dim, pieces, bucket
        cost = _unit_cost(ocfg, [u.shape for m in mats for u in m.units], None)
        assert plan_matrices(mats, gworld, ocfg, cost).digest == part["digest"]


@pytest.mark.parametrize("world,name", [(w, n) for w in LAUNCHES for n in LAUNCHES[w]])
def test_emulated_geometry_equals_megatron_and_dmuon(world, name):
    index = list(LAUNCHES[world]).index(name)
    v = LAUNCHES[world][name]
    results = [rank_results[index] for rank_results in launch(world)]
    for r in results:
        check_rank(v, world, r)
    buckets = {m.bucket for r in results for p in r["parts"] for m in p["matrices"]}
    if v.get("ddp", {}).get("overlap_grad_reduce"):  # the small bucket size cut the stage
        assert len(buckets) > 2, buckets


def test_buffer_layout_follows_megatron_rules():
    """By hand: reverse order, 64-element starts, buckets closed at bucket_size and padded to
    lcm(DP, 128), a shared embedding in a bucket of its own, DP shards of every bucket."""
    from megatron_muon.megatron.geometry import ParamSpec, buffer_layout

    ps = [ParamSpec("emb", (100,), shared_embedding=True), ParamSpec("a", (10, 10)),
          ParamSpec("b", (30,)), ParamSpec("c", (300,))]
    lay = buffer_layout(ps, 2, 200)
    assert [p.name for p in lay.params] == ["c", "b", "a", "emb"]
    # c [0, 300) closes bucket 0 (padded to 384); b [384, 414), a [448, 548); emb is shared,
    # so bucket 1 closes before it (at 576, padded to 640) and emb [640, 740) gets its own
    assert lay.index == ((0, 300, 0), (384, 414, 1), (448, 548, 1), (640, 740, 2))
    assert lay.buckets == ((0, 384), (384, 640), (640, 768))
    shards = lay.dp_slices()
    # bucket 1 shards: [384, 512) and [512, 640): a is cut at 512
    assert (2, 0, 64, 1) in shards[0] and (2, 64, 100, 1) in shards[1]
    assert shards[0][0] == (0, 0, 192, 0) and shards[1][0] == (0, 192, 300, 0)
