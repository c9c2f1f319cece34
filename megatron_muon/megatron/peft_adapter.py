"""PEFT in Megatron-LM's own training loop: LoRA adapters, sMuon, ReLoRA (docs/usage.md).

``patches/megatron-lm-dmuon.patch`` calls into this module at four points and nowhere else:

* ``arguments.py``: ``add_peft_args(parser)`` registers the ``'peft'`` argument group
  (``--lora-*``, ``--relora-*``, ``--smuon-*``; the LoRA flags are named like Megatron-Bridge's
  ``LoRA``: ``--lora-rank`` is its ``dim``) and adds ``smuon`` to ``--optimizer``;
  ``validate_peft_args(args)`` refuses, in one line each, what cannot work.
* ``training.py``, ``setup_model_and_optimizer``: ``LoRAModelBuild(args, cfg_container)``
  adds the adapters (``megatron_muon.peft.lora.apply_lora``) to every model chunk *before*
  any wrapping, on either model-building path: the config container's ``pre_wrap_hooks``
  (stock ``pretrain_gpt.py``) or ``get_model``'s ``model_provider_func``
  (``wrap_provider``).  Megatron DDP then allocates gradient buffers for the adapters only
  and Megatron's optimizers see only them (the frozen base has no optimizer state).
  ``finish(model)`` runs after the build: it decides what the checkpoint Megatron-LM is
  about to load holds and installs the checkpoint view below.
* ``training.py``, the optimizer: ``get_lora_optimizer`` for ``--optimizer smuon`` (and for
  ``--optimizer adam`` with ``--relora-interval``): ``LoRAOptimizer`` (``peft/
  lora_optimizer.py``) behind Megatron's optimizer interface (``LoRAMegatronOptimizer``).
  Every other optimizer (``adam``, ``dmuon`` = Muon on each factor, ...) is Megatron's own,
  on the adapters.

Checkpoints (Megatron's ``--save`` / ``--load``, ``--ckpt-format torch_dist``).  Each model
chunk's ``sharded_state_dict`` is filtered (``_CheckpointView``): a save writes the adapters
only (keys ``....lora.A`` / ``....lora.B``, TP-sharded like their layer, so they reshard to
another TP / PP), plus the optimizer's state, the scheduler, the iteration and the args;
``--lora-save-base`` (and ``--relora-interval``, whose merges change the base) write the
base weights as well.  What a load reads follows from the checkpoint's keys:

* a checkpoint without adapters (a pretrained base; ``--load BASE --finetune`` or
  ``--pretrained-checkpoint BASE``): its base weights; the adapters start fresh;
* an adapter-only checkpoint: the adapters (and, unless ``--finetune`` /
  ``--no-load-optim``, the optimizer); the base weights are loaded here first, from
  ``--pretrained-checkpoint`` if given, else from the base recorded in the checkpoint
  (``args.lora_base_checkpoint``, the exact iteration directory the fine-tuning started
  from);
* a checkpoint with both: everything.

``python -m megatron_muon.peft.merge`` folds the adapters into the base and writes an
ordinary Megatron checkpoint (``peft/merge.py``).

Layers: the local spec's and the Transformer Engine spec's (``lora.py`` lists which TE
layers it adapts and refuses the rest, and TE's fused-op paths, in one line).

Not here: adapter dropout (``--lora-dropout`` > 0 is refused), Megatron-FSDP / torch
FSDP2, ``--dmuon-placement matrix`` / ``--dmuon-zero3``.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Optional

import torch

from megatron.core.optimizer.optimizer import MegatronOptimizer

from megatron_muon.megatron.arguments import DMuonArgumentError

__all__ = ["add_peft_args", "validate_peft_args", "PEFTArgumentError", "LoRAModelBuild",
           "get_lora_optimizer", "LoRAMegatronOptimizer", "PEFT_ARGUMENTS", "LORA_OPTIMIZERS",
           "DEFAULT_TARGET_MODULES", "checkpoint_contents", "load_base_weights"]

#: Megatron-Bridge's ``LoRA.target_modules`` default (experts' linear_fc1 / fc2 included:
#: a name matches every module whose dotted name ends with it).
DEFAULT_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: ``--optimizer`` values that build ``LoRAOptimizer`` (``adam`` only with ReLoRA).
LORA_OPTIMIZERS = ("smuon",)
RELORA_OPTIMIZERS = ("smuon", "adam")
SMUON_WORK = ("distribute", "replicate")
#: The destinations of the 'peft' argument group.
PEFT_ARGUMENTS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules",
                  "lora_save_base", "relora_interval", "relora_reset", "relora_prune_ratio",
                  "smuon_damping", "smuon_work")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
_LORA_KEY = ".lora."


class PEFTArgumentError(DMuonArgumentError):
    """A bad or unsupported ``--lora-*`` / ``--relora-*`` / ``--smuon-*`` combination."""


# ============================================================================== arguments
def _targets(value) -> list:
    items = value if isinstance(value, (list, tuple)) else [value]
    return [t for item in items for t in re.split(r"[,\s]+", str(item)) if t]


def add_peft_args(parser):
    """Register the ``'peft'`` argument group (idempotent) and ``--optimizer smuon``."""
    from megatron_muon.peft.resets import RESETS

    if "--lora-rank" in parser._option_string_actions:
        return parser
    g = parser.add_argument_group(title="peft")
    g.add_argument("--lora-rank", type=int, default=None,
                   help="LoRA adapter rank r (Megatron-Bridge's LoRA 'dim'); turns LoRA on: "
                        "the base weights are frozen, adapters W0 + (alpha / r) B A are added "
                        "to --lora-target-modules")
    g.add_argument("--lora-alpha", type=float, default=32.0,
                   help="LoRA scale numerator: the adapter output is scaled by alpha / r")
    g.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapter input (only 0 is supported)")
    g.add_argument("--lora-target-modules", nargs="+", default=list(DEFAULT_TARGET_MODULES),
                   help="modules that get adapters: names (or dotted name suffixes) of "
                        "ColumnParallelLinear / RowParallelLinear modules or their Transformer "
                        "Engine counterparts (TELayerNormColumnParallelLinear, "
                        "TERowParallelLinear, ...), comma or space "
                        "separated; experts' linear_fc1 / linear_fc2 match too; the aliases "
                        "qkv, proj, fc1, fc2 (dense only) and experts are accepted")
    g.add_argument("--lora-save-base", action="store_true",
                   help="save the frozen base weights with the adapters (default: "
                        "adapter-only checkpoints; on with --relora-interval)")
    g.add_argument("--relora-interval", type=int, default=0,
                   help="ReLoRA: merge the adapters into the base and restart them after every "
                        "this many optimizer steps (0: off); --optimizer smuon or adam")
    g.add_argument("--relora-reset", choices=list(RESETS), default="zero",
                   help="adapter optimizer state at a ReLoRA restart: zero (dropped), prune "
                        "(all but the largest 1 - --relora-prune-ratio of each tensor zeroed), "
                        "keep")
    g.add_argument("--relora-prune-ratio", type=float, default=0.99,
                   help="share of each optimizer state tensor zeroed by --relora-reset prune")
    g.add_argument("--smuon-damping", type=float, default=1e-6,
                   help="sMuon: relative damping of the r x r Gram inverses")
    g.add_argument("--smuon-work", choices=list(SMUON_WORK), default="distribute",
                   help="sMuon: distribute (each TP rank computes some adapters' directions, "
                        "then they are shared) or replicate (every rank computes all); the "
                        "update is bitwise the same")
    action = parser._option_string_actions.get("--optimizer")
    if action is not None and action.choices is not None and "smuon" not in action.choices:
        action.choices = list(action.choices) + ["smuon"]
    return parser


def _given(args, name: str, default) -> bool:
    return getattr(args, name, default) != default


def validate_peft_args(args: Any) -> Any:
    """One-line refusals (``PEFTArgumentError``) for what cannot work; a few settings that
    the adapters make pointless are switched off with a note, as Megatron-LM's own
    ``--freeze-all-layers`` does (``--use-distributed-optimizer`` under sMuon: the adapters'
    state is replicated, a few MB).  Returns ``args``."""
    from megatron_muon.megatron.arguments import reshardable_checkpoints
    from megatron_muon.peft.resets import check_reset

    optimizer = getattr(args, "optimizer", "adam")
    rank = getattr(args, "lora_rank", None)
    relora = getattr(args, "relora_interval", 0) or 0

    def fail(msg):
        raise PEFTArgumentError(msg)

    if not rank:
        if optimizer == "smuon":
            fail("--optimizer smuon trains LoRA adapters: add --lora-rank R")
        for flag, name, default in (("--relora-interval", "relora_interval", 0),
                                    ("--lora-save-base", "lora_save_base", False),
                                    ("--lora-dropout", "lora_dropout", 0.0)):
            if _given(args, name, default):
                fail(f"{flag} needs LoRA: add --lora-rank R")
        return args
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        fail(f"--lora-rank must be an integer >= 1, got {rank!r}")
    alpha = getattr(args, "lora_alpha", 32.0)
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        fail(f"--lora-alpha must be a finite number > 0, got {alpha!r}")
    dropout = getattr(args, "lora_dropout", 0.0)
    if dropout != 0:
        fail(f"--lora-dropout {dropout:g}: dropout on the adapter input is not supported; "
             "use --lora-dropout 0")
    targets = _targets(getattr(args, "lora_target_modules", DEFAULT_TARGET_MODULES))
    if not targets:
        fail("--lora-target-modules is empty; e.g. --lora-target-modules "
             + ",".join(DEFAULT_TARGET_MODULES))
    for t in targets:
        if not _NAME.match(t):
            fail(f"--lora-target-modules {t!r} is not a module name (e.g. linear_qkv, "
                 "decoder.layers.0.mlp.linear_fc2)")
    args.lora_target_modules = targets
    if optimizer in ("dmuon", "muon_naive"):
        if getattr(args, "dmuon_placement", "dmuon") == "matrix" or getattr(args, "dmuon_zero3",
                                                                            False):
            fail("--dmuon-placement matrix / --dmuon-zero3 place the full weights in the DDP "
                 "buffers; with --lora-rank only the adapters train: use --optimizer smuon, "
                 "or dmuon with its default placement")
    if optimizer == "smuon":
        from megatron_muon.megatron.config import config_defaults

        defaults = config_defaults()
        for name in sorted(n for n in vars(args) if n.startswith("dmuon_") and n in defaults):
            if getattr(args, name) != defaults[name]:
                fail(f"--{name.replace('_', '-')} is a dmuon flag; --optimizer smuon does not "
                     "read it (its settings: --muon-momentum, --muon-nesterov, "
                     "--muon-num-ns-steps, --muon-coefficient-type, --muon-scale-mode, "
                     "--muon-extra-scale-factor, --smuon-*)")
    else:
        for flag, name, default in (("--smuon-damping", "smuon_damping", 1e-6),
                                    ("--smuon-work", "smuon_work", "distribute")):
            if _given(args, name, default):
                fail(f"{flag} is read only by --optimizer smuon")
    if relora:
        if isinstance(relora, bool) or not isinstance(relora, int) or relora < 0:
            fail(f"--relora-interval must be an integer >= 0, got {relora!r}")
        if optimizer not in RELORA_OPTIMIZERS:
            fail(f"--relora-interval needs --optimizer smuon or adam (the restarts reset the "
                 f"adapters' optimizer state), not {optimizer}")
        try:
            check_reset(args.relora_reset, args.relora_prune_ratio)
        except ValueError as err:
            fail(f"--relora-reset / --relora-prune-ratio: {err}")
    if getattr(args, "fp16", False) and (optimizer == "smuon" or relora):
        fail("--fp16 needs a loss scaler, which the LoRA optimizer has not: use --bf16 "
             "(or fp32)")
    for flag, name in (("--use-megatron-fsdp", "use_megatron_fsdp"),
                       ("--use-torch-fsdp2", "use_torch_fsdp2"),
                       ("--moe-use-upcycling", "moe_use_upcycling")):
        if getattr(args, name, False):
            fail(f"{flag} does not run with --lora-rank (LoRA adds adapters to Megatron DDP "
                 "models); drop it")
    if getattr(args, "ckpt_format", "torch_dist") != "torch_dist" and (
            getattr(args, "save", None) or getattr(args, "load", None)
            or getattr(args, "pretrained_checkpoint", None)):
        fail(f"--ckpt-format {args.ckpt_format}: LoRA checkpoints need --ckpt-format "
             "torch_dist")
    if optimizer == "smuon" or relora:
        # LoRAOptimizer reads full data-parallel gradients (Megatron DDP's all-reduce)
        for name, flag in (("use_distributed_optimizer", "--use-distributed-optimizer"),
                           ("overlap_param_gather", "--overlap-param-gather")):
            if getattr(args, name, False):
                _note(args, f"{flag} is switched off: the LoRA optimizer keeps the adapters' "
                            "(small) state replicated and reads all-reduced gradients")
                setattr(args, name, False)
    if getattr(args, "use_distributed_optimizer", False):
        reshardable_checkpoints(args)  # adapters and their state reshard to another TP / PP
    return args


def _note(args, msg: str) -> None:
    if getattr(args, "rank", 0) == 0:
        print(f"megatron-muon PEFT: {msg}", flush=True)


# ============================================================================== checkpoints
def _is_lora_key(key: str) -> bool:
    return _LORA_KEY in f".{key}"


def _special(key: str) -> bool:
    head = key.split("/", 1)[0]
    return head.startswith("optimizer") or head in ("rng_state", "rerun_state_machine_state",
                                                     "common_state")


def checkpoint_contents(directory: str) -> tuple[bool, bool]:
    """``(has_base, has_adapters)`` of a torch_dist checkpoint directory (an iteration
    folder), from its storage metadata: the keys of the model's tensors."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(directory).read_metadata().state_dict_metadata.keys()
    model = [k for k in keys if not _special(k)]
    lora = any(_is_lora_key(k) for k in model)
    base = any(not _is_lora_key(k.split("/", 1)[0]) for k in model)
    return base, lora


