"""LoRA adapters for Megatron-Core's parallel linear layers, local and Transformer Engine (docs/design.md#smuon-and-lora).

A LoRA layer computes ``y = x W^T + gamma * (x A^T) B^T``, i.e. ``W = W0 + gamma B A`` with
``W0`` (m x n, out x in) frozen, ``A``: r x n, ``B``: m x r and ``gamma = alpha / r``.
``apply_lora(model, LoRAConfig(...))`` adds an adapter to every targeted linear layer *in
place*: the layer keeps its class, its parameters and their names (so a base checkpoint loads
as before), gets a child module ``lora`` (parameters ``<layer>.lora.A`` and ``<layer>.lora.B``)
and an instance-level ``forward`` that adds the adapter branch to the base output.

Tensor parallelism.  The adapter is sharded like its base layer, and the branch does the
same communication the base layer does, but on r-wide activations:

* ``ColumnParallelLinear`` (output dim m sharded): ``B`` is sharded along its rows (``B_t``:
  m/tp x r, ``partition_dim = 0``), ``A`` is replicated.  ``h = x A^T`` is computed locally,
  then ``copy_to_tensor_model_parallel_region(h)`` (identity forward, all-reduce of the r-wide
  gradient backward), so ``A``'s gradient is complete and identical on every TP rank, and the
  input gradient of the branch is complete (the base layer all-reduces its own).  With
  sequence parallelism ``x`` is sequence-sharded: ``h`` is all-gathered along the sequence
  (``gather_from_sequence_parallel_region``, reduce-scatter backward) and ``A``'s gradient is
  a partial sum over sequence chunks, so ``A.sequence_parallel = True`` and Megatron's
  ``finalize_model_grads`` all-reduces it over TP (as for layernorm weights).  With
  ``gather_output`` the branch output is all-gathered like the base output.
* ``RowParallelLinear`` (input dim n sharded): ``A`` is sharded along its columns (``A_t``:
  r x n/tp, ``partition_dim = 1``), ``B`` is replicated.  ``h = x_t A_t^T`` is a partial sum
  that is all-reduced (``reduce_from_tensor_model_parallel_region``, r wide) -- or
  reduce-scattered along the sequence with sequence parallelism, then ``B``'s gradient is a
  partial sum and ``B.sequence_parallel = True``.

The sharded factor carries Megatron's ``tensor_model_parallel`` / ``partition_dim`` /
``partition_stride`` attributes, the replicated one ``tensor_model_parallel = False`` (so
``param_is_not_tensor_parallel_duplicate`` counts it once in grad norms); both copy the base
weight's ``allreduce`` flag (``False`` for expert-parallel experts: Megatron DDP then reduces
them over the expert-data-parallel group).  Megatron DDP only allocates gradient buffers for
parameters that require grad, so the frozen base costs no gradient memory.

Transformer Engine layers (Megatron-Core's TE layer spec) are adapted the same way, told
apart by class name (nothing here imports ``transformer_engine``):

* ``TEColumnParallelLinear`` / ``TERowParallelLinear``: as the local column / row layers
  (same branch code; TE's own input all-gather / output reduction happen inside the base).
* ``TELayerNormColumnParallelLinear`` (the layernorm fused into a column-parallel linear):
  the branch must multiply what the base matmul multiplies, the *normalised* input, which
  only TE computes.  The layer is switched to ``return_layernorm_output = True`` (and
  ``return_layernorm_output_gathered = False``), so TE returns the layernorm output too
  (``((out, ln_out), None)``, or ``(out, bias, ln_out)`` with ``skip_bias_add``); under
  sequence parallelism that ``ln_out`` is this rank's sequence chunk, exactly the input
  the local column branch expects.  TE's backward adds the branch's gradient of ``ln_out``
  to its own, through the layernorm.
* ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (``TEGroupedMLP``:
  one module per expert group, weights ``weight0 .. weight{E-1}``, ``forward(x, m_splits)``):
  one adapter per local expert (``<layer>.lora.<i>.A`` / ``.B``, a :class:`GroupedLoRA`),
  applied to the expert's ``m_splits[i]`` rows.  The global names are SequentialMLP's
  (``...experts.local_experts.<global expert>.linear_fc1``), and so are the sharded
  checkpoint keys (``...experts.linear_fc1.lora.A`` with the expert axis), so adapters move
  between the two expert implementations.

Refused in one line each: any other TE layer (``TELinear`` "duplicated", ...), TE layers
run through TE's fused ops (``TEFusedMLP``, ``FusedSharedExpertMLP``, ``TEGroupedMLP``
with ``use_transformer_engine_op_fuser``: the fused path never calls the layer's forward), a
grouped linear with one stacked weight (``moe_single_grouped_weight``), fp8 primary
weights (a ``transformer_engine`` tensor type), and a ``TELayerNormColumnParallelLinear``
whose layernorm output is already returned to someone else.

Targets: ``qkv`` (``self_attention.linear_qkv``), ``proj`` (``self_attention.linear_proj``),
``fc1`` / ``fc2`` (dense and shared-expert MLP ``linear_fc1`` / ``linear_fc2``), ``experts``
(every ``linear_fc1`` / ``linear_fc2`` of a ``SequentialMLP``'s local experts or of a
``TEGroupedMLP``; the legacy local ``GroupedMLP`` has no linear modules and is not
supported; expert tensor parallelism must be 1), or any module name / dotted name suffix
(``output_layer``, ``layers.3.mlp.linear_fc2``) that names one of the layers above.  A name
that matches nothing or matches another kind of module is a ``ValueError``; an alias may
match nothing (``fc1`` in an all-MoE model, ``experts`` in a dense one) as long as the
targets together match something.

Checkpoints.  ``save_lora(path, model)`` writes one file with the *full, TP-unsharded*
factors in the TP1 layout (a gated ``linear_fc1``'s rows ``[gate; up]``), keyed by global
names (global layer and expert numbers), plus rank / alpha / targets; ``load_lora`` slices
them for whatever TP / PP / EP layout the model has.  The layers' ``sharded_state_dict`` is
extended too, so a full ``dist_checkpointing`` checkpoint of a LoRA model stores the
adapters correctly sharded.

Not supported: dropout on the adapter input, expert tensor parallelism > 1, layers with
``disable_grad_reduce``, the TE cases refused above.  The TE paths are tested on CPU with
stand-ins of the TE classes (tests/test_lora_te.py) and for real only by
``tools/gpu_check.sh`` (megatron_muon/testing/lora_te_check.py).
"""

