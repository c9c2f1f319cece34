"""``DMuonOptimizerConfig``: Megatron-Core's ``OptimizerConfig`` plus the Muon and DMuon fields.

This module is the one source of truth for those settings.  Each ``muon_*`` / ``dmuon_*``
field carries its type (a ``Literal`` for a fixed set of choices), its default, its help
text and its command-line flag (``field(metadata=...)``, see ``setting``);
``megatron_muon.megatron.arguments`` generates the ``--muon-*`` / ``--dmuon-*`` flags from
them.  ``check_dmuon_settings`` is the one validator: ``__post_init__`` calls it with the
field names, ``arguments.validate_dmuon_args`` (the examples, the patched Megatron-LM)
with the flag names, so both reject the same values with the same reasons.  Its last part,
``check_muon_setup``, refuses the Megatron features a Muon optimizer does not run with
(precision-aware optimizer, FSDP, CPU offload, context parallelism, ...); the factory runs
it again on the config it gets.  Incompatible settings raise; nothing is silently changed.
Megatron fields that map onto DMuon's (``muon_tp_mode``, ``adaptive_muon_moment2_method``)
default to None here, "not given".

Muon fields carry Megatron-Core 0.19's names (``muon_momentum``, ``muon_nesterov``, ...).
On 0.16.1, whose config calls Nesterov ``muon_use_nesterov``, both names are accepted.

``dmuon_overlap`` is ``'auto'``, ``'on'`` or ``'off'`` (``True`` / ``False`` are accepted
and stored as ``'on'`` / ``'off'``).  ``'auto'`` speculates only where the owner work can
hide: with pipeline parallelism (stages that finish early wait in the cool-down), and
adaptively (it backs off after a redone speculation, ``overlap.DMuonOverlap``); without
PP, or with ZeRO-3 (no data-parallel collective to hide), it resolves to off.  ``'on'``
with ZeRO-3 is an error.  Code reads the resolved policy, ``config.overlap_policy(pp_size)``
(or ``resolve_overlap``), never the field itself.
"""

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal, Optional, get_args, get_origin

from megatron.core.optimizer import OptimizerConfig

from megatron_muon.core.moment2 import MOMENT2_METHODS
from megatron_muon.core.newton_schulz import COEFFICIENT_SETS, SCALE_MODES, resolve_coefficients

__all__ = ["DMuonOptimizerConfig", "MUON_OPTIMIZERS", "NS_PRECISIONS", "PLACEMENTS", "TP_MODES",
           "OVERLAP_MODES", "setting", "cli_fields", "flag_of", "choices_of", "resolve_overlap",
           "check_dmuon_settings", "check_muon_setup", "SCALAR_OPTIMIZERS", "MEGATRON_TP_MODES",
           "resolve_tp_mode", "resolve_moment2", "make_optimizer_config"]

MuonOptimizer = Literal["dmuon", "muon_naive"]
# The names come from newton_schulz (the maths owns the tables); Literal takes a tuple.
CoefficientType = Literal[tuple(COEFFICIENT_SETS)]
ScaleMode = Literal[SCALE_MODES]
NSPrecision = Literal["highest", "high", "medium"]
NSMethod = Literal["auto", "standard", "gram"]
PlanCost = Literal["flops", "tuner"]
NSBackend = Literal["auto", "torch", "triton"]
Placement = Literal["dmuon", "matrix"]
TPMode = Literal["exact", "blockwise"]
OverlapMode = Literal["auto", "on", "off"]
QKVSplit = Literal["qkv", "head"]
SplitMode = Literal["auto", "off"]
ScalarOptimizer = Literal["adam", "lion"]
MegatronTPMode = Literal["duplicated", "distributed", "blockwise"]
Moment2Method = Literal[MOMENT2_METHODS]

MUON_OPTIMIZERS = get_args(MuonOptimizer)
OPTIMIZERS = MUON_OPTIMIZERS + ("adam", "sgd")
NS_PRECISIONS = get_args(NSPrecision)
PLACEMENTS = get_args(Placement)
TP_MODES = get_args(TPMode)
OVERLAP_MODES = get_args(OverlapMode)
SCALAR_OPTIMIZERS = get_args(ScalarOptimizer)
#: Megatron-Core's ``muon_tp_mode`` -> DMuon's ``dmuon_tp_mode``: Megatron's two exact modes
#: (every TP shard sees the whole matrix) are DMuon's exact mode; 'blockwise' (NS per TP
#: shard, not TP-invariant) is DMuon's blockwise mode.
MEGATRON_TP_MODES = {"duplicated": "exact", "distributed": "exact", "blockwise": "blockwise"}
_BASE_FIELDS = {f.name for f in fields(OptimizerConfig)}