def _iteration_dir(root: str, step: Optional[int] = None) -> Optional[str]:
    """The iteration folder Megatron-LM loads from checkpoint ``root`` (its tracker, or
    ``step``); ``root`` may be an iteration folder itself.  None when there is none."""
    from megatron.training.checkpointing import (checkpoint_exists, get_checkpoint_name,
                                                 get_checkpoint_tracker_filename, read_metadata)

    if root is None:
        return None
    if not checkpoint_exists(root):
        if os.path.isfile(os.path.join(root, ".metadata")):
            return os.path.abspath(root)
        return None
    iteration, release = read_metadata(get_checkpoint_tracker_filename(root))
    if step:
        iteration, release = step, False
    return os.path.abspath(get_checkpoint_name(root, iteration, release, return_base_dir=True))


def _filter(sd, keep):
    if not isinstance(sd, dict):
        return sd
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict) and not hasattr(v, "key"):
            sub = _filter(v, keep)
            if sub:
                out[k] = sub
            continue
        key = getattr(v, "key", None) or str(k)
        if keep(_is_lora_key(str(k)) or _is_lora_key(key)):
            out[k] = v
    return out


_MODES = {"full": lambda lora: True, "adapters": lambda lora: lora,
          "base": lambda lora: not lora}


class _CheckpointView:
    """What a model chunk's ``sharded_state_dict`` / ``load_state_dict`` cover: the adapters
    (``adapters``), the base weights (``base``) or both (``full``).  A load uses
    ``load_mode`` (what the checkpoint holds); after it, and for every save, ``save_mode``."""

    def __init__(self, chunk, save_mode: str, load_mode: Optional[str]):
        from megatron_muon.megatron import hooks

        self.chunk, self.save_mode, self.load_mode = chunk, save_mode, load_mode
        self._handles = [
            hooks.replace(chunk, "sharded_state_dict", self.sharded_state_dict,
                          owner="PEFT checkpoint"),
            hooks.replace(chunk, "load_state_dict", self.load_state_dict,
                          owner="PEFT checkpoint")]

    @property
    def mode(self) -> str:
        return self.load_mode or self.save_mode

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = type(self.chunk).sharded_state_dict(self.chunk, prefix, sharded_offsets, metadata)
        return _filter(sd, _MODES[self.mode])

    def load_state_dict(self, state_dict, strict=True, *args, **kwargs):
        mode, self.load_mode = self.mode, None
        result = type(self.chunk).load_state_dict(self.chunk, state_dict, strict=False, *args,
                                                  **kwargs)
        keep = _MODES[mode]
        missing = [k for k in result.missing_keys if keep(_is_lora_key(k))
                   and not k.endswith("_extra_state")]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"LoRA checkpoint load ({mode}): missing {missing[:4]}, "
                               f"unexpected {list(result.unexpected_keys)[:4]}")
        return result


