"""Fold LoRA adapters into their base model: an ordinary Megatron-LM checkpoint (no LoRA).

    python -m megatron_muon.peft.merge --base BASE --adapters ADAPTERS --out OUT

``ADAPTERS`` is a checkpoint that Megatron-LM's ``--save`` wrote with ``--lora-rank``
(``megatron_muon/megatron/peft_adapter.py``): adapter-only (the default) or with the base
weights (``--lora-save-base``, ``--relora-interval``; those base weights are then the ones
merged into, and ``--base`` may be left out).  ``BASE`` is the base model's checkpoint
(default: the one the adapters recorded, ``args.lora_base_checkpoint``).  Each may be a
checkpoint root (its ``latest_checkpointed_iteration.txt`` picks the iteration, or
``--adapters-step`` / ``--base-step``) or an iteration folder.  Both must be
``--ckpt-format torch_dist``; any TP / PP layout (the tensors are read whole).

For every adapted layer ``P`` (keys ``P.lora.A``: ``[..., r, n]``, ``P.lora.B``:
``[..., m, r]``, the leading axes Megatron's stacked layers / experts) the merged weight is
``P.weight + (alpha / r) B @ A``, computed in float64 and rounded once to the weight's
dtype.  Every other model tensor and object is the base's, bit for bit.  ``OUT`` gets a
``release`` checkpoint (tracker ``release``), as Megatron-LM's converted checkpoints are:
Megatron-LM loads it with a plain ``--load OUT`` (iteration 0, no optimizer and RNG state,
``no_save_optim`` / ``no_save_rng`` set in its args) or with ``--finetune``, on any TP / PP
layout, and needs no LoRA flag.

One process on CPU (a one-rank gloo group for Megatron's dist-checkpointing, and
``megatron_muon.megatron.cpu_mode`` where there is no CUDA); the whole
model is held in memory once, plus the adapters.  Bad input ends with ``error: ...`` and
exit code 2.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

__all__ = ["merge", "main", "iteration_dir"]

TRACKER = "latest_checkpointed_iteration.txt"
_SPECIAL = ("optimizer", "rng_state", "rerun_state_machine_state", "common_state")


class MergeError(ValueError):
    pass


def iteration_dir(path: str, step=None) -> str:
    """The iteration folder of checkpoint ``path`` (a root with a tracker, or the folder)."""
    path = os.path.abspath(os.path.expanduser(path))
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        if step is not None:
            text = str(int(step))
        folder = "release" if text == "release" else f"iter_{int(text):07d}"
        path = os.path.join(path, folder)
    elif step is not None:
        raise MergeError(f"{path}: no {TRACKER} (give the checkpoint root with a step, or the "
                         "iteration folder)")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise MergeError(f"{path}: not a torch_dist checkpoint (no .metadata)")
    return path


def _is_special(key: str) -> bool:
    return key.split("/", 1)[0].startswith(_SPECIAL)


def _is_lora(key: str) -> bool:
    return ".lora." in f".{key}"


def _model_entries(directory: str) -> dict:
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {k: v for k, v in load_sharded_metadata(directory).items() if not _is_special(k)}


def _load(entries: dict, directory: str) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(dict(entries), directory) if entries else {}


def merge(base: str, adapters: str, out: str, base_step=None, adapters_step=None,
          log=print) -> dict:
    """Write the merged checkpoint; returns ``{"adapted": [weight keys], "gamma": g}``.
    Needs ``torch.distributed`` initialised (``main`` does it: one gloo rank)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    adir = iteration_dir(adapters, adapters_step)
    common = dist_checkpointing.load_common_state_dict(adir)
    ad_args = common.get("args")
    rank, alpha = getattr(ad_args, "lora_rank", None), getattr(ad_args, "lora_alpha", None)
    if not rank:
        raise MergeError(f"{adir} was not written with --lora-rank (no LoRA settings in its "
                         "args)")
    gamma = float(alpha) / int(rank)
    a_entries = _model_entries(adir)
    lora_keys = sorted(k for k in a_entries if _is_lora(k))
    if not lora_keys:
        raise MergeError(f"{adir} holds no LoRA adapters")
    own_base = [k for k in a_entries if not _is_lora(k.split("/", 1)[0])]
    if own_base:
        bdir = adir  # --lora-save-base / ReLoRA: the checkpoint's own (merged) base weights
        if base is not None:
            log(f"merge: {adir} holds its own base weights; --base {base} is not read")
    else:
        if base is None:
            base = getattr(ad_args, "lora_base_checkpoint", None)
            if base is None:
                raise MergeError(f"{adir} records no base model: give --base")
        bdir = iteration_dir(base, base_step)
        recorded = getattr(ad_args, "lora_base_checkpoint", None)
        if recorded and os.path.abspath(recorded) != bdir:
            log(f"merge: note: the adapters were trained on {recorded}, merging into {bdir}")
    b_entries = {k: v for k, v in _model_entries(bdir).items() if not _is_lora(k)}
    base_common = dist_checkpointing.load_common_state_dict(bdir)
    content = dist_checkpointing.load_content_metadata(preloaded_state_dict=base_common)

    loaded = _load(b_entries, bdir)
    factors = _load({k: a_entries[k] for k in lora_keys}, adir)
    adapted = []
    for key in lora_keys:
        if not key.endswith(".lora.A"):
            continue
        prefix = key[: -len(".lora.A")]
        A, B = factors[key], factors.get(prefix + ".lora.B")
        wkey = prefix + ".weight"
        if B is None or wkey not in loaded:
            raise MergeError(f"{prefix}: LoRA factors without "
                             f"{'B' if B is None else 'a base weight ' + wkey}")
        W = loaded[wkey]
        if A.shape[:-2] != W.shape[:-2] or B.shape[-2] != W.shape[-2] \
                or A.shape[-1] != W.shape[-1] or A.shape[-2] != B.shape[-1]:
            raise MergeError(f"{prefix}: adapter shapes A {tuple(A.shape)}, B {tuple(B.shape)} "
                             f"do not fit the base weight {tuple(W.shape)}")
        merged = W.double() + gamma * (B.double() @ A.double())
        loaded[wkey] = merged.to(W.dtype)
        adapted.append(wkey)

    state = {}
    for key, entry in b_entries.items():
        if isinstance(entry, ShardedObject):
            state[key] = ShardedObject(entry.key, loaded[key], entry.global_shape,
                                       entry.global_offset, replica_id=0)
        elif isinstance(entry, ShardedTensor):
            state[key] = ShardedTensor.from_rank_offsets(entry.key, loaded[key].contiguous())
    args = copy.deepcopy(base_common.get("args"))
    if args is not None:
        for name, value in (("lora_rank", None), ("relora_interval", 0),
                            ("lora_save_base", False), ("no_save_optim", True),
                            ("no_save_rng", True), ("consumed_train_samples", 0),
                            ("skipped_train_samples", 0), ("consumed_valid_samples", 0)):
            setattr(args, name, value)
        args.lora_merged_from = {"base": bdir, "adapters": adir, "gamma": gamma}
    state.update(args=args, checkpoint_version=base_common.get("checkpoint_version", 3.0),
                 iteration=0, num_floating_point_operations_so_far=0)
    out = os.path.abspath(os.path.expanduser(out))
    target = os.path.join(out, "release")
    if os.path.exists(target) and os.listdir(target):
        raise MergeError(f"{target} exists and is not empty")
    os.makedirs(target, exist_ok=True)
    dist_checkpointing.save(state, target, content_metadata=content)
    with open(os.path.join(out, TRACKER), "w") as fh:
        fh.write("release")
    log(f"merge: {len(adapted)} adapted weights (gamma = {alpha:g} / {rank} = {gamma:g}) from "
        f"{adir} into {bdir} -> {target}")
    return {"adapted": adapted, "gamma": gamma, "base": bdir, "adapters": adir, "out": target}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_muon.peft.merge",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None,
                   help="base model checkpoint (root or iteration folder); default: the one "
                        "the adapters recorded")
    p.add_argument("--adapters", required=True,
                   help="checkpoint written by Megatron-LM with --lora-rank")
    p.add_argument("--out", required=True, help="folder for the merged (release) checkpoint")
    p.add_argument("--base-step", type=int, default=None, help="iteration of --base")
    p.add_argument("--adapters-step", type=int, default=None, help="iteration of --adapters")
    a = p.parse_args(argv)
    from megatron_muon.megatron.cpu_run import alias_typing_override

    alias_typing_override()
    from megatron_muon.distributed.launch import single_process_group
    from megatron_muon.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()  # Megatron's dist-checkpointing synchronises CUDA; a no-op with CUDA
    try:
        with single_process_group():
            merge(a.base, a.adapters, a.out, a.base_step, a.adapters_step)
    except (MergeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.exit(main())
