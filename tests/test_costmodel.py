"""Cost model: formulas on cases small enough to check by hand, and the planner integration.

No process launches: everything here is arithmetic (the model is pure).
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_muon.core.newton_schulz import ns_flops

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the model is a tool, not part of the package

import cost_model_lib as cm  # noqa: E402

# One layer, hidden 64, ffn 256, 4 heads (MHA), vocab 128, RMSNorm: every count by hand.
# Muon: qkv 192x64 + proj 64x64 + fc1 256x64 + fc2 64x256 = 12288 + 4096 + 16384 + 16384
TINY = cm.ModelConfig(name="tiny", num_layers=1, hidden_size=64, ffn_hidden_size=256,
                      num_attention_heads=4, vocab_size=128, seq_length=16)
TINY_MUON = 49152
TINY_TOTAL = TINY_MUON + 2 * 128 * 64 + 3 * 64  # + embedding, output layer, 3 RMSNorms

# A hardware whose every cost is a single term: 1 TFLOP/s NS, 1 TB/s memory, 100 GB/s links,
# no latencies and no fixed overhead.
IDEAL = cm.Hardware(name="ideal", peak_flops=1e12, ns_efficiency=1.0, mem_bw=1e12,
                    mem_efficiency=1.0, memory_gib=80, intra_bw=1e11, intra_lat=0.0,
                    inter_bw=1e11, inter_lat=0.0, coll_base_lat=0.0, ring_efficiency=1.0,
                    a2a_efficiency=1.0, a2a_peer_lat=0.0, kernel_lat=0.0, step_overhead_s=0.0)
PLAIN = cm.RunConfig(global_batch=8, overlap_grad_reduce=False, overlap_param_gather=False,
                     main_copy_passes=0, grad_norm_calls=0, megatron_pad=False)


@pytest.mark.timeout(60)
def test_tiny_counts_by_hand():
    ts = cm.stage_tensors(TINY, cm.Layout(), PLAIN)
    assert sum(t.numel for t in ts if t.muon) == TINY_MUON
    assert sum(t.numel for t in ts) == TINY_TOTAL


@pytest.mark.timeout(60)
def test_naive_bytes_are_n_minus_1_over_n_of_p():
    assert cm.naive_exchange_bytes(1000, 4, 4) == 3000.0
    lay = cm.Layout(dp=4, gpus_per_node=8)
    p = cm.predict(TINY, lay, IDEAL, "muon_naive", PLAIN)
    # the busiest rank receives every Muon element it does not hold: P - (least held),
    # at least the (N-1)/N P of an even split
    ts = cm.stage_tensors(TINY, lay, PLAIN)
    z = cm.zero1_holdings(ts, 4, 1, PLAIN)
    held = [sum(e for t in ts if t.muon for g, e in z.pieces[t.name] if g == r) for r in range(4)]
    assert sum(held) == TINY_MUON
    assert p.muon_recv_bytes == pytest.approx(4 * (TINY_MUON - min(held)))
    assert p.muon_recv_bytes >= 3 / 4 * TINY_MUON * 4
    # every rank runs NS on every unit: Q, K, V (64x64 each), proj, fc1, fc2
    flops = 4 * ns_flops(64, 64, 5) + 2 * ns_flops(256, 64, 5)
    assert p.breakdown["ns"] == pytest.approx(flops / 1e12)


@pytest.mark.timeout(60)
def test_owner_bytes_even_spread_is_2_n_minus_1_over_n_squared():
    # 8 whole-matrix units of 1000 elements, each spread evenly (250 per rank) over 4 ranks,
    # owners 2 per rank: gather receives 3 x 250 per owned unit, scatter 250 per foreign one.
    n, units = 4, {f"u{i}": {r: 250 for r in range(4)} for i in range(8)}
    owners = {f"u{i}": i % 4 for i in range(8)}
    sent, recv = cm.exchange_elements(units, owners, n)
    assert recv == [3000] * 4 and sent == [3000] * 4
    assert cm.owner_exchange_bytes_even(8000, n, 1) == 3000.0  # 2 (N-1)/N^2 P


@pytest.mark.timeout(60)
def test_owner_bytes_zero_when_owner_holds_its_units():
    units = {"a": {0: 100}, "b": {1: 50}, "c": {0: 10, 1: 30}}
    sent, recv = cm.exchange_elements(units, {"a": 0, "b": 1, "c": 1}, 2)
    assert sent == [10, 10] and recv == [10, 10]  # only c's 10 elements on rank 0 move, twice


@pytest.mark.timeout(60)
def test_ns_flops_per_rank_is_one_over_n():
    # hidden 64, ffn 64, 1 head: Q, K, V, proj, fc1, fc2 are all 64x64: 24 equal units in 4
    # layers, 6 per rank on 4 ranks; the naive mode runs all 24 everywhere.
    m = cm.ModelConfig(name="square", num_layers=4, hidden_size=64, ffn_hidden_size=64,
                       num_attention_heads=1, vocab_size=64, seq_length=8)
    lay = cm.Layout(dp=4)
    dm = cm.predict(m, lay, IDEAL, "dmuon", PLAIN)
    nv = cm.predict(m, lay, IDEAL, "muon_naive", PLAIN)
    one = ns_flops(64, 64, 5) / 1e12
    assert nv.breakdown["ns"] == pytest.approx(24 * one)
    assert dm.breakdown["ns"] == pytest.approx(6 * one)
    assert dm.imbalance == pytest.approx(0.0)


@pytest.mark.timeout(60)
def test_adamw_time_from_bandwidth():
    lay = cm.Layout(dp=4)
    p = cm.predict(TINY, lay, IDEAL, "adamw", PLAIN)
    shard = TINY_TOTAL / 4
    assert p.breakdown["elementwise"] == pytest.approx(shard * cm.ADAM_BYTES_PER_ELEM / 1e12)
    # ring all-gather of the bf16 params: each rank receives 3/4 of them at 100 GB/s
    assert p.breakdown["param_gather"] == pytest.approx(3 / 4 * TINY_TOTAL * 2 / 1e11)
    assert p.opt_s == pytest.approx(p.breakdown["elementwise"] + p.breakdown["param_gather"])
    # nothing overlaps in PLAIN, so the whole step is exposed
    assert p.exposed_s == pytest.approx(p.opt_s)
    assert p.state_bytes == pytest.approx(8 * shard)


@pytest.mark.timeout(60)
def test_collective_times_by_hand():
    g_intra = cm.Group(8, 1, 8)
    g_inter = cm.Group(16, 1, 8)
    hw = replace(IDEAL, inter_bw=1e10, coll_base_lat=1e-5, intra_lat=1e-6, inter_lat=5e-6)
    assert cm.collective_time(hw, "all_gather", g_intra, 1e9) == pytest.approx(1e-5 + 7e-6 + 1e-2)
    # two nodes: 7 NVLink hops + log2(2) = 1 IB hop; the ring runs at the IB speed
    assert cm.collective_time(hw, "all_gather", g_inter, 1e9) == pytest.approx(
        1e-5 + 7e-6 + 5e-6 + 1e-1)
    # all-to-all over 2 nodes: 8 of 15 peers remote -> 8/15 of the bytes over IB
    t = cm.collective_time(hw, "all_to_all", g_inter, 15e8)
    assert t == pytest.approx(1e-5 + max(7e8 / 1e11, 8e8 / 1e10))
    assert cm.collective_time(hw, "all_gather", cm.Group(1, 1, 8), 1e9) == 0.0


@pytest.mark.timeout(60)
def test_units_follow_megatron_and_the_design():
    gqa = cm.ModelConfig(name="gqa", num_layers=2, hidden_size=256, ffn_hidden_size=512,
                         num_attention_heads=8, num_query_groups=2, vocab_size=64, swiglu=True,
                         num_experts=4, moe_ffn_hidden_size=128, first_dense_layers=1)
    ts = {t.name: t for t in cm.stage_tensors(gqa, cm.Layout(dp=4, ep=2))}
    qkv = ts["layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (256 + 2 * 64, 256)
    assert [u for _, u in qkv.units] == [(256, 256), (64, 256), (64, 256)]  # Q, K, V
    assert [u for _, u in ts["layers.0.mlp.linear_fc1.weight"].units] == [(1024, 256)]
    experts = [t for t in ts.values() if t.expert]
    assert len(experts) == 2 * 2  # layer 1 only (layer 0 dense), 4 experts / EP 2, fc1 + fc2
    assert all(len(t.units) == 1 for t in experts)  # one unit per expert matrix
    assert ts["layers.1.mlp.router.weight"].muon and ts["layers.1.mlp.router.weight"].tp_dim is None
    split = cm.stage_tensors(gqa, cm.Layout(), replace(PLAIN, split_fc1=True))
    fc1 = [t for t in split if t.name == "layers.0.mlp.linear_fc1.weight"][0]
    assert [u for _, u in fc1.units] == [(512, 256), (512, 256)]  # gate, up


@pytest.mark.timeout(60)
def test_dmuon_plan_comes_from_the_real_planner_on_the_real_geometry():
    """The cost model's DMuon plan is ``dmuon.plan_matrices`` on ``geometry``'s matrices of
    Megatron's parameter list (what DMuonDistributedOptimizer builds, tests/test_geometry.py),
    and its exchange counts what the matrices' pieces must move under that plan."""
    from megatron_muon.megatron.config import DMuonOptimizerConfig
    from megatron_muon.megatron.dmuon import plan_matrices
    from megatron_muon.megatron.geometry import dmuon_part, stage_matrices
    from megatron_muon.core.plan import flops_cost

    m = cm.MODELS["bench-tiny"]
    for lay, run in ((cm.Layout(dp=4), PLAIN), (cm.Layout(tp=2, dp=3), PLAIN),
                     (cm.Layout(dp=8), replace(PLAIN, locality=False))):
        p = cm.predict(m, lay, IDEAL, "dmuon", run)
        part = dmuon_part([cm.megatron_params(m, lay, run)], dp_size=lay.dp, bucket_size=None,
                          pad=run.megatron_pad)
        cfg = DMuonOptimizerConfig(optimizer="dmuon", lr=1e-3, use_distributed_optimizer=True,
                                   bf16=True, muon_num_ns_steps=run.ns_steps,
                                   dmuon_locality_slack=run.locality_slack)
        mats = stage_matrices(part, tp_size=lay.tp, model_config=cm.model_namespace(m), cfg=cfg,
                              real_tp_size=lay.tp)
        assert sum(len(x.units) for x in mats) == 4 * 6  # Q, K, V, proj, fc1, fc2 per layer
        for x in mats:  # every element held once as a gather source, TP shards included
            assert sum(q.end - q.start for q in x.pieces if q.source) == x.shape[0] * x.shape[1]
        plan = plan_matrices(mats, lay.tp * lay.dp, cfg, flops_cost(run.ns_steps),
                             replicate=not run.locality)
        assert p.imbalance == pytest.approx(plan.imbalance)
        ex = cm.matrix_exchange(mats, plan, cm.Group(lay.tp * lay.dp, 1, 8))
        _, _, allreduce = cm.split_allreduce(plan, cm.Group(lay.tp * lay.dp, 1, 8), IDEAL,
                                             run.ns_steps)
        assert p.muon_recv_bytes == pytest.approx(max(4 * r + b for r, b in zip(ex.recv, allreduce)))
        assert sum(ex.sent) == sum(ex.recv)


