"""ReLoRA merge-and-restart (megatron_muon/peft/relora.py, docs/relora.md).

Two launches of ``relora_run``: a TP2 run (2 gloo ranks) and its single-process TP1
reference, each training the tiny GPT's LoRA adapters for 3 steps with a restart after step 2:
``smuon`` (state reset to zero, embeddings / norms / output trained at full rank by
TrainableAdamW) and ``adam`` (state pruned by magnitude).  The TP2 run also saves its state
after step 1 and resumes it in a fresh model, across the merge.
"""

import math

import pytest
import torch

from megatron_muon.testing.launch import run_ranks

pytestmark = [pytest.mark.distributed]

CFG = dict(num_layers=2, num_microbatches=2)
RUNS = {
    "smuon": dict(optimizer="smuon", restart_every=2, reset="zero", dense=True),
    "adam": dict(optimizer="adam", restart_every=2, reset="prune", prune_ratio=0.5,
                 opt=dict(lr=3e-3)),
}
GAMMA = 8.0 / 4  # LORA alpha / rank in relora_workers
EPS32 = 2.0 ** -24  # unit roundoff of fp32


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("relora"))
    tp2 = run_ranks("megatron_muon.testing.relora_workers:relora_run", 2,
                    dict(cfg=CFG, tp=2, runs=RUNS, directory=d), timeout=240)
    tp1 = run_ranks("megatron_muon.testing.relora_workers:relora_run", 1,
                    dict(cfg=CFG, tp=1, runs=RUNS), timeout=240)[0]
    return tp2, tp1


def _max_rel(a: dict, b: dict, keys=None) -> float:
    worst = 0.0
    for k in (keys or b):
        x, y = a[k], b[k]
        assert x.shape == y.shape, k
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp(min=1e-30)))
    return worst


def _adapter_key(param_name: str) -> str:
    return param_name.rsplit(".lora.", 1)[0]


@pytest.mark.timeout(10)
def test_jagged_lr_and_bad_input():
    from megatron_muon.peft.relora import jagged_lr, prune_by_magnitude
    from megatron_muon.peft.resets import check_reset

    kw = dict(lr=1.0, min_lr=0.0, warmup=0, total=100, restart_every=10, restart_warmup=4)
    assert jagged_lr(0, **kw) == 1.0
    assert jagged_lr(9, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.09)))
    for s in range(4):  # re-warm-up after the restart at step 10: (s + 1) / 5 of the envelope
        env = 0.5 * (1 + math.cos(math.pi * (10 + s) / 100))
        assert jagged_lr(10 + s, **kw) == pytest.approx(env * (s + 1) / 5)
    assert jagged_lr(14, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.14)))
    t = torch.tensor([3.0, -1.0, 0.5, -4.0, 2.0, 1.0])
    prune_by_magnitude(t, 0.5)  # the 3 smallest |x| (0.5, 1, 1 -- the tie goes too) -> 0
    assert t.tolist() == [3.0, 0.0, 0.0, -4.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="reset must be one of"):
        check_reset("forget", 0.5)
    with pytest.raises(ValueError, match="prune ratio"):
        check_reset("prune", 1.5)


@pytest.mark.timeout(600)
def test_merge_equals_reference_and_restart_resets(runs):
    """At the first restart, on every TP2 rank: W0' = W0 + gamma B A (fp64 reference on the
    gathered full tensors), B' = 0, A' the TP1 run's redrawn A bit for bit, the model's outputs
    unchanged, and the adapter optimizer's state dropped (smuon) or pruned (adam)."""
    tp2, tp1 = runs
    for r in tp2:
        for name, rec in r["runs"].items():
            pre, post = rec["pre"], rec["post"]
            names = {_adapter_key(k) for k in pre["params"] if ".lora." in k}
            assert len(names) == 8 and rec["restarts"] == 1
            for key in names:
                A, B = pre["factors"][key]
                W = pre["params"][f"{key}.weight"]
                ref = W.double() + GAMMA * (B.double() @ A.double())
                got = post["params"][f"{key}.weight"].double()
                # fp32: a length-r dot product (r rounding errors) plus the add into W, each
                # at most EPS32 relative to the magnitudes summed: bound (r + 2) EPS32 (|W| +
                # gamma |B| |A|), elementwise
                bound = (4 + 2) * EPS32 * (W.double().abs()
                                           + GAMMA * (B.double().abs() @ A.double().abs()))
                assert bool(((got - ref).abs() <= bound + 1e-30).all()), (name, key)
                assert float((got - W.double()).abs().max()) > 1e-4  # the merge moved W
                A2, B2 = post["factors"][key]
                assert torch.equal(B2, torch.zeros_like(B2))
                assert torch.equal(A2, tp1["runs"][name]["post"]["factors"][key][0])
                assert not torch.equal(A2, A)
            # B' = 0: the merged model computes what the adapted one did (fp32 re-association
            # of W x + gamma B (A x): observed 1e-6 on losses of ~5)
            assert float((post["outputs"] - pre["outputs"]).abs().max()) < 1e-4
            if name == "smuon":
                assert post["state_len"] == 0
            else:
                for key, st in pre["state"].items():
                    for f in ("A", "B"):
                        for k in ("exp_avg", "exp_avg_sq"):
                            x = st[f][k].clone()
                            n = x.numel() // 2
                            thr = x.abs().reshape(-1).sort().values[n - 1]
                            x[x.abs() <= thr] = 0
                            assert torch.equal(post["state"][key][f][k], x), (key, f, k)
                            assert int((x != 0).sum()) <= x.numel() - n
                        assert torch.equal(post["state"][key][f]["step"], st[f]["step"])


