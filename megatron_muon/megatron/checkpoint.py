"""Save and resume model + optimizer (+ LR scheduler) with ``megatron.core.dist_checkpointing``.

Optimizer state is stored in model space, so a checkpoint written on one DP / TP / PP layout
loads on another (dist_checkpointing reshards it): DMuon (and its Lion subset) write, on
every rank, only the rank's own range of each managed parameter's main param and state, as
rectangular blocks of the TP-local tensor at their offsets (``state_dict.py``,
``flat_range_blocks``: nothing is gathered or summed over DP); Megatron's own
DistributedOptimizers (``adam`` and the AdamW subset) use the format ``optim_sharding_type``
names (``SHARDING_TYPE`` by default).  A resumed run saves again; a changed LR schedule follows Megatron-LM's
rule (``--use-checkpoint-opt-param-scheduler`` / ``--override-opt-param-scheduler``); a
damaged checkpoint is one ``CheckpointLoadError`` line, raised before anything loads.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Optional

import torch.distributed as dist

__all__ = ["save_checkpoint", "load_checkpoint", "sync_params", "SHARDING_TYPE", "SHARDING_TYPES",
           "ScheduleMismatchError", "schedule_differences", "CheckpointLoadError",
           "checkpoint_problem", "no_checkpoint_reason"]

SHARDING_TYPE = "fully_reshardable"
#: Formats of Megatron's DistributedOptimizer state that ``save_checkpoint`` can write (and
#: ``load_checkpoint`` reads back, from the checkpoint's own record): ``fully_reshardable``
#: (the default here: loads on any DP / TP / PP layout; Megatron gathers the state on DP rank
#: 0 at save, which costs the stage's state in memory there), ``dp_reshardable``
#: (Megatron-LM's default: every rank writes its own buffers, no gather; reshards across DP
#: only) and ``fully_sharded_model_space``.  DMuon's state has one format of its own.
SHARDING_TYPES = ("fully_reshardable", "dp_reshardable", "fully_sharded_model_space")


# OptimizerParamScheduler state -> the command-line flag it comes from
_SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                   "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                   "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
                   "wd_incr_steps": "weight-decay iterations", "wd_incr_style":
                   "--weight-decay-incr-style"}


def schedule_differences(scheduler, saved: dict) -> list:
    """``[(flag, this run's value, checkpoint's value)]`` for every schedule setting that
    differs between ``scheduler`` and a saved ``OptimizerParamScheduler.state_dict()``."""
    now = scheduler.state_dict()  # the same settings Megatron's load_state_dict checks
    return [(flag, now[k], saved[k]) for k, flag in _SCHEDULE_FLAGS.items()
            if k in saved and k in now and now[k] != saved[k]]


def _check_schedule(scheduler, saved: dict, path: str):
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
            path, dist.get_rank(),
            f"its LR schedule differs from this run's: {text}; pass "
            "--use-checkpoint-opt-param-scheduler to keep the checkpoint's or "
            "--override-opt-param-scheduler to use the command line's", all_ranks=True)
    else:
        note = None
    return note


def _model_keys(model: list) -> list:
    """The checkpoint keys of the model chunks: ``model``, or ``model0``, ``model1``, ..."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _model_state(model: list, is_loading: bool) -> dict:
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(list(model))
    return {k: m.sharded_state_dict() for k, m in zip(_model_keys(chunks), chunks)}


def _sharded_state(model, optimizer, scheduler, step: int, is_loading: bool,
                   sharding_type: str = SHARDING_TYPE) -> dict:
    if is_loading:
        from megatron_muon.megatron.compat import prepare_torch_adam_for_load

        prepare_torch_adam_for_load(optimizer)
    state = _model_state(model, is_loading)
    state["optimizer"] = optimizer.sharded_state_dict(
        dict(state), is_loading=is_loading, metadata={"distrib_optim_sharding_type": sharding_type})
    state["iteration"] = step
    state["optim_sharding_type"] = sharding_type  # what load_checkpoint asks Megatron for
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


class CheckpointLoadError(RuntimeError):
    """A checkpoint that cannot be loaded, as one line: ``cannot load checkpoint <path> on rank
    <r>: <reason>`` (the reason names the file when it is known).

    ``all_ranks``: every rank raised this same error (the ranks agreed on it, so none is left
    waiting in a collective); otherwise only this rank did and the job must be stopped.  After
    a failure inside the load itself the model and optimizer may be partly overwritten: do not
    train on.
    """

    def __init__(self, path: str, rank: int, reason: str, all_ranks: bool = False):
        self.path, self.rank, self.reason, self.all_ranks = path, rank, reason, all_ranks
        super().__init__(f"cannot load checkpoint {path} on rank {rank}: {reason}")


class ScheduleMismatchError(CheckpointLoadError):
    """The checkpoint's LR / weight-decay schedule differs from the one asked for, and
    neither ``use_checkpoint_opt_param_scheduler`` nor ``override_opt_param_scheduler``
    says which one wins (Megatron-LM's rule).  Every rank raises it, before anything loads."""


