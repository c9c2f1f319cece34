"""Save and resume model + optimizer (+ LR scheduler) with ``megatron.core.dist_checkpointing``.

The optimizer state uses Megatron's ``fully_sharded_model_space`` format: every main
param and momentum shard is a flattened slice of a model-space ShardedTensor, so a
checkpoint written on one DP/TP layout loads on another (resharding is done by
dist_checkpointing, not by us).
"""

from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

__all__ = ["save_checkpoint", "load_checkpoint", "sync_params", "SHARDING_TYPE",
           "ScheduleMismatchError", "schedule_differences"]

SHARDING_TYPE = "fully_reshardable"


class ScheduleMismatchError(ValueError):
    """The checkpoint's LR / weight-decay schedule differs from the one asked for, and
    neither ``use_checkpoint_opt_param_scheduler`` nor ``override_opt_param_scheduler``
    says which one wins (Megatron-LM's rule)."""


# OptimizerParamScheduler state -> the command-line flag it comes from
_SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                   "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                   "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
                   "wd_incr_steps": "weight-decay iterations", "wd_incr_style":
                   "--weight-decay-incr-style"}


def schedule_differences(scheduler, saved: dict) -> list:
    """``[(flag, this run's value, checkpoint's value)]`` for every schedule setting that
    differs between ``scheduler`` and a saved ``OptimizerParamScheduler.state_dict()``."""
    now = scheduler.state_dict()
    keys = list(_SCHEDULE_FLAGS)
    if now.get("wd_incr_style") == saved.get("wd_incr_style") == "constant":
        keys.remove("wd_incr_steps")  # a constant weight decay does not depend on it
    return [(_SCHEDULE_FLAGS[k], now[k], saved[k]) for k in keys
            if k in saved and k in now and now[k] != saved[k]]


def _check_schedule(scheduler, saved: dict):
    """Megatron-LM's rule for a schedule that changed on resume, as one clear error (raised
    before anything is loaded) or the one line to print that says which schedule is used."""
    diffs = schedule_differences(scheduler, saved)
    text = ", ".join(f"{flag} {ours} (checkpoint: {theirs})" for flag, ours, theirs in diffs)
    if diffs and scheduler.override_opt_param_scheduler:
        note = f"LR schedule: the command line overrides the checkpoint's: {text}"
    elif diffs and scheduler.use_checkpoint_opt_param_scheduler:
        note = ("LR schedule: using the checkpoint's, not the command line's: "
                + ", ".join(f"{flag} {theirs} (command line: {ours})"
                            for flag, ours, theirs in diffs))
    elif diffs:
        raise ScheduleMismatchError(
            f"the checkpoint's LR schedule differs from this run's: {text}; pass "
            "--use-checkpoint-opt-param-scheduler to keep the checkpoint's or "
            "--override-opt-param-scheduler to use the command line's")
    else:
        note = None
    return note


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _model_state(model: list, is_loading: bool) -> dict:
    model = [_unwrap(m) for m in model]
    if len(model) == 1:
        return {"model": model[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(model)}


def _sharded_state(model, optimizer, scheduler, step: int, is_loading: bool) -> dict:
    if is_loading:
        from .compat import prepare_torch_adam_for_load

        prepare_torch_adam_for_load(optimizer)
    state = _model_state(model, is_loading)
    state["optimizer"] = optimizer.sharded_state_dict(
        dict(state), is_loading=is_loading, metadata={"distrib_optim_sharding_type": SHARDING_TYPE})
    state["iteration"] = step
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def sync_params(model: list) -> None:
    """Make the model parameters final: with ``overlap_param_gather`` (and DMuon's deferred
    updates) they are only all-gathered under the next forward pass.  Megatron-LM does the
    same (``disable_forward_pre_hook``) before it saves or evaluates."""
    for chunk in model:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is not None and ddp.use_distributed_optimizer and ddp.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def save_checkpoint(directory: str, model: list, optimizer, step: int, scheduler=None) -> str:
    """Write ``directory/iter_{step:07d}`` and a ``latest`` pointer; returns the path."""
    from megatron.core import dist_checkpointing

    from .zero3 import gathered_params

    path = os.path.join(directory, f"iter_{step:07d}")
    sync_params(model)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    with gathered_params(model):  # ZeRO-3: parameters materialised while they are written
        dist_checkpointing.save(_sharded_state(model, optimizer, scheduler, step, False), path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "latest"), "w") as fh:
            fh.write(str(step))
    dist.barrier()
    return path


def load_checkpoint(directory: str, model: list, optimizer, scheduler=None,
                    step: Optional[int] = None) -> int:
    """Load the latest (or ``step``) checkpoint in place; returns the step to resume from."""
    from megatron.core import dist_checkpointing

    if step is None:
        latest = os.path.join(directory, "latest")
        if not os.path.exists(latest):
            raise FileNotFoundError(f"no checkpoint in {directory!r} (missing 'latest' file)")
        with open(latest) as fh:
            step = int(fh.read().strip())
    path = os.path.join(directory, f"iter_{step:07d}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    from .zero3 import gathered_params

    note = None
    if scheduler is not None:  # a changed schedule fails before anything is loaded
        saved = dist_checkpointing.load_common_state_dict(path).get("opt_param_scheduler")
        note = _check_schedule(scheduler, saved) if saved is not None else None
    with gathered_params(model):  # ZeRO-3: each rank keeps what it owns of the loaded model
        state = dist_checkpointing.load(_sharded_state(model, optimizer, scheduler, step, True),
                                        path)
        if len(model) == 1:
            _unwrap(model[0]).load_state_dict(state["model"])
        else:
            for i, m in enumerate(model):
                _unwrap(m).load_state_dict(state[f"model{i}"])
    from .compat import load_optimizer_state

    load_optimizer_state(optimizer, state["optimizer"])
    if scheduler is not None and "opt_param_scheduler" in state:
        scheduler.load_state_dict(state["opt_param_scheduler"])
        if note and dist.get_rank() == 0:
            print(note, flush=True)
    return int(state["iteration"])
