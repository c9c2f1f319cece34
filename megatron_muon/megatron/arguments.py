"""Megatron-LM style command-line arguments for ``--optimizer dmuon`` / ``muon_naive``.

The flags are generated from ``DMuonOptimizerConfig``'s fields (``megatron_muon.megatron.
config``: type, default, help text and flag name live there, once), and the values are
checked by the config's own validator, so the command line and the Python API agree.

Three functions, meant to be used from Megatron-LM's ``arguments.py`` (see
``patches/megatron-lm-dmuon.patch``) or from any argparse-based script (the examples):

* ``add_dmuon_args(parser)`` registers an argument group titled ``'dmuon'``.  Megatron-LM
  (0.17+, including the ``megatron/training/arguments.py`` shipped in megatron-core 0.19.2)
  already defines most ``--muon-*`` flags; those are *not* registered again (argparse would
  raise a conflict) but reused.  Only the flags the parser does not have yet are added, so
  the same call works on Megatron-LM's parser and on a plain ``argparse.ArgumentParser``.
  If the parser already has ``--optimizer`` with a ``choices`` list, ``dmuon`` and
  ``muon_naive`` are appended to it; ``--muon-fp32-matmul-prec`` gains ``highest``.
  A ``bool`` field becomes a pair, ``--flag`` / ``--no-flag`` (``--muon-nesterov`` /
  ``--no-muon-nesterov``); older spellings stay accepted (``--muon-no-split-qkv``,
  ``--dmuon-no-log-plan``, ``--no-dmuon-overlap`` = ``--dmuon-overlap off``).
* ``validate_dmuon_args(args)`` runs ``config.check_dmuon_settings`` with messages that
  name the flag (``DMuonArgumentError``, a ``ValueError``); with ``parser=`` it calls
  ``parser.error``.
* ``dmuon_config_from_args(args, base_config=None)`` builds the ``DMuonOptimizerConfig``
  (from Megatron-LM's ``OptimizerConfig`` when given, so lr, weight decay, Adam betas,
  clipping and precision carry over unchanged).

Flags that Megatron-LM 0.19.2 defines and this module reuses (defaults there differ from
``DMuonOptimizerConfig``'s where noted): ``--muon-momentum`` (0.9 in Megatron-LM),
``--muon-nesterov`` (no ``--no-`` form there; its default is off),
``--muon-num-ns-steps``, ``--muon-coefficient-type``, ``--muon-scale-mode``,
``--muon-extra-scale-factor``, ``--muon-fp32-matmul-prec`` (choices low/medium/high
there), ``--muon-no-split-qkv``, ``--muon-scalar-optimizer`` and ``--lion-beta1/2``
(the optimizer of the non-matrix parameters), ``--muon-tp-mode`` (default ``blockwise``
there: for dmuon it counts only when given on the command line, ``duplicated`` /
``distributed`` -> ``--dmuon-tp-mode exact``, ``blockwise`` -> ``blockwise``).  New here:
every ``--dmuon-*`` flag, and ``--adaptive-muon-moment2-method`` / ``-beta2`` / ``-eps``
(Megatron-Core 0.19's config fields; Megatron-LM versions that define the flags are reused,
and their ``--adaptive-muon-moment2-method`` default counts only when given, as
``--muon-tp-mode``'s: ``GIVEN_ONLY``).  The Megatron features dmuon does not run with
(``--use-precision-aware-optimizer``, ``--use-torch-fsdp2``, ``--context-parallel-size`` > 1,
...) are refused by ``validate_dmuon_args`` (``config.check_muon_setup``).  The whole
table, every Megatron-LM optimizer flag: docs/megatron_flags.md.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional, get_args

from megatron_muon.megatron.config import (MUON_OPTIMIZERS, DMuonOptimizerConfig, check_dmuon_settings, choices_of,
                     cli_fields, config_defaults, flag_of)

__all__ = [
    "add_dmuon_args",
    "validate_dmuon_args",
    "dmuon_config_from_args",
    "DMuonArgumentError",
    "MUON_ARGUMENTS",
    "DMUON_ARGUMENTS",
    "megatron_given",
    "GIVEN_ONLY",
    "reshardable_checkpoints",
]

_MUON_OPTIMIZERS = MUON_OPTIMIZERS

#: The destinations of the generated flags (the config field names), Muon then DMuon.
MUON_ARGUMENTS = tuple(f.name for f in cli_fields()
                       if f.name.startswith(("muon_", "adaptive_muon_")))
DMUON_ARGUMENTS = tuple(f.name for f in cli_fields() if f.name.startswith("dmuon_"))


class DMuonArgumentError(ValueError):
    """A bad ``--muon-*`` / ``--dmuon-*`` value; the message names the flag."""


#: Megatron-LM flags that dmuon maps onto its own settings and whose Megatron-LM parser
#: defaults must not count: ``--muon-tp-mode`` ('blockwise' there; dmuon's default is exact)
#: and ``--adaptive-muon-moment2-method`` ('adamuon' in Megatron-LM versions that have the
#: flag; dmuon's default is plain Muon).  Each counts only when given on the command line.
GIVEN_ONLY = ("muon_tp_mode", "adaptive_muon_moment2_method")


def given_marker(dest: str) -> str:
    """The namespace attribute that records that Megatron-LM's flag for ``dest`` was given
    (False by default once ``add_dmuon_args`` has marked the flag)."""
    return f"dmuon_{dest}_given"


TP_MODE_GIVEN = given_marker("muon_tp_mode")


class _StoreMarkingGiven(argparse._StoreAction):
    """Megatron-LM's flag for a ``GIVEN_ONLY`` setting (a plain store), also recording that
    it was given."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        setattr(namespace, given_marker(self.dest), True)