@pytest.mark.timeout(60)
def test_locality_aware_plan_moves_less_than_the_even_bound():
    m = cm.MODELS["bench-tiny"]
    run = replace(PLAIN, megatron_pad=True)
    muon = sum(t.numel for t in cm.stage_tensors(m, cm.Layout()) if t.muon)
    loc = cm.predict(m, cm.Layout(dp=4), IDEAL, "dmuon", run)
    lpt = cm.predict(m, cm.Layout(dp=4), IDEAL, "dmuon", replace(run, locality=False))
    bound = cm.owner_exchange_bytes_even(muon, 4, 4)
    assert loc.muon_recv_bytes < lpt.muon_recv_bytes <= 1.5 * bound
    assert loc.muon_recv_bytes < 0.5 * bound  # DP shards hold whole matrices under ZeRO-1


@pytest.mark.timeout(60)
def test_zero1_layout_follows_megatron_buffer():
    # reverse order, 64-element start padding, bucket padded to lcm(DP, 128), DP equal shards
    a = cm.StageTensor("a", (100,), None, False, False)
    b = cm.StageTensor("b", (10, 10), 0, False, True, (("b#0", (10, 10)),))
    ts = [a, b]
    z = cm.zero1_holdings(ts, 2, 1, cm.RunConfig())
    assert z.buckets == [(0, 256)]  # b at [0, 100), a at [128, 228) -> padded to 256
    assert z.pieces["b"] == [(0, 100)] and z.pieces["a"] == [(1, 100)]


