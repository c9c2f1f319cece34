"""Which Megatron parameters Muon takes, and how each splits into units.

See docs/design.md#which-parameters and docs/design.md#units.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from megatron_muon.core.units import Unit, gate_up_units, qkv_units, whole_units

__all__ = ["is_muon_matrix", "muon_units", "full_shape", "tp_partition_dim"]

_NON_MUON = re.compile(r"(embedding|output_layer|word_embeddings|position_embeddings)")


def is_muon_matrix(name: str, param: torch.Tensor, extra_adam: Optional[str] = None) -> bool:
    """2-D weights inside transformer layers go to Muon; everything else to AdamW.

    Embeddings, the output layer, norms and biases (all 1-D or named as such) use AdamW;
    ``extra_adam`` is a user regex of more names to send to AdamW.
    """
    if param.ndim != 2 or _NON_MUON.search(name):
        return False
    if ".layers." not in f".{name}":
        return False
    if extra_adam and re.search(extra_adam, name):
        return False
    return True


def tp_partition_dim(param: torch.Tensor) -> Optional[int]:
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim)
    return None


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, int]:
    m, n = param.shape
    dim = tp_partition_dim(param)
    if dim == 0:
        m *= tp_size
    elif dim == 1:
        n *= tp_size
    return int(m), int(n)


def muon_units(name: str, shape: tuple[int, int], model_config, *, split_qkv: bool,
               split_fc1: bool, tp_size: int) -> list[Unit]:
    """Units of one full (TP-unsharded, shards concatenated in TP order) parameter."""
    if split_qkv and name.endswith("linear_qkv.weight"):
        heads = model_config.num_attention_heads
        groups = model_config.num_query_groups or heads
        head_dim = model_config.kv_channels or model_config.hidden_size // heads
        return qkv_units(shape, groups, heads // groups, head_dim)
    if split_fc1 and name.endswith("linear_fc1.weight") and model_config.gated_linear_unit:
        # Each TP shard stores [gate_t; up_t]; concatenated shards interleave them.
        m, n = shape
        half = m // (2 * tp_size)
        gate = Unit((m, n), 0, tuple((2 * t * half, half) for t in range(tp_size)), "gate")
        up = Unit((m, n), 0, tuple(((2 * t + 1) * half, half) for t in range(tp_size)), "up")
        return [gate, up] if tp_size > 1 else gate_up_units(shape)
    return whole_units(shape)
