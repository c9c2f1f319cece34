"""DMuon on a real Megatron-Core GPT (gloo ranks) against the single-process reference.

Every layout sees the same global batch (4 microbatches per step), so the reference is one
process that takes all of them; parameters must agree after several steps.
"""

import tempfile

import pytest
import torch

from megatron_muon.megatron.params import is_muon_matrix
from megatron_muon.testing.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

OPT = dict(muon_fp32_matmul_prec="highest", muon_nesterov=True, lr=2e-3, adam_eps=1e-5)
STEPS = 5
ATOL = 2e-6  # observed ~2e-7 (fp32 summation order differs between layouts)
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


def assert_matches(full, ref, atol=ATOL):
    assert set(full) == set(ref["params"])
    worst = max((full[n] - ref["params"][n]).abs().max().item() for n in full)
    assert worst < atol, worst
    init = reference(steps=0)["params"]
    moved = max((init[n] - ref["params"][n]).abs().max().item()
                for n in full if is_muon_matrix(n, init[n]))
    assert moved > 100 * atol, "the Muon matrices barely moved: the comparison would be vacuous"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dmuon_equals_reference(layout):
    assert_matches(merged_params(train(layout)), reference())


def test_interleaved_pipeline_equals_reference():
    """PP2 x VPP2 (Megatron's interleaved schedule), DMuon with the overlap on."""
    res = run_ranks("megatron_muon.testing.workers:train_megatron", 2,
                    dict(cfg={"num_microbatches": 4}, pp=2, vpp=2, optimizer="dmuon", opt=OPT,
                         steps=STEPS, ddp=dict(overlap_grad_reduce=True)), timeout=300)
    assert len({n for r in res for n in r["params"]}) == len(reference()["params"])
    assert_matches({n: t for r in res for n, t in r["params"].items()}, reference())


def test_tp1_and_tp2_give_the_same_update():
    a, b = merged_params(train("dp4")), merged_params(train("tp2dp2"))
    assert max((a[n] - b[n]).abs().max().item() for n in a) < ATOL


def test_muon_naive_equals_reference_and_moves_more_bytes():
    naive = train("tp2dp2", optimizer="muon_naive")
    assert_matches(merged_params(naive), reference())
    dm = train("tp2dp2")
    n_recv = max(r["dmuon_stats"]["comm"]["bytes_received"] for r in naive)
    d_recv = max(r["dmuon_stats"]["comm"]["bytes_received"] for r in dm)
    assert n_recv > 2 * d_recv


@pytest.mark.parametrize("layout", ["dp4", "tp2dp2", "tp2pp2dp2"])
def test_traffic_and_state_per_rank(layout):
    """Bytes per rank <= 2 (N-1)/N^2 of the stage's Muon bytes; state sums to 1x, ~1/N each."""
    results = train(layout)
    by_stage = {}
    for r in results:
        by_stage.setdefault(r["layout"]["pp"], []).append(r)
    for ranks in by_stage.values():
        n = len(ranks)
        muon_bytes = 4 * ranks[0]["dmuon_stats"]["muon_numel"]
        bound = 2 * (n - 1) / n**2 * muon_bytes * STEPS
        for r in ranks:
            c = r["dmuon_stats"]["comm"]
            assert c["bytes_sent"] <= bound and c["bytes_received"] <= bound, (c, bound)
            assert c["calls"] <= 2 * STEPS  # one gather + one scatter all-to-all per bucket
        state = [r["dmuon_stats"]["state_bytes"] for r in ranks]
        assert sum(state) == muon_bytes  # every element's momentum lives exactly once
        assert max(state) <= 1.5 * muon_bytes / n
        # exchange bookkeeping: a few blocks per piece, not an index per element (an int64
        # table per shard element would be 2x the fp32 momentum on its own)
        for r in ranks:
            assert r["dmuon_stats"]["index_bytes"] <= 0.1 * r["dmuon_stats"]["state_bytes"], \
                r["dmuon_stats"]


def test_global_clipping_matches_reference():
    opt = dict(OPT, clip_grad=0.05)
    results = train("pp2dp2", opt=opt)
    assert all(g is not None and g > 0.05 for g in results[-1]["grad_norms"])  # clipping active
    assert_matches(merged_params(results), reference(opt=opt))


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def saved_dp4():
    d = tempfile.mkdtemp(prefix="dmuon_ckpt_")
    full = train("dp4", steps=4, checkpoint=dict(save=d, save_at=2))
    return d, merged_params(full), full


def test_resume_is_bitwise_identical(saved_dp4):
    d, full, _ = saved_dp4
    resumed = merged_params(train("dp4", steps=4, checkpoint=dict(load=d)))
    for n in full:
        assert torch.equal(full[n], resumed[n]), n


@pytest.mark.parametrize("layout", ["tp2dp2"])
def test_checkpoint_reshards_to_another_dp_and_tp(saved_dp4, layout):
    d, full, _ = saved_dp4
    resumed = merged_params(train(layout, steps=4, checkpoint=dict(load=d)))
    assert max((full[n] - resumed[n]).abs().max().item() for n in full) < ATOL


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
    """bf16 model params, fp32 main params: owners compute exactly what every rank would."""
    a = merged_params(train("tp2dp2", steps=3, cfg_extra={"bf16": True}))
    b = merged_params(train("tp2dp2", optimizer="muon_naive", steps=3, cfg_extra={"bf16": True}))
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 1e-6


