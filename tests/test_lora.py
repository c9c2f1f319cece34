"""LoRA for Megatron's parallel linear layers (docs/design.md#smuon-and-lora): TP layouts, merge, checkpoints, errors.

Three launches: a TP2 x DP2 run (gloo, 4 ranks) that trains adapters with sMuon (distributed and
replicated direction work, with and without sequence parallelism), AdamW, per-factor Muon and
Riemannion (distributed and replicated) and saves an adapter checkpoint and a full-model dist_checkpointing checkpoint; a PP2 run
(2 ranks) that trains with sMuon and saves an adapter checkpoint; then one TP1 process that
trains the same adapters on the same data, checks B = 0 / merge / unmerge, loads the TP2
and PP2 checkpoints, and collects error messages.  The tiny GPT uses SwiGLU, so the gated fc1 layout ([gate_t; up_t] shards) is
exercised.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_muon.peft.lora import LoRAConfig
from megatron_muon.testing.launch import run_ranks

pytestmark = [pytest.mark.distributed]

CFG = dict(swiglu=True, num_microbatches=4)  # per DP rank; the TP2 x DP2 run takes 2
STEPS = 4
RUNS_TP1 = {
    "smuon": {},
    "adam": {"optimizer": "adam", "opt": {"lr": 3e-3}},
    "muon_factors": {"optimizer": "muon_factors"},
    "riemannion": {"optimizer": "riemannion"},
}
RUNS_TP2 = {
    **RUNS_TP1,
    "smuon_replicate": {"okw": {"smuon_work": "replicate"}},
    "smuon_tp_dp": {"okw": {"work_group": "tp_dp"}},  # owners spread over TP x DP
    "smuon_sp": {"cfg_extra": {"sequence_parallel": True}},
    "riemannion_replicate": {"optimizer": "riemannion", "okw": {"smuon_work": "replicate"}},
}
N_ADAPTERS = 16  # 4 layers x (qkv, proj, fc1, fc2)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora_ckpt"))


@pytest.fixture(scope="module")
def tp2(ckpt_dir):
    return run_ranks("megatron_muon.testing.lora_workers:lora_train", 4,
                     dict(cfg={**CFG, "num_microbatches": 2}, tp=2, steps=STEPS, runs=RUNS_TP2,
                          save=ckpt_dir), timeout=240)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("lora_pp2"))
    return save, run_ranks("megatron_muon.testing.lora_workers:lora_train", 2,
                           dict(cfg=CFG, tp=1, pp=2, steps=STEPS, runs={"smuon": {}}, save=save),
                           timeout=240)


@pytest.fixture(scope="module")
def tp1(tp2, pp2, ckpt_dir):
    return run_ranks("megatron_muon.testing.lora_workers:lora_tp1_checks", 1,
                     dict(cfg=CFG, tp2_checkpoint=ckpt_dir, steps=STEPS, runs=RUNS_TP1,
                          pp2_checkpoint=pp2[0]), timeout=240)[0]


def _max_rel(a: dict, b: dict) -> float:
    """max over adapters and factors of max|a - b| / max|b|."""
    assert set(a) == set(b)
    worst = 0.0
    for k in a:
        for x, y in zip(a[k], b[k]):
            assert x.shape == y.shape, (k, x.shape, y.shape)
            worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp(min=1e-30)))
    return worst


@pytest.mark.timeout(10)
def test_config_validation():
    assert LoRAConfig(rank=4, alpha=8).gamma == 2.0
    assert LoRAConfig(targets="qkv, fc2").targets == ["qkv", "fc2"]
    for bad in (dict(rank=0), dict(rank=-2), dict(rank=2.5), dict(alpha=0), dict(targets=[]),
                dict(init="xavier"), dict(targets=[""])):
        with pytest.raises(ValueError):
            LoRAConfig(**bad)


@pytest.mark.timeout(300)
def test_b_zero_forward_equals_base(tp1):
    assert tp1["b0_max_diff"] == 0.0  # B = 0: the adapted model is exactly the base model
    assert tp1["disabled_max_diff"] == 0.0  # lora_disabled() runs the base model
    assert tp1["lora_vs_base_diff"] > 1e-3  # ... and a nonzero B does change the outputs
    assert tp1["moe_b0_diff"] == 0.0


@pytest.mark.timeout(300)
def test_merge_unmerge_round_trip(tp1):
    assert tp1["merged_count"] == N_ADAPTERS and tp1["merge_again"] == 0
    assert tp1["merged_weight_change"] > 1e-3
    assert tp1["merged_max_diff"] < 1e-5  # merged W0 + gamma B A gives the adapter outputs
    assert tp1["unmerged_count"] == N_ADAPTERS
    assert tp1["unmerge_weight_diff"] < 1e-6  # W0 back (fp32 rounding)
    assert tp1["unmerged_max_diff"] < 1e-5
    assert "unmerge the adapter before loading" in tp1["load_while_merged"]


def _invariants(run: dict) -> tuple[dict, dict]:
    """What Riemannion defines: per adapter the product B A (the factors themselves are an
    SVD gauge, unique only up to a rotation among near-equal singular values: after the
    first step from B = 0 all r are equal), and the last step's gradient terms G_B A and
    B G_A at the factors it was taken at (unchanged by a rotation B Q, Q^T A)."""
    prods = {k: (B @ A,) for k, (A, B) in run["factors"].items()}
    grads = {k: (gB @ run["pre_factors"][k][0], run["pre_factors"][k][1] @ gA)
             for k, (gA, gB) in run["grads"].items()}
    return prods, grads


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", ["smuon", "smuon_sp", "adam", "muon_factors", "riemannion"])
def test_tp2_matches_tp1(tp1, tp2, run):
    """Same data, same init: the TP2 adapters (gathered) equal the TP1 ones after 4 steps."""
    ref = tp1["runs"]["smuon" if run == "smuon_sp" else run]
    for rank_result in tp2:  # every TP and DP rank holds the same full adapters
        got = rank_result["runs"][run]
        assert len(got["factors"]) == N_ADAPTERS
        if run == "riemannion":  # compare what the optimizer defines (see _invariants)
            (p_got, g_got), (p_ref, g_ref) = _invariants(got), _invariants(ref)
            assert _max_rel(g_got, g_ref) < 1e-4
            assert _max_rel(p_got, p_ref) < 1e-4
        else:
            # gradients first: the normalised optimizers would hide a wrong gradient scale
            assert _max_rel(got["grads"], ref["grads"]) < 1e-4  # observed 1.4e-5 (adam)
            # AdamW's first steps are ~lr * sign(g): entries with tiny gradients amplify the
            # fp32 summation-order noise (observed 9e-5 for adam, 3e-6 for the Muon ones)
            assert _max_rel(got["factors"], ref["factors"]) < (1e-3 if run == "adam" else 1e-4)
        assert float((got["outputs"] - ref["outputs"]).abs().max()) < 1e-5
    # each DP rank reports the loss of its half of the global batch
    dp = [r["runs"][run]["losses"] for r in tp2 if r["layout"]["tp"] == 0]
    mean = [sum(step) / len(step) for step in zip(*dp)]
    assert mean == pytest.approx(ref["losses"], abs=1e-5)
    b = ref["factors"]["decoder.layers.0.mlp.linear_fc1"][1]
    assert float(b.abs().max()) > 1e-3  # the adapters did move


@pytest.mark.timeout(300)
def test_distributed_smuon_equals_replicated(tp2):
    """Owners over TP, owners over TP x DP and replicated work: bitwise the same update
    (sMuon, and Riemannion, whose owners send the new factors and momentum state)."""
    for r in tp2:
        for name, replicate in (("smuon", "smuon_replicate"), ("smuon_tp_dp", "smuon_replicate"),
                                ("riemannion", "riemannion_replicate")):
            repl = r["runs"][replicate]
            run = r["runs"][name]
            for k in run["factors"]:
                for x, y in zip(run["factors"][k], repl["factors"][k]):
                    assert torch.equal(x, y), (name, k)
            # and every rank holds the replicated optimizer state (non-owners included)
            assert run["inner_state"].keys() == repl["inner_state"].keys()
            for k, st in run["inner_state"].items():
                for key, t in st.items():
                    assert torch.equal(t, repl["inner_state"][k][key]), (name, k, key)
            assert "exchange_s" in run["timing"]
            assert "exchange_s" not in repl["timing"]


@pytest.mark.timeout(300)
def test_adapter_checkpoint_tp2_loads_at_tp1(tp1, tp2):
    assert tp1["ckpt_loaded"] == N_ADAPTERS
    diff = float((tp1["ckpt_outputs"] - tp2[0]["saved_outputs"]).abs().max())
    assert diff < 1e-5, diff


@pytest.mark.timeout(300)
def test_base_weights_unchanged_after_training(tp1, tp2):
    for runs in [tp1["runs"]] + [r["runs"] for r in tp2]:
        for name, run in runs.items():
            assert run["n_base"] > 20 and run["base_unchanged"], name


@pytest.mark.timeout(300)
def test_tp_attributes(tp2):
    attrs, sp = tp2[0]["runs"]["smuon"]["attrs"], tp2[0]["runs"]["smuon_sp"]["attrs"]
    for name, a in attrs.items():
        column = name.endswith(("linear_qkv", "linear_fc1"))
        sharded, replicated = ("B", "A") if column else ("A", "B")
        assert a[sharded]["tp"] and a[sharded]["dim"] == (0 if column else 1)
        assert not a[replicated]["tp"]
        assert a["A"]["requires_grad"] and a["B"]["requires_grad"]
        assert not a[replicated]["sp"] and sp[name][replicated]["sp"]  # SP: partial grads
        assert not sp[name][sharded]["sp"]
    qkv = attrs["decoder.layers.0.self_attention.linear_qkv"]
    assert qkv["B"]["shape"][1] == qkv["A"]["shape"][0] == 4


@pytest.mark.timeout(300)
def test_bad_input_errors(tp1):
    e = tp1["errors"]
    assert "unknown LoRA target 'attention_out'" in e["unknown_target"]
    assert "not a linear layer" in e["not_linear"] and "input_layernorm" in e["not_linear"]
    assert "not a linear layer" in e["not_linear_core"]
    assert "rank must be >= 1" in e["rank0"]
    assert "larger than min(m, n)" in e["rank_too_big"]
    assert "alpha" in e["alpha"]
    assert "no expert linear layers" in e["experts_dense"]
    assert tp1["qkv_plus_experts_dense"] == 4  # "experts if present": skipped in a dense model
    assert "already has a LoRA adapter" in e["twice"]
    assert "before wrapping" in e["after_ddp"]
    assert "unknown LoRA optimizer" in e["bad_optimizer"]
    assert e["load_missing"].startswith("FileNotFoundError")


@pytest.mark.timeout(300)
def test_moe_expert_targets(tp1):
    names = tp1["moe_names"]
    assert len(names) == 2 * 2 * 2  # layers x experts x (fc1, fc2)
    assert "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2" in names
    assert not any(n.endswith(("linear_qkv", "linear_proj")) for n in names)
    assert math.isfinite(tp1["moe_b0_diff"])


@pytest.mark.timeout(300)
def test_pp2_matches_tp1(tp1, pp2):
    """Pipeline stages name layers globally; the two stages' adapters are the TP1 ones."""
    _, results = pp2
    factors = {}
    for r in results:
        assert not set(factors) & set(r["runs"]["smuon"]["factors"])  # disjoint stages
        factors.update(r["runs"]["smuon"]["factors"])
    ref = tp1["runs"]["smuon"]
    assert _max_rel(factors, ref["factors"]) < 1e-4
    last = [r for r in results if r["layout"]["pp"] == 1][0]["runs"]["smuon"]
    assert last["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert tp1["pp2_ckpt_loaded"] == N_ADAPTERS  # its adapter file has both stages
    assert float((tp1["pp2_ckpt_outputs"] - ref["outputs"]).abs().max()) < 1e-5


@pytest.mark.timeout(300)
def test_full_dist_checkpoint_with_adapters_tp2_to_tp1(tp1, tp2):
    """The layers' sharded_state_dict shards the adapters like their base weights (gated fc1
    included), so a full dist_checkpointing checkpoint at TP2 loads at TP1."""
    saved = tp2[0]["runs"]["smuon"]["factors"]
    for k, (A, B) in tp1["full_ckpt_factors"].items():
        assert torch.equal(A, saved[k][0]) and torch.equal(B, saved[k][1]), k
    assert set(tp1["full_ckpt_factors"]) == set(saved)
    assert float((tp1["full_ckpt_outputs"] - tp2[0]["saved_outputs"]).abs().max()) < 1e-5


@pytest.mark.timeout(60)
def test_recipe_bad_flags_fail_fast():
    """examples/finetune_lora.py rejects bad LoRA flags before starting anything."""
    script = Path(__file__).resolve().parents[1] / "examples" / "finetune_lora.py"
    for flags, message in ((["--lora-rank", "0"], "LoRA rank must be >= 1"),
                           (["--lora-alpha", "-1"], "LoRA alpha must be a finite number > 0"),
                           (["--optimizer", "sgd"], "invalid choice")):
        p = subprocess.run([sys.executable, str(script), *flags], capture_output=True,
                           text=True, timeout=50)
        assert p.returncode == 2, p.stderr[-2000:]
        assert p.stderr.startswith("error: ") and message in p.stderr, p.stderr[-2000:]


@pytest.mark.timeout(300)
def test_lora_optimizer_save_resume_save_resume_equals_uninterrupted(tmp_path):
    """The LoRA optimizers' lifecycle at TP2: two resumes (adapters via save_lora/load_lora,
    optimizer via state_dict), each from a fresh model and optimizer, equal 6 uninterrupted
    steps bit for bit (same layout: the same arithmetic in the same order)."""
    res = run_ranks("megatron_muon.testing.lora_workers:lora_resume_chain", 2,
                    dict(cfg=CFG, directory=str(tmp_path), tp=2), timeout=280)
    for r in res:
        for name, run in r.items():
            assert run["chain"] == run["whole"], name
            for k, (A, B) in run["whole_factors"].items():
                A2, B2 = run["chain_factors"][k]
                assert torch.equal(A, A2) and torch.equal(B, B2), (name, k)
