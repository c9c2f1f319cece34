"""Which Megatron parameters Muon takes, and how each splits into units.

See docs/design.md#which-parameters and docs/design.md#units.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from megatron_muon.core.units import Unit, gate_up_units, head_units, qkv_units, whole_units

__all__ = ["is_muon_matrix", "check_expert_layout", "muon_units", "full_shape", "tp_partition_dim"]

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


def check_expert_layout(named_parameters, named_modules, extra_adam: Optional[str] = None) -> None:
    """Refuse expert weights that Muon would orthogonalise as one matrix for several experts.

    Each MoE expert must be its own unit.  Megatron's legacy ``GroupedMLP``
    (``--moe-grouped-gemm`` without Transformer Engine, megatron-core <= 0.16) stores all
    local experts in one 2-D ``weight1`` / ``weight2`` whose per-expert matrices are
    reshapes of flat blocks, not blocks of the 2-D tensor; a weight of 3 or more dimensions
    inside the layers would go to AdamW unnoticed.  ``TEGroupedMLP`` (one ``weight{i}`` per
    expert) and ``SequentialMLP`` keep one 2-D tensor per expert and work as they are.
    Other weights of more than two dimensions go to the scalar optimizer
    (``layer_weights_not_2d``).
    """
    for name, module in named_modules:
        if type(module).__name__ == "GroupedMLP":
            raise ValueError(f"dmuon: {name} is Megatron's legacy GroupedMLP, which keeps all "
                             "local experts in one weight1 / weight2; Muon needs one matrix per "
                             "expert: use Transformer Engine's grouped experts (TEGroupedMLP, "
                             "--transformer-impl transformer_engine --moe-grouped-gemm) or "
                             "SequentialMLP (no --moe-grouped-gemm)")
    for name, p in named_parameters:
        if p.ndim > 2 and ".experts." in f".{name}" and p.requires_grad and \
                not (extra_adam and re.search(extra_adam, name)):
            raise ValueError(f"dmuon: {name} has shape {tuple(p.shape)}; Muon takes 2-D "
                             "matrices, one per expert: store each expert's weight as its own "
                             "2-D parameter, or send it to AdamW with --dmuon-adam-params")


def layer_weights_not_2d(named_parameters) -> list:
    """Names of the trainable weights of more than two dimensions inside the transformer
    layers that are not experts' (Mamba's 3-D ``conv1d.weight``, say): like Megatron's own
    Muon, they go to the scalar optimizer (AdamW or Lion), which the factory logs once."""
    return [name for name, p in named_parameters if p.ndim > 2 and p.requires_grad and
            ".layers." in f".{name}" and ".experts." not in f".{name}"]


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


#: MLA's per-head up-projections (and its q projection without a q LoRA): the parts of
#: each head's rows, from the model config
_MLA_Q = lambda c: [("q", c.qk_head_dim + c.qk_pos_emb_head_dim)]  # noqa: E731
MLA_HEAD_PARTS = {
    "linear_q_up_proj.weight": _MLA_Q,
    "linear_q_proj.weight": _MLA_Q,
    "linear_kv_up_proj.weight": lambda c: [("k", c.qk_head_dim), ("v", c.v_head_dim)],
}


def muon_units(name: str, shape: tuple[int, int], model_config, *, split_qkv: bool,
               split_fc1: bool, tp_size: int, qkv_split: str = "qkv") -> list[Unit]:
    """Units of one full (TP-unsharded, shards concatenated in TP order) parameter.
    ``qkv_split='head'`` (with ``split_qkv``): one unit per attention head of Q (and of
    gated attention's gate), per query group of K and V, and per head of MLA's
    up-projections; ``'qkv'``: Q, K and V (and the gate) one unit each, MLA's whole."""
    per_head = qkv_split == "head"
    if split_qkv and name.endswith("linear_qkv.weight"):
        heads = model_config.num_attention_heads
        groups = model_config.num_query_groups or heads
        head_dim = model_config.kv_channels or model_config.hidden_size // heads
        return qkv_units(shape, groups, heads // groups, head_dim, per_head=per_head,
                         gate=bool(getattr(model_config, "attention_output_gate", False)))
    if split_qkv and per_head and getattr(model_config, "multi_latent_attention", False):
        mla = next((k for k in MLA_HEAD_PARTS if name.endswith("self_attention." + k)), None)
        if mla:
            return head_units(shape, model_config.num_attention_heads,
                              MLA_HEAD_PARTS[mla](model_config))
    if split_fc1 and name.endswith("linear_fc1.weight") and model_config.gated_linear_unit:
        # Each TP shard stores [gate_t; up_t]; concatenated shards interleave them.
        m, n = shape
        half = m // (2 * tp_size)
        gate = Unit((m, n), 0, tuple((2 * t * half, half) for t in range(tp_size)), "gate")
        up = Unit((m, n), 0, tuple(((2 * t + 1) * half, half) for t in range(tp_size)), "up")
        return [gate, up] if tp_size > 1 else gate_up_units(shape)
    return whole_units(shape)
