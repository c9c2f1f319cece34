"""Megatron-LM style command-line arguments for ``--optimizer dmuon`` / ``muon_naive``.

Three functions, meant to be used from Megatron-LM's ``arguments.py`` (see
``patches/megatron-lm-dmuon.patch``) or from any argparse-based script (the examples):

* ``add_dmuon_args(parser)`` registers an argument group titled ``'dmuon'``.  Megatron-LM
  (0.17+, including the ``megatron/training/arguments.py`` shipped in megatron-core 0.19.2)
  already defines most ``--muon-*`` flags; those are *not* registered again (argparse would
  raise a conflict) but reused.  Only the flags the parser does not have yet are added, so
  the same call works on Megatron-LM's parser and on a plain ``argparse.ArgumentParser``.
  If the parser already has ``--optimizer`` with a ``choices`` list, ``dmuon`` and
  ``muon_naive`` are appended to it; ``--muon-fp32-matmul-prec`` gains ``highest``.
* ``validate_dmuon_args(args)`` checks the values with messages that name the flag
  (``DMuonArgumentError``, a ``ValueError``); with ``parser=`` it calls ``parser.error``.
* ``dmuon_config_from_args(args, base_config=None)`` builds the ``DMuonOptimizerConfig``
  (from Megatron-LM's ``OptimizerConfig`` when given, so lr, weight decay, Adam betas,
  clipping and precision carry over unchanged).

Flags that Megatron-LM 0.19.2 defines and this module reuses (defaults there differ from
``DMuonOptimizerConfig``'s where noted): ``--muon-momentum`` (0.9 in Megatron-LM),
``--muon-nesterov``, ``--muon-num-ns-steps``, ``--muon-coefficient-type``,
``--muon-scale-mode``, ``--muon-extra-scale-factor``, ``--muon-fp32-matmul-prec``
(choices low/medium/high there), ``--muon-no-split-qkv``; ``--muon-tp-mode`` and
``--muon-scalar-optimizer`` are Megatron's own (DMuon is always exact / TP-invariant and
always uses AdamW for non-matrix parameters).  New here: every ``--dmuon-*`` flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import Any, Optional

__all__ = [
    "add_dmuon_args",
    "validate_dmuon_args",
    "dmuon_config_from_args",
    "DMuonArgumentError",
    "MUON_ARGUMENTS",
    "DMUON_ARGUMENTS",
]

_MUON_OPTIMIZERS = ("dmuon", "muon_naive")


class DMuonArgumentError(ValueError):
    """A bad ``--muon-*`` / ``--dmuon-*`` value; the message names the flag."""


def _config_defaults() -> dict:
    from .config import DMuonOptimizerConfig

    return {f.name: f.default for f in dataclasses.fields(DMuonOptimizerConfig)
            if f.default is not dataclasses.MISSING}


def _choices():
    from ..newton_schulz import COEFFICIENT_SETS, SCALE_MODES
    from .config import NS_PRECISIONS, PLACEMENTS

    return sorted(COEFFICIENT_SETS), list(SCALE_MODES), list(NS_PRECISIONS), list(PLACEMENTS)


# (dest, option string, argparse kwargs without default). Defaults come from
# DMuonOptimizerConfig so the command line and the Python API agree.
def _muon_arguments():
    coeffs, scales, precs, _ = _choices()
    return [
        ("muon_momentum", "--muon-momentum",
         dict(type=float, help="Muon momentum mu in [0, 1).")),
        ("muon_nesterov", "--muon-nesterov",
         dict(action="store_true", help="Nesterov momentum (U = G + mu M) for Muon.")),
        ("muon_num_ns_steps", "--muon-num-ns-steps",
         dict(type=int, help="Newton-Schulz iterations (>= 1).")),
        ("muon_coefficient_type", "--muon-coefficient-type",
         dict(type=str, help=f"Newton-Schulz coefficient set: {', '.join(coeffs)}.")),
        ("muon_scale_mode", "--muon-scale-mode",
         dict(type=str, choices=scales, help="Muon update scale: spectral = sqrt(max(m, n)), "
              "shape_scaling = sqrt(max(1, m/n)), unit_rms_norm = sqrt(m/n).")),
        ("muon_extra_scale_factor", "--muon-extra-scale-factor",
         dict(type=float, help="Extra factor on the Muon update (0.2 with spectral "
              "matches AdamW's update RMS, as Moonlight does).")),
        ("muon_fp32_matmul_prec", "--muon-fp32-matmul-prec",
         dict(type=str, choices=precs, help="Newton-Schulz precision: highest = fp32, "
              "high = fp32 with TF32 matmuls (GPU), medium = bf16.")),
        ("muon_split_qkv", "--muon-no-split-qkv",
         dict(action="store_false", help="Orthogonalize the fused QKV matrix as one unit "
              "instead of separate Q, K and V blocks.")),
    ]


def _dmuon_arguments():
    _, _, _, placements = _choices()
    return [
        ("dmuon_split_fc1", "--dmuon-split-fc1",
         dict(action="store_true", help="Orthogonalize a SwiGLU linear_fc1 as separate gate "
              "and up units.")),
        ("dmuon_adam_params", "--dmuon-adam-params",
         dict(type=str, metavar="REGEX", help="Parameter names matching this regex go to AdamW "
              "even if they are hidden 2-D matrices.")),
        ("dmuon_plan_cost", "--dmuon-plan-cost",
         dict(type=str, choices=["flops", "tuner"], help="Owner-plan cost model: flops "
              "(k (2mns + s^3)) or tuner (measured Newton-Schulz times).")),
        ("dmuon_tuner_cache", "--dmuon-tuner-cache",
         dict(type=str, metavar="PATH", help="JSON cache of the Newton-Schulz kernel tuner.")),
        ("dmuon_ns_backend", "--dmuon-ns-backend",
         dict(type=str, choices=["auto", "torch", "triton"], help="Batched Newton-Schulz "
              "implementation on the owners.")),
        ("dmuon_locality_slack", "--dmuon-locality-slack",
         dict(type=float, help="Owner plan: a unit goes to the rank holding most of it while "
              "that rank stays within (1 + slack) x the mean Newton-Schulz load.")),
        ("dmuon_log_plan", "--dmuon-no-log-plan",
         dict(action="store_false", help="Do not log the owner plan at construction.")),
        ("dmuon_check_finite", "--dmuon-check-finite",
         dict(action="store_true", help="Raise a clear error if a Muon gradient is NaN/Inf.")),
        ("dmuon_placement", "--dmuon-placement",
         dict(type=str, choices=placements, help="Which ranks own the Muon units: dmuon "
              "(anywhere in the stage's DP x TP group) or matrix (MatrixFSDP: whole matrices "
              "per DP rank; build the model inside megatron_muon.megatron.matrix_placement).")),
        ("dmuon_zero3", "--dmuon-zero3",
         dict(action="store_true", help="With --dmuon-placement matrix: ZeRO-3, parameters "
              "stored only on their owner DP rank, gathered bucket by bucket for forward and "
              "backward (needs --overlap-grad-reduce; the bucket is the gather unit). Turns the "
              "DMuon overlap off (the Muon step has no data-parallel collective).")),
        ("dmuon_tp_mode", "--dmuon-tp-mode",
         dict(type=str, choices=["exact", "blockwise"], help="exact: Newton-Schulz on whole "
              "(TP-unsharded) units, TP-invariant; blockwise: on each TP rank's shard "
              "separately (Megatron's muon_tp_mode=blockwise), NOT TP-invariant.")),
        ("dmuon_overlap", "--no-dmuon-overlap",
         dict(action="store_false", help="Run DMuon's owner work (gather, Newton-Schulz, "
              "scatter) inside optimizer.step() instead of speculatively at the end of each "
              "stage's backward pass (the speculation is exact: redone when clipping changed "
              "the gradients).")),
        ("dmuon_overlap_bucket_gather", "--no-dmuon-overlap-bucket-gather",
         dict(action="store_false", help="Do not start a bucket's gather to the owners "
              "during the backward pass, right after its gradient reduce-scatter.")),
        ("dmuon_overlap_param_update", "--no-dmuon-overlap-param-update",
         dict(action="store_false", help="Wait for DMuon's scatters and apply the update in "
              "optimizer.step() instead of just before each bucket's param all-gather "
              "(under the next forward pass with --overlap-param-gather).")),
        ("dmuon_trace_dir", "--dmuon-trace-dir",
         dict(type=str, metavar="DIR", help="Write a per-rank Chrome trace "
              "(trace_rank<R>.json, Perfetto) of forward/backward, grad reduce-scatter, DMuon "
              "gather/Newton-Schulz/scatter, param all-gather and optimizer step.")),
    ]


MUON_ARGUMENTS = ("muon_momentum", "muon_nesterov", "muon_num_ns_steps",
                  "muon_coefficient_type", "muon_scale_mode", "muon_extra_scale_factor",
                  "muon_fp32_matmul_prec", "muon_split_qkv")
DMUON_ARGUMENTS = ("dmuon_split_fc1", "dmuon_adam_params", "dmuon_plan_cost",
                   "dmuon_tuner_cache", "dmuon_ns_backend", "dmuon_locality_slack",
                   "dmuon_log_plan", "dmuon_check_finite", "dmuon_placement", "dmuon_zero3",
                   "dmuon_tp_mode", "dmuon_overlap",
                   "dmuon_overlap_bucket_gather", "dmuon_overlap_param_update",
                   "dmuon_trace_dir")


def _existing(parser: argparse.ArgumentParser, dest: str, option: str):
    """The action already registered for ``option`` (or for ``dest``), else None."""
    action = parser._option_string_actions.get(option)
    if action is not None:
        return action
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return action
    return None


def _extend_choices(action, extra) -> None:
    if action is not None and action.choices is not None:
        missing = [c for c in extra if c not in action.choices]
        if missing:
            action.choices = list(action.choices) + missing


def add_dmuon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``'dmuon'`` argument group (skipping flags the parser already has).

    Usable as Megatron-LM's ``extra_args_provider``: returns the parser.
    """
    defaults = _config_defaults()
    group = None
    for dest, option, kwargs in _muon_arguments() + _dmuon_arguments():
        action = _existing(parser, dest, option)
        if action is not None:
            if dest == "muon_fp32_matmul_prec":
                _extend_choices(action, ["highest"])  # Megatron-LM: low/medium/high
            continue
        if group is None:
            group = parser.add_argument_group(title="dmuon")
        group.add_argument(option, dest=dest, default=defaults.get(dest), **kwargs)
    if group is None:
        group = parser.add_argument_group(title="dmuon")  # keep the group visible in --help
    _extend_choices(parser._option_string_actions.get("--optimizer"), list(_MUON_OPTIMIZERS))
    return parser