def megatron_given(args: Any, name: str) -> Optional[Any]:
    """``args.<name>`` for a ``GIVEN_ONLY`` setting if the user gave it (or a hand-made
    namespace sets it), else None (Megatron-LM's parser default, which dmuon ignores)."""
    if getattr(args, given_marker(name), True) is False:
        return None
    return getattr(args, name, None)


class _Switch(argparse.Action):
    """A boolean flag with its negation: ``--x`` sets True, ``--no-x`` (and any other
    ``off`` spelling) False.  ``--help`` lists the positive flag first, so its
    ``(default: True)`` reads the right way round."""

    def __init__(self, option_strings, dest, off=(), default=None, help=None, **kwargs):
        self.off = tuple(off)
        super().__init__(option_strings=list(option_strings) + list(self.off), dest=dest,
                         nargs=0, default=default, help=help, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.off)

    def format_usage(self) -> str:  # the usage line: [--x | --no-x]
        return f"{self.option_strings[0]} | {self.off[0]}"


def flag_specs() -> list:
    """``(dest, option strings, argparse kwargs)`` for every generated flag, in order; one
    field can give several (its value aliases, e.g. ``--no-dmuon-overlap``)."""
    specs = []
    for f in cli_fields():
        meta, flag = f.metadata, flag_of(f.name)
        aliases = meta.get("aliases") or {}
        if f.type is bool:
            off = ["--no-" + flag[2:]] + [a for a, v in aliases.items() if v is False]
            on = [flag] + [a for a, v in aliases.items() if v is True]
            specs.append((f.name, on, dict(action=_Switch, off=off, default=f.default,
                                           help=meta["help"])))
            continue
        choices = choices_of(f)
        kwargs = dict(default=f.default, help=meta["help"])
        if choices is not None:
            kwargs["type"] = type(choices[0])
            if meta.get("cli_choices", True):
                kwargs["choices"] = list(choices)
            else:
                kwargs["metavar"] = "{" + ",".join(choices) + "}"
        else:
            kinds = [a for a in get_args(f.type) if a is not type(None)] or [f.type]
            kwargs["type"] = kinds[0]
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        specs.append((f.name, [flag], kwargs))
        for alias, value in aliases.items():
            specs.append((f.name, [alias], dict(action="store_const", const=value,
                                                default=argparse.SUPPRESS,
                                                help=f"Same as {flag} {value}.")))
    return specs


def _existing(parser: argparse.ArgumentParser, dest: str, options):
    """The action already registered for one of ``options`` (or for ``dest``), else None."""
    for option in options:
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
    group = next((g for g in parser._action_groups if g.title == "dmuon"), None)
    skipped, added = set(), set()  # skipped: Megatron-LM (or an earlier call) has the flag
    for dest, options, kwargs in flag_specs():
        options_all = options + list(kwargs.get("off", ()))
        if dest in skipped:
            continue
        action = _existing(parser, dest if dest not in added else None, options_all)
        if action is not None:
            if dest == "muon_fp32_matmul_prec":
                _extend_choices(action, ["highest"])  # Megatron-LM: low/medium/high
            if dest in GIVEN_ONLY and type(action) is argparse._StoreAction:
                action.__class__ = _StoreMarkingGiven  # its default is not a choice for dmuon
                parser.set_defaults(**{given_marker(dest): False})
            skipped.add(dest)
            continue
        if group is None:
            group = parser.add_argument_group(title="dmuon")
        group.add_argument(*options, dest=dest, **kwargs)
        added.add(dest)
    if group is None:
        group = parser.add_argument_group(title="dmuon")  # keep the group visible in --help
    _extend_choices(parser._option_string_actions.get("--optimizer"), list(_MUON_OPTIMIZERS))
    return parser


