"""DMuon's shard geometry without building the model (docs/design.md#exchange).

DMuon's ``ShardedMatrix`` descriptions come from Megatron's DDP buffers: which flat slice
``[start, end)`` of each parameter every DP rank holds, and where DMuon's flat step buffer
keeps it.  This module computes the same from a list of parameters (name, TP-local shape,
TP dimension) in Megatron's registration order, following Megatron-Core 0.16.1's rules:

* ``_ParamAndGradBuffer``: one buffer per model chunk and kind (dense, or expert-parallel
  when EP > 1), parameters in *reverse* order; with the distributed optimizer every
  parameter starts at a multiple of 64 and every bucket ends at a multiple of
  lcm(DP, 128) (lcm(DP, 128, 2^16) with ``pad_buckets_for_high_nccl_busbw``); a bucket is
  closed once it holds ``bucket_size`` elements, and a ``shared_embedding`` parameter gets
  a bucket of its own;
* ``DistributedDataParallel``: ``bucket_size`` defaults to max(40M, 1M x DP), is ``None``
  (one bucket) without ``overlap_grad_reduce`` and on pipeline stages after the first, and
  on model chunks after the first (``disable_bucketing``, as Megatron-LM and
  ``testing.gpt.build_gpt`` build them);
* ``DistributedOptimizer``: DP rank r holds the r-th of DP equal contiguous shards of every
  bucket; its shard main params are ordered by param group, then buffer, bucket and the
  buffer's parameter order, and DMuon's flat buffer lays them out in that order
  (``dmuon.flat_offsets``).

``matrices_from_slices`` turns every group rank's slices into ``ShardedMatrix`` objects;
``dmuon.sharded_matrices`` calls it after its ``all_gather_object``, and ``stage_matrices``
calls it on the emulated slices of every rank, so both build the matrices with one
implementation.  ``tests/test_geometry.py`` checks the emulation against a real
Megatron-Core DDP model and DMuon optimizer (DP, TP x DP, PP x DP, experts, several
buckets).  ``tools/bench_scale.py`` and the cost model (``tools/cost_model_lib.py``) use it
to run the real planner and exchange at any scale.

Pure: no torch.distributed, no Megatron import.  Not emulated: matrix placement (it re-lays
the buffers, ``matrix_placement.py``; ``stage_matrices`` refuses it), parameters of several
dtypes in one model chunk (Megatron makes a buffer per dtype), linear-layer biases and
learned position embeddings in ``gpt_param_specs`` (the tests' GPT and the presets have
neither), virtual pipeline stages in ``gpt_param_specs`` (``dmuon_part`` takes any list of
chunks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Hashable, Optional, Sequence

from megatron_muon.distributed.owner_centric import Piece, ShardedMatrix
from megatron_muon.megatron.params import is_muon_matrix, muon_units

__all__ = ["ParamSpec", "MuonParam", "BufferLayout", "PartGeometry", "gpt_param_specs",
           "ddp_bucket_size", "buffer_layout", "dmuon_part", "slice_info",
           "matrices_from_slices", "stage_matrices", "check_whole", "full_shape_of"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a model chunk as Megatron's DDP sees it."""

    name: str  # as the DDP-wrapped chunk's named_parameters() gives it
    shape: tuple  # TP-local
    tp_dim: Optional[int] = None  # partition_dim; None: not TP-split (replicated)
    muon: bool = False  # DMuon takes it (params.is_muon_matrix)
    expert: bool = False  # expert-parallel (allreduce=False): the expert buffer
    group: int = 0  # the optimizer param group it falls in (its position)
    shared_embedding: bool = False  # Megatron's shared_embedding attribute

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class MuonParam:
    """What ``matrices_from_slices`` needs of one Muon parameter."""

    key: str  # "chunk index:name", the order every rank agrees on
    name: str
    shape: tuple  # TP-local
    tp_dim: Optional[int]
    bucket: Hashable  # DMuon's exchange key: (buffer index, bucket id)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# ------------------------------------------------------------------- the model's parameters