def load_base_weights(chunks, directory: str) -> None:
    """Load the base weights of ``chunks`` (unwrapped) from a torch_dist checkpoint folder
    (any TP / PP layout: dist-checkpointing reshards).  Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    metadata = dict(dist_checkpointing.load_content_metadata(directory) or {})
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    request = {}
    for i, chunk in enumerate(chunks):
        sd = type(chunk).sharded_state_dict(chunk, metadata=metadata)
        request[f"model{i}"] = _filter(sd, _MODES["base"])
    loaded = dist_checkpointing.load(request, directory)
    for i, chunk in enumerate(chunks):
        result = type(chunk).load_state_dict(chunk, loaded[f"model{i}"], strict=False)
        missing = [k for k in result.missing_keys if not _is_lora_key(k)
                   and not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"LoRA base {directory}: missing {missing[:4]}, unexpected "
                               f"{list(result.unexpected_keys)[:4]}")


class LoRAModelBuild:
    """Adds the adapters while Megatron-LM builds the model (see the module docstring)."""

    def __init__(self, args, cfg_container=None):
        from megatron_muon.peft.lora import LoRAConfig

        self.args = args
        self.config = LoRAConfig(rank=int(args.lora_rank), alpha=float(args.lora_alpha),
                                 targets=_targets(args.lora_target_modules),
                                 seed=int(getattr(args, "seed", 0)))
        self.adapters: list = []
        self.views: list = []
        model_cfg = getattr(cfg_container, "model", None) if cfg_container is not None else None
        if model_cfg is not None:
            model_cfg.pre_wrap_hooks.append(self.pre_wrap_hook)

    # -------------------------------------------------------------------- the build
    def _add(self, chunk):
        from megatron_muon.peft.lora import apply_lora

        try:
            self.adapters += apply_lora(chunk, self.config)
        except ValueError as err:  # unknown target, a layer type LoRA does not know, ...
            raise ValueError(f"--lora-target-modules {','.join(self.config.targets)}: "
                             f"{err}") from None
        return chunk

    def pre_wrap_hook(self, chunks):
        """The config container's pre-wrap hook: the bare chunks, before Float16Module / DDP."""
        for chunk in chunks:
            self._add(chunk)
        return chunks

    def wrap_provider(self, provider):
        """``get_model``'s ``model_provider_func``, adding adapters to each chunk it builds."""
        if provider is None:
            return None

        def lora_model_provider(*args, **kwargs):
            return self._add(provider(*args, **kwargs))

        return lora_model_provider

    # -------------------------------------------------------------------- after the build
    def finish(self, model) -> None:
        """Decide what the coming checkpoint load reads, install the checkpoint views, load
        the base weights for an adapter-only checkpoint, and log what was built."""
        from megatron.core.utils import unwrap_model

        from megatron_muon.peft.lora import lora_adapters

        args = self.args
        model = model if isinstance(model, (list, tuple)) else [model]
        chunks = [unwrap_model(m) for m in model]
        if not lora_adapters(chunks):
            raise ValueError("--lora-rank: no adapter was added while the model was built "
                             "(a model-building path megatron-muon does not know)")
        save_mode = "full" if (getattr(args, "lora_save_base", False)
                               or getattr(args, "relora_interval", 0)) else "adapters"
        load_mode, base_dir = None, None
        target, finetune = self._megatron_load_target()
        if target is not None:
            has_base, has_lora = checkpoint_contents(target)
            if has_base and has_lora:
                load_mode = "full"
            elif has_base:
                if not finetune:
                    raise ValueError(
                        f"--load {args.load}: the checkpoint holds no LoRA adapters (a base "
                        "model): add --finetune, or give it as --pretrained-checkpoint")
                load_mode = "base"
                args.lora_base_checkpoint = target
            elif has_lora:
                load_mode = "adapters"
                base_dir = self._base_for(target)
                args.lora_base_checkpoint = base_dir
            else:
                raise ValueError(f"{target}: no model weights in this checkpoint")
        for chunk in chunks:
            self.views.append(_CheckpointView(chunk, save_mode, load_mode))
        if base_dir is not None:
            load_base_weights(chunks, base_dir)
        if getattr(args, "rank", 0) == 0:
            n = sum(a.A.numel() + a.B.numel() for a in self.adapters)
            print(f"megatron-muon PEFT: {len(self.adapters)} LoRA adapters on this rank "
                  f"(rank {self.config.rank}, alpha {self.config.alpha:g}, targets "
                  f"{','.join(self.config.targets)}), {n} trainable parameters; "
                  f"checkpoints: {'adapters + base' if save_mode == 'full' else 'adapters only'}"
                  + (f"; loading {load_mode} from {target}" if target else "")
                  + (f", base weights from {base_dir}" if base_dir else ""), flush=True)

    def _megatron_load_target(self) -> tuple[Optional[str], bool]:
        """The iteration folder Megatron-LM's ``load_checkpoint`` will read, and whether it
        loads it as ``--finetune`` (its own fallback to ``--pretrained-checkpoint`` sets it)."""
        from megatron.training.checkpointing import checkpoint_exists

        args = self.args
        load = getattr(args, "load", None)
        pretrained = getattr(args, "pretrained_checkpoint", None)
        step = getattr(args, "ckpt_step", None)
        if pretrained is not None and not checkpoint_exists(load):
            return _iteration_dir(pretrained, step), True
        if load is None or not checkpoint_exists(load):
            return None, bool(getattr(args, "finetune", False))
        return _iteration_dir(load, step), bool(getattr(args, "finetune", False))

    def _base_for(self, adapters_dir: str) -> str:
        from megatron.core import dist_checkpointing

        args = self.args
        pretrained = getattr(args, "pretrained_checkpoint", None)
        if pretrained is not None:
            base = _iteration_dir(pretrained)
            if base is None:
                raise ValueError(f"--pretrained-checkpoint {pretrained}: no checkpoint there")
        else:
            saved = dist_checkpointing.load_common_state_dict(adapters_dir).get("args")
            base = getattr(saved, "lora_base_checkpoint", None)
            if base is None:
                raise ValueError(f"{adapters_dir} holds LoRA adapters only and records no base "
                                 "model: give it with --pretrained-checkpoint BASE")
        if not os.path.isfile(os.path.join(base, ".metadata")):
            raise ValueError(f"LoRA base model {base}: no torch_dist checkpoint there "
                             "(give it with --pretrained-checkpoint BASE)")
        has_base, _ = checkpoint_contents(base)
        if not has_base:
            raise ValueError(f"LoRA base model {base} holds no base weights")
        return base