# --------------------------------------------------------------------------- MoE
MOE = {"num_moe_experts": 2, "num_microbatches": 2,
       "extra": {"moe_token_dispatcher_type": "allgather"}}  # alltoall: gloo wants list splits


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_experts_equal_reference(ep):
    """One unit per expert, planned over the expert-data-parallel group (EP1: 2 ranks share
    the experts' work; EP2: each rank owns its local experts)."""
    key = ("moe_reference",)
    if key not in _CACHE:
        _CACHE[key] = run_ranks("megatron_muon.testing.reference:reference_train", 1,
                                dict(cfg=dict(MOE, num_microbatches=4), dp_size=1, steps=4,
                                     opt=OPT), timeout=300)[0]
    ref = _CACHE[key]
    res = run_ranks("megatron_muon.testing.workers:train_megatron", 2,
                    dict(cfg=MOE, ep=ep, optimizer="dmuon", opt=OPT, steps=4), timeout=300)
    full = {}
    for r in res:
        full.update(r["params"])
    assert set(full) == set(ref["params"])
    assert any("local_experts.1." in n for n in full)
    worst = max((full[n] - ref["params"][n]).abs().max().item() for n in full)
    assert worst < ATOL, worst


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
    results = train(layout, opt=MATRIX, record_muon_collectives=True)
    assert_matches(merged_params(results), reference())
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
    assert max((full[n] - resumed[n]).abs().max().item() for n in full) < ATOL


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
    worst = max((full[n] - ref["params"][n]).abs().max().item() for n in full)
    assert worst < ATOL, worst
    # not TP-invariant: it is not the exact (whole-unit) update
    exact = reference()["params"]
    assert max((full[n] - exact[n]).abs().max().item() for n in full) > 100 * ATOL
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


def test_zero3_memory_per_rank_is_near_even_sharding():
    """Persistent parameter and gradient bytes per rank vs model bytes / DP (tiny model:
    a 4-layer GPT with a 128 x 64 embedding; the 12-layer figure is in the benchmark)."""
    for r in train("dp4", opt=ZERO3, ddp=ZERO3_DDP, record_muon_collectives=True):
        m = r["zero3"]["memory"]
        even = m["model_params"] / m["world"]
        assert m["params"] <= 1.15 * even, (m["params"], even)
        assert m["grads"] <= 1.15 * m["model_grads"] / m["world"]


def test_zero3_checkpoint_resumes_bitwise_and_reshards():
    d = tempfile.mkdtemp(prefix="zero3_ckpt_")
    full = merged_params(train("dp4", opt=ZERO3, ddp=ZERO3_DDP, steps=4,
                               checkpoint=dict(save=d, save_at=2)))
    same = merged_params(train("dp4", opt=ZERO3, ddp=ZERO3_DDP, steps=4,
                               checkpoint=dict(load=d)))
    for n in full:
        assert torch.equal(full[n], same[n]), n
    # to DP2 x TP2 under ZeRO-3, and to the default DMuon placement at DP4
    other = merged_params(train("tp2dp2", opt=ZERO3, ddp=ZERO3_DDP, steps=4,
                                checkpoint=dict(load=d)))
    plain = merged_params(train("dp4", steps=4, checkpoint=dict(load=d)))
    for resumed in (other, plain):
        assert max((full[n] - resumed[n]).abs().max().item() for n in full) < ATOL


def test_zero3_interleaved_pipeline_equals_reference():
    """PP2 x VPP2 x DP2: two model chunks per rank, each with its own ZeRO-3 buckets."""
    res = run_ranks("megatron_muon.testing.workers:train_megatron", 4,
                    dict(cfg={"num_microbatches": 2}, pp=2, vpp=2, optimizer="dmuon", opt=ZERO3,
                         steps=STEPS, ddp=ZERO3_DDP), timeout=300)
    assert_matches(merged_params(res), reference())


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
    worst = max((res[0]["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
    assert set(res[0]["params"]) == set(ref["params"]) and worst < ATOL, worst


def test_zero3_fp16_clip_and_found_inf_equal_zero1():
    """fp16 with a loss scaler: clipping forced at step 1 and an Inf at step 3 (skipped)
    give the same parameters as matrix placement under ZeRO-1 after every step."""
    common = dict(steps=4, inf_at_step=2, clip_at_steps=(1,), params_each_step=True,
                  cfg_extra={"fp16": True})
    z3 = train("tp2dp2", opt=dict(ZERO3, initial_loss_scale=1024.0), ddp=ZERO3_DDP, **common)
    z1 = train("tp2dp2", opt=dict(MATRIX, initial_loss_scale=1024.0), **common)
    assert z3[0]["updated"] == z1[0]["updated"] == [True, True, False, True]
    for r3, r1 in zip(z3, z1):
        for h3, h1 in zip(r3["history"], r1["history"]):
            assert max((h3[n] - h1[n]).abs().max().item() for n in h3) < 1e-6


@pytest.mark.parametrize("ddp,placement,lr,match", [
    (dict(overlap_grad_reduce=False), True, None, "overlap_grad_reduce=True"),
    (ZERO3_DDP, False, None, "matrix_placement_for"),
    # Megatron's NaN check runs on each bucket before its reduce-scatter (lr 1e30: NaN at step 2)
    (dict(ZERO3_DDP, check_for_nan_in_grad=True), True, 1e30, "found NaN in local grad norm"),
])
def test_zero3_clear_errors(ddp, placement, lr, match):
    from megatron_muon.testing.launch import RankFailure

    with pytest.raises(RankFailure, match=match):
        run_ranks("megatron_muon.testing.workers:train_megatron", 2,
                  dict(cfg={}, optimizer="dmuon", opt=dict(ZERO3, lr=lr or OPT["lr"]), steps=3,
                       ddp=ddp, matrix_placement=placement), timeout=120)