def setting(default: Any, help: str, *, flag: Optional[str] = None, metavar: Optional[str] = None,
            aliases: Optional[dict] = None, cli_choices: bool = True):
    """A config field that is also a command-line flag.

    ``flag``: the option (default ``--`` + the field name with dashes); a ``bool`` field
    gets the pair ``--flag`` / ``--no-flag``.  ``aliases``: extra options that set a fixed
    value (``{'--no-dmuon-overlap': 'off'}``), e.g. Megatron-LM's spellings.
    ``cli_choices=False``: the parser takes any string and the validator names the choices
    (as Megatron-LM's own flag does, so the message is the same under both parsers).
    """
    meta = {"help": help, "flag": flag, "metavar": metavar, "aliases": dict(aliases or {}),
            "cli_choices": cli_choices}
    return field(default=default, metadata=meta)


@dataclass
class DMuonOptimizerConfig(OptimizerConfig):
    """Optimizer config for ``optimizer='dmuon'`` (owner-centric Muon) and ``'muon_naive'``.

    Everything not listed here is Megatron-Core's ``OptimizerConfig`` (lr, weight_decay,
    clip_grad, bf16, fp16, use_distributed_optimizer, adam_* for the AdamW part, ...).
    The help text of each field is in its metadata (``setting``); ``--help`` shows it.
    """

    optimizer: str = "dmuon"

    # --- Muon maths (Megatron-Core 0.19 names and defaults) ---
    muon_momentum: float = setting(0.95, "Muon momentum mu in [0, 1).")
    muon_nesterov: bool = setting(False, "Nesterov momentum (U = G + mu M) for Muon.")
    muon_num_ns_steps: int = setting(5, "Newton-Schulz iterations (>= 1).")
    # The Python API also takes explicit (a, b, c) triples here (see newton_schulz).
    muon_coefficient_type: CoefficientType = setting(
        "quintic", f"Newton-Schulz coefficient set: {', '.join(sorted(COEFFICIENT_SETS))}.",
        cli_choices=False)
    muon_scale_mode: ScaleMode = setting(
        "spectral", "Muon update scale: spectral = sqrt(max(m, n)), shape_scaling = "
        "sqrt(max(1, m/n)), unit_rms_norm = sqrt(m/n).")
    muon_extra_scale_factor: float = setting(
        1.0, "Extra factor on the Muon update (0.2 with spectral matches AdamW's update RMS, "
        "as Moonlight does).")
    muon_split_qkv: bool = setting(
        True, "Orthogonalize the fused QKV matrix as separate Q, K and V blocks "
        "(--no-muon-split-qkv or Megatron-LM's --muon-no-split-qkv: as one unit).",
        aliases={"--muon-no-split-qkv": False})
    muon_fp32_matmul_prec: NSPrecision = setting(
        "medium", "Newton-Schulz precision: highest = fp32, high = fp32 with TF32 matmuls "
        "(GPU), medium = bf16.")
    muon_ns_method: NSMethod = setting(
        "auto", "Newton-Schulz algorithm: standard (iterate on X), gram (iterate on the small "
        "Gram matrix X X^T, restarting every few steps: the same map in exact arithmetic, "
        "fewer flops on rectangular units, docs/design.md#gram-newton-schulz), or auto (the "
        "kernel tuner's timed, accuracy-checked choice with --dmuon-plan-cost tuner; else "
        "standard).")

    # --- DMuon ---
    dmuon_qkv_split: QKVSplit = setting(
        "qkv", "With --muon-split-qkv (the default): qkv = Q, K and V (and gated attention's "
        "gate) are one Newton-Schulz unit each; head = one unit per attention head of Q, per "
        "query group of K and V, and per head of MLA's up-projections.")
    dmuon_split_fc1: bool = setting(
        False, "Orthogonalize a SwiGLU linear_fc1 as separate gate and up units.")
    dmuon_adam_params: Optional[str] = setting(
        None, "Parameter names matching this regex go to AdamW even if they are hidden 2-D "
        "matrices.", metavar="REGEX")
    dmuon_plan_cost: PlanCost = setting(
        "flops", "Owner-plan cost model: flops (k (2mns + s^3)) or tuner (measured "
        "Newton-Schulz times).")
    dmuon_tuner_cache: Optional[str] = setting(
        None, "JSON cache of the Newton-Schulz kernel tuner.", metavar="PATH")
    dmuon_ns_backend: NSBackend = setting(
        "auto", "Batched Newton-Schulz implementation on the owners: auto (the tuner's choice "
        "with --dmuon-plan-cost tuner, else torch), torch or triton.")
    dmuon_locality_slack: float = setting(
        0.03, "Owner plan: a unit goes to the rank holding most of it while that rank stays "
        "within (1 + slack) x the mean Newton-Schulz load; 0 still prefers local owners among "
        "equally loaded ranks.")
    dmuon_split: SplitMode = setting(
        "auto", "Split the Newton-Schulz of units that cost more than the stage's group can "
        "balance across several of its ranks (one all-reduce of the s x s Gram matrix per NS "
        "step; docs/design.md#split-ns): auto (the planner splits where it pays; plain Muon, "
        "standard NS, flops plan cost and --dmuon-placement dmuon only) or off.")
    dmuon_split_parts: Optional[int] = setting(
        None, "Split every unit into exactly this many parts (2 .. the group's ranks), "
        "whatever it costs: for tests and experiments.", metavar="K")
    dmuon_split_flops_per_byte: float = setting(
        2500.0, "The planner's price of the split all-reduce: Newton-Schulz flops a rank does "
        "in the time it moves one byte of it (about an H100's bf16 rate over NVLink's "
        "bandwidth; raise it where a stage's group spans nodes).")
    dmuon_log_plan: bool = setting(
        True, "Log the owner plan when the optimizer is built.",
        aliases={"--dmuon-no-log-plan": False})
    dmuon_check_finite: bool = setting(
        False, "Raise a clear error if a Muon gradient is NaN/Inf (one reduction per step).")
    dmuon_placement: Placement = setting(
        "dmuon", "Which ranks own the Muon units: dmuon (anywhere in the stage's DP x TP "
        "group, Megatron's even buffer shards) or matrix (MatrixFSDP: every unit whole on one "
        "DP rank, no data-parallel bytes in the Muon step; build the model inside "
        "megatron_muon.megatron.matrix_placement).")
    dmuon_zero3: bool = setting(
        False, "ZeRO-3: parameters gathered bucket by bucket for forward and backward, "
        "gradients reduce-scattered per bucket (needs --overlap-grad-reduce; the bucket is the "
        "gather unit). With --dmuon-placement matrix (MatrixFSDP) each parameter is stored "
        "only on its owner DP rank and the Muon step is local; with the default placement "
        "each rank stores its even 1/DP slice of every bucket (with --optimizer muon_naive: "
        "the reconstruction baseline, which gathers every matrix in the step). "
        "--dmuon-overlap auto is off with it.")
    dmuon_zero3_prefetch: bool = setting(
        True, "With --dmuon-zero3: start gathering the bucket used next (in the forward, and "
        "in the backward) while the current one computes; at most two buckets are gathered "
        "at a time. --dmuon-no-zero3-prefetch: one bucket at a time, gathered when needed.",
        aliases={"--dmuon-no-zero3-prefetch": False})
    dmuon_tp_mode: TPMode = setting(
        "exact", "exact: Newton-Schulz on whole (TP-unsharded) units, TP-invariant; "
        "blockwise: on each TP rank's shard separately (Megatron's muon_tp_mode=blockwise), "
        "NOT TP-invariant (the update changes with the TP size).")

    # --- adaptive second moments (docs/variants.md#adaptive-second-moments) ---
    dmuon_moment2: Optional[Moment2Method] = setting(
        None, "Second moment of each unit's orthogonalised update (Megatron's adaptive_muon): "
        "adamuon (element-wise, like Adam) or normuon (one value per row, or per column of a "
        "wide unit, then the unit's Frobenius norm restored); unset: plain Muon. The state "
        "lives with the unit's owner; turns the DMuon overlap off.")
    # Megatron-Core 0.19's field (default 'adamuon' there, read only by its adaptive_muon
    # optimizer); here None means "not given": dmuon_moment2 decides.
    adaptive_muon_moment2_method: Optional[Moment2Method] = setting(
        None, "Megatron-Core's second-moment method of --optimizer adaptive_muon (adamuon or "
        "normuon), mapped onto --dmuon-moment2; a different --dmuon-moment2 with it is an "
        "error. Not given: --dmuon-moment2 decides.")
    # Megatron-Core 0.19's names and defaults (0.16.1 lacks them; declared here for both)
    adaptive_muon_beta2: float = setting(
        0.95, "With --dmuon-moment2: decay rate of the second moment, in [0, 1).")
    adaptive_muon_eps: float = setting(
        1e-8, "With --dmuon-moment2: epsilon of the second moment (> 0).")

    # --- DMuon overlap (docs/design.md, "Overlap"); exact: a bitwise check decides ---
    dmuon_overlap: OverlapMode = setting(
        "auto", "Run DMuon's owner work (gather, Newton-Schulz, scatter launch) "
        "speculatively at the end of each stage's backward pass instead of in "
        "optimizer.step(); the step uses it only if its gradients are bit-identical (no "
        "clipping), else redoes it. auto: only with pipeline parallelism (the work hides in "
        "the cool-down), only while probe windows (5 + 5 steps every 100 from step 4) "
        "measure every speculating step faster than every plain one, and adaptively (after "
        "a redone step it skips 1, 2, 4, ... up to 16 steps, back to every step after a "
        "used one); off without PP and with --dmuon-zero3. "
        "on: every step; on with --dmuon-zero3 is an error.",
        aliases={"--no-dmuon-overlap": "off"})
    dmuon_overlap_bucket_gather: bool = setting(
        True, "With the overlap on: start each bucket's gather to the owners right after "
        "its gradient reduce-scatter, while the backward pass goes on.")
    dmuon_overlap_param_update: bool = setting(
        True, "With the overlap on: optimizer.step() does not apply a used speculation's "
        "update; each bucket's update lands just before its param all-gather (under the "
        "next forward pass with --overlap-param-gather).")
    dmuon_trace_dir: Optional[str] = setting(
        None, "Write a per-rank Chrome trace (trace_rank<R>.json, Perfetto) of "
        "forward/backward, grad reduce-scatter, DMuon gather/Newton-Schulz/scatter, param "
        "all-gather and optimizer step.", metavar="DIR")

    # --- Megatron-Core's scalar optimizer and TP-mode fields (docs/megatron_flags.md) ---
    # Megatron-Core 0.19 declares the first three itself (same names and defaults); on
    # megatron-core versions without them they are added here, with their flags.
    muon_scalar_optimizer: ScalarOptimizer = setting(
        "adam", "Optimizer for the parameters Muon does not take (embeddings, output layer, "
        "norms, biases): adam (AdamW, --adam-*) or lion (--lion-beta1/2).")
    lion_beta1: float = setting(
        0.95, "Lion: c = beta1 m + (1 - beta1) g gives the sign of the update.")
    lion_beta2: float = setting(
        0.98, "Lion: the state m <- beta2 m + (1 - beta2) g.")
    # Megatron-Core main's flag for its Triton SYRK Gram kernel: the same idea (compute only
    # one triangle of the symmetric products) is dmuon's Triton NS backend
    muon_use_syrk: bool = setting(
        False, "Megatron-Core's Triton SYRK kernel for the Gram products of Newton-Schulz; "
        "maps onto --dmuon-ns-backend triton (dmuon's symmetric Triton kernels, CUDA).")
    # Megatron's default is 'blockwise'; here None means "not given": dmuon_tp_mode decides.
    muon_tp_mode: Optional[MegatronTPMode] = setting(
        None, "Megatron-Core's TP mode, mapped onto --dmuon-tp-mode: duplicated and "
        "distributed = exact (TP-invariant), blockwise = blockwise (Newton-Schulz per TP "
        "shard, inexact: the update changes with the TP size). Not given: --dmuon-tp-mode.")

    def __post_init__(self):
        if "muon_use_nesterov" in _BASE_FIELDS and getattr(self, "muon_use_nesterov", False):
            self.muon_nesterov = True  # 0.16.1 spelling
        if isinstance(self.dmuon_overlap, bool):  # the former bool field: True/False = on/off
            self.dmuon_overlap = "on" if self.dmuon_overlap else "off"
        # before Megatron's checks: its AssertionErrors (e.g. "--use-precision-aware-optimizer
        # only supported with adam") would hide the reason and the fix
        check_dmuon_settings(lambda name: getattr(self, name, None), cli=False)
        super().__post_init__()
        self.dmuon_tp_mode = resolve_tp_mode(self.muon_tp_mode, self.dmuon_tp_mode)
        if self.muon_use_syrk:  # check_dmuon_settings refused a contradicting backend
            self.dmuon_ns_backend = "triton"
        self.dmuon_moment2 = resolve_moment2(self.adaptive_muon_moment2_method, self.dmuon_moment2)

    def overlap_policy(self, pp_size: int) -> str:
        """``dmuon_overlap`` resolved for a stage of a ``pp_size``-stage pipeline: what the
        optimizer does, ``'on'``, ``'adaptive'`` or ``'off'`` (see ``resolve_overlap``)."""
        return resolve_overlap(self.dmuon_overlap, self.dmuon_zero3, pp_size,
                               moment2=self.dmuon_moment2)