def _exc_text(exc: BaseException) -> str:
    """``Type: first line of the message`` (one line, bounded)."""
    text = " ".join(str(exc).split())
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _write_atomically(path: str, text: str) -> None:
    """Readers see the old content or the new, never a partial file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fully_parallel_strategy():
    """Megatron-LM's default save strategy (``--ckpt-fully-parallel-save``): the writes of
    DP-replicated tensors (the model's parameters) are spread over the DP group instead of
    all falling to DP rank 0, whose save peak otherwise holds the serialised stage.  Not
    under ZeRO-3, where each parameter lives on its owner only and the owner writes it."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import \
        FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(),
        parallel_state.get_data_parallel_group(with_context_parallel=True))


def save_checkpoint(directory: str, model: list, optimizer, step: int, scheduler=None,
                    optim_sharding_type: str = SHARDING_TYPE) -> str:
    """Write ``directory/iter_{step:07d}`` and a ``latest`` pointer; returns the path.

    ``optim_sharding_type``: the format of Megatron's own distributed optimizers' state (one
    of ``SHARDING_TYPES``; ``load_checkpoint`` reads it from the checkpoint)."""
    from megatron.core import dist_checkpointing

    from megatron_muon.megatron.zero3 import mark_owner_replicas, owner_only

    if optim_sharding_type not in SHARDING_TYPES:
        raise ValueError(f"optim_sharding_type must be one of {', '.join(SHARDING_TYPES)}, "
                         f"got {optim_sharding_type!r}")
    path = os.path.join(directory, f"iter_{step:07d}")
    sync_params(model)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    with owner_only(model):  # ZeRO-3: each owner writes its parameters, nothing gathered
        state = _sharded_state(model, optimizer, scheduler, step, False, optim_sharding_type)
        owned = mark_owner_replicas(model, {k: state[k] for k in _model_keys(model)})
        dist_checkpointing.save(state, path, None if owned else _fully_parallel_strategy())
    dist.barrier()  # every rank has written its part: only now does `latest` name it
    if dist.get_rank() == 0:
        _write_atomically(os.path.join(directory, "latest"), str(step))
    dist.barrier()
    return path


def no_checkpoint_reason(directory: str) -> Optional[str]:
    """Why there is nothing to resume from in ``directory`` (no such directory, no ``latest``
    file), or None when it has a ``latest`` file (which ``load_checkpoint`` then checks).
    Megatron-LM starts from scratch in these cases; this says why."""
    if not os.path.exists(directory):
        return "no such directory"
    if not os.path.isdir(directory):
        return "not a directory"
    if not os.path.exists(os.path.join(directory, "latest")):
        return "no 'latest' file in it (no complete checkpoint was saved there)"
    return None


def _resolve(directory: str, step: Optional[int]) -> tuple[str, int]:
    """The ``iter_XXXXXXX`` directory to load and its step; raises ``_Problem``."""
    named_by = ""
    if step is None:
        why = no_checkpoint_reason(directory)
        if why is not None:
            raise _Problem(directory, why)
        try:
            with open(os.path.join(directory, "latest")) as fh:
                text = fh.read().strip()
        except OSError as err:
            raise _Problem(directory, f"cannot read its 'latest' file ({_exc_text(err)})") from None
        if not text.isdigit():
            shown = text[:40] + ("..." if len(text) > 40 else "")
            raise _Problem(directory, f"its 'latest' file does not hold an iteration number "
                                      f"(it holds {shown!r})")
        step, named_by = int(text), " (its 'latest' file names it)"
    path = os.path.join(directory, f"iter_{step:07d}")
    if not os.path.isdir(path):
        raise _Problem(path, f"no such directory{named_by}")
    return path, step


class _Problem(Exception):
    def __init__(self, path: str, reason: str):
        super().__init__(reason)
        self.path, self.reason = path, reason


def checkpoint_problem(path: str) -> Optional[str]:
    """What is wrong with the files of checkpoint directory ``path`` (one line), or None.

    Checks what ``dist_checkpointing`` needs before it starts to load: ``metadata.json``
    (backend), ``common.pt`` (a complete zip archive; megatron-core >= 0.17 stores that
    state in the torch_dist data instead and writes no such file), and for torch_dist the
    ``.metadata`` index and every ``*.distcp`` file it lists, each at least as long as the
    last item the index places in it.  A truncated or deleted file is found here, by name.
    Reads no tensor data; needs no process group.
    """
    meta_json = os.path.join(path, "metadata.json")
    if not os.path.isfile(meta_json):
        return "file metadata.json is missing (not a complete distributed checkpoint)"
    try:
        with open(meta_json) as fh:
            config = json.load(fh)
        backend = config["sharded_backend"]
    except Exception as err:  # noqa: BLE001 -- any failure to read it is the answer
        return f"file metadata.json is truncated or corrupt ({_exc_text(err)})"
    common = os.path.join(path, "common.pt")
    if os.path.isfile(common):
        why = _common_pt_problem(common)
        if why is not None:
            return why
    elif "common_backend" in config:  # megatron-core < 0.17 keeps non-tensor state there
        return "file common.pt is missing"
    if backend != "torch_dist":
        return None
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return "file .metadata is missing"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        index = FileSystemReader(path).read_metadata()
        needed: dict = {}
        for info in index.storage_data.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    except Exception as err:  # noqa: BLE001
        return f"file .metadata is truncated or corrupt ({_exc_text(err)})"
    for name in sorted(needed):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return f"file {name} is missing"
        size = os.path.getsize(f)
        if size < needed[name]:
            return (f"file {name} is truncated or corrupt ({size} bytes; the checkpoint's "
                    f".metadata places data up to byte {needed[name]})")
    return None