# ============================================================================== the optimizer
def _replica_id(adapter):
    from megatron.core import parallel_state as ps

    if adapter.is_expert:
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())
    return (ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(with_context_parallel=True))


def get_lora_optimizer(config, model, config_overrides=None, **kwargs):
    """``--optimizer smuon`` (or ``adam`` with ``--relora-interval``): the adapters'
    ``LoRAOptimizer`` as a Megatron optimizer.  ``config`` is Megatron's ``OptimizerConfig``
    (lr, weight decay, clipping, Adam betas); the Muon settings are Megatron-LM's
    ``--muon-*`` flags."""
    from megatron.training import get_args

    from megatron_muon.peft.lora_optimizer import LoRAOptimizer
    from megatron_muon.peft.relora import ReLoRA

    args = get_args()
    kind = "smuon" if args.optimizer == "smuon" else "adam"
    inner = LoRAOptimizer(
        model, kind, lr=config.lr, weight_decay=config.weight_decay,
        clip_grad=float(config.clip_grad or 0.0), momentum=float(args.muon_momentum),
        nesterov=bool(getattr(args, "muon_nesterov", False)),
        ns_steps=int(args.muon_num_ns_steps), coefficient_type=args.muon_coefficient_type,
        scale_mode=args.muon_scale_mode, extra_scale_factor=float(args.muon_extra_scale_factor),
        damping=float(args.smuon_damping), adam_betas=(config.adam_beta1, config.adam_beta2),
        adam_eps=config.adam_eps, smuon_work=args.smuon_work)
    relora = None
    if getattr(args, "relora_interval", 0):
        relora = ReLoRA(model, inner, restart_every=int(args.relora_interval),
                        reset=args.relora_reset, prune_ratio=float(args.relora_prune_ratio),
                        seed=int(args.seed))
    return LoRAMegatronOptimizer(inner, config, relora)