# --------------------------------------------------------------------------- the flag table
def cli_fields() -> list:
    """The ``muon_*`` / ``dmuon_*`` fields that are command-line flags, in the order this
    class declares them (``fields()`` keeps the base class's order for redeclared names)."""
    by_name = {f.name: f for f in fields(DMuonOptimizerConfig) if "help" in f.metadata}
    return [by_name[n] for n in DMuonOptimizerConfig.__annotations__ if n in by_name]


def _field(name: str):
    for f in fields(DMuonOptimizerConfig):
        if f.name == name:
            return f
    return None


def flag_of(name: str) -> str:
    """The command-line option of a config field (or of a Megatron-LM argument ``name``)."""
    f = _field(name)
    flag = f.metadata.get("flag") if f is not None else None
    return flag or "--" + name.replace("_", "-")


def choices_of(f) -> Optional[tuple]:
    """The allowed values of a ``Literal`` field (``Optional[Literal]`` too), else None."""
    tp = f.type
    if get_origin(tp) is not Literal:
        args = [a for a in get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else None
    return get_args(tp) if get_origin(tp) is Literal else None


def resolve_overlap(overlap: Any, zero3: bool, pp_size: int, moment2: Optional[str] = None) -> str:
    """The DMuon overlap policy: ``'on'`` (speculate every step), ``'adaptive'`` or ``'off'``.

    ``'auto'`` is ``'adaptive'`` with pipeline parallelism (``pp_size > 1``: the owner work
    hides in the cool-down of stages that finish early; speculation runs only while measured
    faster (``overlap.SpeculationGate``) and backs off after a redone step) and ``'off'`` without it (DP/TP only: nothing to hide behind, the exact step runs
    without speculation) or with ZeRO-3; bools are accepted (True/False = on/off).
    ``'on'`` with ZeRO-3 is rejected (``check_dmuon_settings`` already does at construction;
    this catches a field changed afterwards).  With ``moment2`` (AdaMuon / NorMuon) the
    owners' second-moment state would have to be rolled back after a redone speculation,
    so ``'auto'`` is ``'off'`` and ``'on'`` is rejected.
    """
    mode = _overlap_mode(overlap)
    if mode not in OVERLAP_MODES:
        raise ValueError(f"dmuon_overlap must be one of {', '.join(OVERLAP_MODES)}, "
                         f"got {overlap!r}")
    if mode == "on" and zero3:
        raise ValueError("dmuon_overlap='on' does not work with dmuon_zero3=True (ZeRO-3's Muon "
                         "step has no data-parallel collective to hide): use 'auto' or 'off'")
    if mode == "on" and moment2 is not None:
        raise ValueError(f"dmuon_overlap='on' does not work with dmuon_moment2={moment2!r} (the "
                         "owners' second moment cannot be rolled back after a redone "
                         "speculation): use 'auto' (off with a second moment) or 'off'")
    if mode == "auto":
        return "adaptive" if pp_size > 1 and not zero3 and moment2 is None else "off"
    return mode


def _overlap_mode(value: Any) -> Any:
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


# --------------------------------------------------------------------------- the validator
class _Spelling:
    """Names settings in messages: config fields (``dmuon_zero3=True``) or flags
    (``--dmuon-zero3``)."""

    def __init__(self, cli: bool):
        self.cli = cli

    def name(self, key: str) -> str:
        return flag_of(key) if self.cli else key

    def set(self, key: str, value: Any) -> str:
        if not self.cli:
            return f"{key}={value!r}"
        flag = flag_of(key)
        if value is True:
            return flag
        if value is False:
            return "--no-" + flag[2:]
        return f"{flag} {value}"

    def both(self, *pairs) -> str:
        return (" " if self.cli else " and ").join(self.set(k, v) for k, v in pairs)


def check_dmuon_settings(get: Callable[[str], Any], *, cli: bool,
                         error: type = ValueError) -> None:
    """The one validator of the Muon / DMuon settings.

    ``get(name)``: the value of a config field or Megatron-LM argument (None when it has
    none); ``cli``: name settings by their flags (``--muon-momentum``) instead of their
    field names.  Raises ``error`` with a message that names the setting and the fix.
    ``DMuonOptimizerConfig.__post_init__`` calls it for every optimizer;
    ``arguments.validate_dmuon_args`` for dmuon / muon_naive.
    """
    s = _Spelling(cli)
    N = s.name

    def fail(msg: str):
        raise error(msg)

    optimizer = get("optimizer")
    if optimizer not in OPTIMIZERS:
        fail(f"{N('optimizer')} must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")

    # --- Muon maths ---
    momentum = get("muon_momentum")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or \
            not 0.0 <= momentum < 1.0:
        fail(f"{N('muon_momentum')} must be in [0, 1), got {momentum}")
    steps = get("muon_num_ns_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        fail(f"{N('muon_num_ns_steps')} must be an integer >= 1, got {steps}")
    coeff = get("muon_coefficient_type")
    if isinstance(coeff, str) and coeff not in COEFFICIENT_SETS:
        fail(f"{N('muon_coefficient_type')} {coeff!r} is unknown to {optimizer}; "
             f"choose one of {', '.join(sorted(COEFFICIENT_SETS))}")
    try:  # the Python API also takes explicit (a, b, c) triples; cubic5 needs 5 steps
        resolve_coefficients(coeff, steps)
    except (TypeError, ValueError) as err:
        fail(f"{N('muon_coefficient_type')} with {N('muon_num_ns_steps')} {steps}: {err}")
    factor = get("muon_extra_scale_factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or \
            not math.isfinite(factor) or factor <= 0:
        fail(f"{N('muon_extra_scale_factor')} must be a finite number > 0, got {factor}")
    prec = get("muon_fp32_matmul_prec")
    if prec not in NS_PRECISIONS:
        fail(f"{N('muon_fp32_matmul_prec')} {prec!r} is not supported by {optimizer}; "
             f"choose one of {', '.join(NS_PRECISIONS)}")
    for f in cli_fields():  # every other fixed-choice setting
        allowed = choices_of(f)
        if allowed is None or f.name in ("muon_coefficient_type", "muon_fp32_matmul_prec"):
            continue
        value = get(f.name)
        if value is None and type(None) in get_args(f.type):
            continue  # an unset Optional choice (dmuon_moment2: plain Muon)
        if f.name == "dmuon_overlap":
            value = _overlap_mode(value)
        if value not in allowed:
            fail(f"{N(f.name)} {value!r} is unknown; choose one of {', '.join(allowed)}")

    if get("dmuon_qkv_split") == "head" and get("muon_split_qkv") is False:
        fail(f"{s.both(('dmuon_qkv_split', 'head'), ('muon_split_qkv', False))} contradict each "
             f"other: per-head units are a split of the fused QKV; drop one")
    if get("muon_use_syrk") and get("dmuon_ns_backend") == "torch":
        fail(f"{s.both(('muon_use_syrk', True), ('dmuon_ns_backend', 'torch'))} contradict each "
             f"other: the SYRK kernel is dmuon's Triton backend; drop one")
    if get("muon_ns_method") == "gram" and (get("dmuon_ns_backend") == "triton" or
                                            get("muon_use_syrk")):
        triton = ("muon_use_syrk", True) if get("muon_use_syrk") else ("dmuon_ns_backend", "triton")
        fail(f"{s.both(('muon_ns_method', 'gram'), triton)}: there is no Triton Gram kernel; "
             f"use {s.set(*triton[:1], False if triton[1] is True else 'auto')} or "
             f"{s.set('muon_ns_method', 'standard')}")

    try:
        moment2 = resolve_moment2(get("adaptive_muon_moment2_method"), get("dmuon_moment2"), s)
    except ValueError as err:
        fail(str(err))
    if moment2 is not None:
        beta2, eps = get("adaptive_muon_beta2"), get("adaptive_muon_eps")
        if isinstance(beta2, bool) or not isinstance(beta2, (int, float)) or \
                not 0.0 <= beta2 < 1.0:
            fail(f"{N('adaptive_muon_beta2')} must be in [0, 1), got {beta2}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or \
                not math.isfinite(eps) or eps <= 0:
            fail(f"{N('adaptive_muon_eps')} must be a finite number > 0, got {eps}")
        if _overlap_mode(get("dmuon_overlap")) == "on":
            fail(f"{s.set('dmuon_overlap', 'on')} does not work with "
                 f"{s.set('dmuon_moment2', moment2)}: the owners' second moment cannot be "
                 f"rolled back after a redone speculation; use "
                 f"{s.set('dmuon_overlap', 'auto')} (off with a second moment) or "
                 f"{s.set('dmuon_overlap', 'off')}")

    # --- DMuon ---
    slack = get("dmuon_locality_slack")
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or \
            not math.isfinite(slack) or slack < 0:
        fail(f"{N('dmuon_locality_slack')} must be a finite number >= 0, got {slack}")
    price = get("dmuon_split_flops_per_byte")
    if isinstance(price, bool) or not isinstance(price, (int, float)) or \
            not math.isfinite(price) or price <= 0:
        fail(f"{N('dmuon_split_flops_per_byte')} must be a finite number > 0, got {price}")
    parts = get("dmuon_split_parts")
    if parts is not None:
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 2:
            fail(f"{N('dmuon_split_parts')} must be an integer >= 2, got {parts!r}")
        for name, bad, why in (
                ("dmuon_split", "off", "it turns splitting off"),
                ("dmuon_placement", "matrix", "matrix placement keeps every unit on one rank"),
                ("muon_ns_method", "gram", "the split runs standard Newton-Schulz"),
                ("dmuon_plan_cost", "tuner", "the split is planned in flops")):
            if get(name) == bad:
                fail(f"{s.set('dmuon_split_parts', parts)} does not work with "
                     f"{s.set(name, bad)}: {why}")
        if moment2 is not None:
            fail(f"{s.set('dmuon_split_parts', parts)} does not work with "
                 f"{s.set('dmuon_moment2', moment2)}: the owners' second moment needs whole units")
    regex = get("dmuon_adam_params")
    if regex is not None:
        try:
            re.compile(regex)
        except (re.error, TypeError) as err:
            fail(f"{N('dmuon_adam_params')} {regex!r} is not a valid regular expression: {err}")
    if get("dmuon_zero3"):
        # MatrixFSDP (dmuon + matrix), or even shards: the reconstruction baseline
        # (muon_naive: every rank gathers every matrix) or DMuon's owners on even shards
        combos = (("dmuon", "matrix"), ("dmuon", "dmuon"), ("muon_naive", "dmuon"))
        if (optimizer, get("dmuon_placement")) not in combos:
            got = s.both(("optimizer", optimizer), ("dmuon_placement", get("dmuon_placement")))
            want = " or ".join(s.both(("optimizer", o), ("dmuon_placement", pl))
                               for o, pl in combos)
            fail(f"{s.set('dmuon_zero3', True)} needs {want} (got {got})")
        if get("dmuon_placement") != "matrix" and get("sequence_parallel"):
            fail(f"{s.set('dmuon_zero3', True)} with even shards "
                 f"({s.set('dmuon_placement', 'dmuon')}) does not support "
                 f"{N('sequence_parallel')}: use {s.set('dmuon_placement', 'matrix')}")
        if _overlap_mode(get("dmuon_overlap")) == "on":
            fail(f"{s.set('dmuon_overlap', 'on')} does not work with "
                 f"{s.set('dmuon_zero3', True)}: ZeRO-3's Muon step has no data-parallel "
                 f"collective to hide; use {s.set('dmuon_overlap', 'auto')} (off with ZeRO-3) "
                 f"or {s.set('dmuon_overlap', 'off')}")
        if get("overlap_grad_reduce") is False:
            fail(f"{s.set('dmuon_zero3', True)} reduces gradients bucket by bucket in the "
                 f"backward: add {s.set('overlap_grad_reduce', True)}")
        if (get("num_experts") or 0) > 0:
            fail(f"{s.set('dmuon_zero3', True)} supports dense models only "
                 f"(no {N('num_experts')})")
        if get("dmuon_placement") != "matrix" and get("qk_layernorm") and \
                (get("tensor_model_parallel_size") or 1) > 1:
            # even shards leave main_grad None, so Megatron's TP all-reduce of the q/k-norm
            # gradients (after finish_grad_sync) skips them and the TP replicas drift apart
            fail(f"{s.set('dmuon_zero3', True)} with even shards "
                 f"({s.set('dmuon_placement', 'dmuon')}) does not support "
                 f"{N('qk_layernorm')} at {N('tensor_model_parallel_size')} > 1: use "
                 f"{s.set('dmuon_placement', 'matrix')}")
        graphs = [k for k in ("enable_cuda_graph", "external_cuda_graph") if get(k)]
        if get("cuda_graph_impl") not in (None, "none"):
            graphs.append("cuda_graph_impl")
        if graphs:
            fail(f"{s.set('dmuon_zero3', True)} does not work with {N(graphs[0])}: a captured "
                 "layer replays without ZeRO-3's gather and free hooks and would read freed "
                 "parameter storage")
        for key in ("log_params_norm", "async_save"):  # read every parameter off the hooks
            if get(key):
                fail(f"{s.set('dmuon_zero3', True)} does not support {N(key)} yet (it reads "
                     "parameters a ZeRO-3 rank does not hold)")

    fmt = get("ckpt_format")
    if optimizer in ("dmuon", "muon_naive") and fmt not in (None, "torch_dist"):
        fail(f"{N('ckpt_format')} {fmt} is not supported by {optimizer}: it saves the "
             "distributed optimizer's state by DP shard with Adam's state keys only, so the "
             "owners' Muon state would be lost and the checkpoint fixed to one DP layout; use "
             f"{N('ckpt_format')} torch_dist")

    # --- Megatron's scalar-optimizer and TP-mode settings ---
    for key in ("lion_beta1", "lion_beta2"):
        b = get(key)
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or
                              not 0.0 <= b < 1.0):
            fail(f"{N(key)} must be in [0, 1), got {b}")
    try:
        resolve_tp_mode(get("muon_tp_mode"), get("dmuon_tp_mode"), s)
    except ValueError as err:
        fail(str(err))

    check_muon_setup(get, cli=cli, error=error)


#: Megatron switches a Muon optimizer does not run with: (setting, why), for
#: ``check_muon_setup``.
_UNSUPPORTED_SWITCHES = (
    ("use_megatron_fsdp", "it runs on Megatron DDP with the distributed optimizer (ZeRO-1), "
                          "not on Megatron-FSDP"),
    ("use_custom_fsdp", "it runs on Megatron DDP with the distributed optimizer (ZeRO-1), "
                        "not on Megatron-FSDP"),
    ("use_torch_fsdp2", "it runs on Megatron DDP with the distributed optimizer (ZeRO-1), "
                        "not on torch FSDP2"),
    ("use_precision_aware_optimizer", "with it Megatron puts the gradients in "
                                      "param.decoupled_grad, which DMuon does not read (its "
                                      "Muon matrices would only decay)"),
    ("optimizer_cpu_offload", "DMuon's step and its exchange run on the device that holds "
                              "the gradient buffers"),
    ("overlap_param_gather_with_optimizer_step",
     "Megatron's ChainedOptimizer starts the param all-gather right after its first "
     "sub-optimizer, and dmuon chains a DMuon and an AdamW over the same buffers"),
    ("optimizer_cuda_graph", "a captured optimizer.step() would replay the host-side "
                             "decisions of one step (learning rate, overlap) in every step"),
)
#: Megatron's precision-aware-optimizer dtypes: fp32 is the only value without it.
_PRECISION_AWARE_DTYPES = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
                           "exp_avg_sq_dtype")


def _dtype_name(value: Any) -> str:
    """``torch.bfloat16`` -> ``'bf16'`` (Megatron-LM maps its dtype flags to torch dtypes)."""
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.uint8: "fp8"}
    return names.get(value, str(value)) if isinstance(value, torch.dtype) else str(value)


def check_muon_setup(get: Callable[[str], Any], *, cli: bool, error: type = ValueError) -> None:
    """What a Muon optimizer (dmuon / muon_naive) needs from the rest of the setup.

    The Megatron features it does not run with are refused here, one line each naming the
    setting and the fix, instead of a hang or a silently wrong update.  ``get``, ``cli`` and
    ``error`` as in ``check_dmuon_settings``, which calls it; ``compat.check_supported``
    calls it again on the config the factory gets (a field set after construction).
    Settings ``get`` has no value for (None) are not checked: the config has no
    ``context_parallel_size``, a plain parser no ``--use-torch-fsdp2``.
    """
    s = _Spelling(cli)
    N = s.name
    optimizer = get("optimizer")
    if optimizer not in MUON_OPTIMIZERS:
        return
    opt = s.set("optimizer", optimizer)

    def fail(msg: str):
        raise error(msg)

    def drop(key: str) -> str:
        return f"drop {N(key)}" if cli else f"turn it off ({key}=False)"

    if get("use_distributed_optimizer") is False:
        fail(f"{opt} needs {s.set('use_distributed_optimizer', True)} "
             "(it replaces the distributed optimizer's inner step)")
    for key, why in _UNSUPPORTED_SWITCHES:
        if get(key):
            fail(f"{opt} does not support {s.set(key, True)}: {why}; {drop(key)}")
    for key in _PRECISION_AWARE_DTYPES:
        value = get(key)
        if value is not None and _dtype_name(value) != "fp32":
            shown = s.set(key, _dtype_name(value)) if cli else s.set(key, value)
            fail(f"{opt} keeps main grads, main params and Adam moments in fp32: {shown} needs "
                 f"{s.set('use_precision_aware_optimizer', True)}, which {optimizer} does not "
                 f"support; {'drop ' + N(key) if cli else 'leave ' + key + ' at fp32'}")
    for key, later in (("context_parallel_size", " yet"),
                       ("num_distributed_optimizer_instances", "")):
        size = get(key) or 1
        if size > 1:
            fail(f"{opt} does not support {N(key)} > 1{later} (got {size}); "
                 f"use {s.set(key, 1)}")
    if get("dump_param_to_param_group_map"):
        fail(f"{opt} does not support {N('dump_param_to_param_group_map')} (its parameter "
             f"groups are split between DMuon and AdamW); drop it")


def resolve_tp_mode(muon_tp_mode: Optional[str], dmuon_tp_mode: str,
                    spelling: Optional[_Spelling] = None) -> str:
    """DMuon's TP mode given Megatron's ``muon_tp_mode`` (None: not given) and
    ``dmuon_tp_mode`` (``MEGATRON_TP_MODES``); contradicting values are an error."""
    if muon_tp_mode is None:
        return dmuon_tp_mode
    if muon_tp_mode not in MEGATRON_TP_MODES:
        raise ValueError(f"{(spelling or _Spelling(False)).name('muon_tp_mode')} "
                         f"{muon_tp_mode!r} is unknown; choose one of "
                         f"{', '.join(MEGATRON_TP_MODES)}")
    mapped = MEGATRON_TP_MODES[muon_tp_mode]
    if dmuon_tp_mode == "blockwise" and mapped == "exact":
        s = spelling or _Spelling(False)
        raise ValueError(f"{s.both(('muon_tp_mode', muon_tp_mode), ('dmuon_tp_mode', 'blockwise'))}"
                         f" contradict each other: {muon_tp_mode} is DMuon's exact mode; drop one")
    return mapped


def resolve_moment2(megatron_method: Optional[str], dmuon_moment2: Optional[str],
                    spelling: Optional[_Spelling] = None) -> Optional[str]:
    """DMuon's second moment given Megatron's ``adaptive_muon_moment2_method`` (None: not
    given) and ``dmuon_moment2`` (None: plain Muon); different values are an error."""
    if megatron_method is None or dmuon_moment2 in (None, megatron_method):
        return megatron_method if megatron_method is not None else dmuon_moment2
    s = spelling or _Spelling(False)
    both = s.both(("adaptive_muon_moment2_method", megatron_method),
                  ("dmuon_moment2", dmuon_moment2))
    raise ValueError(f"{both} contradict each other ({s.name('adaptive_muon_moment2_method')} "
                     f"maps onto {s.name('dmuon_moment2')}); drop one")


def config_defaults() -> dict:
    """Field name -> default of every ``DMuonOptimizerConfig`` field that has one."""
    return {f.name: f.default for f in fields(DMuonOptimizerConfig)
            if f.default is not dataclasses.MISSING}


def make_optimizer_config(optimizer: str, **overrides) -> DMuonOptimizerConfig:
    """A ``DMuonOptimizerConfig`` with small-model defaults (lr = min_lr = 1e-3, weight decay
    0.01, Adam betas 0.9 / 0.95, eps 1e-8, no clipping, the distributed optimizer, fp32);
    ``overrides`` replace any of them or set other fields.  With ``optimizer='adam'`` /
    ``'sgd'`` it is a plain Megatron optimizer.  The examples and the tests build their
    optimizers from it."""
    base = dict(lr=1e-3, min_lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                adam_eps=1e-8, clip_grad=0.0, use_distributed_optimizer=True, bf16=False)
    base.update(overrides)
    return DMuonOptimizerConfig(optimizer=optimizer, **base)