@pytest.mark.timeout(60)
def test_peers_spread_ns_over_tp_ranks():
    """Megatron's TP mode 'layer_sharded' and Canzona's TP micro-groups run each owned
    matrix's NS on one TP rank: at TP2 x DP2 the busiest rank runs half of what
    mcore_layerwise / matrix_zero1 run on every TP rank (12 of 24 64x64 units -> 6), and the
    TP exchange is two all-to-alls of half the owner's local Muon elements instead of one
    all-gather of them; at TP1 they are mcore_layerwise / matrix_zero1."""
    m = cm.ModelConfig(name="square", num_layers=4, hidden_size=64, ffn_hidden_size=64,
                       num_attention_heads=2, vocab_size=64, seq_length=8)
    one = ns_flops(64, 64, 5) / 1e12
    for peer, base in (("mcore_layer_sharded", "mcore_layerwise"), ("canzona", "matrix_zero1")):
        tp2 = cm.predict(m, cm.Layout(tp=2, dp=2), IDEAL, peer, PLAIN)
        ref = cm.predict(m, cm.Layout(tp=2, dp=2), IDEAL, base, PLAIN)
        assert ref.breakdown["ns"] == pytest.approx(12 * one), base
        assert tp2.breakdown["ns"] == pytest.approx(6 * one), peer
        assert tp2.muon_recv_bytes == pytest.approx(ref.muon_recv_bytes), peer  # 2 x half = all
        tp1 = cm.predict(m, cm.Layout(tp=1, dp=2), IDEAL, peer, PLAIN)
        assert tp1.opt_s == pytest.approx(cm.predict(m, cm.Layout(tp=1, dp=2), IDEAL, base,
                                                     PLAIN).opt_s), peer


