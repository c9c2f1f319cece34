"""QK-clip (``--qk-clip``, ``--qk-clip-threshold``, ``--qk-clip-alpha``) with dmuon.

Megatron-Core (0.16 and 0.19) clips after ``optimizer.step()`` (``megatron.core.optimizer.
qk_clip.clip_qk``): it rescales each attention layer's fused ``linear_qkv`` weight in the
model and in ``weight.main_param`` when that exists.  Megatron's distributed optimizer keeps
the fp32 main params as DP shards in its own param groups (no ``main_param`` attribute), so
with it the rescale reaches only the model copy, and the next step's main -> model copy
undoes it.  ``clip_qk(model, optimizer)`` here applies the same rescale
(``megatron_muon.core.qk_clip``) to

* every fp32 main-param shard of ``linear_qkv.weight`` that a sub-optimizer of ``optimizer``
  holds (default and matrix placement, ZeRO-3: each rank's shard, from the optimizer's range
  maps) -- skipping a shard that is a view of the model weight (fp32 models), and
* the model weight wherever this rank stores it (every DP replica scales it the same way;
  under ZeRO-3 only the owner stores it, the others gather it again for the next forward),

after finishing any DMuon update still deferred to the param all-gather.  The per-head max
logits are Megatron's where its attention computes them (Transformer Engine >= 2.9,
``core_attention.current_max_attn_logits``); for Megatron's local ``DotProductAttention``
(CPU, no TE) ``install_max_logit_recorders`` records them in a forward pre-hook: the max of
softmax_scale * q . k over the unmasked positions of each head, over every microbatch of the
step.  Both are all-reduced (MAX) over the data-parallel group as Megatron does.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from megatron_muon.core.qk_clip import check_qk_clip_settings, qk_clip_eta, qkv_row_scales, scale_flat_rows
from megatron_muon.megatron import compat

__all__ = ["clip_qk", "install_max_logit_recorders", "record_max_logits", "MaxLogitRecorders",
           "attention_layers"]

_RECORDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # core_attention -> [heads]
_HOOKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # core_attention -> hook handle


def attention_layers(model_chunks) -> list:
    """This rank's self-attention modules that have a fused ``linear_qkv``, in model order."""
    from megatron.core.transformer.attention import SelfAttention

    return [m for chunk in model_chunks for m in chunk.modules()
            if isinstance(m, SelfAttention) and hasattr(m, "linear_qkv")]


def _wants_logits(config) -> bool:
    return bool(getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False))


def _te_records(core) -> bool:
    return hasattr(core, "current_max_attn_logits")


def install_max_logit_recorders(model_chunks) -> int:
    """Record per-head max attention logits on every local (non-TE) core attention of a
    layer with ``qk_clip`` (or ``log_max_attention_logit``); returns how many were hooked."""
    return len(record_max_logits(model_chunks).cores)


class MaxLogitRecorders:
    """The recorders one ``record_max_logits`` call installed; ``close()`` removes them."""

    def __init__(self, cores: list):
        self.cores = cores

    def close(self) -> None:
        """Remove these recorders and what they recorded (a core attention hooked by another
        call stays hooked); a later ``record_max_logits`` can install them again.
        Idempotent."""
        for core in self.cores:
            handle = _HOOKED.pop(core, None)
            if handle is not None:
                handle.remove()
            _RECORDED.pop(core, None)
        self.cores = []


def record_max_logits(model_chunks) -> MaxLogitRecorders:
    """``install_max_logit_recorders`` with a teardown (the factory's: ``close_optimizer``):
    a core attention that already records (an earlier call) is left to that call."""
    cores = []
    for attn in attention_layers(model_chunks):
        core = attn.core_attention
        if not _wants_logits(attn.config) or _te_records(core) or core in _HOOKED:
            continue
        _HOOKED[core] = core.register_forward_pre_hook(_record, with_kwargs=True)
        cores.append(core)
    return MaxLogitRecorders(cores)


