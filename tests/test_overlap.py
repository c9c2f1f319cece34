"""DMuon overlap (speculative owner work during the backward pass) against the plain step.

Each layout trains the same fp16 GPT four times in one launch: DMuon with the overlap off,
with it on, and under MatrixFSDP placement with it on and off (Megatron's
overlap_grad_reduce, small buckets so that gathers start while the backward pass runs).
Step 1 forces clipping (tiny clip_grad: the speculation must be redone), step 3 injects an
Inf (found-inf: the step is skipped, the speculation dropped).
Those runs force the overlap on; the default policy ('auto': adaptive with PP, off without)
has its own tests at the end.
"""

import json
import os

import pytest
import torch

from megatron_muon.megatron.params import is_muon_matrix
from megatron_muon.testing.launch import run_ranks
from test_dmuon import ulp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

OPT = dict(muon_fp32_matmul_prec="highest", muon_nesterov=True, lr=2e-3, adam_eps=1e-5,
           initial_loss_scale=1024.0)
# name: (pp, world, microbatches per DP rank, vpp, layers).  pp2vpp2: the interleaved
# schedule; the DMuon speculation starts once every model chunk of the stage has finished
# its backward.  (It needs cpu_transformer_config's batch_p2p_comm=False on gloo.)
LAYOUTS = {"dp2": (1, 2, 2, None, 4), "pp2": (2, 2, 4, None, 4), "pp2dp2": (2, 4, 2, None, 4),
           "pp2vpp2": (2, 2, 4, 2, 4)}
STEPS, CLIP_AT, INF_AT = 5, (1,), 3


def run_pair(layout, trace_dir=None):
    pp, world, m, vpp, layers = LAYOUTS[layout]
    off = dict(opt={"dmuon_overlap": False})
    on = dict(opt={"dmuon_overlap": True}, trace_dir=trace_dir)
    matrix = dict(opt={"dmuon_overlap": True, "dmuon_placement": "matrix"})
    matrix_off = dict(opt={"dmuon_overlap": False, "dmuon_placement": "matrix"})
    return run_ranks("megatron_muon.testing.workers:train_variants", world,
                     dict(variants=[off, on, matrix, matrix_off],
                          cfg={"num_microbatches": m, "fp16": True, "num_layers": layers},
                          pp=pp, vpp=vpp,
                          optimizer="dmuon", opt=OPT, steps=STEPS, clip_at_steps=CLIP_AT,
                          inf_at_step=INF_AT, params_each_step=trace_dir is None,
                          ddp=dict(overlap_grad_reduce=True, overlap_param_gather=True,
                                   bucket_size=3000)),
                     timeout=420)


def merged(results, which, step=None):
    full = {}
    for r in results:
        res = r[which]
        if res["layout"]["dp"] == 0 and res["layout"]["tp"] == 0:
            full.update(res["history"][step] if step is not None else res["params"])
    return full


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlapped_dmuon_equals_plain_dmuon(layout, tmp_path):
    trace_dir = str(tmp_path) if layout == "pp2dp2" else None
    results = run_pair(layout, trace_dir)
    for r in results:
        off, on, matrix, matrix_off = r
        assert matrix["updated"] == on["updated"] == matrix_off["updated"]
        assert off["updated"] == on["updated"]
        assert on["updated"][INF_AT] is False and all(
            u for i, u in enumerate(on["updated"]) if i != INF_AT)
        ov = on["dmuon_stats"]["overlap"]
        # every step speculated; the clipped step redid the work, the Inf step dropped it
        assert ov == dict(speculated=STEPS, used=STEPS - 2, redone=1, dropped=1, skipped=0,
                          probes=0), ov
        assert off["dmuon_stats"]["overlap"] is None
        assert matrix_off["dmuon_stats"]["overlap"] is None
        # the overlap under matrix placement took the same path (a stale speculation used
        # at the clipped step, or one dropped too few, would show here or in the params)
        assert matrix["dmuon_stats"]["overlap"] == ov, matrix["dmuon_stats"]["overlap"]
        # a complete speculation holds U over the step's own flat buffer and the owners'
        # results, nothing else: they are scattered in the step (one extra buffer, the
        # owned units, beyond the plain step's)
        held = on["spec_held"]
        assert len(held) == STEPS - 1, held  # the Inf step's speculation is dropped
        assert all(h["flat"] == h["shard"] and h["owned"] == h["owned_numel"]
                   and not h["out"] for h in held), held
    # Per step, except with the trace: reading the parameters after every step forces the
    # param all-gather there, and the trace must show the deferred updates in the forward.
    steps = range(STEPS) if trace_dir is None else [None]
    for step in steps:
        a, b, c, d = (merged(results, i, step) for i in range(4))
        # the exactness rule, in either placement: the overlap changes no operation
        for plain, overlapped, what in ((a, b, "dmuon"), (d, c, "matrix")):
            worst = max((plain[n] - overlapped[n]).abs().max().item() for n in plain)
            assert worst <= 1e-6, (what, step, worst)
        # MatrixFSDP placement against the default placement.  Step 0 is bitwise by
        # construction: the same gradients (each DP reduction adds at most 2 terms, the
        # same in either order; the microbatches accumulate in the same order), NS of the
        # same units (another owner and batch: CPU bmm gives each matrix of a batch bitwise
        # its own result) and the same element-wise updates.  At the clipped step 1 the
        # gradient norm adds its per-parameter terms in another order (matrix placement
        # lays the buckets out differently): the clip factor, hence the fp32 main params,
        # may differ in the last bits, far below an fp16 ULP of the model copy, each of
        # whose elements is the main param rounded to the nearest fp16: within one ULP of
        # the other placement's (measured at PP2 x DP2 with the parameters read every step:
        # 79 elements one ULP apart, 3.1e-5 at most; the layouts checked per step here are
        # bitwise).  From step 2 on those weights change the forward pass and the runs
        # diverge by more than any ULP count (1.6e-4 after step 4, measured; see
        # test_dmuon.py's test_zero3_fp16_clip_and_found_inf_equal_zero1): matrix placement
        # with the overlap is held to its own placement without it (above), and the
        # placement to the reference in tests/test_dmuon.py.
        if step is not None and step <= 1:
            for n in a:
                one_ulp = 0.0 if step == 0 else ulp(torch.maximum(a[n].abs(), c[n].abs()), 10)
                assert bool(((a[n] - c[n]).abs() <= one_ulp).all()), ("matrix", step, n)
    if trace_dir is None:
        first, last = merged(results, 1, 0), merged(results, 1, STEPS - 1)
        moved = max((last[n] - first[n]).abs().max().item() for n in last
                    if is_muon_matrix(n, last[n]))
        assert moved > 1e-3
    if trace_dir:
        check_trace(trace_dir, world=LAYOUTS[layout][1])