@pytest.mark.timeout(60)
def test_mcore_duplicates_ns_on_tp_ranks_and_dmuon_divides_it():
    # 2 heads (TP2 needs heads and query groups divisible by TP, as Megatron does): Q, K, V,
    # proj, fc1, fc2 are still all 64x64
    m = cm.ModelConfig(name="square", num_layers=4, hidden_size=64, ffn_hidden_size=64,
                       num_attention_heads=2, vocab_size=64, seq_length=8)
    one = ns_flops(64, 64, 5) / 1e12
    tp1 = cm.predict(m, cm.Layout(tp=1, dp=2), IDEAL, "mcore_layerwise", PLAIN)
    tp2 = cm.predict(m, cm.Layout(tp=2, dp=2), IDEAL, "mcore_layerwise", PLAIN)
    # per layer: qkv (3 units), proj, fc1, fc2 = 4 params dealt over 2 DP ranks
    assert tp1.breakdown["ns"] == pytest.approx(tp2.breakdown["ns"])
    assert tp2.breakdown["ns"] == pytest.approx(12 * one)  # half of 24 units, not a quarter
    dm = cm.predict(m, cm.Layout(tp=2, dp=2), IDEAL, "dmuon", PLAIN)
    assert dm.breakdown["ns"] == pytest.approx(6 * one)  # 24 units over DP x TP = 4 ranks


@pytest.mark.timeout(60)
def test_pingpong_matches_megatron_core_docstring():
    # LayerWiseDistributedOptimizer.shard_params: sorted p0..p9 on 4 ranks ->
    # [[p0, p7, p8], [p1, p6, p9], [p2, p5], [p3, p4]]
    own = cm.pingpong_owners([(f"p{i}", i) for i in range(10)], 4)
    ranks = [[k for k, r in own.items() if r == q] for q in range(4)]
    assert ranks == [["p0", "p7", "p8"], ["p1", "p6", "p9"], ["p2", "p5"], ["p3", "p4"]]


@pytest.mark.timeout(60)
def test_matrix_placement_has_no_muon_exchange():
    lay = cm.Layout(dp=4)
    for mode in ("matrix_zero1", "matrix_zero3"):
        p = cm.predict(cm.MODELS["bench-tiny"], lay, IDEAL, mode, PLAIN)
        assert p.muon_recv_bytes == 0 and p.breakdown["muon_comm"] == 0
    z3 = cm.predict(cm.MODELS["bench-tiny"], lay, IDEAL, "matrix_zero3", PLAIN)
    z1 = cm.predict(cm.MODELS["bench-tiny"], lay, IDEAL, "matrix_zero1", PLAIN)
    assert z3.memory_bytes < z1.memory_bytes and z3.breakdown["param_gather"] == 0


@pytest.mark.timeout(60)
def test_water_fill():
    assert cm.water_fill([1, 5, 2], 4) == [3.5, 5, 3.5]
    assert cm.water_fill([0, 0], 3) == [1.5, 1.5]


@pytest.mark.timeout(60)
def test_overlap_exposes_at_least_the_last_bucket():
    assert cm._hidden(10.0, 100.0, 5) == pytest.approx(2.0)  # only the last bucket's share
    assert cm._hidden(10.0, 3.0, 5) == pytest.approx(7.0)  # the window is too short
    m, lay = cm.MODELS["llama3-8b"], cm.Layout(dp=64)
    run = cm.RunConfig()
    hw = cm.HARDWARE["H100"]
    dm = cm.predict(m, lay, hw, "dmuon", run)
    ov = cm.predict(m, lay, hw, "dmuon_overlap", run)
    assert ov.opt_s == pytest.approx(dm.opt_s)  # same work ...
    assert ov.exposed_s < dm.exposed_s  # ... less of it on the critical path
    none = cm.predict(m, lay, hw, "dmuon_overlap", replace(run, overlap_efficiency=0.0))
    assert none.exposed_s == pytest.approx(dm.exposed_s)