def _common_pt_problem(common: str) -> Optional[str]:
    with open(common, "rb") as fh:
        head = fh.read(4)
    if head not in (b"", b"PK\x03\x04"):  # not torch.save's zip archive: torch.load decides
        return None
    try:
        with zipfile.ZipFile(common) as zf:
            bad = zf.testzip()  # reads every member and checks its CRC
    except Exception as err:  # noqa: BLE001
        return f"file common.pt is truncated or corrupt ({_exc_text(err)})"
    if bad is not None:
        return f"file common.pt is corrupt (its member {bad} fails the CRC check)"
    return None


def _first_problem(problem: Optional[tuple]) -> None:
    """Collective over all ranks: if any rank has a problem ``(path, reason)``, every rank
    raises the same ``CheckpointLoadError`` naming the lowest such rank."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    for rank, p in enumerate(problems):
        if p is not None:
            raise CheckpointLoadError(p[0], rank, p[1], all_ranks=True)


def _dcp_failure(err: BaseException, path: str) -> Optional[CheckpointLoadError]:
    """torch.distributed.checkpoint reports a failure on any rank to every rank (its
    ``CheckpointException`` carries each failed rank's exception), so all ranks can name
    the same rank and reason without another collective."""
    failures = getattr(err, "failures", None)
    if type(err).__name__ != "CheckpointException" or not isinstance(failures, dict) \
            or not failures:
        return None
    rank = min(failures)
    exc = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    return CheckpointLoadError(path, rank, f"its data cannot be read into this model: a file is "
                                           f"corrupt or the checkpoint does not match the model "
                                           f"({_exc_text(exc)})", all_ranks=True)


def load_checkpoint(directory: str, model: list, optimizer, scheduler=None,
                    step: Optional[int] = None) -> int:
    """Load the latest (or ``step``) checkpoint in place; returns the step to resume from.

    Collective over all ranks.  Any failure raises ``CheckpointLoadError`` (one line: the
    checkpoint, the rank, the file when known).  Before anything is read every rank checks
    the ``latest`` pointer and the checkpoint's files (``checkpoint_problem``) and the ranks
    agree, so a missing or truncated file stops all of them at once, nothing loaded.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    me = dist.get_rank()
    try:
        path, step = _resolve(directory, step)
        why = checkpoint_problem(path)
        problem = None if why is None else (path, why)
    except _Problem as p:
        path, problem = p.path, (p.path, p.reason)
    _first_problem(problem)  # all ranks raise, or none

    from megatron_muon.megatron.compat import load_optimizer_state
    from megatron_muon.megatron.zero3 import drop_non_owned, mark_owner_replicas, owner_only

    note = None
    common = dist_checkpointing.load_common_state_dict(path)
    if scheduler is not None:  # a changed schedule fails before anything is loaded
        saved = common.get("opt_param_scheduler")
        note = _check_schedule(scheduler, saved, path) if saved is not None else None
    sharding = common.get("optim_sharding_type", SHARDING_TYPE)  # older checkpoints: the default
    try:
        with owner_only(model):  # ZeRO-3: each rank reads the parameters it owns, no more
            sharded = _sharded_state(model, optimizer, scheduler, step, True, sharding)
            names = _model_keys(model)
            # each parameter's owner is its main replica; the other ranks' entries go
            mark_owner_replicas(model, {n: sharded[n] for n in names})
            dropped = {n: drop_non_owned(model, sharded[n]) for n in names}
            state = dist_checkpointing.load(sharded, path)
            for n, m in zip(names, model):
                result = unwrap_model(m).load_state_dict(state[n], strict=not dropped[n])
                missing = set(getattr(result, "missing_keys", ())) - dropped[n]
                if missing or getattr(result, "unexpected_keys", ()):
                    raise RuntimeError(f"checkpoint does not match the model: missing "
                                       f"{sorted(missing)[:3]}, unexpected "
                                       f"{sorted(result.unexpected_keys)[:3]}")
        load_optimizer_state(optimizer, state["optimizer"])
        if scheduler is not None and "opt_param_scheduler" in state:
            scheduler.load_state_dict(state["opt_param_scheduler"])
            if note and me == 0:
                print(note, flush=True)
        return int(state["iteration"])
    except CheckpointLoadError:
        raise
    except (Exception, _checkpoint_exception_type()) as err:  # DCP's is a BaseException
        agreed = _dcp_failure(err, path)
        if agreed is not None:
            raise agreed from None
        raise CheckpointLoadError(path, me, _exc_text(err)) from err


def _checkpoint_exception_type() -> type:
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover
        return Exception
    return CheckpointException