# The adaptive policy ('auto' at PP2), its gate's verdict set to speculate and no probe
# window in the run (the verdict's timing is tested in test_overlap_gate.py): steps 0 and 2
# clip (redone: skip 1, then 2 steps), step 3 would clip too (skipped: the plain step
# clips), step 5 is clean (used).
AUTO_STEPS, AUTO_CLIP = 6, (0, 2, 3)


def test_auto_overlap_backs_off_and_equals_plain_dmuon():
    """dmuon_overlap='auto' at PP2 backs off after a redone speculation, and every step,
    speculated or skipped, is bitwise that of dmuon_overlap='off'."""
    pp, world, m, vpp, layers = LAYOUTS["pp2"]
    results = run_ranks("megatron_muon.testing.workers:train_variants", world,
                        dict(variants=[dict(opt={"dmuon_overlap": "off"}),
                                       dict(opt={"dmuon_overlap": "auto"})],
                             cfg={"num_microbatches": m, "fp16": True, "num_layers": layers},
                             pp=pp, vpp=vpp, optimizer="dmuon", opt=OPT, steps=AUTO_STEPS,
                             clip_at_steps=AUTO_CLIP, params_each_step=True,
                             overlap_gate=dict(first=100, verdict=True),
                             ddp=dict(overlap_grad_reduce=True, overlap_param_gather=True,
                                      bucket_size=3000)),
                        timeout=420)
    for off, auto in results:
        assert off["updated"] == auto["updated"] and all(auto["updated"])
        assert off["dmuon_stats"]["overlap"] is None
        ov = auto["dmuon_stats"]["overlap"]
        assert ov == dict(speculated=3, used=1, redone=2, dropped=0, skipped=3, probes=0), ov
    for step in range(AUTO_STEPS):
        a, b = (merged(results, i, step) for i in range(2))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a), step


def test_auto_overlap_is_off_without_pp():
    """DP only: 'auto' resolves to off (nothing hides the owner work), no speculation."""
    results = run_ranks("megatron_muon.testing.workers:train_variants", 2,
                        dict(variants=[dict(opt={"dmuon_overlap": "auto"})],
                             cfg={"num_microbatches": 2, "fp16": True, "num_layers": 2},
                             pp=1, optimizer="dmuon", opt=OPT, steps=1,
                             ddp=dict(overlap_grad_reduce=True, overlap_param_gather=True,
                                      bucket_size=3000)),
                        timeout=300)
    for (auto,) in results:
        assert auto["updated"] == [True]
        assert auto["dmuon_stats"]["overlap"] is None