_STATE_KEYS = {"smuon": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}


class LoRAMegatronOptimizer(MegatronOptimizer):
    """``LoRAOptimizer`` (+ ReLoRA) behind Megatron-Core's ``MegatronOptimizer`` interface:
    ``step()`` -> ``(update_successful, grad_norm, None)``, its ``param_groups`` are the
    inner optimizer's (Megatron's scheduler sets their lr and weight decay), and
    ``sharded_state_dict`` writes the full (TP-unsharded) fp32 masters and state of every
    adapter once (main replica: TP rank 0 / DP rank 0 of its stage), so the state reshards
    to any TP / PP / DP."""

    is_stub_optimizer = False

    def __init__(self, lora_optimizer, config, relora=None):
        super().__init__(lora_optimizer.inner, config)
        self.lora = lora_optimizer
        self.relora = relora
        self.steps = 0
        self._synced = False  # masters re-read from the model before the first step
        for group in self.optimizer.param_groups:
            group["default_config"] = True  # Megatron logs this group's lr
        dev = lora_optimizer.masters[0][0].device
        self._scale = torch.ones(1, dtype=torch.float32, device=dev)

    # ---------------------------------------------------------------- the step
    def zero_grad(self, set_to_none: bool = True):
        self.lora.zero_grad(set_to_none)

    def get_loss_scale(self):
        return self._scale

    def prepare_grads(self) -> bool:
        return False

    def step_with_ready_grads(self) -> bool:
        return self.step()[0]

    @torch.no_grad()
    def step(self):
        if not self._synced:
            self.reload_model_params()
        ok, norm, _ = self.lora.step()
        if ok:
            self.steps += 1
            if self.relora is not None and self.relora.due(self.steps):
                self.relora.restart()
        return ok, norm, None

    @torch.no_grad()
    def reload_model_params(self, state_dict=None):
        """Masters <- the model's adapters (after a model-only load, or at the start)."""
        for ad, (A, B) in zip(self.lora.adapters, self.lora.masters):
            A_full, B_full = ad.gather_full(canonical=True)
            A.copy_(A_full)
            B.copy_(B_full)
        self._synced = True

    # ---------------------------------------------------------------- state
    def _state_of(self, t) -> dict:
        state = self.optimizer.state[t]
        for key in _STATE_KEYS[self.lora.kind]:
            if key not in state:  # never stepped, or reset: zeros are the same state
                state[key] = torch.zeros_like(t)
        if self.lora.kind == "adam" and "step" not in state:
            state["step"] = torch.tensor(0.0)
        return state

    def _common(self) -> dict:
        common = {"kind": self.lora.kind, "steps": self.steps,
                  "groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in self.optimizer.param_groups]}
        if self.lora.kind == "adam":
            steps = {float(self._state_of(t)["step"]) for pair in self.lora.masters
                     for t in pair}
            common["adam_step"] = steps.pop() if len(steps) == 1 else None
        if self.relora is not None:
            common["relora"] = self.relora.state_dict()
        return common

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False,
                           metadata=None, **kwargs):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        out = {}
        for ad, pair in zip(self.lora.adapters, self.lora.masters):
            rep = _replica_id(ad)
            for factor, t in zip(("A", "B"), pair):
                tensors = {"param": t, **{k: v for k, v in self._state_of(t).items()
                                          if k in _STATE_KEYS[self.lora.kind]}}
                for name, value in tensors.items():
                    key = f"optimizer.lora.{ad.global_name}.{factor}.{name}"
                    data = torch.empty_like(value) if is_loading else value
                    out[key] = ShardedTensor.from_rank_offsets(key, data, replica_id=rep)
        out["lora_common"] = self._common()
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        common = state_dict["lora_common"]
        if common["kind"] != self.lora.kind:
            raise ValueError(f"the checkpoint's adapter optimizer is {common['kind']!r}, "
                             f"this run's --optimizer builds {self.lora.kind!r}")
        for ad, pair in zip(self.lora.adapters, self.lora.masters):
            for factor, t in zip(("A", "B"), pair):
                prefix = f"optimizer.lora.{ad.global_name}.{factor}."
                t.copy_(state_dict[prefix + "param"])
                state = self._state_of(t)
                for key in _STATE_KEYS[self.lora.kind]:
                    state[key].copy_(state_dict[prefix + key])
                if self.lora.kind == "adam":
                    state["step"] = torch.tensor(float(common["adam_step"] or 0.0))
        for group, saved in zip(self.optimizer.param_groups, common["groups"]):
            group.update(saved)
        self.steps = int(common["steps"])
        if self.relora is not None:
            if "relora" not in common:
                raise ValueError("the checkpoint was written without --relora-interval")
            self.relora.load_state_dict(common["relora"])
        self.lora._write_back()
        self._synced = True

    def state_dict(self):
        return {"lora": self.lora.state_dict(), "lora_common": self._common()}