def validate_dmuon_args(args: Any, parser: Optional[argparse.ArgumentParser] = None) -> Any:
    """Check the Muon / DMuon values of ``args`` when ``args.optimizer`` is dmuon/muon_naive.

    The checks are ``DMuonOptimizerConfig``'s (``config.check_dmuon_settings``), plus what
    only the command line knows (Megatron-LM's ``--overlap-grad-reduce``,
    ``--context-parallel-size``, ``--use-torch-fsdp2``, ...: ``config.check_muon_setup``).
    Raises ``DMuonArgumentError`` (or calls ``parser.error``: usage + ``error: msg``, exit
    code 2) with a message naming the flag.
    Returns ``args`` unchanged otherwise.
    """
    if getattr(args, "optimizer", None) not in _MUON_OPTIMIZERS:
        return args
    defaults = config_defaults()  # a hand-made namespace may lack some flags

    def get(name):
        if name in GIVEN_ONLY:
            return megatron_given(args, name)
        return getattr(args, name, defaults.get(name))

    try:
        check_dmuon_settings(get, cli=True, error=DMuonArgumentError)
    except DMuonArgumentError as err:
        if parser is not None:
            parser.error(str(err))
        raise
    reshardable_checkpoints(args)
    return args


def reshardable_checkpoints(args: Any) -> Any:
    """Megatron-LM's torch_dist checkpoints of a dmuon run reshard to any TP / PP / DP.

    DMuon's own state is always saved in model space; the AdamW (or Lion) subset is
    Megatron's ``DistributedOptimizer``, whose default ``dp_reshardable`` format (flat
    buckets) makes Megatron-LM refuse a TP or PP change on load.  Under dmuon that subset is
    the embeddings, the output layer, norms and biases, so its fully reshardable format
    (``--dist-ckpt-optim-fully-reshardable``) is the default.  Megatron-LM's local
    non-persistent checkpoints do not support that format: with
    ``--non-persistent-ckpt-type local`` the flag is left as given.
    """
    if getattr(args, "non_persistent_ckpt_type", None) == "local":
        return args
    if hasattr(args, "dist_ckpt_optim_fully_reshardable"):
        args.dist_ckpt_optim_fully_reshardable = True
    return args


def dmuon_config_from_args(args: Any, base_config: Any = None):
    """A ``DMuonOptimizerConfig`` from ``args`` (and Megatron's ``OptimizerConfig``, if given).

    With ``base_config`` (what Megatron-LM's ``get_megatron_optimizer_config`` built), every
    field of it is kept; the Muon and DMuon fields and ``optimizer`` come from ``args``.
    Without it, every ``DMuonOptimizerConfig`` field that ``args`` has is taken from ``args``.
    """
    init_fields = {f.name for f in dataclasses.fields(DMuonOptimizerConfig) if f.init}
    kwargs: dict = {}
    if base_config is not None:
        for f in dataclasses.fields(base_config):
            if f.init and f.name in init_fields:
                kwargs[f.name] = getattr(base_config, f.name)
        # adaptive_muon_*: Megatron-LM 0.19 has the config fields but no flags; ours set them
        from_args = [n for n in init_fields
                     if n.startswith(("muon_", "dmuon_", "adaptive_muon_", "lion_"))]
    else:
        from_args = list(init_fields)
    for name in from_args:
        if hasattr(args, name):
            kwargs[name] = getattr(args, name)
    for name in GIVEN_ONLY:  # Megatron-LM's defaults of these do not count (see GIVEN_ONLY)
        value = megatron_given(args, name)
        if value is not None:
            kwargs[name] = value
        elif name != "adaptive_muon_moment2_method" or \
                getattr(base_config, "optimizer", None) != "adaptive_muon":
            # Megatron's config default ('adamuon') means nothing outside adaptive_muon
            kwargs.pop(name, None)
    kwargs["optimizer"] = getattr(args, "optimizer", kwargs.get("optimizer", "dmuon"))
    if "muon_use_nesterov" in init_fields and "muon_nesterov" in kwargs:
        kwargs["muon_use_nesterov"] = kwargs["muon_nesterov"]  # megatron-core 0.16 spelling
    return DMuonOptimizerConfig(**kwargs)