def _fail(msg: str, parser: Optional[argparse.ArgumentParser]):
    if parser is not None:
        parser.error(msg)  # prints usage + "error: msg", exits with code 2
    raise DMuonArgumentError(msg)


def validate_dmuon_args(args: Any, parser: Optional[argparse.ArgumentParser] = None) -> Any:
    """Check the Muon / DMuon values of ``args`` when ``args.optimizer`` is dmuon/muon_naive.

    Raises ``DMuonArgumentError`` (or calls ``parser.error``) with a message naming the flag.
    Returns ``args`` unchanged otherwise.
    """
    optimizer = getattr(args, "optimizer", None)
    if optimizer not in _MUON_OPTIMIZERS:
        return args
    coeffs, scales, precs, placements = _choices()
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731

    momentum = get("muon_momentum", 0.95)
    if not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        _fail(f"--muon-momentum must be in [0, 1), got {momentum}", parser)
    steps = get("muon_num_ns_steps", 5)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        _fail(f"--muon-num-ns-steps must be an integer >= 1, got {steps}", parser)
    coeff = get("muon_coefficient_type", "quintic")
    if coeff not in coeffs:
        _fail(f"--muon-coefficient-type {coeff!r} is unknown to {optimizer}; "
              f"choose one of {', '.join(coeffs)}", parser)
    scale = get("muon_scale_mode", "spectral")
    if scale not in scales:
        _fail(f"--muon-scale-mode {scale!r} is unknown; choose one of {', '.join(scales)}", parser)
    factor = get("muon_extra_scale_factor", 1.0)
    if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        _fail(f"--muon-extra-scale-factor must be a finite number > 0, got {factor}", parser)
    prec = get("muon_fp32_matmul_prec", "medium")
    if prec not in precs:
        _fail(f"--muon-fp32-matmul-prec {prec!r} is not supported by {optimizer}; "
              f"choose one of {', '.join(precs)}", parser)
    if get("use_distributed_optimizer") is False:
        _fail(f"--optimizer {optimizer} needs --use-distributed-optimizer (it replaces the "
              "distributed optimizer's inner step)", parser)
    if get("use_torch_fsdp2") or get("use_megatron_fsdp") or get("use_custom_fsdp"):
        _fail(f"--optimizer {optimizer} runs on Megatron DDP with the distributed optimizer; "
              "it does not support --use-torch-fsdp2 / --use-megatron-fsdp", parser)
    scalar = get("muon_scalar_optimizer", "adam")
    if scalar not in (None, "adam"):
        _fail(f"--optimizer {optimizer} uses AdamW for non-matrix parameters; "
              f"--muon-scalar-optimizer {scalar} is not supported", parser)
    if (get("context_parallel_size", 1) or 1) > 1:
        _fail(f"--optimizer {optimizer} does not support --context-parallel-size > 1 yet", parser)
    if get("fp16"):
        _fail(f"--optimizer {optimizer} supports fp32 and --bf16 training; not --fp16", parser)
    slack = get("dmuon_locality_slack", 0.0)
    if not isinstance(slack, (int, float)) or not math.isfinite(slack) or slack < 0:
        _fail(f"--dmuon-locality-slack must be a finite number >= 0, got {slack}", parser)
    regex = get("dmuon_adam_params")
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as err:
            _fail(f"--dmuon-adam-params {regex!r} is not a valid regular expression: {err}", parser)
    for dest, flag, allowed in (("dmuon_plan_cost", "--dmuon-plan-cost", ("flops", "tuner")),
                                ("dmuon_ns_backend", "--dmuon-ns-backend",
                                 ("auto", "torch", "triton")),
                                ("dmuon_placement", "--dmuon-placement", tuple(placements))):
        value = get(dest, allowed[0])
        if value not in allowed:
            _fail(f"{flag} {value!r} is unknown; choose one of {', '.join(allowed)}", parser)
    if get("dmuon_zero3"):
        if optimizer != "dmuon" or get("dmuon_placement", "dmuon") != "matrix":
            _fail("--dmuon-zero3 needs --optimizer dmuon --dmuon-placement matrix", parser)
        if get("overlap_grad_reduce") is False:
            _fail("--dmuon-zero3 reduces gradients bucket by bucket in the backward: add "
                  "--overlap-grad-reduce", parser)
        if (get("num_experts") or 0) > 0:
            _fail("--dmuon-zero3 supports dense models only (no --num-experts)", parser)
        for flag in ("log_params_norm", "async_save"):  # read every parameter off the hooks
            if get(flag):
                _fail(f"--dmuon-zero3 does not support --{flag.replace('_', '-')} yet (it reads "
                      "parameters a ZeRO-3 rank does not hold)", parser)
    return args