@torch.no_grad()
def _record(core, args, kwargs):
    names = ("query", "key", "value", "attention_mask")
    vals = dict(zip(names, args))
    vals.update({k: v for k, v in kwargs.items() if k in names})
    q, k, mask = vals["query"], vals["key"], vals.get("attention_mask")
    heads, groups = q.shape[2], k.shape[2]
    if heads != groups:
        k = k.repeat_interleave(heads // groups, dim=2)
    # [sq, b, np, hn] x [sk, b, np, hn] -> [b, np, sq, sk], as DotProductAttention's baddbmm
    logits = torch.einsum("sbnh,tbnh->bnst", q.float(), k.float()) * core.softmax_scale
    if mask is not None:
        logits = logits.masked_fill(mask.bool(), float("-inf"))
    else:  # Megatron's local attention is causal unless given a mask
        sq, sk = logits.shape[-2:]
        causal = torch.ones(sq, sk, dtype=torch.bool, device=logits.device).triu(1 + sk - sq)
        logits = logits.masked_fill(causal, float("-inf"))
    head_max = logits.amax(dim=(0, 2, 3))
    prev = _RECORDED.get(core)
    _RECORDED[core] = head_max if prev is None else torch.maximum(prev, head_max)


def _max_logits(core) -> Optional[torch.Tensor]:
    if _te_records(core):
        return core.current_max_attn_logits
    return _RECORDED.get(core)


def _reset(core) -> None:
    if _te_records(core):
        compat.set_megatron_attr(core, "current_max_attn_logits", None)
    _RECORDED.pop(core, None)


def _main_shards(optimizer, weight) -> list:
    """(fp32 main-param shard, its start in the flattened weight) for every sub-optimizer
    of ``optimizer`` that holds part of ``weight``."""
    out = []
    subs = getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else []
    for sub in subs:
        managed = getattr(sub, "_managed", None)
        if getattr(sub, "is_stub_optimizer", False) or (managed is not None and weight not in managed):
            continue
        if weight not in getattr(sub, "model_param_gbuf_map", {}):
            continue
        r = sub._get_model_param_range_map(weight)["param"]
        gi, go = sub.model_param_group_index_map[weight]
        out.append((sub.optimizer.param_groups[gi]["params"][go], r.start))
    return out


def _stored(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() > 0


@torch.no_grad()
def clip_qk(model_chunks, optimizer=None, log_max_only: bool = False,
            dp_group=None) -> float:
    """Megatron's ``clip_qk`` for a dmuon (or any distributed) optimizer; returns the max
    attention logit of this stage (0 when no layer recorded one), as Megatron's does.

    Call it right after ``optimizer.step()``.  ``optimizer=None``: the model weights only
    (a single-process model without main params).  ``dp_group``: default Megatron's
    data-parallel group with context parallelism (what its ``clip_qk`` reduces over).
    """
    layers = [a for a in attention_layers(model_chunks) if _max_logits(a.core_attention) is not None]
    if not layers:
        return 0.0
    if dp_group is None:
        from megatron.core import parallel_state

        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    maxes = [_max_logits(a.core_attention) for a in layers]
    flat = torch.cat([m.float().reshape(-1) for m in maxes])
    if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=dp_group)
    biggest = float(flat.max())
    if not log_max_only:
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else []:
            if hasattr(sub, "finish_deferred"):
                sub.finish_deferred()  # DMuon's update waiting for the param all-gather
        off = 0
        for attn, m in zip(layers, maxes):
            n = m.numel()
            _clip_layer(attn, flat[off: off + n], optimizer)
            off += n
    for attn in layers:
        _reset(attn.core_attention)
    return biggest


def _clip_layer(attn, max_logits: torch.Tensor, optimizer) -> None:
    cfg = attn.config
    check_qk_clip_settings(cfg.qk_clip_threshold, cfg.qk_clip_alpha)
    groups = attn.num_query_groups_per_partition
    heads = attn.num_attention_heads_per_partition
    if max_logits.numel() != heads:
        raise ValueError(f"max attention logits of shape {tuple(max_logits.shape)}; expected "
                         f"one per local head ({heads})")
    eta = qk_clip_eta(max_logits, groups, cfg.qk_clip_threshold)
    if eta is None:
        return
    head_dim = attn.hidden_size_per_attention_head
    weight = attn.linear_qkv.weight
    rows, cols = weight.shape
    scales = qkv_row_scales(eta, heads // groups, head_dim, cfg.qk_clip_alpha)
    if scales.numel() != rows:
        raise ValueError(f"linear_qkv has {rows} rows; [q, k, v] x {groups} groups of head "
                         f"dim {head_dim} would be {scales.numel()}")
    stored = _stored(weight)
    for main, start in _main_shards(optimizer, weight):
        if stored and main.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
            continue  # fp32: the shard is a view of the weight, scaled with it below
        scale_flat_rows(main.view(-1), scales, start, cols)
    if stored:
        scale_flat_rows(weight.data.view(-1), scales, 0, cols)