def check_trace(trace_dir, world):
    files = sorted(os.listdir(trace_dir))
    assert files == [f"trace_rank{r}.json" for r in range(world)], files
    for f in files:
        events = json.load(open(os.path.join(trace_dir, f)))["traceEvents"]
        names = {e["name"] for e in events}
        for need in ("forward", "backward", "grad.reduce_scatter_launch", "dmuon.speculate",
                     "dmuon.ns", "dmuon.scatter", "dmuon.deferred_update", "param.gather_launch",
                     "optimizer.step"):
            assert need in names, (f, need)
        # the deferred updates land inside the next step's forward pass
        fwd = [e for e in events if e["name"] == "forward"]
        upd = [e for e in events if e["name"] == "dmuon.deferred_update"]
        assert any(b["ts"] <= u["ts"] and u["ts"] + u["dur"] <= b["ts"] + b["dur"]
                   for u in upd for b in fwd), f
        # On the first stage (ranks 0, 1: several Muon buckets), in every step but the first
        # (Megatron's first batch launches its reduce-scatters only after the backward
        # pass), some bucket's gather started inside a backward microbatch.
        if f not in ("trace_rank0.json", "trace_rank1.json"):
            continue
        steps = sorted((e for e in events if e["name"] == "optimizer.step"), key=lambda e: e["ts"])
        bwd = [e for e in events if e["name"] == "backward"]
        spec = [e for e in events if e["name"] == "dmuon.speculate"]
        lo = 0.0
        for st in steps:
            inside = [s for s in spec for b in bwd if lo <= b["ts"] <= s["ts"]
                      and s["ts"] + s["dur"] <= b["ts"] + b["dur"] <= st["ts"]]
            assert inside or lo == 0.0, (f, st["ts"])
            lo = st["ts"]


def test_gate_decides_the_same_on_every_rank_from_the_groups_maximum():
    """The 'auto' gate's probe window with real ranks and the real timing all-reduce: rank 0
    measures speculation faster (periods 1 vs 2), every other rank slower (3 vs 2).  Each
    rank alone would disagree; the group-maximised periods (spec 3, plain 2) give every rank
    the same verdict, no speculation, and every rank's step is still the plain step's.
    PP2 x DP2: the gate's group is a stage's DP x TP group (2 ranks), so rank 0's stage
    pairs a fast and a slow rank."""
    pp, world, m, vpp, layers = LAYOUTS["pp2dp2"]
    periods = {r: ((1.0, 2.0) if r == 0 else (3.0, 2.0)) for r in range(world)}
    gate = dict(first=0, every=4, run=2, periods=periods)  # steps 0-1 speculate, 2-3 plain
    results = run_ranks("megatron_muon.testing.workers:train_variants", world,
                        dict(variants=[dict(opt={"dmuon_overlap": "off"}),
                                       dict(opt={"dmuon_overlap": "auto"})],
                             cfg={"num_microbatches": m, "fp16": True, "num_layers": layers},
                             pp=pp, vpp=vpp, optimizer="dmuon", opt=OPT, steps=5,
                             overlap_gate=gate,
                             ddp=dict(overlap_grad_reduce=True, overlap_param_gather=True,
                                      bucket_size=3000)),
                        timeout=420)
    decisions = [auto["gate_decisions"] for _, auto in results]
    # one window, decided at its last step (3): the maxima over the group, on every rank
    assert decisions[0] == [[3, [3.0], [2.0], False]], decisions[0]
    assert all(d == decisions[0] for d in decisions), decisions
    for off, auto in results:
        assert auto["dmuon_stats"]["overlap"]["probes"] == 1
        assert off["params"].keys() == auto["params"].keys()
        assert all(torch.equal(off["params"][n], auto["params"][n]) for n in off["params"])


def test_overlap_with_bf16_gradients_equals_plain_dmuon():
    """bf16 parameters with ``grad_reduce_in_fp32=False``: the gradients the speculation
    reads and the ones the step reads are bf16 buffers (cast to fp32 on the way), and the
    step's bitwise comparison must still find them equal on clean steps (used) and the
    result must be the plain step's bit for bit, clipped step included."""
    pp, world, m, vpp, layers = LAYOUTS["pp2"]
    results = run_ranks("megatron_muon.testing.workers:train_variants", world,
                        dict(variants=[dict(opt={"dmuon_overlap": False}),
                                       dict(opt={"dmuon_overlap": True})],
                             cfg={"num_microbatches": m, "bf16": True, "num_layers": layers},
                             pp=pp, optimizer="dmuon", opt=OPT, steps=4, clip_at_steps=(1,),
                             params_each_step=True,
                             ddp=dict(overlap_grad_reduce=True, overlap_param_gather=True,
                                      bucket_size=3000, grad_reduce_in_fp32=False)),
                        timeout=420)
    for off, on in results:
        assert off["updated"] == on["updated"] == [True] * 4
        ov = on["dmuon_stats"]["overlap"]
        assert ov["used"] == 3 and ov["redone"] == 1, ov  # the clipped step is redone
    for step in range(4):
        a, b = (merged(results, i, step) for i in range(2))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), step