from __future__ import annotations

import math
import os
import re
import types
import zlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

__all__ = [
    "LoRAConfig",
    "LoRAAdapter",
    "GroupedLoRA",
    "TE_LAYERS",
    "LORA_TARGETS",
    "apply_lora",
    "lora_adapters",
    "merge_lora",
    "unmerge_lora",
    "lora_disabled",
    "full_lora_factors",
    "save_lora",
    "load_lora",
    "read_lora_config",
]

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "experts")
DEFAULT_TARGETS = ("qkv", "proj", "fc1", "fc2")
CHECKPOINT_FORMAT = "megatron_muon.lora/1"
INITS = ("kaiming", "normal")


# ============================================================================== configuration
@dataclass
class LoRAConfig:
    """What to adapt and how.

    rank: r >= 1 (at most min(m, n) of every targeted layer).  alpha: the LoRA scale is
    ``gamma = alpha / rank``.  targets: aliases from ``LORA_TARGETS`` or module-name
    suffixes.  init: ``kaiming`` (A ~ U(-1/sqrt(n), 1/sqrt(n)), as ``nn.Linear`` and PEFT)
    or ``normal`` (A ~ N(0, 1/r^2), PEFT's "gaussian"); B = 0 always, so the adapted model
    starts equal to the base.  A is drawn from a generator seeded by ``seed`` and the
    layer's *global* name, so the initial adapters are the same for every TP/PP layout.
    freeze_base: set ``requires_grad = False`` on every non-LoRA parameter of the model.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: Sequence[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    init: str = "kaiming"
    seed: int = 0
    freeze_base: bool = True

    def __post_init__(self):
        if isinstance(self.targets, str):
            self.targets = [t for t in re.split(r"[,\s]+", self.targets) if t]
        if not isinstance(self.targets, (list, tuple)):
            raise ValueError(f"LoRA targets must be a list of names, got {self.targets!r}")
        self.targets = list(self.targets)
        self.validate()

    @property
    def gamma(self) -> float:
        return float(self.alpha) / int(self.rank)

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if not self.targets:
            raise ValueError(f"LoRA targets must not be empty; choose from {list(LORA_TARGETS)} "
                             "or give module names")
        for t in self.targets:
            if not isinstance(t, str) or not t.strip() or t != t.strip():
                raise ValueError(f"LoRA target {t!r} must be a non-empty name")
        if self.init not in INITS:
            raise ValueError(f"LoRA init must be one of {list(INITS)}, got {self.init!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"LoRA seed must be an integer, got {self.seed!r}")


# ============================================================================== the adapter
def _linear_classes():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


#: Transformer Engine layers LoRA adapts: class name -> (kind, family).  Matched by name
#: along the class's MRO (a subclass is one of them too), so that nothing here imports
#: transformer_engine.
TE_LAYERS = {
    "TELayerNormColumnParallelLinear": ("column", "te_layernorm"),
    "TEColumnParallelLinear": ("column", "te"),
    "TERowParallelLinear": ("row", "te"),
    "TEColumnParallelGroupedLinear": ("column", "te_grouped"),
    "TERowParallelGroupedLinear": ("row", "te_grouped"),
}
_SUPPORTED = ("ColumnParallelLinear, RowParallelLinear, " + ", ".join(TE_LAYERS))


def _is_te(module) -> bool:
    return any(c.__name__.startswith("TE") or "transformer_engine" in c.__module__
               for c in type(module).__mro__)


def _layer_kind(module) -> Optional[tuple[str, str]]:
    """``(kind, family)`` of a layer LoRA adapts (``kind``: ``"column"`` / ``"row"``;
    ``family``: ``"local"``, ``"te"``, ``"te_layernorm"``, ``"te_grouped"``), else None."""
    Column, Row = _linear_classes()
    if isinstance(module, Column):
        return "column", "local"
    if isinstance(module, Row):
        return "row", "local"
    for cls in type(module).__mro__:
        if cls.__name__ in TE_LAYERS:
            return TE_LAYERS[cls.__name__]
    return None


def _tp_group_of(base):
    # TE wrappers keep Megatron's TP group in ``_tp_group`` (their ``tp_group`` is TE's own,
    # None for experts whose communication Megatron does explicitly).
    group = getattr(base, "_tp_group", None)
    if group is None:
        group = getattr(base, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
    return group


class LoRAAdapter(torch.nn.Module):
    """The factors of one LoRA layer (this rank's shards) and how they are laid out.

    Attributes: ``A`` (local r x n_local), ``B`` (local m_local x r), ``kind`` (``"column"``
    or ``"row"``), ``shape`` (full m, n), ``rank``, ``alpha``, ``gamma``, ``tp_size``,
    ``tp_rank``, ``tp_group``, ``sharded`` (``"A"``, ``"B"`` or ``None`` when TP is 1),
    ``name`` (module name in this chunk), ``global_name`` (layout-independent), ``gated``
    (a SwiGLU ``linear_fc1``, whose TP shards are ``[gate_t; up_t]``), ``merged``,
    ``enabled``, ``weight_name`` (the base weight it adapts: ``weight``, or ``weight<i>``
    for expert ``i`` of a TE grouped linear), ``is_expert``.
    """

    def __init__(self, base: torch.nn.Module, kind: str, name: str, global_name: str,
                 config: LoRAConfig, gated: bool = False, weight_name: str = "weight",
                 is_expert: Optional[bool] = None):
        super().__init__()
        self.kind = kind
        self.name = name
        self.global_name = global_name
        self.weight_name = weight_name
        self.rank = int(config.rank)
        self.alpha = float(config.alpha)
        self.gamma = config.gamma
        self.gated = bool(gated)
        self.tp_group = _tp_group_of(base)
        self.tp_size = dist.get_world_size(self.tp_group) if dist.is_initialized() else 1
        self.tp_rank = dist.get_rank(self.tp_group) if dist.is_initialized() else 0
        self.is_expert = bool(getattr(base, "is_expert", False) if is_expert is None
                              else is_expert)
        self.merged = False
        self.enabled = True
        w = getattr(base, weight_name)
        m_loc, n_loc = w.shape
        if kind == "column":
            m, n = m_loc * self.tp_size, n_loc
            self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) \
                and not getattr(base, "explicit_expert_comm", False) and self.tp_size > 1
        else:
            m, n = m_loc, n_loc * self.tp_size
            self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) \
                and self.tp_size > 1
        self.shape = (int(m), int(n))
        if self.rank > min(m, n):
            raise ValueError(f"LoRA rank {self.rank} is larger than min(m, n) = {min(m, n)} of "
                             f"{global_name} ({m} x {n}); choose rank <= {min(m, n)}")
        self.sharded = None if self.tp_size == 1 else ("B" if kind == "column" else "A")

        A_full = self._init_A(config, w.device)
        if kind == "column":
            A_loc = A_full
            B_loc = torch.zeros(m_loc, self.rank, device=w.device)
        else:
            A_loc = A_full.chunk(self.tp_size, dim=1)[self.tp_rank]
            B_loc = torch.zeros(m, self.rank, device=w.device)
        self.A = torch.nn.Parameter(A_loc.to(w.dtype).contiguous())
        self.B = torch.nn.Parameter(B_loc.to(w.dtype).contiguous())
        self._set_attributes(base)

    # -------------------------------------------------------------------- setup
    def _init_A(self, config: LoRAConfig, device) -> torch.Tensor:
        r, n = self.rank, self.shape[1]
        seed = (config.seed * 1_000_003 + zlib.crc32(self.global_name.encode())) % (2 ** 63)
        gen = torch.Generator().manual_seed(seed)
        if config.init == "kaiming":  # kaiming_uniform_(a=sqrt(5)) as nn.Linear / PEFT
            A = (torch.rand(r, n, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(n)
        else:
            A = torch.randn(r, n, generator=gen, dtype=torch.float64) / r
        return A.float().to(device)

    def _set_attributes(self, base) -> None:
        from megatron.core.tensor_parallel.layers import (
            set_defaults_if_not_set_tensor_model_parallel_attributes,
            set_tensor_model_parallel_attributes)

        allreduce = getattr(getattr(base, self.weight_name), "allreduce", True)
        sharded, replicated = (self.B, self.A) if self.kind == "column" else (self.A, self.B)
        set_tensor_model_parallel_attributes(sharded, True, 0 if self.kind == "column" else 1, 1)
        set_defaults_if_not_set_tensor_model_parallel_attributes(replicated)
        for p, factor in ((self.A, "A"), (self.B, "B")):
            p.allreduce = allreduce
            p.is_lora = True
            p.lora_factor = factor
        # The replicated factor sees a sequence chunk per rank under sequence parallelism:
        # its gradient is a partial sum that finalize_model_grads all-reduces over TP.
        replicated.sequence_parallel = self.sequence_parallel
        sharded.sequence_parallel = False

    def extra_repr(self) -> str:
        m, n = self.shape
        return (f"{self.kind}, {self.global_name}: {m} x {n}, rank {self.rank}, alpha "
                f"{self.alpha:g}, tp {self.tp_size} (sharded {self.sharded})")

    # -------------------------------------------------------------------- layout helpers
    @property
    def shard_dim(self) -> int:
        """Dimension along which the sharded factor is split (0 for B, 1 for A)."""
        return 0 if self.kind == "column" else 1

    def local_delta(self) -> torch.Tensor:
        """``gamma * B_local @ A_local``: this rank's shard of gamma B A, in fp32."""
        return self.gamma * (self.B.detach().float() @ self.A.detach().float())

    def _to_tp_order(self, B_full: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or not self.gated:
            return B_full
        g, u = B_full.chunk(2, dim=0)
        return torch.cat([torch.cat([gt, ut]) for gt, ut in zip(g.chunk(self.tp_size),
                                                                  u.chunk(self.tp_size))])

    def _from_tp_order(self, B_cat: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or not self.gated:
            return B_cat
        parts = [p.chunk(2, dim=0) for p in B_cat.chunk(self.tp_size)]
        return torch.cat([torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])])

    def gather_full(self, canonical: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Full ``(A, B)`` (fp32) on every rank of the TP group (a collective when TP > 1).

        ``canonical``: B's rows in the TP1 layout (matters only for a gated fc1).
        """
        A, B = self.A.detach().float(), self.B.detach().float()
        if self.tp_size > 1:
            t = B if self.kind == "column" else A
            parts = [torch.empty_like(t) for _ in range(self.tp_size)]
            dist.all_gather(parts, t.contiguous(), group=self.tp_group)
            full = torch.cat(parts, dim=self.shard_dim)
            if self.kind == "column":
                B = self._from_tp_order(full) if canonical else full
            else:
                A = full
        return A.clone(), B.clone()

    def shard(self, A_full: torch.Tensor, B_full: torch.Tensor, canonical: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shards of full factors (inverse of :meth:`gather_full`)."""
        if self.tp_size == 1:
            return A_full, B_full
        if self.kind == "column":
            B_cat = self._to_tp_order(B_full) if canonical else B_full
            return A_full, B_cat.chunk(self.tp_size, dim=0)[self.tp_rank]
        return A_full.chunk(self.tp_size, dim=1)[self.tp_rank], B_full

    @torch.no_grad()
    def load_full(self, A_full: torch.Tensor, B_full: torch.Tensor, canonical: bool = True
                  ) -> None:
        m, n = self.shape
        if tuple(A_full.shape) != (self.rank, n) or tuple(B_full.shape) != (m, self.rank):
            raise ValueError(
                f"LoRA factors for {self.global_name} have shapes A {tuple(A_full.shape)}, B "
                f"{tuple(B_full.shape)}; the layer needs A {(self.rank, n)}, B {(m, self.rank)}")
        if self.merged:
            raise ValueError(f"{self.global_name}: unmerge the adapter before loading factors")
        A_loc, B_loc = self.shard(A_full, B_full, canonical)
        self.A.copy_(A_loc.to(self.A.dtype))
        self.B.copy_(B_loc.to(self.B.dtype))

    # -------------------------------------------------------------------- merge
    @torch.no_grad()
    def merge(self, base) -> bool:
        if self.merged:
            return False
        w = getattr(base, self.weight_name)
        w.add_(self.local_delta().to(w.dtype))
        self.merged = True
        return True

    @torch.no_grad()
    def unmerge(self, base) -> bool:
        if not self.merged:
            return False
        w = getattr(base, self.weight_name)
        w.sub_(self.local_delta().to(w.dtype))
        self.merged = False
        return True


class GroupedLoRA(torch.nn.ModuleList):
    """The adapters of a TE grouped linear: child ``i`` adapts expert ``i``'s ``weight<i>``."""


# ============================================================================== forwards
def _active(ad: LoRAAdapter) -> Optional[LoRAAdapter]:
    """The adapter when it adds a term (not merged, not disabled), else None."""
    return None if ad.merged or not ad.enabled else ad


def _base_forward(self, input_, args, kwargs):
    """The layer's own forward, and its adapter when the adapter adds a term (else None)."""
    output, output_bias = type(self).forward(self, input_, *args, **kwargs)
    return output, output_bias, _active(self.lora)


def _column_branch(ad: LoRAAdapter, x: torch.Tensor, gather: bool) -> torch.Tensor:
    """gamma (x A^T) B_t^T for a column-parallel layer whose matmul multiplies ``x``."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region)

    h = torch.nn.functional.linear(x, ad.A)  # [s(/tp), b, r], replicated A
    if ad.tp_size > 1:
        if ad.sequence_parallel:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True,
                                                     group=ad.tp_group)
        else:  # the r-wide gradient of h is a partial sum over B's row shards
            h = copy_to_tensor_model_parallel_region(h, group=ad.tp_group)
    delta = torch.nn.functional.linear(h, ad.B) * ad.gamma  # [s, b, m/tp]
    if gather and ad.tp_size > 1:
        delta = gather_from_tensor_model_parallel_region(delta, group=ad.tp_group)
    return delta


def _row_branch(ad: LoRAAdapter, x: torch.Tensor, input_is_parallel: bool) -> torch.Tensor:
    """gamma (x_t A_t^T, reduced over TP) B^T for a row-parallel layer."""
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
        scatter_to_tensor_model_parallel_region)

    if ad.tp_size > 1 and not input_is_parallel:
        x = scatter_to_tensor_model_parallel_region(x, group=ad.tp_group)
    h = torch.nn.functional.linear(x, ad.A)  # partial sum over A's column shards
    if ad.tp_size > 1:
        if ad.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=ad.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=ad.tp_group)
    return torch.nn.functional.linear(h, ad.B) * ad.gamma


def _column_lora_forward(self, input_, *args, **kwargs):
    """``ColumnParallelLinear`` and ``TEColumnParallelLinear`` (TE: ``forward(x)``, no
    ``gather_output``)."""
    output, output_bias, ad = _base_forward(self, input_, args, kwargs)
    if ad is None:
        return output, output_bias
    gather = kwargs.get("runtime_gather_output", args[1] if len(args) > 1 else None)
    if gather is None:
        gather = getattr(self, "gather_output", False)
    return output + _column_branch(ad, input_, gather).to(output.dtype), output_bias


def _row_lora_forward(self, input_, *args, **kwargs):
    """``RowParallelLinear`` and ``TERowParallelLinear`` (TE: input always parallel)."""
    output, output_bias, ad = _base_forward(self, input_, args, kwargs)
    if ad is None:
        return output, output_bias
    delta = _row_branch(ad, input_, getattr(self, "input_is_parallel", True))
    return output + delta.to(output.dtype), output_bias


def _layernorm_column_lora_forward(self, input_, *args, **kwargs):
    """``TELayerNormColumnParallelLinear`` with ``return_layernorm_output = True`` (set by
    ``apply_lora``): Megatron's wrapper returns ``((out, ln_out), None)``, or TE's
    ``(out, bias, ln_out)`` when it returns the bias; the branch multiplies ``ln_out``."""
    result = type(self).forward(self, input_, *args, **kwargs)
    if isinstance(result[0], (tuple, list)):
        (output, ln_out), output_bias = result
    else:
        output, output_bias, ln_out = result
    ad = _active(self.lora)
    if ad is None:
        return output, output_bias
    return output + _column_branch(ad, ln_out, False).to(output.dtype), output_bias


def _grouped_lora_forward(self, input_, m_splits, *args, **kwargs):
    """``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``: ``input_`` holds
    the local experts' tokens one after another (``m_splits[i]`` rows for expert ``i``);
    each expert's rows get its own adapter's branch."""
    output, output_bias = type(self).forward(self, input_, m_splits, *args, **kwargs)
    active = [_active(ad) for ad in self.lora]
    if not any(ad is not None for ad in active):
        return output, output_bias
    splits = m_splits.tolist() if torch.is_tensor(m_splits) else [int(m) for m in m_splits]
    if len(splits) != len(active):
        raise ValueError(f"{type(self).__name__}: {len(splits)} token splits for "
                         f"{len(active)} expert adapters")
    pieces = []
    for ad, x in zip(active, torch.split(input_, splits, dim=0)):
        if ad is None:
            pieces.append(output.new_zeros(*x.shape[:-1], output.shape[-1]))
        elif ad.kind == "column":
            pieces.append(_column_branch(ad, x, False).to(output.dtype))
        else:
            pieces.append(_row_branch(ad, x, True).to(output.dtype))
    return output + torch.cat(pieces, dim=0), output_bias


def _lora_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """The base layer's sharded state dict, with the sharded LoRA factor TP-sharded."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    ad: LoRAAdapter = self.lora
    if ad.kind == "column":
        axis = {"weight": 0, "bias": 0, "lora.B": 0}
    else:
        axis = {"weight": 1, "lora.A": 1}
    dp_cp = (metadata or {}).get("dp_cp_group")
    if dp_cp is None:
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    state = self.state_dict(prefix="", keep_vars=True)
    sharded = make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets,
                                                  tp_group=ad.tp_group, dp_cp_group=dp_cp)
    key = f"{prefix}lora.B"
    if ad.gated and key in sharded:  # rows [gate_t; up_t]: the same treatment MLP gives weight
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        sharded[key] = apply_swiglu_sharded_factory(
            sharded[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
    return sharded


def _expert_layout(module, experts=None) -> tuple[int, int]:
    """(EP rank, EP size) of a TE grouped linear (its process groups, else the parent
    ``TEGroupedMLP``'s ``ep_group``, else parallel_state)."""
    group = getattr(getattr(module, "_pg_collection", None), "ep", None)
    if group is None and experts is not None:
        group = getattr(experts, "ep_group", None)
    if group is not None:
        return dist.get_rank(group), dist.get_world_size(group)
    if not dist.is_initialized():
        return 0, 1
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def _grouped_lora_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """A TE grouped linear's sharded state dict (its own, for the base weights) plus each
    expert's factors, keyed as SequentialMLP keys them: ``{prefix}lora.A`` with the global
    expert as a leading axis (or, with ``singleton_local_shards``, ``{expert}.{prefix}...``),
    the sharded factor split along TP like the weight, a gated fc1's ``B`` split in
    ``[gate; up]`` halves like the weight (``TEGroupedMLP`` does that for ``weight<i>``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    sharded = type(self).sharded_state_dict(self, prefix, sharded_offsets, metadata)
    group: GroupedLoRA = self.lora
    metadata = metadata or {}
    singleton = metadata.get("singleton_local_shards", False)
    dp_cp = metadata.get("dp_cp_group")
    if dp_cp is None:
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    ep_rank, ep_size = _expert_layout(self)
    expt_dp = getattr(getattr(self, "_pg_collection", None), "expt_dp", None)
    edp_rank = dist.get_rank(expt_dp) if expt_dp is not None else \
        ps.get_expert_data_parallel_rank()
    num_global = ep_size * len(group)
    for i, ad in enumerate(group):
        expert = ep_rank * len(group) + i
        if singleton:
            expert_prefix, offsets = f"{expert}.{prefix}", tuple(sharded_offsets)
        else:
            expert_prefix = prefix
            offsets = (*sharded_offsets, (len(sharded_offsets), expert, num_global))
        axis = {f"{i}.lora.B": 0} if ad.kind == "column" else {f"{i}.lora.A": 1}
        sub = make_sharded_tensors_for_checkpoint({f"{i}.lora.A": ad.A, f"{i}.lora.B": ad.B},
                                                  "", axis, offsets, tp_group=ad.tp_group,
                                                  dp_cp_group=dp_cp)
        replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
        for sh in sub.values():  # experts are replicated over the expert-data-parallel group
            sh.replica_id = (*sh.replica_id[:2], edp_rank)
        if ad.gated:
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            sub[f"{i}.lora.B"] = apply_swiglu_sharded_factory(sub[f"{i}.lora.B"], offsets,
                                                              singleton)
        for factor in ("A", "B"):
            sharded[f"{prefix}lora.{i}.{factor}"] = sub[f"{i}.lora.{factor}"]
    return sharded


# ============================================================================== model level
def _as_chunks(model) -> list:
    if isinstance(model, (list, tuple)):
        if not model:
            raise ValueError("empty model list")
        return list(model)
    return [model]


def _is_ddp(module) -> bool:
    return any(c.__name__ in ("DistributedDataParallel", "FullyShardedDataParallel",
                              "TorchFullyShardedDataParallel") for c in type(module).__mro__)


_LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"(^|\.)local_experts\.(\d+)\.")


def _global_name(root: torch.nn.Module, name: str) -> str:
    """Module name with pipeline-local layer and EP-local expert numbers made global."""
    out = name
    m = _EXPERT_RE.search(name)
    if m:
        experts = root.get_submodule(name[: m.start(2)].rstrip(".").rsplit(".", 1)[0])
        local = int(m.group(2))
        num_local = getattr(experts, "num_local_experts", None)
        if num_local is not None:
            ep_group = getattr(experts, "ep_group", None)
            if ep_group is not None:
                ep_rank = dist.get_rank(ep_group)
            else:
                from megatron.core import parallel_state as ps

                ep_rank = ps.get_expert_model_parallel_rank()
            local = ep_rank * int(num_local) + local
        out = f"{out[: m.start(2)]}{local}{out[m.end(2):]}"
    m = _LAYER_RE.search(name)  # same position in `out`: it comes before the expert number
    if m:
        number = getattr(root.get_submodule(name[: m.end(2)]), "layer_number", None)
        if number is not None:
            out = f"{out[: m.start(2)]}{int(number) - 1}{out[m.end(2):]}"
    return out


def _in_experts(name: str) -> bool:
    """A SequentialMLP's local expert, or a TEGroupedMLP's grouped linear (``experts.fc``)."""
    parts = name.split(".")
    return "local_experts" in parts[:-1] or (len(parts) > 1 and parts[-2] == "experts")


def _alias_matches(alias: str, name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    in_experts = _in_experts(name)
    if alias == "qkv":
        return leaf == "linear_qkv"
    if alias == "proj":
        return leaf == "linear_proj"
    if alias in ("fc1", "fc2"):
        return leaf == f"linear_{alias}" and not in_experts
    if alias == "experts":
        return leaf in ("linear_fc1", "linear_fc2") and in_experts
    raise AssertionError(alias)


def _parent(root: torch.nn.Module, name: str) -> Optional[torch.nn.Module]:
    return root.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None


def _unsupported(root: torch.nn.Module, name: str, module, family: str) -> Optional[str]:
    """Why LoRA cannot adapt this layer (one line), or None."""
    what = f"{name} ({type(module).__name__})"
    parent = _parent(root, name)
    if family != "local":
        # TEFusedMLP, FusedSharedExpertMLP, TEGroupedMLP's fused path: the fused ops share
        # the layer's weights but never call its forward (nor would they call the branch)
        fused = (parent is not None and (any("Fused" in c.__name__ for c in type(parent).__mro__)
                                         or getattr(parent, "_with_fused_impl", False))) \
            or getattr(getattr(module, "config", None), "use_transformer_engine_op_fuser", False)
        if fused:
            return (f"{what} runs through Transformer Engine's fused ops "
                    f"({type(parent).__name__ if parent is not None else 'the MLP'}), which "
                    f"never call the layer's forward; build without the op fuser "
                    f"(use_transformer_engine_op_fuser / use_grouped_gemm_for_shared_expert)")
    if family == "te_grouped":
        num = int(getattr(module, "num_gemms", 0))
        weights = [getattr(module, f"weight{i}", None) for i in range(num)]
        if num < 1 or any(w is None for w in weights):
            return (f"{what} does not hold one weight per expert (weight0..weight{num - 1}; "
                    f"moe_single_grouped_weight stacks them), which LoRA needs")
    else:
        weights = [getattr(module, "weight", None)]
        if weights[0] is None:
            return (f"{what}: LoRA needs the layer's own weight "
                    f"(skip_weight_param_allocation is not supported)")
    for w in weights:
        if "transformer_engine" in type(w).__module__:
            return (f"{what} keeps its weight as a Transformer Engine {type(w).__name__} "
                    f"(fp8 primary weights), which LoRA cannot merge into; keep the weights "
                    f"in high precision")
    if getattr(module, "disable_grad_reduce", False):
        return f"{what}: layers with disable_grad_reduce are not supported"
    if family == "te_layernorm" and getattr(module, "return_layernorm_output", False):
        return (f"{what} already returns its layernorm output to another consumer; LoRA "
                f"needs that output for its own branch")
    return None


def _match_targets(root: torch.nn.Module, targets: Sequence[str]
                   ) -> list[tuple[str, torch.nn.Module, str, str]]:
    """``(name, module, kind, family)`` of the modules named by ``targets``, checked (a
    layer LoRA cannot adapt is a one-line ``ValueError``).  A module-name target must
    match; an alias may match nothing (``fc1`` in an all-MoE model, ``experts`` in a dense
    one) as long as the targets together match something."""
    modules = dict(root.named_modules())
    order = {n: i for i, n in enumerate(modules)}
    chosen: dict[str, tuple] = {}
    for target in targets:
        if target in LORA_TARGETS:
            hits = [(n, m) for n, m in modules.items() if n and _alias_matches(target, n)]
        else:
            hits = [(n, m) for n, m in modules.items()
                    if n and (n == target or n.endswith("." + target))]
            if not hits:
                raise ValueError(
                    f"unknown LoRA target {target!r}: not one of {list(LORA_TARGETS)} and not "
                    f"the name (or a dotted name suffix) of a module of the model")
        for n, m in hits:
            layer = _layer_kind(m)
            if layer is None and _is_te(m):
                raise ValueError(
                    f"LoRA target {target!r} matches {n} ({type(m).__name__}), a Transformer "
                    f"Engine layer LoRA does not adapt; it adapts {_SUPPORTED}")
            if layer is None:
                raise ValueError(
                    f"LoRA target {target!r} matches {n} ({type(m).__name__}), which is not a "
                    f"linear layer LoRA adapts ({_SUPPORTED})")
            if hasattr(m, "lora"):
                raise ValueError(f"{n} already has a LoRA adapter")
            why = _unsupported(root, n, m, layer[1])
            if why is not None:
                raise ValueError(f"LoRA target {target!r}: {why}")
            chosen[n] = (n, m, *layer)
    has_layers = any(re.search(r"(^|\.)layers\.\d+$", n) for n in modules)
    if not chosen and has_layers:
        if "experts" in targets:
            raise ValueError(
                "LoRA target 'experts': the model has no expert linear layers (a dense model, "
                "or the legacy local GroupedMLP, which has no linear modules and is not "
                "supported; use SequentialMLP (moe_grouped_gemm=False) or TEGroupedMLP)")
        raise ValueError(f"LoRA targets {list(targets)} match no layer of this model")
    return sorted(chosen.values(), key=lambda item: order[item[0]])


def _grouped_global_names(root: torch.nn.Module, name: str, module) -> list[str]:
    """SequentialMLP's names for a TE grouped linear's experts:
    ``...experts.linear_fc1`` -> ``...experts.local_experts.<global expert>.linear_fc1``."""
    base, leaf = _global_name(root, name).rsplit(".", 1)
    num = int(module.num_gemms)
    ep_rank, _ = _expert_layout(module, _parent(root, name))
    return [f"{base}.local_experts.{ep_rank * num + i}.{leaf}" for i in range(num)]


def _build_adapters(root, name: str, module, kind: str, family: str, config: LoRAConfig):
    """The adapter of one layer: a LoRAAdapter, or a GroupedLoRA for a TE grouped linear."""
    gated = (name.rsplit(".", 1)[-1] == "linear_fc1"
             and bool(getattr(getattr(module, "config", None), "gated_linear_unit", False)))
    if family == "te_grouped":
        ads = [LoRAAdapter(module, kind, name, gname, config, gated=gated,
                           weight_name=f"weight{i}", is_expert=True)
               for i, gname in enumerate(_grouped_global_names(root, name, module))]
        adapter = GroupedLoRA(ads)
    else:
        is_expert = None if family == "local" else (
            bool(getattr(module, "is_expert", False)) or _in_experts(name))
        ads = [LoRAAdapter(module, kind, name, _global_name(root, name), config, gated=gated,
                           is_expert=is_expert)]
        adapter = ads[0]
    for ad in ads:
        if ad.is_expert and ad.tp_size > 1:
            raise ValueError(f"{name}: LoRA on experts needs expert tensor parallelism 1 "
                             f"(it is {ad.tp_size})")
    return adapter


_FORWARDS = {"te_layernorm": {"column": _layernorm_column_lora_forward},
             "te_grouped": {"column": _grouped_lora_forward, "row": _grouped_lora_forward}}


def apply_lora(model, config: Optional[LoRAConfig] = None, **kwargs) -> list[LoRAAdapter]:
    """Add LoRA adapters to ``model`` (a module or a list of pipeline chunks) in place.

    Call it after loading the base weights and *before* wrapping the model in Megatron's
    ``DistributedDataParallel``.  Keyword arguments build a :class:`LoRAConfig` when
    ``config`` is None (``apply_lora(model, rank=8, alpha=16, targets=["qkv"])``).
    Returns the adapters, in module order (a TE grouped linear's in expert order).  Every
    check runs before the model is changed: on an error the model is as it was.
    """
    if config is None:
        config = LoRAConfig(**kwargs)
    elif kwargs:
        raise ValueError("give either a LoRAConfig or keyword arguments, not both")
    elif not isinstance(config, LoRAConfig):
        raise ValueError(f"config must be a LoRAConfig, got {type(config).__name__}")
    from megatron_muon.megatron import hooks

    config.validate()
    from megatron.core.utils import unwrap_model

    chunks = _as_chunks(model)
    for chunk in chunks:
        if _is_ddp(chunk):
            raise ValueError("apply LoRA before wrapping the model in DistributedDataParallel "
                             "(DDP allocates gradient buffers for the trainable parameters)")
    plan = []
    for chunk in chunks:
        root = unwrap_model(chunk)
        for name, module, kind, family in _match_targets(root, config.targets):
            plan.append((root, name, module, kind, family))
    adapters = [(module, family, kind,
                 _build_adapters(root, name, module, kind, family, config))
                for root, name, module, kind, family in plan]
    if config.freeze_base:
        for chunk in chunks:
            for p in chunk.parameters():
                p.requires_grad_(False)
    for module, family, kind, adapter in adapters:
        module.add_module("lora", adapter)
        if family == "te_layernorm":  # TE returns the normalised input with the output
            module.return_layernorm_output = True
            if hasattr(module, "return_layernorm_output_gathered"):
                module.return_layernorm_output_gathered = False
        forward = _FORWARDS.get(family, {}).get(kind) or (
            _column_lora_forward if kind == "column" else _row_lora_forward)
        sharded = _grouped_lora_sharded_state_dict if family == "te_grouped" \
            else _lora_sharded_state_dict
        hooks.replace(module, "forward", types.MethodType(forward, module), owner="LoRA")
        hooks.replace(module, "sharded_state_dict", types.MethodType(sharded, module),
                      owner="LoRA")
    if config.freeze_base:
        for chunk in chunks:
            for module in chunk.modules():
                # Megatron's fused wgrad accumulation (TE: fuse_wgrad_accumulation) writes
                # into weight.main_grad, which a frozen weight does not have.
                weights = [p for n, p in module.named_parameters(recurse=False)
                           if re.fullmatch(r"weight\d*", n)]
                if weights and not any(w.requires_grad for w in weights):
                    for flag in ("gradient_accumulation_fusion", "fuse_wgrad_accumulation"):
                        if hasattr(module, flag):
                            setattr(module, flag, False)
    flat = [ad for _, _, _, a in adapters for ad in (a if isinstance(a, GroupedLoRA) else [a])]
    for ad in flat:
        ad.A.requires_grad_(True)
        ad.B.requires_grad_(True)
    for chunk in chunks:
        unwrap_model(chunk).lora_config = asdict(config)
    return flat


def _lora_layers(model) -> list[tuple[torch.nn.Module, LoRAAdapter]]:
    """``(layer, adapter)`` pairs in module order (a grouped linear once per expert)."""
    from megatron.core.utils import unwrap_model

    out = []
    for chunk in _as_chunks(model):
        for module in unwrap_model(chunk).modules():
            ad = getattr(module, "lora", None)
            if isinstance(ad, LoRAAdapter):
                out.append((module, ad))
            elif isinstance(ad, GroupedLoRA):
                out.extend((module, a) for a in ad)
    return out

def lora_adapters(model) -> list[LoRAAdapter]:
    """The model's adapters in module order (same order on every rank of a stage)."""
    return [ad for _, ad in _lora_layers(model)]


def merge_lora(model) -> int:
    """``W0 += gamma B A`` for every adapter (local shards, no communication); the adapter
    branch is then skipped.  Returns the number of adapters merged (already merged ones are
    left alone).  Exact up to rounding in the weight dtype."""
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters")
    return sum(ad.merge(module) for module, ad in layers)


def unmerge_lora(model) -> int:
    """Undo :func:`merge_lora`: ``W0 -= gamma B A`` and re-enable the branch."""
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters")
    return sum(ad.unmerge(module) for module, ad in layers)


@contextmanager
def lora_disabled(model):
    """Run the base model: adapters skipped inside the block."""
    ads = lora_adapters(model)
    old = [a.enabled for a in ads]
    for a in ads:
        a.enabled = False
    try:
        yield
    finally:
        for a, e in zip(ads, old):
            a.enabled = e


# ============================================================================== checkpoints
def full_lora_factors(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{global name: (A, B)} full, canonical fp32 factors of this rank's stage, on CPU.

    A collective over each adapter's TP group (call it on every rank).
    """
    out = {}
    for ad in lora_adapters(model):
        A, B = ad.gather_full(canonical=True)
        out[ad.global_name] = (A.cpu(), B.cpu())
    return out


def _writes_for(ad: LoRAAdapter) -> bool:
    """One rank per distinct adapter contributes it to a saved file."""
    if not dist.is_initialized():
        return True
    from megatron.core import parallel_state as ps

    if ad.tp_rank != 0:
        return False
    try:
        if ad.is_expert:
            return ps.get_expert_data_parallel_rank() == 0
        return ps.get_data_parallel_rank(with_context_parallel=True) == 0
    except Exception:  # parallel_state not initialised: every rank writes, duplicates merge
        return True


def save_lora(path: Union[str, os.PathLike], model, metadata: Optional[dict] = None) -> None:
    """Write the adapters (full, TP-unsharded, canonical layout) to one file.

    Collective: every rank calls it; global rank 0 writes ``path`` atomically.
    """
    from megatron.core.utils import unwrap_model

    layers = _lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters")
    local = {}
    for _, ad in layers:
        A, B = ad.gather_full(canonical=True)
        if _writes_for(ad):
            local[ad.global_name] = {"A": A.cpu(), "B": B.cpu(), "kind": ad.kind,
                                     "shape": list(ad.shape)}
    config = dict(getattr(unwrap_model(_as_chunks(model)[0]), "lora_config", {}))
    ranks = {ad.rank for _, ad in layers}
    alphas = {ad.alpha for _, ad in layers}
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(local, gathered, dst=0)
    else:
        gathered = [local]
    if not dist.is_initialized() or dist.get_rank() == 0:
        adapters = {}
        for part in gathered:
            adapters.update(part)
        blob = {"format": CHECKPOINT_FORMAT, "rank": ranks.pop() if len(ranks) == 1 else None,
                "alpha": alphas.pop() if len(alphas) == 1 else None,
                "config": config, "metadata": dict(metadata or {}),
                "adapters": dict(sorted(adapters.items()))}
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(blob, tmp)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()


def _read(path) -> dict:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no LoRA checkpoint at {path!r}")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{path!r} is not a readable LoRA checkpoint ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path!r} is not a {CHECKPOINT_FORMAT} LoRA checkpoint")
    return blob


def read_lora_config(path) -> LoRAConfig:
    """The LoRAConfig a checkpoint was saved with (to ``apply_lora`` before ``load_lora``)."""
    blob = _read(path)
    cfg = dict(blob.get("config") or {})
    if not cfg:
        cfg = {"rank": blob["rank"], "alpha": blob["alpha"]}
    return LoRAConfig(**{k: v for k, v in cfg.items() if k in LoRAConfig.__dataclass_fields__})


def load_lora(path, model, strict: bool = True) -> int:
    """Load a :func:`save_lora` file onto ``model``'s adapters (any TP / PP / EP layout).

    Every rank reads the file and takes its shards; no communication.  ``strict``: every
    adapter of the model must be in the file.  Ranks and full shapes must match.  Returns
    the number of adapters loaded on this rank.
    """
    blob = _read(path)
    entries = blob["adapters"]
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters; apply_lora(model, "
                         "read_lora_config(path)) first")
    missing = [ad.global_name for _, ad in layers if ad.global_name not in entries]
    if missing and strict:
        raise ValueError(f"LoRA checkpoint {os.fspath(path)!r} has no adapter for "
                         f"{len(missing)} layer(s) of the model, e.g. {missing[:3]}")
    loaded = 0
    for _, ad in layers:
        entry = entries.get(ad.global_name)
        if entry is None:
            continue
        if blob.get("alpha") is not None and float(blob["alpha"]) != ad.alpha:
            raise ValueError(f"LoRA checkpoint alpha {blob['alpha']} != the model's {ad.alpha}")
        r = entry["A"].shape[0]
        if r != ad.rank:
            raise ValueError(f"LoRA checkpoint rank {r} != the model's rank {ad.rank} for "
                             f"{ad.global_name}")
        ad.load_full(entry["A"], entry["B"], canonical=True)
        loaded += 1
    return loaded