@pytest.mark.timeout(600)
def test_steps_across_merge_equal_single_process(runs):
    """After 3 steps with a restart after step 2, the TP2 parameters (merged bases, adapters,
    full-rank parts) equal the single-process TP1 run's."""
    tp2, tp1 = runs
    for r in tp2:
        for name, rec in r["runs"].items():
            ref = tp1["runs"][name]
            # fp32 reductions in another order (TP partial sums): relative 1e-4 for the
            # Muon-type steps; AdamW's first steps are ~lr sign(g), so entries with tiny
            # gradients amplify the same noise (the bounds of test_lora.py's TP2 vs TP1)
            tol = 1e-3 if name == "adam" else 1e-4
            assert _max_rel(rec["final"], ref["final"]) < tol, name
            dp = rec["losses"]
            assert dp == pytest.approx(ref["losses"], abs=1e-5)
            lora_b = [k for k in ref["final"] if k.endswith(".lora.B")]
            assert max(float(ref["final"][k].abs().max()) for k in lora_b) > 0  # trained again


@pytest.mark.timeout(600)
def test_resume_across_merge_is_bitwise(runs):
    """State saved after step 1, loaded into a fresh model: steps 2-3 (the restart between
    them included) give bit for bit the uninterrupted run's losses and parameters."""
    tp2, _ = runs
    for r in tp2:
        for name, rec in r["runs"].items():
            assert rec["resumed_from"] == 1 and rec["resumed_restarts"] == 1
            assert rec["resumed_losses"] == rec["losses"][1:], name
            assert rec["resumed_final"].keys() == rec["final"].keys()
            for k, v in rec["final"].items():
                assert torch.equal(rec["resumed_final"][k], v), (name, k)
            assert "run = 'smuon'" in rec["meta_error"] or "run = 'adam'" in rec["meta_error"]


@pytest.mark.timeout(300)
def test_recipe_bad_flags_fail_fast():
    """examples/pretrain_relora.py rejects bad ReLoRA flags with one line, before any rank."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "pretrain_relora.py"
    for flags, message in ((["--relora-every", "0"], "--relora-every must be >= 1"),
                           (["--restart-warmup-iters", "60"], "must be below --relora-every")):
        p = subprocess.run([sys.executable, str(script), *flags], capture_output=True,
                           text=True, timeout=140)
        assert p.returncode == 2, p.stderr[-2000:]
        assert p.stderr.startswith("error: ") and message in p.stderr, p.stderr[-2000:]
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]


def test_compare_relora_table_pairs_seeds():
    """tools/compare_relora.py's table: the best LR per optimizer by mean held-out loss, and
    the paired per-seed differences against the leader's best LR."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "compare_relora", Path(__file__).resolve().parents[1] / "tools" / "compare_relora.py")
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)
    rec = lambda o, lr, s, h: dict(part="pretrain", optimizer=o, lr=lr, seed=s, heldout=h,  # noqa: E731
                                   opt_ms=1.0, train_s=1.0)
    rs = [rec("a", 0.1, 1, 2.0), rec("a", 0.1, 2, 3.0), rec("a", 0.2, 1, 2.5),
          rec("a", 0.2, 2, 3.5), rec("b", 0.1, 1, 2.25), rec("b", 0.1, 2, 3.75)]
    lines = cr.table(rs).splitlines()
    assert lines[-2] == "best LR per optimizer: a 0.1: 2.5000 +- 0.7071; b 0.1: 3.0000 +- 1.0607"
    # b - a per seed: +0.25, +0.75
    assert lines[-1] == ("paired, best LR minus a's best LR, per seed: "
                         "b +0.5000 +- 0.3536 [+0.2500, +0.7500] (2 seeds)")


def test_compare_relora_time_to_target():
    """tools/compare_relora.py's time-to-target table: the target is the worst optimizer's
    best mean final held-out loss; each optimizer at its best LR is timed to its first
    evaluation at or below it, summing the logged per-step times before that iteration."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "compare_relora", Path(__file__).resolve().parents[1] / "tools" / "compare_relora.py")
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)

    def rec(o, lr, s, curve, step=1.0, opt=0.25):
        return dict(part="pretrain", optimizer=o, lr=lr, seed=s, heldout=curve[-1][1],
                    opt_ms=1.0, train_s=1.0, curve=curve, step_s=[step] * 4,
                    step_opt_s=[opt] * 4)

    rs = [rec("a", 0.1, 1, [(0, 5.0), (2, 2.0), (4, 1.0)]),  # a's best: 1.0
          rec("a", 0.2, 1, [(0, 5.0), (2, 4.0), (4, 3.5)]),
          rec("b", 0.1, 1, [(0, 5.0), (2, 3.0), (4, 2.5)], step=2.0, opt=1.0)]  # worst best
    lines = cr.time_to_target(rs).splitlines()
    assert "target held-out loss 2.5000" in lines[1]
    # a reaches 2.5 at iteration 2 (2 steps of 1 s, 0.25 s optimizer each); b at 4
    assert lines[4] == "| a            | 0.1      |   1/1   |       2.0 |     2.0 |    0.50 |"
    assert lines[5] == "| b            | 0.1      |   1/1   |       4.0 |     8.0 |    4.00 |"
    assert cr.reach(rs[1], 2.5) is None