def gpt_param_specs(*, num_layers: int, hidden_size: int, ffn_hidden_size: int,
                    num_attention_heads: int, vocab_size: int,
                    num_query_groups: Optional[int] = None, kv_channels: Optional[int] = None,
                    gated_linear_unit: bool = False, normalization: str = "LayerNorm",
                    qk_layernorm: bool = False, num_moe_experts: Optional[int] = None,
                    moe_ffn_hidden_size: Optional[int] = None,
                    moe_shared_expert_intermediate_size: Optional[int] = None,
                    first_dense_layers: int = 0,
                    share_embeddings_and_output_weights: bool = False, tp: int = 1,
                    pp: int = 1, pp_rank: int = 0, ep: int = 1, etp: Optional[int] = None,
                    stage_layers: Optional[Sequence[int]] = None,
                    extra_adam: Optional[str] = None, prefix: str = "module.") -> list:
    """The parameters of pipeline stage ``pp_rank`` of Megatron-Core's ``GPTModel`` with the
    local layer spec (``get_gpt_layer_local_spec``, RoPE, no linear biases), in
    registration order, as ``ParamSpec`` (names as the DDP-wrapped chunk gives them).

    ``stage_layers``: the global indices of the stage's layers (default: Megatron's even
    split, which needs PP to divide the layers); ``etp``: expert TP (default TP, as in
    Megatron); ``extra_adam``: ``dmuon_adam_params``."""
    if stage_layers is None:
        if num_layers % pp:
            raise ValueError(f"{num_layers} layers do not split evenly over PP = {pp}")
        per = num_layers // pp
        stage_layers = range(pp_rank * per, (pp_rank + 1) * per)
    etp = tp if etp is None else etp
    heads, groups = num_attention_heads, num_query_groups or num_attention_heads
    head_dim = kv_channels or hidden_size // heads
    glu = 2 if gated_linear_unit else 1
    for what, n, d in (("vocabulary", vocab_size, tp), ("query groups", groups, tp),
                       ("heads", heads, tp), ("FFN", ffn_hidden_size, tp)):
        if n % d:
            raise ValueError(f"{what} ({n}) must divide by TP = {d}")
    if num_moe_experts and num_moe_experts % ep:
        raise ValueError(f"{num_moe_experts} experts do not split over EP = {ep}")
    out: list = []
    norm_parts = ("weight", "bias") if normalization == "LayerNorm" else ("weight",)

    def add(name, shape, tp_dim=None, expert=False, shared=False):
        out.append(ParamSpec(
            name=prefix + name, shape=tuple(int(s) for s in shape), tp_dim=tp_dim,
            muon=is_muon_matrix(prefix + name, SimpleNamespace(ndim=len(shape)), extra_adam),
            expert=expert and ep > 1, shared_embedding=shared))

    def norm(name, size=hidden_size):
        for part in norm_parts:
            add(f"{name}.{part}", (size,))

    first, last = pp_rank == 0, pp_rank == pp - 1
    tied = share_embeddings_and_output_weights
    if first:
        add("embedding.word_embeddings.weight", (vocab_size // tp, hidden_size), 0,
            shared=tied and pp > 1)
    for local, layer in enumerate(stage_layers):
        p = f"decoder.layers.{local}."
        norm(p + "input_layernorm")
        add(p + "self_attention.linear_proj.weight", (hidden_size, heads * head_dim // tp), 1)
        add(p + "self_attention.linear_qkv.weight",
            ((heads + 2 * groups) * head_dim // tp, hidden_size), 0)
        if qk_layernorm:
            norm(p + "self_attention.q_layernorm", head_dim)
            norm(p + "self_attention.k_layernorm", head_dim)
        norm(p + "pre_mlp_layernorm")
        if num_moe_experts and layer >= first_dense_layers:
            f = moe_ffn_hidden_size or ffn_hidden_size
            if f % etp:
                raise ValueError(f"expert FFN ({f}) must divide by expert TP = {etp}")
            add(p + "mlp.router.weight", (num_moe_experts, hidden_size))
            for x in range(num_moe_experts // ep):
                q = f"{p}mlp.experts.local_experts.{x}."
                add(q + "linear_fc1.weight", (glu * f // etp, hidden_size), 0, expert=True)
                add(q + "linear_fc2.weight", (hidden_size, f // etp), 1, expert=True)
            if moe_shared_expert_intermediate_size:
                sf = moe_shared_expert_intermediate_size
                add(p + "mlp.shared_experts.linear_fc1.weight", (glu * sf // tp, hidden_size), 0)
                add(p + "mlp.shared_experts.linear_fc2.weight", (hidden_size, sf // tp), 1)
        else:
            add(p + "mlp.linear_fc1.weight", (glu * ffn_hidden_size // tp, hidden_size), 0)
            add(p + "mlp.linear_fc2.weight", (hidden_size, ffn_hidden_size // tp), 1)
    if last:
        norm("decoder.final_layernorm")
        if not (tied and pp == 1):
            add("output_layer.weight", (vocab_size // tp, hidden_size), 0, shared=tied)
    return out


# --------------------------------------------------------------------------- DDP buffers
def ddp_bucket_size(bucket_size: Optional[int], dp_size: int, *,
                    overlap_grad_reduce: bool) -> Optional[int]:
    """The bucket size Megatron's ``DistributedDataParallel`` gives the first chunk of the
    first pipeline stage (``bucket_size``: ``DistributedDataParallelConfig.bucket_size``,
    ``None`` for Megatron's default max(40M, 1M x DP); ``dp_size``: the dense data-parallel
    size; returns ``None``, one bucket, without ``overlap_grad_reduce``)."""
    if bucket_size is None:
        bucket_size = max(40_000_000, 1_000_000 * dp_size)
    return bucket_size if overlap_grad_reduce else None


@dataclass(frozen=True)
class BufferLayout:
    """One ``_ParamAndGradBuffer``: ``params`` in the buffer's order (reversed registration),
    ``index[i] = (start, end, bucket id)`` of ``params[i]``, ``buckets[b] = (start, end)``
    (padded), every bucket cut into ``dp_size`` equal contiguous shards."""

    params: tuple
    index: tuple
    buckets: tuple
    dp_size: int

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0

    def dp_slices(self) -> list:
        """Per DP rank, ``[(i, start, end, bucket id)]``: the flat range ``[start, end)`` of
        ``params[i]`` (in the parameter's own coordinates, Megatron's ``"param"`` range) the
        rank's shards hold, in the buffer's parameter order."""
        out: list = [[] for _ in range(self.dp_size)]
        for i, (ps, pe, b) in enumerate(self.index):
            if pe <= ps:
                continue
            b0, b1 = self.buckets[b]
            size = (b1 - b0) // self.dp_size
            for r in range((ps - b0) // size, (pe - 1 - b0) // size + 1):
                lo, hi = max(ps, b0 + r * size), min(pe, b0 + (r + 1) * size)
                out[r].append((i, lo - ps, hi - ps, b))
        return out


def buffer_layout(params: Sequence[ParamSpec], dp_size: int, bucket_size: Optional[int], *,
                  pad: bool = True, pad_for_high_nccl_busbw: bool = False) -> BufferLayout:
    """Megatron-Core 0.16.1's ``_ParamAndGradBuffer`` layout of ``params`` (registration
    order) over ``dp_size`` DP ranks; ``pad``: the distributed optimizer's padding
    (``use_distributed_optimizer``; without it nothing is sharded by Megatron, kept here
    only for idealised layouts)."""
    divisor = math.lcm(dp_size, 128, 2 ** 16) if pad_for_high_nccl_busbw else \
        math.lcm(dp_size, 128)

    def pad_end(i: int) -> int:
        return -(-i // divisor) * divisor if pad else -(-i // dp_size) * dp_size

    order = tuple(reversed(list(params)))
    index, buckets = [], []
    start = bucket_start = 0
    open_bucket = False
    end = 0
    for p in order:
        if pad:
            start = -(-start // 64) * 64
        if p.shared_embedding and open_bucket:
            buckets.append((bucket_start, pad_end(start)))
            start = bucket_start = buckets[-1][1]
            open_bucket = False
        end = start + p.numel
        index.append((start, end, len(buckets)))
        open_bucket = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or \
                p.shared_embedding:
            buckets.append((bucket_start, pad_end(end)))
            start = bucket_start = buckets[-1][1]
            open_bucket = False
        else:
            start = end
    if open_bucket:
        buckets.append((bucket_start, pad_end(end)))
    return BufferLayout(order, tuple(index), tuple(buckets), dp_size)


# ------------------------------------------------------------------------ DMuon's holdings
@dataclass
class PartGeometry:
    """What one DMuon optimizer (the dense or the expert one of a stage) sees of its
    buffers: ``params`` (its Muon matrices, in the order every rank agrees on),
    ``buffers`` (its DDP buffers, in Megatron's order), and per DP rank ``slices``
    (``[(key, start, end, local offset)]``, DMuon's ``held``) and ``local_numel`` (the
    size of its flat step buffer)."""

    params: list
    buffers: list
    slices: list
    local_numel: list

    @property
    def dp_size(self) -> int:
        return len(self.slices)


def dmuon_part(chunks: Sequence[Sequence[ParamSpec]], *, dp_size: int,
               bucket_size: Optional[int], expert: bool = False, pp_rank: int = 0,
               pad: bool = True, pad_for_high_nccl_busbw: bool = False) -> PartGeometry:
    """DMuon's view of the dense (``expert=False``) or expert-parallel buffers of a stage.

    ``chunks``: each model chunk's parameters (``gpt_param_specs``) in registration order;
    ``dp_size``: the buffers' data-parallel size (the expert-DP size for experts);
    ``bucket_size``: what ``DistributedDataParallel`` resolved for the first chunk of the
    first stage (``ddp_bucket_size``).  Stages after the first get one bucket per buffer
    (Megatron's DDP), and so do chunks after the first (``disable_bucketing``, as
    Megatron-LM and ``testing.gpt.build_gpt`` build them)."""
    buffers, owners = [], []  # owners[bi]: the chunk index of buffer bi
    for ci, chunk in enumerate(chunks):
        ps = [p for p in chunk if p.expert == expert]
        if not ps:
            continue
        size = bucket_size if pp_rank == 0 and ci == 0 else None
        buffers.append(buffer_layout(ps, dp_size, size, pad=pad,
                                     pad_for_high_nccl_busbw=pad_for_high_nccl_busbw))
        owners.append(ci)
    params = []
    for bi, (buf, ci) in enumerate(zip(buffers, owners)):
        for p, (_, _, b) in zip(buf.params, buf.index):
            if p.muon:
                key = f"{ci}:{p.name}"
                params.append((ci, p.name, MuonParam(key, p.name, p.shape, p.tp_dim, (bi, b))))
    params = [m for _, _, m in sorted(params, key=lambda t: (t[0], t[1]))]
    groups = sorted({p.group for buf in buffers for p in buf.params if p.muon})
    per_buffer = [buf.dp_slices() for buf in buffers]
    slices, local = [], []
    for r in range(dp_size):
        mine, off = [], 0
        for g in groups:  # Megatron's shard main params: group, buffer, bucket, param order
            for bi, (buf, ci) in enumerate(zip(buffers, owners)):
                for i, s, e, _ in per_buffer[bi][r]:
                    p = buf.params[i]
                    if p.muon and p.group == g:
                        mine.append((f"{ci}:{p.name}", s, e, off))
                        off += e - s
        slices.append(mine)
        local.append(off)
    return PartGeometry(params=params, buffers=buffers, slices=slices, local_numel=local)


# ------------------------------------------------------------- slices -> ShardedMatrix
def full_shape_of(shape: Sequence[int], tp_dim: Optional[int], tp_size: int) -> tuple:
    """A TP-local 2-D shape's full (TP-unsharded) shape (``params.full_shape`` by shape)."""
    m, n = (int(s) for s in shape)
    if tp_dim == 0:
        m *= tp_size
    elif tp_dim == 1:
        n *= tp_size
    return m, n


def slice_info(params: Sequence[MuonParam], held: dict, tp_rank: int) -> tuple:
    """What one rank contributes to the gather of ``matrices_from_slices``: ``(tp_rank,
    keys, [(key, start, end, local offset)])``; ``held``: {key: (start, end, offset)}."""
    return (tp_rank, [p.key for p in params],
            [(p.key, *held[p.key]) for p in params if p.key in held])


def _blockwise_config(model_config, tp: int):
    """The attention geometry of one TP shard (``dmuon_tp_mode='blockwise'``)."""
    heads = model_config.num_attention_heads
    return SimpleNamespace(
        num_attention_heads=heads // tp,
        num_query_groups=(model_config.num_query_groups or heads) // tp,
        kv_channels=model_config.kv_channels or model_config.hidden_size // heads,
        hidden_size=model_config.hidden_size,
        gated_linear_unit=model_config.gated_linear_unit)


def check_whole(key: str, numel: int, pieces, holders: int) -> None:
    """Matrix placement: this DP rank's TP group must hold every TP shard of a parameter of
    ``numel`` (TP-local) elements whole (``holders``: how many TP shards or replicas the
    group holds)."""
    held: dict = {}
    for _, trank, start, end, _ in pieces:
        held[trank] = held.get(trank, 0) + end - start
    if len(held) != holders or any(n != numel for n in held.values()):
        raise ValueError(
            f"dmuon_placement='matrix': {key} is not whole on one data-parallel rank "
            f"(TP shard elements held here: {held}, need {numel} each). Build the "
            "DDP model inside megatron_muon.megatron.matrix_placement.matrix_placement(...)")


def matrices_from_slices(params: Sequence[MuonParam], gathered: Sequence[tuple], *,
                         tp_size: int, model_config, cfg, expert: bool = False,
                         real_tp_size: int = 1) -> list:
    """Every Muon matrix of the group as a ``ShardedMatrix``, from every group rank's
    ``slice_info`` (``gathered[g]``, in group-rank order).

    ``tp_size``: how the matrices' TP shards are counted in the group (``dmuon.
    exchange_group``); ``model_config``: the attention / MLP geometry (``num_attention_heads``,
    ``num_query_groups``, ``kv_channels``, ``hidden_size``, ``gated_linear_unit``);
    ``real_tp_size``: the stage's TP size (blockwise mode cuts the attention geometry by it).
    """
    matrix = cfg.dmuon_placement == "matrix"
    blockwise = cfg.dmuon_tp_mode == "blockwise" and not expert
    if blockwise:
        model_config = _blockwise_config(model_config, real_tp_size)
    world = len(gathered)
    keys = gathered[0][1]
    for g in gathered[1:]:
        if g[1] != keys:
            raise RuntimeError("DMuon: ranks of one pipeline stage disagree on the Muon "
                               "parameters; every DP x TP rank must build the same model")
    pieces: dict = {k: [] for k in keys}
    for grank, (trank, _, slices) in enumerate(gathered):
        for key, start, end, local_offset in slices:
            pieces[key].append((grank, trank, start, end, local_offset))
    matrices = []
    for p in params:
        dim = None if blockwise else p.tp_dim
        if matrix:
            if not pieces[p.key]:
                continue  # lives whole on another DP rank
            check_whole(p.key, p.numel, pieces[p.key], tp_size if dim is not None else world)
        shape = tuple(p.shape) if blockwise else full_shape_of(p.shape, dim, tp_size)
        units = muon_units(p.name, shape, model_config, split_qkv=cfg.muon_split_qkv,
                           split_fc1=cfg.dmuon_split_fc1, tp_size=tp_size,
                           qkv_split=cfg.dmuon_qkv_split)
        ps = tuple(Piece(rank=g, tp_rank=t, start=s, end=e, local_offset=o,
                         source=dim is not None or t == 0)
                   for g, t, s, e, o in sorted(pieces[p.key]))
        matrices.append(ShardedMatrix(key=p.key, shape=shape, units=tuple(units), tp_dim=dim,
                                      tp_size=tp_size, pieces=ps, bucket=p.bucket))
    return matrices


def stage_matrices(part: PartGeometry, *, tp_size: int, model_config, cfg,
                   expert: bool = False, real_tp_size: int = 1) -> list:
    """``matrices_from_slices`` on the emulated slices of every rank of the exchange group:
    group rank g = dp rank x ``tp_size`` + TP rank (Megatron's rank order, TP fastest), every
    TP rank holding the same slices of its own shard.  ``tp_size``: 1 for experts and for
    blockwise mode (``dmuon.exchange_group``)."""
    if cfg.dmuon_placement == "matrix":
        raise ValueError("the geometry emulation does not lay out matrix placement's buffers")
    keys = [p.key for p in part.params]
    gathered = [(t, keys, part.slices[d]) for d in range(part.dp_size) for t in range(tp_size)]
    return matrices_from_slices(part.params, gathered, tp_size=tp_size,
                                model_config=model_config, cfg=cfg, expert=expert,
                                real_tp_size=real_tp_size)
