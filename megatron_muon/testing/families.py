"""The model families users train, the layouts and modes they run them in, and the cases
that cover every pair of those dimensions (tests/test_families.py, tools/sweep_families.py).

A case is one (family, layout, mode, precision) point; ``case_runs`` turns it into
Megatron-LM trainings for ``mlm_gpt.py`` (its ``MLM_GPT_RUNS`` spec): train ``STEPS``
iterations saving at ``SAVE_AT``, resume from there (saving again at the end), and resume
the same checkpoint at another layout.  ``pairwise_cases`` chooses, greedily and
deterministically, cases until every pair of values of two dimensions that some allowed case
contains is in one of them; ``all_cases`` is the full product (less what is not allowed).

What is not allowed, and why (``allowed``): expert-parallel layouts need an MoE family;
MoE with TP needs sequence parallelism (Megatron refuses it otherwise); ``--dmuon-zero3`` is
refused for MoE models at setup.  Everything else must run.  MoE layouts run their experts
at expert TP 1, except TP2 x EP2, at expert TP 2 (Megatron-LM's default there: the TP size).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

STEPS, SAVE_AT = 6, 3
# every case's common Megatron-LM flags: a 2-layer model, 6 iterations, checkpoints in
# torch_dist (a collective that waits 4 minutes fails with gloo's error naming it)
COMMON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--vocab-size", "256", "--lr", "1e-3",
          "--train-iters", str(STEPS), "--eval-interval", "1000", "--log-interval", "1",
          "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
          "--distributed-timeout-minutes", "4"]
# A checkpoint resumed at another layout: the same model and data, only the fp32 summation
# order differs (TP splits inner products, EP regroups the experts' tokens, PP moves nothing);
# tests/test_megatron_lm.py's TOLERANCE derives this bound on the losses for fp32 NS.
RESHARD_TOLERANCE = 3e-4

GQA = ["--group-query-attention", "--num-query-groups", "2"]
SWIGLU_RMS_ROPE = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                   "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
LLAMA = GQA + SWIGLU_RMS_ROPE
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
       "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-2",
       # Megatron-LM defaults it to the TP size; tp2ep2 sets 2 (the layout's flag comes later)
       "--expert-tensor-parallel-size", "1"]

FAMILIES = {
    "gpt": [],  # dense GPT: bias, GeLU, LayerNorm, learned positions, tied embeddings
    "llama": LLAMA,  # GQA, SwiGLU, RMSNorm, RoPE, untied, no bias
    "qwen3": LLAMA + ["--qk-layernorm"],
    "qwen3_moe": LLAMA + ["--qk-layernorm"] + MOE,
    "deepseek_moe": LLAMA + MOE + ["--moe-shared-expert-intermediate-size", "64"],
    # DeepSeek-V3 / Kimi-K2 style: multi-latent attention (with a q LoRA), MoE with a
    # shared expert, one multi-token-prediction layer
    "deepseek_v3": SWIGLU_RMS_ROPE + MOE +
    ["--moe-shared-expert-intermediate-size", "64", "--multi-latent-attention",
     "--q-lora-rank", "32", "--kv-lora-rank", "32", "--qk-head-dim", "16",
     "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--mtp-num-layers", "1"],
}
MOE_FAMILIES = {"qwen3_moe", "deepseek_moe", "deepseek_v3"}

LAYOUTS = {
    "dp4": [],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2vpp": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
               "--num-layers-per-virtual-pipeline-stage", "1"],
    "ep2": ["--expert-model-parallel-size", "2"],
    "tp2ep2": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
}
EP_LAYOUTS = {"ep2", "tp2ep2"}
# where each layout's checkpoint is resumed at another layout (TP <-> PP <-> DP).  MoE
# models keep expert process groups (EP > 1, or expert TP 1 under TP 2) on both sides or on
# neither: Megatron gives the experts optimizers of their own only with them, and a
# checkpoint with another number of optimizer parts is refused (factory.DMuonChainedOptimizer)
RESHARD_TO = {"dp4": "tp2", "tp2": "pp2", "tp2sp": "dp4", "pp2vpp": "dp4"}
MOE_RESHARD_TO = {"dp4": "pp2", "tp2sp": "ep2", "pp2vpp": "dp4", "ep2": "tp2ep2",
                  "tp2ep2": "ep2"}
RESHARD_LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"]}

FP32_NS = ["--muon-fp32-matmul-prec", "highest"]
MODES = {
    "dmuon": ["--optimizer", "dmuon"],
    "matrix": ["--optimizer", "dmuon", "--dmuon-placement", "matrix"],
    "zero3": ["--optimizer", "dmuon", "--dmuon-placement", "matrix", "--dmuon-zero3",
              "--overlap-grad-reduce"],
    "split": ["--optimizer", "dmuon", "--dmuon-split-parts", "2", "--overlap-grad-reduce",
              "--overlap-param-gather"],
    "naive": ["--optimizer", "muon_naive"],
}
PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}

DIMENSIONS = {"family": FAMILIES, "layout": LAYOUTS, "mode": MODES, "precision": PRECISIONS}


@dataclass(frozen=True)
class Case:
    family: str
    layout: str
    mode: str
    precision: str

    @property
    def name(self) -> str:
        return f"{self.family}-{self.layout}-{self.mode}-{self.precision}"


def allowed(case: Case) -> bool:
    """Whether Megatron (and dmuon) can run ``case`` at all (module docstring)."""
    if case.layout in EP_LAYOUTS and case.family not in MOE_FAMILIES:
        return False
    if case.layout == "tp2" and case.family in MOE_FAMILIES:
        return False  # Megatron: MoE with TP needs sequence parallelism
    if case.mode == "zero3" and case.family in MOE_FAMILIES:
        return False  # refused at setup: --dmuon-zero3 supports dense models only
    return True


def all_cases() -> list:
    return [c for c in itertools.starmap(Case, itertools.product(*DIMENSIONS.values()))
            if allowed(c)]


def _pairs(case: Case) -> set:
    values = list(zip(DIMENSIONS, (case.family, case.layout, case.mode, case.precision)))
    return set(itertools.combinations(values, 2))


def pairwise_cases() -> list:
    """Greedy all-pairs cover of ``all_cases()``: repeatedly take the case (first in product
    order on ties) that covers the most pairs not yet covered.  Deterministic."""
    cases = all_cases()
    todo = set().union(*map(_pairs, cases))
    chosen = []
    while todo:
        best = max(cases, key=lambda c: len(_pairs(c) & todo))
        chosen.append(best)
        todo -= _pairs(best)
    return chosen


def layout_args(layout: str) -> list:
    return LAYOUTS.get(layout) or RESHARD_LAYOUTS.get(layout, [])


def case_args(case: Case, layout: str | None = None) -> list:
    """The Megatron-LM flags of ``case`` (at ``layout``, default its own)."""
    args = FAMILIES[case.family] + layout_args(layout or case.layout) + MODES[case.mode] + \
        FP32_NS + PRECISIONS[case.precision]
    # the model is the case's, whatever layout resumes it
    if "--pipeline-model-parallel-size" in LAYOUTS[case.layout] and case.mode == "zero3" and \
            "--untie-embeddings-and-output-weights" not in args:
        args += ["--untie-embeddings-and-output-weights"]  # ZeRO-3 with PP needs them untied
    if case.layout == "pp2vpp" and "--num-layers" not in layout_args(layout or case.layout):
        args += ["--num-layers", "4"]
    return args


def reshard_layout(case: Case) -> str:
    """The layout ``case``'s checkpoint is resumed at (``RESHARD_TO``, kept within what the
    family allows)."""
    return (MOE_RESHARD_TO if case.family in MOE_FAMILIES else RESHARD_TO)[case.layout]


LORA = ["--optimizer", "smuon", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "3e-3",
        "--lr-decay-style", "constant"]
# CI's warm starts from AdamW and LoRA fine-tunes: the families and modes they cover
CI_WARM = ("qwen3_moe", "deepseek_v3")
CI_LORA = ("qwen3",)


def ci_plan() -> tuple[list, dict]:
    """What CI runs: every pairwise case trains and saves; per family, its first case is
    resumed at the same layout (bitwise) and its first fp32 case at another layout; the
    first case of the ``CI_WARM`` families also starts from an AdamW checkpoint, and that
    of the ``CI_LORA`` ones is fine-tuned with LoRA + sMuon from its own checkpoint.
    ``(cases, {case name: ["resume", "reshard", "warm", "lora"] (some of them)})``."""
    cases = pairwise_cases()
    follow: dict = {}
    for family in FAMILIES:
        mine = [c for c in cases if c.family == family]
        follow.setdefault(mine[0].name, []).append("resume")
        fp32 = [c for c in mine if c.precision == "fp32"] or mine
        follow.setdefault(fp32[0].name, []).append("reshard")
        follow[mine[0].name] += ["warm"] * (family in CI_WARM) + ["lora"] * (family in CI_LORA)
    return cases, follow


def case_runs(case: Case, out: str, lifecycle=("resume", "reshard", "warm", "lora")) -> list:
    """``[[run name, extra args], ...]`` for ``mlm_gpt.py``: the whole run (saving at
    SAVE_AT and STEPS), then per ``lifecycle`` its resume from SAVE_AT (saving at STEPS),
    that checkpoint resumed at another layout (``reshard_layout``), the case's model trained
    with Megatron's AdamW and warm-started from it (``--no-load-optim --finetune``), and a
    LoRA + sMuon fine-tune from the case's final checkpoint (``--finetune``)."""
    n = case.name
    save = lambda d: ["--save", f"{out}/{d}", "--save-interval", str(SAVE_AT)]  # noqa: E731
    load = lambda d: ["--load", f"{out}/{d}", "--ckpt-step", str(SAVE_AT)]  # noqa: E731
    runs = [[n, case_args(case) + save(f"ck_{n}")]]
    if "resume" in lifecycle:
        runs.append([f"{n}.resume", case_args(case) + load(f"ck_{n}") + save(f"ck_{n}.resume")])
    if "reshard" in lifecycle:
        other = reshard_layout(case)
        runs.append([f"{n}.at_{other}", case_args(case, other) + load(f"ck_{n}")])
    if "warm" in lifecycle:
        adam = _model_and_layout(case, ["--optimizer", "adam"])
        runs += [[f"{n}.adam", adam + save(f"ck_{n}.adam")],
                 [f"{n}.from_adam", case_args(case) + ["--load", f"{out}/ck_{n}.adam",
                                                      "--no-load-optim", "--finetune"]]]
    if "lora" in lifecycle:
        runs.append([f"{n}.lora", _model_and_layout(case, LORA) +
                     ["--load", f"{out}/ck_{n}", "--finetune"]])
    return runs


def _model_and_layout(case: Case, optimizer: list) -> list:
    """``case_args`` with ``optimizer``'s flags in place of the mode's."""
    args, mode = case_args(case), MODES[case.mode]
    i = args.index(mode[0])
    return args[:i] + optimizer + args[i + len(mode):]