def dmuon_config_from_args(args: Any, base_config: Any = None):
    """A ``DMuonOptimizerConfig`` from ``args`` (and Megatron's ``OptimizerConfig``, if given).

    With ``base_config`` (what Megatron-LM's ``get_megatron_optimizer_config`` built), every
    field of it is kept; the Muon and DMuon fields and ``optimizer`` come from ``args``.
    Without it, every ``DMuonOptimizerConfig`` field that ``args`` has is taken from ``args``.
    """
    from .config import DMuonOptimizerConfig

    init_fields = {f.name for f in dataclasses.fields(DMuonOptimizerConfig) if f.init}
    kwargs: dict = {}
    if base_config is not None:
        for f in dataclasses.fields(base_config):
            if f.init and f.name in init_fields:
                kwargs[f.name] = getattr(base_config, f.name)
        from_args = [n for n in init_fields if n.startswith(("muon_", "dmuon_"))]
    else:
        from_args = list(init_fields)
    for name in from_args:
        if hasattr(args, name):
            kwargs[name] = getattr(args, name)
    kwargs["optimizer"] = getattr(args, "optimizer", kwargs.get("optimizer", "dmuon"))
    if "muon_use_nesterov" in init_fields and "muon_nesterov" in kwargs:
        kwargs["muon_use_nesterov"] = kwargs["muon_nesterov"]  # megatron-core 0.16 spelling
    return DMuonOptimizerConfig(**kwargs)