@pytest.mark.timeout(60)
def test_overlap_policy_and_clip_rate():
    """'on' pays the owner work W again on every clipped step; 'off' and 'auto' without PP
    are the plain step; 'auto' with PP keeps the cheaper mode plus its probe share, the
    probe schedule being SpeculationGate's."""
    import inspect

    from megatron_muon.megatron.overlap import SpeculationGate

    defaults = inspect.signature(SpeculationGate).parameters
    assert (cm.PROBE_RUN, cm.PROBE_EVERY) == (defaults["run"].default, defaults["every"].default)
    share = cm.PROBE_RUN / cm.PROBE_EVERY

    def exposed(policy, clip, pp, work=10.0, hidden=2.0):
        run = replace(PLAIN, overlap_policy=policy, clip_rate=clip)
        return cm.overlap_exposed(work, hidden, run, pp)

    assert exposed("on", 0.0, 1) == (2.0, "on")
    assert exposed("on", 1.0, 1) == (12.0, "on")  # NS twice on a clipped step
    assert exposed("on", 0.25, 1) == (4.5, "on")
    assert exposed("off", 0.0, 2) == (10.0, "off") and exposed("auto", 0.0, 1) == (10.0, "off")
    # measured: the cheaper mode, plus the other one in the probe windows
    assert exposed("auto", 0.0, 2) == (pytest.approx(2.0 + share * 8.0), "measured")
    assert exposed("auto", 1.0, 2) == (pytest.approx(10.0 + share * 2.0), "measured")
    with pytest.raises(ValueError, match="overlap_policy must be"):
        exposed("sometimes", 0.0, 1)
    with pytest.raises(ValueError, match="clip_rate"):
        exposed("on", 1.5, 1)
    # a used speculation still scatters its results in the step
    assert cm.overlap_exposed(10.0, 2.0, replace(PLAIN, overlap_policy="on", clip_rate=0.25),
                              1, in_step=1.0) == (pytest.approx(2.0 + 0.75 + 2.5), "on")
    # predict() charges it: on the tiny model a clipped step adds the owner work W less the
    # scatter a used step pays anyway (half the exchange)
    lay = cm.Layout(dp=4)
    dm = cm.predict(TINY, lay, IDEAL, "dmuon", PLAIN)
    work = sum(dm.breakdown[k] for k in ("muon_comm", "ns", "owned"))
    on = [cm.predict(TINY, lay, IDEAL, "dmuon_overlap", replace(PLAIN, clip_rate=c)).exposed_s
          for c in (0.0, 1.0)]
    assert work > 0 and on[1] == pytest.approx(on[0] + work - dm.breakdown["muon_comm"] / 2)
    off = cm.predict(TINY, lay, IDEAL, "dmuon_overlap", replace(PLAIN, overlap_policy="auto"))
    assert off.exposed_s == pytest.approx(dm.exposed_s)


@pytest.mark.timeout(60)
def test_cpu_profile_roundtrip(tmp_path):
    prof = dict(ns_rate_points=[[128, 1e10], [384, 2e10]], collectives={
        "all_to_all": [5e8, 1e-3], "all_gather": [2e8, 1e-3], "all_reduce": [5e8, 2e-3]},
        adam_s_per_elem=1e-8, muon_s_per_elem=2e-8, owned_s_per_elem=1e-8,
        copy_s_per_elem=1e-9, nproc=4)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    hw = cm.load_cpu_profile(str(path))
    assert hw.ns_rate(128) == 1e10 and hw.ns_rate(384) == 2e10
    assert 1e10 < hw.ns_rate(256) < 2e10  # log-interpolated
    assert hw.adam_time(100) == pytest.approx(1e-6)
    g = cm.Group(4, 1, 4)
    assert cm.collective_time(hw, "all_gather", g, 2e8) == pytest.approx(1.001)


@pytest.mark.timeout(60)
def test_cli_prints_a_sweep(capsys):
    import cost_model

    assert cost_model.main(["--model", "bench-tiny", "--gpus", "8,16",
                            "--modes", "adamw,dmuon,matrix_zero1"]) == 0
    out = capsys.readouterr().out
    assert out.count("dmuon") >= 2 and "matrix_zero1" in out
    assert cost_model.parse_gpus("8-64") == [8, 16, 32, 64]
