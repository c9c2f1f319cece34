"""Cluster cost model: optimizer-step time, bytes, memory and balance of every Muon mode.

Predicts, for a model config, a parallel layout, a hardware profile and an optimizer mode,
what one training step costs per rank:

- ``opt_s``: ``optimizer.step()`` (what ``tools/bench_optimizer.py`` times): elementwise
  updates, Newton-Schulz (NS), the Muon exchange, and the ZeRO parameter all-gather unless
  ``overlap_param_gather`` moves it into the next forward;
- ``exposed_s``: the part of the optimizer's work that the training step waits for;
- ``step_s``: forward/backward compute (an assumed MFU) + exposed gradient sync + ``exposed_s``;
- bytes per rank, memory per rank (weights, grads, optimizer state, Muon workspace; not
  activations) and the plan imbalance (max / mean - 1 of the per-rank NS cost).

DMuon's owner plan and exchange are DMuon's own: the stage's parameters as Megatron-Core's
GPT registers them (``megatron_params``: ``geometry.gpt_param_specs``), Megatron's DDP
buffers and DP shards and every rank's ``ShardedMatrix`` (``geometry.dmuon_part`` /
``stage_matrices``, the code ``dmuon.sharded_matrices`` uses, checked against a real
Megatron DDP + DMuon build in ``tests/test_geometry.py``), the plan from
``dmuon.plan_matrices`` (the planner DMuon runs, locality included) and the elements each
rank moves counted per piece and unit as the executor's tables do (``matrix_exchange``,
``flat_blocks.piece_unit_blocks``).  ``tools/bench_scale.py`` builds the executors themselves
on a fake process group and compares.  Megatron-Core's layer-wise Muon uses Megatron-Core's
own placement, re-implemented from its source: 0.16 deals params sorted by size ping-pong
over DP; 0.19 packs them into a shard-aligned buffer.

Modes (see docs/design.md):

- ``adamw``: Megatron's distributed optimizer (ZeRO-1).
- ``muon_naive``: ZeRO-1; every rank of the stage's DP x TP group gathers every matrix and
  runs NS on all of them (one all-to-all per bucket, as ``optimizer='muon_naive'`` does).
- ``mcore_layerwise``: Megatron-Core's layer-wise distributed Muon, ``muon_tp_mode=
  'duplicated'``: whole parameters placed on DP ranks, each TP rank all-gathers its TP
  shards and runs the same NS (duplicated on the TP ranks); 0.19 layout (default): padded
  shard-aligned buffer, bucketed reduce-scatter / all-gather; 0.16: gradients all-reduced,
  updated parameters all-gathered (uneven) inside the step.
- ``dmuon``: owner-centric Muon: each unit gathered on one owner of the DP x TP group, NS
  there, pieces scattered back (two all-to-alls per bucket); experts (EP > 1) planned in
  their expert-data-parallel group; at EP = 1 experts are dense parameters, as in Megatron.
- ``dmuon_overlap``: the same work, started per bucket during the backward pass.
- ``matrix_zero1`` / ``matrix_zero3``: MatrixFSDP placement, every Muon parameter whole on
  one DP rank, no Muon communication; uneven (padded) reduce-scatter / all-gather; under
  ZeRO-3 the parameters are sharded too and gathered per layer in forward and backward.
- ``fsdp2_reconstruct`` (extra, the MatrixFSDP paper's baseline): ZeRO-3 with even shards;
  the optimizer all-gathers every matrix (one call per parameter) and runs all NS on
  every rank.
- ``mcore_layer_sharded`` (extra, a peer): ``mcore_layerwise`` in its 0.19 layout with
  Megatron-LM's TP mode 'layer_sharded' (PR 6683): each owned matrix's NS runs on one TP
  rank, which gathers the other TP shards and sends the results back (two all-to-alls)
  instead of every TP rank running all of them.
- ``canzona`` (extra, a peer; arXiv 2602.06079): ``matrix_zero1``'s whole-matrix ZeRO-1
  placement balanced by NS cost (its alpha-balanced partition; ours stands in for it) and
  TP micro-groups as in ``mcore_layer_sharded``.  Its asynchronous pipelining of the TP
  exchange with the NS is not modelled (the exchange is charged in full).

Pure arithmetic: no process group, no model.  The DMuon modes import ``megatron_muon.
megatron.dmuon`` (and with it Megatron-Core) for its planner, on first use.  A tool, not
part of the ``megatron_muon`` package (the training runtime never needs it):
``tools/cost_model.py`` is its command line, ``tests/test_costmodel.py`` its tests.
Every number below that is not measured is an assumption, named where it is used.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from types import SimpleNamespace
from typing import Optional, Sequence

from megatron_muon.core.flat_blocks import piece_unit_blocks
from megatron_muon.core.newton_schulz import ns_flops
from megatron_muon.core.plan import OwnerPlan, UnitTask, flops_cost, plan_owners
from megatron_muon.megatron.geometry import (ParamSpec, buffer_layout, ddp_bucket_size,
                                             dmuon_part, full_shape_of, gpt_param_specs,
                                             stage_matrices)
from megatron_muon.megatron.params import muon_units

__all__ = [
    "ModelConfig", "Layout", "RunConfig", "Hardware", "Prediction", "HARDWARE", "MODELS",
    "MODES", "EXTRA_MODES", "predict", "stage_tensors", "megatron_params", "zero1_holdings",
    "exchange_elements", "owner_exchange", "Exchange", "naive_exchange_bytes", "owner_exchange_bytes_even",
    "collective_time", "Group", "load_cpu_profile", "cpu_hardware", "fwd_bwd_seconds", "pingpong_owners",
    "ADAM_BYTES_PER_ELEM", "MUON_BYTES_PER_ELEM", "OWNED_BYTES_PER_ELEM", "layout_for", "sweep",
    "model_param_counts", "matrix_exchange", "placed_units", "split_allreduce", "RankSet",
    "water_fill", "mcore19_layout",
]

MODES = ("adamw", "muon_naive", "mcore_layerwise", "dmuon", "dmuon_overlap",
         "matrix_zero1", "matrix_zero3")
# the peers: Megatron-Core's layer-wise Muon with its TP 'layer_sharded' mode (Megatron-LM
# PR 6683: each matrix's NS on one TP rank) and Canzona (arXiv 2602.06079: whole matrices
# per DP rank, balanced by cost, and TP micro-groups); fsdp2_reconstruct: MatrixFSDP's baseline
PEER_MODES = ("mcore_layer_sharded", "canzona")
EXTRA_MODES = ("fsdp2_reconstruct",) + PEER_MODES

# Bytes moved through memory per fp32 shard element by one optimizer update (GPU presets):
# AdamW: master param r/w 8 + grad r 4 + exp_avg r/w 8 + exp_avg_sq r/w 8 + bf16 param w 2.
ADAM_BYTES_PER_ELEM = 30
# Muon elementwise part: momentum r/w 8 + grad r 4 + write U 4 + read O 4 + master r/w 8 +
# bf16 param w 2.
MUON_BYTES_PER_ELEM = 30
# Handling one element of a rank's owned-unit buffer (zero it, index_copy the gathered
# pieces in, copy NS's output out and scale it, index_select the pieces to scatter): ~40 B.
OWNED_BYTES_PER_ELEM = 40
# One fp32 copy pass (Megatron's grad -> main shard and main -> model param copies).
COPY_BYTES_PER_ELEM = 8


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer, in Megatron's terms."""

    name: str = "custom"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None  # None: MHA
    kv_channels: Optional[int] = None  # head dim; None: hidden / heads
    vocab_size: int = 32000
    swiglu: bool = False
    num_experts: int = 0  # routed experts per MoE layer (0: dense model)
    moe_ffn_hidden_size: Optional[int] = None
    moe_topk: int = 1
    moe_shared_expert_ffn: int = 0  # 0: no shared expert
    first_dense_layers: int = 0  # leading dense layers of a MoE model (Kimi-K2: 1)
    normalization: str = "RMSNorm"  # LayerNorm adds a bias per norm
    tied_embeddings: bool = False
    seq_length: int = 4096

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_dense_layers


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Parallel layout.  world = tp * pp * dp; experts: ep * etp * edp = tp * dp."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallel size (1: whole experts, Megatron's usual MoE setup)
    gpus_per_node: int = 8

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.ep * self.etp)

    def check(self) -> None:
        for k in ("tp", "pp", "dp", "ep", "etp", "gpus_per_node"):
            if getattr(self, k) < 1:
                raise ValueError(f"layout {k} must be >= 1")
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise ValueError(f"EP x ETP = {self.ep} x {self.etp} must divide TP x DP = "
                             f"{self.tp} x {self.dp}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Training and optimizer settings that change the costs."""

    global_batch: int = 1024  # sequences per step
    micro_batch: int = 1
    mfu: float = 0.40  # assumed model-flops utilisation of forward/backward
    ns_steps: int = 5
    split_qkv: bool = True
    split_fc1: bool = False
    param_bytes: int = 2  # bf16 model params
    grad_bytes: int = 4  # grad_reduce_in_fp32 (Megatron's main_grad)
    muon_comm_bytes: int = 4  # the Muon exchange moves fp32 momentum / update pieces
    ns_dtype_bytes: int = 2  # bf16 NS ('medium'); 4 for fp32 NS
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    bucket_elems: Optional[int] = None  # None: Megatron's max(40M, 1M x DP) when overlapping
    locality: bool = True  # DMuon's locality-aware plan (dmuon_locality_slack)
    locality_slack: float = 0.03
    locality_max_work: int = 1_500_000  # units x ranks above which plain LPT is used (speed)
    dmuon_split: str = "auto"  # DMuon's dmuon_split: the planner splits units' NS where it pays
    overlap_efficiency: float = 0.5  # dmuon_overlap: usable share of the backward window
    # dmuon_overlap's policy (dmuon_overlap='on' / 'auto' / 'off'; 'auto': measured with
    # PP > 1, off without) and the share of steps whose gradients clipping (or anything
    # else) changes after the speculation: those redo the owner work in the step
    overlap_policy: str = "on"
    clip_rate: float = 0.0
    naive_per_matrix_calls: bool = False  # naive Muon issuing one collective per matrix
    megatron_pad: bool = True  # Megatron's 64-element param and lcm(DP,128) bucket padding
    main_copy_passes: int = 2  # bf16 training: grads -> fp32 main shard, main -> bf16 params
    grad_norm_calls: int = 1  # all-reduces of the global grad norm per step (clipping)
    mcore_layout: str = "0.19"  # mcore_layerwise as in Megatron-Core 0.19 or 0.16 (see there)
    pad_uneven_collectives: bool = False  # MatrixFSDP: pad shards to the largest (gloo)
    step_overhead_s: Optional[float] = None  # fixed per-step cost; None: the hardware's


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator and its network; per-direction bandwidths in bytes/s."""

    name: str
    peak_flops: float  # dense bf16 matmul peak (what MFU refers to)
    ns_efficiency: float  # achieved fraction of peak by batched NS matmuls (assumed)
    mem_bw: float  # HBM bytes/s
    mem_efficiency: float  # achieved fraction of mem_bw by elementwise kernels (assumed)
    memory_gib: float
    intra_bw: float  # NVLink per GPU per direction
    intra_lat: float  # seconds per hop inside a node
    inter_bw: float  # InfiniBand per GPU per direction (one NIC per GPU)
    inter_lat: float  # seconds per hop between nodes
    coll_base_lat: float = 10e-6  # launch + protocol start of one collective
    ring_efficiency: float = 0.80  # achieved bus bandwidth of ring all-gather/reduce-scatter
    a2a_efficiency: float = 0.60  # achieved bandwidth of all-to-all
    a2a_peer_lat: float = 1e-6  # per-peer cost of an all-to-all
    kernel_lat: float = 8e-6  # per NS kernel launch (3 kernels per NS step and batch)
    step_overhead_s: float = 2e-3  # Python / launch overhead of one optimizer step
    # Measured per-element costs (the calibrated CPU profile); None: derived from mem_bw.
    adam_s_per_elem: Optional[float] = None
    muon_s_per_elem: Optional[float] = None
    owned_s_per_elem: Optional[float] = None
    copy_s_per_elem: Optional[float] = None
    # NS rate by min(m, n) of the unit: ((s, flop/s), ...) measured; None: peak x efficiency.
    ns_rate_points: Optional[tuple] = None
    # Measured collectives (gloo on one host): kind -> (bandwidth B/s, latency s).
    collectives: Optional[dict] = None
    source: str = ""

    @property
    def elem_bw(self) -> float:
        return self.mem_bw * self.mem_efficiency

    def ns_rate(self, s: int) -> float:
        """flop/s of NS on units whose small side is ``s``."""
        if not self.ns_rate_points:
            return self.peak_flops * self.ns_efficiency
        pts = sorted(self.ns_rate_points)
        if s <= pts[0][0]:
            return pts[0][1]
        if s >= pts[-1][0]:
            return pts[-1][1]
        for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
            if s0 <= s <= s1:  # interpolate in log s
                w = (math.log(s) - math.log(s0)) / (math.log(s1) - math.log(s0))
                return r0 + w * (r1 - r0)
        return pts[-1][1]

    def _elem_time(self, elems: float, measured: Optional[float], bytes_per_elem: float) -> float:
        """``elems`` times the calibrated seconds per element, else bytes over ``elem_bw``."""
        per = measured if measured is not None else bytes_per_elem / self.elem_bw
        return elems * per

    def adam_time(self, elems: float) -> float:
        return self._elem_time(elems, self.adam_s_per_elem, ADAM_BYTES_PER_ELEM)

    def muon_elem_time(self, elems: float) -> float:
        return self._elem_time(elems, self.muon_s_per_elem, MUON_BYTES_PER_ELEM)

    def owned_time(self, elems: float) -> float:
        return self._elem_time(elems, self.owned_s_per_elem, OWNED_BYTES_PER_ELEM)

    def copy_time(self, elems: float) -> float:
        return self._elem_time(elems, self.copy_s_per_elem, COPY_BYTES_PER_ELEM)


# Public spec numbers (dense, no sparsity).  Bandwidths are per GPU and per direction.
# H100 SXM5: 989 TFLOP/s bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s total (450 per
#   direction) -- NVIDIA H100 Tensor Core GPU datasheet; DGX H100: 8 x ConnectX-7 400 Gb/s
#   NDR InfiniBand, one per GPU = 50 GB/s -- DGX H100 user guide.
# H200 SXM: 989 TFLOP/s bf16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s -- NVIDIA H200
#   datasheet; same 400 Gb/s NDR per GPU in HGX H200 systems.
# A100 SXM4 80GB: 312 TFLOP/s bf16, 2.039 TB/s HBM2e, NVLink 3 600 GB/s total (300 per
#   direction) -- NVIDIA A100 datasheet; DGX A100: 8 x 200 Gb/s HDR = 25 GB/s per GPU.
# A800 SXM4 80GB: A100 compute and memory, NVLink capped at 400 GB/s total (200 per
#   direction) -- NVIDIA A800 product brief; clusters typically 200 Gb/s HDR per GPU.
# Latencies are typical NCCL figures, not datasheet numbers: ~2 us per NVLink hop, ~6 us
# per InfiniBand hop, ~10 us to start a collective (NCCL tests, small messages).
# ns_efficiency 0.6 (batched bf16 GEMMs of 1k-8k matrices reach 55-70% of peak) and
# mem_efficiency 0.8 (fused elementwise kernels) are assumptions.
HARDWARE: dict[str, Hardware] = {
    "H100": Hardware(name="H100", peak_flops=989e12, ns_efficiency=0.6, mem_bw=3.35e12,
                     mem_efficiency=0.8, memory_gib=80 * 1e9 / 2**30, intra_bw=450e9,
                     intra_lat=2e-6, inter_bw=50e9, inter_lat=6e-6, source="datasheet"),
    "H200": Hardware(name="H200", peak_flops=989e12, ns_efficiency=0.6, mem_bw=4.8e12,
                     mem_efficiency=0.8, memory_gib=141 * 1e9 / 2**30, intra_bw=450e9,
                     intra_lat=2e-6, inter_bw=50e9, inter_lat=6e-6, source="datasheet"),
    "A100": Hardware(name="A100", peak_flops=312e12, ns_efficiency=0.6, mem_bw=2.039e12,
                     mem_efficiency=0.8, memory_gib=80 * 1e9 / 2**30, intra_bw=300e9,
                     intra_lat=2e-6, inter_bw=25e9, inter_lat=6e-6, source="datasheet"),
    "A800": Hardware(name="A800", peak_flops=312e12, ns_efficiency=0.6, mem_bw=2.039e12,
                     mem_efficiency=0.8, memory_gib=80 * 1e9 / 2**30, intra_bw=200e9,
                     intra_lat=2e-6, inter_bw=25e9, inter_lat=6e-6, source="datasheet"),
}


def load_cpu_profile(path: str) -> Hardware:
    """The 'cpu' hardware from a calibration JSON written by ``tools/cost_model.py``."""
    with open(path) as fh:
        return cpu_hardware(json.load(fh))


def cpu_hardware(d: dict) -> Hardware:
    """The 'cpu' hardware from a calibration (the dict ``tools/cost_model.py`` writes)."""
    coll = {k: tuple(v) for k, v in d["collectives"].items()}
    a2a_bw, a2a_lat = coll["all_to_all"]
    return Hardware(
        name="cpu", peak_flops=max(r for _, r in d["ns_rate_points"]), ns_efficiency=1.0,
        mem_bw=d.get("copy_bw", 1e9), mem_efficiency=1.0, memory_gib=d.get("memory_gib", 24.0),
        intra_bw=a2a_bw, intra_lat=a2a_lat, inter_bw=a2a_bw, inter_lat=a2a_lat,
        coll_base_lat=0.0, ring_efficiency=1.0, a2a_efficiency=1.0, a2a_peer_lat=0.0,
        kernel_lat=0.0, step_overhead_s=d.get("step_overhead_s", 0.0),
        adam_s_per_elem=d["adam_s_per_elem"], muon_s_per_elem=d["muon_s_per_elem"],
        owned_s_per_elem=d["owned_s_per_elem"], copy_s_per_elem=d["copy_s_per_elem"],
        ns_rate_points=tuple(tuple(p) for p in d["ns_rate_points"]), collectives=coll,
        source=f"calibrated {d.get('when', '')} on {d.get('nproc')} ranks")


# Public architectures ("-like": attention of Kimi-K2 is MLA, approximated here by GQA with
# the same head count; its parameter count differs by < 1% of the model).
MODELS: dict[str, ModelConfig] = {
    "bench-tiny": ModelConfig(name="bench-tiny", num_layers=4, hidden_size=384,
                              ffn_hidden_size=1536, num_attention_heads=6, vocab_size=256,
                              normalization="LayerNorm", seq_length=32),
    "gpt-1.3b": ModelConfig(name="gpt-1.3b", num_layers=24, hidden_size=2048,
                            ffn_hidden_size=8192, num_attention_heads=16, vocab_size=50304,
                            normalization="LayerNorm", seq_length=2048),
    "llama3-8b": ModelConfig(name="llama3-8b", num_layers=32, hidden_size=4096,
                             ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
                             vocab_size=128256, swiglu=True, seq_length=8192),
    "llama3-70b": ModelConfig(name="llama3-70b", num_layers=80, hidden_size=8192,
                              ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8,
                              vocab_size=128256, swiglu=True, seq_length=8192),
    "qwen3-30b-a3b": ModelConfig(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048,
                                 ffn_hidden_size=6144, num_attention_heads=32,
                                 num_query_groups=4, kv_channels=128, vocab_size=151936,
                                 swiglu=True, num_experts=128, moe_ffn_hidden_size=768,
                                 moe_topk=8, seq_length=4096),
    # Canzona's largest model (arXiv 2602.06079): Qwen3-32B's published shape
    "qwen3-32b": ModelConfig(name="qwen3-32b", num_layers=64, hidden_size=5120,
                             ffn_hidden_size=25600, num_attention_heads=64, num_query_groups=8,
                             kv_channels=128, vocab_size=151936, swiglu=True, seq_length=4096),
    "kimi-k2": ModelConfig(name="kimi-k2", num_layers=61, hidden_size=7168,
                           ffn_hidden_size=18432, num_attention_heads=64, num_query_groups=8,
                           kv_channels=128, vocab_size=163840, swiglu=True, num_experts=384,
                           moe_ffn_hidden_size=2048, moe_topk=8, moe_shared_expert_ffn=2048,
                           first_dense_layers=1, seq_length=4096),
}


# ----------------------------------------------------------------------------- the stage
@dataclass(frozen=True)
class StageTensor:
    """One parameter of the modelled pipeline stage (the first: it also holds the embedding)."""

    name: str
    shape: tuple  # full (TP-unsharded) shape; 1-D for norms
    tp_dim: Optional[int]  # None: replicated on the TP ranks
    expert: bool
    muon: bool
    units: tuple = ()  # ((key, (m, n)), ...) NS units of a Muon matrix
    tp: int = 1  # TP (ETP for experts) size it is split over

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_numel(self) -> int:
        return self.numel // self.tp if self.tp_dim is not None else self.numel


def _layers_of_stage(model: ModelConfig, pp: int, pp_rank: int = 0) -> range:
    per = math.ceil(model.num_layers / pp)
    return range(min(pp_rank * per, model.num_layers), min((pp_rank + 1) * per, model.num_layers))


def megatron_params(model: ModelConfig, layout: Layout, run: RunConfig = RunConfig(),
                    pp_rank: int = 0) -> list:
    """The parameters of pipeline stage ``pp_rank`` as Megatron-Core's ``GPTModel`` (local
    spec) registers them: ``geometry.gpt_param_specs``, the list DMuon's geometry, the
    planner and ``tools/bench_scale.py`` work on, and the one ``stage_tensors`` describes.
    One EP rank's experts (E / EP per MoE layer); the vocabulary is padded to a multiple of
    TP (Megatron-LM pads it)."""
    vocab = -(-model.vocab_size // layout.tp) * layout.tp
    return gpt_param_specs(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size, num_attention_heads=model.num_attention_heads,
        vocab_size=vocab, num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels, gated_linear_unit=model.swiglu,
        normalization=model.normalization, num_moe_experts=model.num_experts or None,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_ffn or None,
        first_dense_layers=model.first_dense_layers,
        share_embeddings_and_output_weights=model.tied_embeddings, tp=layout.tp, pp=layout.pp,
        pp_rank=pp_rank, ep=layout.ep, etp=layout.etp,
        stage_layers=_layers_of_stage(model, layout.pp, pp_rank))


def model_namespace(model: ModelConfig) -> SimpleNamespace:
    """What ``params.muon_units`` reads of a model (Megatron's ``TransformerConfig`` names)."""
    return SimpleNamespace(num_attention_heads=model.num_attention_heads,
                           num_query_groups=model.num_query_groups,
                           kv_channels=model.kv_channels, hidden_size=model.hidden_size,
                           gated_linear_unit=model.swiglu)


def _short_name(name: str) -> str:
    for prefix in ("module.decoder.", "module."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def stage_tensors(model: ModelConfig, layout: Layout, run: RunConfig = RunConfig()
                  ) -> list[StageTensor]:
    """Parameters of pipeline stage 0 in Megatron's ``named_parameters`` order
    (``megatron_params``), with full shapes and NS units (``params.muon_units``, as DMuon
    cuts them: QKV into Q, K, V, SwiGLU fc1 optionally into gate/up, one unit per expert);
    names without the ``module.decoder.`` prefix."""
    mc = model_namespace(model)
    out: list[StageTensor] = []
    for spec in megatron_params(model, layout, run):
        expert = ".local_experts." in spec.name
        tp = layout.etp if expert else layout.tp
        shape = full_shape_of(spec.shape, spec.tp_dim, tp) if len(spec.shape) == 2 else spec.shape
        name = _short_name(spec.name)
        units: tuple = ()
        if spec.muon:
            units = tuple((f"{name}#{i}", u.shape) for i, u in enumerate(muon_units(
                spec.name, shape, mc, split_qkv=run.split_qkv, split_fc1=run.split_fc1,
                tp_size=tp)))
        out.append(StageTensor(name, tuple(shape), spec.tp_dim, expert, spec.muon, units, tp))
    return out


def model_param_counts(model: ModelConfig) -> dict:
    """Total and active (per token) parameters of the whole model, and matmul params."""
    full = stage_tensors(model, Layout(), RunConfig())
    total = sum(t.numel for t in full)
    experts = sum(t.numel for t in full if t.expert)
    muon = sum(t.numel for t in full if t.muon)
    active_matmul = sum(t.numel for t in full if t.muon and not t.expert)
    if model.num_experts:
        active_matmul += experts * model.moe_topk / model.num_experts
    if not model.tied_embeddings:
        active_matmul += model.vocab_size * model.hidden_size  # output layer
    return dict(total=total, experts=experts, muon=muon, active_matmul=active_matmul)


# ----------------------------------------------------------------------------- groups & comm
@dataclass(frozen=True)
class Group:
    """A process group: member j is global rank ``base + j * stride`` (Megatron's rank order
    is TP fastest, then DP, then PP: a stage's DP x TP group is contiguous, its DP group has
    stride TP, an expert-DP group has stride EP x ETP)."""

    size: int
    stride: int
    gpus_per_node: int
    base: int = 0

    def node(self, j: int) -> int:
        return (self.base + j * self.stride) // self.gpus_per_node

    @property
    def nodes(self) -> int:
        return _count_nodes(self.size, self.stride, self.gpus_per_node, self.base)

    @property
    def local_size(self) -> int:
        """Members on one node."""
        return max(1, -(-self.size // self.nodes))


@lru_cache(maxsize=4096)
def _count_nodes(size: int, stride: int, gpn: int, base: int) -> int:
    return len({(base + j * stride) // gpn for j in range(size)})


def collective_time(hw: Hardware, kind: str, group: Group, recv_bytes: float,
                    inter_bytes: Optional[float] = None, peers: Optional[int] = None) -> float:
    """Seconds of one collective in which a rank receives ``recv_bytes``.

    ring kinds ('all_gather', 'reduce_scatter'): alpha + recv / (bw x ring efficiency),
    bw = InfiniBand when the group spans nodes (the ring's slowest link), else NVLink;
    alpha = base + hops, with (local - 1) NVLink hops and log2(nodes) InfiniBand hops
    (NCCL's tree/PAT algorithms at scale).  'all_reduce' = 2 x the reduce-scatter bytes.
    'all_to_all': alpha + (size - 1) peer costs + max(intra bytes / NVLink, inter bytes / IB);
    ``peers``: the peers with something to move, where fewer (torch's NCCL all-to-all with
    split sizes issues no send / receive for a zero count).
    A calibrated profile (gloo) replaces bandwidth and latency by its measured pair
    ('kind@size' when that group size was measured).
    """
    if group.size <= 1:
        return 0.0
    g = group.size
    if hw.collectives:
        key = kind if kind in hw.collectives else (
            "all_gather" if kind in ("reduce_scatter", "all_gather_v") else "all_to_all")
        key = f"{key}@{g}" if f"{key}@{g}" in hw.collectives else key  # measured group size
        bw, lat = hw.collectives.get(key, hw.collectives["all_to_all"])
        factor = 2.0 if kind == "all_reduce" and key != "all_reduce" else 1.0
        return lat + factor * recv_bytes / bw
    nodes = group.nodes
    local = group.local_size
    if kind == "all_to_all":
        if inter_bytes is None:
            inter_bytes = recv_bytes * (g - local) / (g - 1)
        intra = recv_bytes - inter_bytes
        return (hw.coll_base_lat + (g - 1 if peers is None else peers) * hw.a2a_peer_lat +
                max(intra / (hw.intra_bw * hw.a2a_efficiency),
                    inter_bytes / (hw.inter_bw * hw.a2a_efficiency)))
    lat = hw.coll_base_lat + (local - 1) * hw.intra_lat + \
        (math.ceil(math.log2(nodes)) * hw.inter_lat if nodes > 1 else 0.0)
    bw = (hw.inter_bw if nodes > 1 else hw.intra_bw) * hw.ring_efficiency
    if kind == "all_reduce":
        return 2 * lat + 2 * recv_bytes / bw
    return lat + recv_bytes / bw


def naive_exchange_bytes(muon_numel: int, n: int, elem_bytes: int = 4) -> float:
    """Bytes a rank receives when every rank gathers every matrix: (N-1)/N x P."""
    return (n - 1) / n * muon_numel * elem_bytes


def owner_exchange_bytes_even(muon_numel: int, n: int, elem_bytes: int = 4) -> float:
    """Owner-centric exchange with every unit spread evenly over N ranks and owners balanced:
    a rank receives (N-1)/N of the P/N it owns (gather) and its 1/N of the others' units
    (scatter): 2 (N-1)/N^2 x P (and sends the same)."""
    return 2 * (n - 1) / n**2 * muon_numel * elem_bytes


# ----------------------------------------------------------------------------- ZeRO-1 layout
@dataclass
class Zero1Layout:
    """Megatron's grad/param buffer of one rank and its DP shards.

    ``pieces[name] = [(group_rank, elems), ...]`` over the DMuon group (DP x TP ranks,
    group rank = dp_rank * tp + tp_rank, TP fastest as in Megatron's rank order)."""

    numel: int  # padded buffer length per TP rank
    buckets: list  # [(start, end)]
    pieces: dict
    shard_elems: int  # elements per DP rank (sum over buckets)


def zero1_holdings(tensors: Sequence[StageTensor], dp: int, tp: int, run: RunConfig,
                   bucket_elems: Optional[int] = None) -> Zero1Layout:
    """Megatron's buffer of ``tensors`` (``geometry.buffer_layout``: reverse parameter order,
    64-element start padding, buckets padded to lcm(DP, 128), each bucket cut into DP equal
    contiguous shards; ``run.megatron_pad=False``: no padding beyond a multiple of DP), as
    elements per group rank; TP-replicated tensors are counted once, on TP rank 0."""
    lay = buffer_layout([ParamSpec(t.name, (t.local_numel,)) for t in tensors], dp,
                        bucket_elems, pad=run.megatron_pad)
    by_name = {t.name: t for t in tensors}
    pieces: dict = {t.name: [] for t in tensors}
    for d, slices in enumerate(lay.dp_slices()):
        for i, start, end, _ in slices:
            name = lay.params[i].name
            tps = range(tp) if by_name[name].tp_dim is not None else range(1)
            pieces[name].extend((d * tp + tr, end - start) for tr in tps)
    return Zero1Layout(numel=lay.numel, buckets=[tuple(b) for b in lay.buckets], pieces=pieces,
                       shard_elems=sum(b1 - b0 for b0, b1 in lay.buckets) // dp)


@dataclass
class Exchange:
    """Elements per rank of one owner-centric step: gather (holders -> owner) and scatter
    (owner -> holders); ``*_inter``: the part that crosses nodes.  A rank's own part of its
    own unit never moves."""

    gather_sent: list
    gather_recv: list
    scatter_sent: list
    scatter_recv: list
    gather_inter: list  # received from other nodes in the gather
    scatter_inter: list
    # per rank, the peers it exchanges anything with, summed over the buckets' all-to-alls
    # (None: not counted); NCCL's all-to-all skips the peers with nothing to move
    gather_peers: Optional[list] = None
    scatter_peers: Optional[list] = None

    @property
    def sent(self) -> list:
        return [a + b for a, b in zip(self.gather_sent, self.scatter_sent)]

    @property
    def recv(self) -> list:
        return [a + b for a, b in zip(self.gather_recv, self.scatter_recv)]


def owner_exchange(holdings: dict, owners: dict, group: Group) -> Exchange:
    n = group.size
    gs, gr, ss, sr, gi, si = ([0] * n for _ in range(6))
    for key, held in holdings.items():
        o = owners[key]
        for g, elems in held.items():
            if g == o or elems == 0:
                continue
            gs[g] += elems
            gr[o] += elems
            ss[o] += elems
            sr[g] += elems
            if group.node(g) != group.node(o):
                gi[o] += elems
                si[g] += elems
    return Exchange(gs, gr, ss, sr, gi, si)


def placed_units(m, plan) -> list:
    """``[(unit or part, owner)]`` of matrix ``m`` under ``plan``: a unit the plan splits
    (``plan.splits``) is its parts (``units.split_unit``), each on its own rank, as
    ``OwnerCentricNS`` moves them."""
    splits = getattr(plan, "splits", None) or {}
    out = []
    for i, u in enumerate(m.units):
        sp = splits.get(m.unit_key(i))
        if sp is None:
            out.append((u, plan.owners[m.unit_key(i)]))
        else:
            from megatron_muon.core.units import split_unit

            out.extend(zip(split_unit(u, sp.widths), sp.ranks))
    return out


def matrix_exchange(matrices: Sequence, plan, group: Group) -> Exchange:
    """The elements DMuon's exchange moves per rank for ``matrices`` (``ShardedMatrix``, from
    ``geometry``) under ``plan``, as ``OwnerCentricNS`` builds its tables: every source
    piece's part of a unit (or of a split unit's part, ``placed_units``) goes to its owner
    (gather) and every piece's part of the result back to its holder (scatter), both counted
    by ``flat_blocks.piece_unit_blocks`` (exact, also for QKV, gate/up and split parts); a
    piece on its owner never moves.  The split units' all-reduces are not in it
    (``split_allreduce``)."""
    n = group.size
    gs, gr, ss, sr, gi, si = ([0] * n for _ in range(6))
    gp: list = [set() for _ in range(n)]  # (bucket, peer) pairs of each rank
    sp: list = [set() for _ in range(n)]
    for m in matrices:
        placed = placed_units(m, plan)
        whole = len(placed) == 1 and placed[0][0].numel == m.shape[0] * m.shape[1]
        for u, o in placed:
            for pc in m.pieces:
                if pc.rank == o:
                    continue
                elems = pc.end - pc.start if whole else sum(
                    h * w for _, _, h, w, _, _ in piece_unit_blocks(
                        m.shape, m.tp_dim, m.tp_size, pc.tp_rank, pc.start, pc.end,
                        pc.local_offset, u))
                if not elems:
                    continue
                remote = group.node(pc.rank) != group.node(o)
                b = getattr(m, "bucket", None)
                if pc.source:
                    gs[pc.rank] += elems
                    gr[o] += elems
                    gi[o] += elems if remote else 0
                    gp[pc.rank].add((b, o))
                    gp[o].add((b, pc.rank))
                ss[o] += elems
                sr[pc.rank] += elems
                si[pc.rank] += elems if remote else 0
                sp[o].add((b, pc.rank))
                sp[pc.rank].add((b, o))
    return Exchange(gs, gr, ss, sr, gi, si, [len(x) for x in gp], [len(x) for x in sp])


@dataclass(frozen=True)
class RankSet:
    """The ranks of one split unit inside a group, for ``collective_time`` (which reads
    ``size``, ``nodes`` and ``local_size``)."""

    size: int
    nodes: int
    local_size: int

    @classmethod
    def of(cls, ranks: Sequence[int], group: Group) -> "RankSet":
        per: dict = {}
        for r in ranks:
            per[group.node(r)] = per.get(group.node(r), 0) + 1
        return cls(len(ranks), len(per), max(per.values()))


def split_allreduce(plan, group: Group, hw: "Hardware", steps: int,
                    element_size: int = 4) -> tuple[list, list, list]:
    """``(NS flops, all-reduce seconds, all-reduce bytes)`` per rank of ``plan``'s split
    units (``plan.splits``): part j of a unit runs ``plan.split_costs``' flops on
    ``ranks[j]``, and every NS step all-reduces the s x s Gram matrix (``element_size``
    bytes per element: the NS dtype's) among the unit's
    ranks (``plan.split_bytes`` per step; each all-reduce priced by ``collective_time`` on
    those ranks; a rank's all-reduces add up).  Zeros for a plan without splits."""
    n = group.size
    flops, secs, nbytes = [0.0] * n, [0.0] * n, [0.0] * n
    splits = getattr(plan, "splits", None) or {}
    if not splits:
        return flops, secs, nbytes
    from megatron_muon.core.plan import split_bytes, split_costs

    shape = {t.key: t.shape for t in plan.tasks}
    # the executor runs each all-reduce point to point among the unit's ranks (a rank with
    # no part takes no part): per NS step one Gram all-reduce, plus the norm's (4 bytes)
    for key, sp in splits.items():
        sh, k = shape[key], len(sp.ranks)
        _, part_flops, _ = split_costs(sh, sp.widths, steps, 1.0, ay=sp.form == "ay")
        per_step = split_bytes(sh, k, 1, element_size)  # one Gram all-reduce, bytes per rank
        ranks = RankSet.of(sp.ranks, group)
        t = steps * collective_time(hw, "all_reduce", ranks, per_step / 2) + \
            collective_time(hw, "all_reduce", ranks, 4.0)
        for j, r in enumerate(sp.ranks):
            flops[r] += part_flops[j]
            secs[r] += t
            nbytes[r] += steps * per_step
    return flops, secs, nbytes


def exchange_elements(holdings: dict, owners: dict, num_ranks: int) -> tuple[list, list]:
    """(sent, received) elements per rank of one gather + one scatter."""
    ex = owner_exchange(holdings, owners, Group(num_ranks, 1, num_ranks))
    return ex.sent, ex.recv


def pingpong_owners(sizes: Sequence[tuple[str, int]], n: int) -> dict:
    """Megatron-Core 0.16 ``LayerWiseDistributedOptimizer.shard_params``: parameters sorted
    by numel (stable), dealt to ranks 0..n-1, n-1..0, 0..n-1, ..."""
    loop = list(range(n)) + list(range(n))[::-1]
    order = sorted(range(len(sizes)), key=lambda i: sizes[i][1])
    return {sizes[i][0]: loop[k % len(loop)] for k, i in enumerate(order)}


# ----------------------------------------------------------------------------- forward/backward
def fwd_bwd_seconds(model: ModelConfig, layout: Layout, run: RunConfig, hw: Hardware) -> dict:
    """Forward + backward compute of one step per GPU at the assumed MFU, with the 1F1B bubble.

    flops = 6 x active matmul params x tokens + causal attention 6 x L x seq x q_dim x tokens.
    """
    counts = model_param_counts(model)
    tokens = run.global_batch * model.seq_length
    attn = 6 * model.num_layers * model.seq_length * model.num_attention_heads * model.head_dim
    flops = (6 * counts["active_matmul"] + attn) * tokens
    t = flops / layout.world / (hw.peak_flops * run.mfu)
    micro = max(1, run.global_batch // (layout.dp * run.micro_batch))
    bubble = (layout.pp - 1) / micro if layout.pp > 1 else 0.0
    total = t * (1 + bubble)
    return dict(compute=total, fwd=total / 3, bwd=2 * total / 3, flops=flops, bubble=bubble)


# ----------------------------------------------------------------------------- prediction
@dataclass
class Prediction:
    mode: str
    model: str
    hardware: str
    layout: dict
    opt_s: float  # optimizer.step(): param all-gather included unless overlap_param_gather
    exposed_s: float  # optimizer work the step waits for (incl. un-hidden param gather)
    step_s: float  # fwd/bwd + exposed grad sync + exposed_s (+ ZeRO-3 exposed gathers)
    fwd_bwd_s: float
    muon_recv_bytes: float  # Muon exchange, bytes received by the busiest rank per step
    muon_sent_bytes: float
    opt_recv_bytes: float  # everything the optimizer step receives (Muon + param gather)
    memory_bytes: float  # weights + grads + optimizer state + Muon workspace (not activations)
    state_bytes: float  # optimizer state per rank (momentum / Adam moments)
    muon_state_bytes: float  # Muon momentum on the busiest rank
    imbalance: float  # max/mean - 1 of per-rank NS flops (0: balanced or replicated)
    breakdown: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.layout["tp"] * self.layout["pp"] * self.layout["dp"]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["world"] = self.world
        return d


def _ns_time(hw: Hardware, units: Sequence[tuple[int, int]], steps: int) -> float:
    """NS seconds for one rank's units, batched by shape (one batch per shape)."""
    by_shape: dict = {}
    for m, n in units:
        key = (min(m, n), max(m, n))
        by_shape[key] = by_shape.get(key, 0) + 1
    t = 0.0
    for (s, big), count in by_shape.items():
        t += count * ns_flops(s, big, steps) / hw.ns_rate(s) + 3 * steps * hw.kernel_lat
    return t


def _ns_workspace(units: Sequence[tuple[int, int]], dtype_bytes: int) -> float:
    """Largest NS batch's temporaries: X, X_new (b s big) and A, B (b s^2)."""
    by_shape: dict = {}
    for m, n in units:
        key = (min(m, n), max(m, n))
        by_shape[key] = by_shape.get(key, 0) + 1
    return max([c * (2 * s * big + 2 * s * s) * dtype_bytes for (s, big), c in by_shape.items()]
               or [0])


class _Stage:
    """Everything about stage 0 that several modes share (built once per model x layout)."""

    def __init__(self, model: ModelConfig, layout: Layout, run: RunConfig):
        layout.check()
        self.model, self.layout, self.run = model, layout, run
        self.tensors = stage_tensors(model, layout, run)
        # the expert-parallel buffers (Megatron: experts with EP > 1; at EP = 1 experts are
        # dense parameters, in the dense buffers and DMuon's DP x TP group)
        split = layout.ep > 1
        self.dense = [t for t in self.tensors if not (t.expert and split)]
        self.experts = [t for t in self.tensors if t.expert and split]
        tp, dp, gpn = layout.tp, layout.dp, layout.gpus_per_node
        self.g_dense = Group(tp * dp, 1, gpn)  # DMuon group: DP x TP of the stage
        self.g_dp = Group(dp, tp, gpn)
        self.g_tp = Group(tp, 1, gpn)
        self.g_edp = Group(layout.edp, layout.ep * layout.etp, gpn)
        self.g_world = Group(layout.world, 1, gpn)
        self.local_dense = sum(t.local_numel for t in self.dense)
        self.local_expert = sum(t.local_numel for t in self.experts)
        self.local_total = self.local_dense + self.local_expert
        self.muon_dense_full = sum(t.numel for t in self.dense if t.muon)
        self.muon_expert_full = sum(t.numel for t in self.experts if t.muon)
        self.adam_local = sum(t.local_numel for t in self.tensors if not t.muon)
        self.dense_muon_local = sum(t.local_numel for t in self.dense if t.muon)
        self.kinds = (False, True) if self.experts else (False,)  # dense, expert
        bucket = ddp_bucket_size(run.bucket_elems, dp, overlap_grad_reduce=run.overlap_grad_reduce)
        self.bucket = bucket
        self.nbuckets = max(1, math.ceil(self.local_total / bucket)) if bucket else 1
        self._cache: dict = {}

    def part(self, expert: bool) -> tuple[list, int, Group, int]:
        """``(tensors, DP size, DP group, TP size)`` of the dense part or of the local experts."""
        lay = self.layout
        if expert:
            return self.experts, lay.edp, self.g_edp, lay.etp
        return self.dense, lay.dp, self.g_dp, lay.tp

    # DMuon's geometry and owner plan: the real ones (megatron_muon.megatron.geometry and
    # dmuon.plan_matrices, as tools/bench_scale.py and DMuonDistributedOptimizer run them) --
    def dmuon_cfg(self):
        """DMuon's settings (``DMuonOptimizerConfig``, defaults for everything the run does not
        set), which the geometry and the planner read."""
        if "cfg" not in self._cache:
            from megatron_muon.megatron.config import DMuonOptimizerConfig  # Megatron-Core

            run = self.run
            self._cache["cfg"] = DMuonOptimizerConfig(
                optimizer="dmuon", lr=1e-3, use_distributed_optimizer=True,
                bf16=run.param_bytes == 2, muon_num_ns_steps=run.ns_steps,
                muon_split_qkv=run.split_qkv, dmuon_split_fc1=run.split_fc1,
                dmuon_locality_slack=run.locality_slack, dmuon_log_plan=False,
                dmuon_split=run.dmuon_split,
                muon_fp32_matmul_prec="medium" if run.ns_dtype_bytes == 2 else "high")
        return self._cache["cfg"]

    def geometry(self, expert: bool) -> tuple:
        """``(PartGeometry, matrices)`` of DMuon's dense or expert optimizer: Megatron's
        buffers of stage 0 (``geometry.dmuon_part``) and every rank's ``ShardedMatrix``
        (``geometry.stage_matrices``: group rank = DP rank x TP + TP rank; experts over their
        expert-DP group, x ETP)."""
        key = ("geometry", expert)
        if key not in self._cache:
            lay = self.layout
            part = dmuon_part([megatron_params(self.model, lay, self.run)],
                              dp_size=lay.edp if expert else lay.dp, bucket_size=self.bucket,
                              expert=expert, pad=self.run.megatron_pad)
            mats = stage_matrices(part, tp_size=lay.etp if expert else lay.tp,
                                  model_config=model_namespace(self.model), cfg=self.dmuon_cfg(),
                                  expert=expert, real_tp_size=lay.tp)
            self._cache[key] = (part, mats)
        return self._cache[key]

    def muon_held_max(self, expert: bool) -> int:
        """Most Muon-matrix elements any rank's ZeRO-1 shard holds (DMuon's flat buffer)."""
        return max(self.geometry(expert)[0].local_numel, default=0)

    def muon_held_min(self, expert: bool) -> int:
        """Fewest Muon-matrix elements any rank of the Muon group holds as a gather source
        (TP-replicated matrices: their TP-rank-0 copies)."""
        per = [0] * self.muon_group(expert).size
        for m in self.geometry(expert)[1]:
            for pc in m.pieces:
                if pc.source:
                    per[pc.rank] += pc.end - pc.start
        return min(per)

    def muon_group(self, expert: bool) -> Group:
        """Ranks that together hold every element of the stage's (dense or local-expert)
        matrices once: DP x TP for dense; expert-DP x ETP for one EP rank's experts (exact
        member placement for ETP = 1)."""
        lay = self.layout
        if not expert:
            return self.g_dense
        return Group(lay.edp * lay.etp, lay.ep if lay.etp == 1 else 1, lay.gpus_per_node)

    def dmuon_plan(self, expert: bool) -> tuple[OwnerPlan, list, Group]:
        """``(plan, matrices, group)``: DMuon's owner plan, from ``dmuon.plan_matrices`` on the
        real geometry with the flop cost DMuon's default ``dmuon_plan_cost='flops'`` uses.
        Above ``run.locality_max_work`` units x ranks (or ``run.locality=False``) the plan
        is taken without holdings (plain LPT), for the sweeps' speed: there the model
        deviates from DMuon, which always plans with locality, and says so in its notes."""
        key = ("dmuon", expert)
        if key not in self._cache:
            from megatron_muon.megatron.dmuon import plan_matrices  # imports Megatron-Core

            _, mats = self.geometry(expert)
            group = self.muon_group(expert)
            units = sum(len(m.units) for m in mats)
            use_loc = self.run.locality and units * group.size <= self.run.locality_max_work
            plan = plan_matrices(mats, group.size, self.dmuon_cfg(), flops_cost(self.run.ns_steps),
                                 replicate=not use_loc)  # replicate: the plan without holdings
            self._cache[key] = (plan, mats, group, use_loc)
        return self._cache[key][:3]

    def locality_used(self, expert: bool) -> bool:
        self.dmuon_plan(expert)
        return self._cache[("dmuon", expert)][3]


_STAGES: dict = {}


def _stage(model: ModelConfig, layout: Layout, run: RunConfig) -> _Stage:
    key = (model, layout, run)
    if key not in _STAGES:
        if len(_STAGES) > 64:
            _STAGES.clear()
        _STAGES[key] = _Stage(model, layout, run)
    return _STAGES[key]


def _hidden(total: float, window: float, pieces: int) -> float:
    """Exposed part of ``total`` overlapped per bucket with ``window``: the last piece never
    hides; the rest hides up to the window."""
    if total <= 0:
        return 0.0
    return max(total / max(1, pieces), total - window)


@dataclass
class _Costs:
    """One mode's per-rank costs before they are assembled into a Prediction."""

    bd: dict = field(default_factory=dict)  # seconds per optimizer-step component
    grad_sync: float = 0.0  # backward-pass gradient collective(s)
    param_gather_overlappable: bool = True
    zero3_comm: float = 0.0  # ZeRO-3 per-layer gathers + reduce-scatter (forward/backward)
    muon_sent: float = 0.0
    muon_recv: float = 0.0
    pg_recv: float = 0.0
    weights: float = 0.0  # bf16 params + fp32 main grads held
    main_state: float = 0.0  # fp32 main params + optimizer state
    opt_state: float = 0.0  # optimizer state only (momentum / Adam moments)
    muon_state: float = 0.0  # Muon momentum on the busiest rank
    workspace: float = 0.0
    imbalance: float = 0.0
    notes: list = field(default_factory=list)


def _zero1_common(st: "_Stage", hw: Hardware, run: RunConfig, c: _Costs) -> tuple[float, float]:
    """Megatron's distributed optimizer around any ZeRO-1 mode: gradient reduce-scatter,
    param all-gather, the main-shard copies.  Returns (shard elements, Muon shard elements)."""
    lay = st.layout
    dp, edp, L, E = lay.dp, lay.edp, st.local_dense, st.local_expert
    pb, gb = run.param_bytes, run.grad_bytes
    c.grad_sync = collective_time(hw, "reduce_scatter", st.g_dp, (dp - 1) / dp * L * gb) + \
        collective_time(hw, "reduce_scatter", st.g_edp, (edp - 1) / edp * E * gb)
    c.bd["param_gather"] = collective_time(hw, "all_gather", st.g_dp, (dp - 1) / dp * L * pb) + \
        collective_time(hw, "all_gather", st.g_edp, (edp - 1) / edp * E * pb)
    c.pg_recv = (dp - 1) / dp * L * pb + (edp - 1) / edp * E * pb
    shard = L / dp + E / edp
    # Muon elements of the busiest rank's shard (exact, from Megatron's buffer layout)
    muon_shard = sum(st.muon_held_max(expert) for expert in st.kinds)
    c.bd["elementwise"] = run.main_copy_passes * hw.copy_time(shard)
    c.weights = (pb + gb) * st.local_total
    return shard, muon_shard


def _cost_adamw(st, hw, run, mode) -> _Costs:
    c = _Costs()
    shard, _ = _zero1_common(st, hw, run, c)
    c.bd["elementwise"] += hw.adam_time(shard)
    c.opt_state = 8 * shard
    c.main_state = 4 * shard + c.opt_state
    return c


def _cost_zero1_muon(st, hw, run, mode) -> _Costs:
    """muon_naive, dmuon and dmuon_overlap: Megatron's ZeRO-1 + a Muon exchange."""
    c = _Costs()
    cb = run.muon_comm_bytes
    shard, muon_shard = _zero1_common(st, hw, run, c)
    adam_shard = max(0.0, shard - muon_shard)
    c.muon_state = 4 * muon_shard
    c.bd["elementwise"] += hw.muon_elem_time(muon_shard) + hw.adam_time(adam_shard)
    c.opt_state = 4 * muon_shard + 8 * adam_shard
    c.main_state = 4 * shard + c.opt_state
    comm = ns = owned = 0.0
    ws_units: list = []
    for expert in st.kinds:
        ts = st.experts if expert else st.dense
        g = st.muon_group(expert)
        if mode == "muon_naive":
            full = sum(t.numel for t in ts if t.muon)
            # a rank receives every Muon element it does not hold: (N-1)/N P on average,
            # P - (least held) on the busiest rank (exact from the buffer layout)
            recv = (full - st.muon_held_min(expert)) * cb
            calls = sum(1 for t in ts if t.muon) if run.naive_per_matrix_calls else st.nbuckets
            comm += collective_time(hw, "all_to_all", g, recv) + \
                (calls - 1) * collective_time(hw, "all_to_all", g, 0.0)
            c.muon_recv += recv
            c.muon_sent += recv
            units = [u for t in ts if t.muon for _, u in t.units]
            ns += _ns_time(hw, units, run.ns_steps)
            owned += full
            ws_units += units
        else:
            plan, mats, g = st.dmuon_plan(expert)
            ex = matrix_exchange(mats, plan, g)
            gmax = max(range(g.size), key=lambda q: max(ex.gather_recv[q], ex.gather_sent[q]))
            smax = max(range(g.size), key=lambda q: max(ex.scatter_recv[q], ex.scatter_sent[q]))
            # the exchange's all-to-alls (one gather and one scatter per bucket): the busiest
            # rank's bytes; the per-peer latency of the rank with the most peers over the
            # buckets (NCCL skips the empty peers; a calibrated profile's measured latency
            # is per call)
            sparse = None if hw.collectives else (max(ex.gather_peers), max(ex.scatter_peers))
            comm += collective_time(
                hw, "all_to_all", g, max(ex.gather_recv[gmax], ex.gather_sent[gmax]) * cb,
                ex.gather_inter[gmax] * cb, peers=sparse and 0)
            comm += collective_time(
                hw, "all_to_all", g, max(ex.scatter_recv[smax], ex.scatter_sent[smax]) * cb,
                ex.scatter_inter[smax] * cb, peers=sparse and 0)
            comm += 2 * (st.nbuckets - 1) * collective_time(hw, "all_to_all", g, 0.0,
                                                             peers=sparse and 0)
            if sparse:
                comm += sum(sparse) * hw.a2a_peer_lat
            sflops, ssecs, sbytes = split_allreduce(plan, g, hw, run.ns_steps,
                                                    run.ns_dtype_bytes)
            c.muon_recv += max(r * cb + b for r, b in zip(ex.recv, sbytes))
            c.muon_sent += max(r * cb + b for r, b in zip(ex.sent, sbytes))
            per_rank: list = [[] for _ in range(g.size)]
            for task in plan.tasks:
                if task.key in plan.owners:  # whole units; split ones: split_allreduce
                    per_rank[plan.owners[task.key]].append(task.shape)
            # NS of the split parts at the rate of their short side, and their all-reduces
            # (synchronous inside NS: every NS step waits for its Gram all-reduce)
            small = {t.key: min(t.shape) for t in plan.tasks}
            part_s = [[] for _ in range(g.size)]
            for key, sp in (getattr(plan, "splits", None) or {}).items():
                for r in sp.ranks:
                    part_s[r].append(small[key])
            times = [_ns_time(hw, us, run.ns_steps) + ssecs[q] +
                     (sflops[q] / hw.ns_rate(min(part_s[q])) if part_s[q] else 0.0) +
                     3 * run.ns_steps * hw.kernel_lat * len(part_s[q])
                     for q, us in enumerate(per_rank)]
            w = max(range(g.size), key=lambda q: times[q])
            ns += times[w]
            ws_units += per_rank[w]
            owned += max(plan.bytes_owned) / 4
            c.imbalance = max(c.imbalance, plan.imbalance)
            if plan.splits:
                c.notes.append(f"{'expert' if expert else 'dense'} plan splits "
                               f"{len(plan.splits)} units into "
                               f"{sum(len(v.ranks) for v in plan.splits.values())} parts")
            if not st.locality_used(expert):
                c.notes.append(f"{'expert' if expert else 'dense'} owner plan: plain LPT "
                               f"({len(plan.tasks)} units x {g.size} ranks > locality_max_work)")
    c.bd["owned"] = hw.owned_time(owned)
    c.bd["ns"] = ns
    c.bd["muon_comm"] = comm
    # owned buffer + NS result (fp32), the flat shard buffers, NS temporaries
    c.workspace = 4 * (2 * owned + 2 * muon_shard) + _ns_workspace(ws_units, run.ns_dtype_bytes)
    return c


def mcore19_layout(sizes: Sequence[tuple[str, int]], n: int, bucket_elems: Optional[int]
                   ) -> tuple[dict, list]:
    """Megatron-Core 0.19 ``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout``
    for the Muon buffer: params in backprop (reverse) order cut into chunks of at least
    max(bucket_size, 0.9 x DP x largest param); inside a chunk, largest first to the shard
    with the smallest cursor (64-element aligned); every shard of a bucket padded to the
    largest.  Returns ({name: owner}, [padded shard size per bucket])."""
    owners: dict = {}
    padded: list = []

    def emit(chunk):
        if not chunk:
            return
        cursors = [0] * n
        for name, numel in sorted(chunk, key=lambda x: -x[1]):
            q = min(range(n), key=lambda s: (cursors[s], s))
            owners[name] = q
            cursors[q] = -(-cursors[q] // 64) * 64 + numel
        padded.append(-(-max(cursors) // 128) * 128)

    chunk, numel, biggest = [], 0, 0
    for name, size in reversed(list(sizes)):
        chunk.append((name, size))
        numel += size
        biggest = max(biggest, size)
        if bucket_elems is not None and numel >= max(bucket_elems, int(n * biggest * 0.9)):
            emit(chunk)
            chunk, numel, biggest = [], 0, 0
    emit(chunk)
    return owners, padded


def _tp_sharded_ns(hw: Hardware, units: Sequence[tuple[int, int]], ttp: int, steps: int,
                   local_elems: float, elem_bytes: int, gpus_per_node: int) -> tuple:
    """One DP owner's whole units spread over its ``ttp`` TP ranks instead of every TP rank
    running all of them (Megatron's TP mode 'layer_sharded', Canzona's micro-groups): LPT
    by NS flops; each TP rank sends the others its shards of their units and receives
    theirs of its own, (ttp - 1) / ttp of the owner's local Muon elements, and the results
    go back the same way: two all-to-alls.  ``(NS seconds of the busiest TP rank, exchange
    seconds, bytes received, that rank's units)``."""
    loads, per = [0.0] * ttp, [[] for _ in range(ttp)]
    for u in sorted(units, key=lambda u: -ns_flops(min(u), max(u), steps)):
        r = min(range(ttp), key=loads.__getitem__)
        per[r].append(u)
        loads[r] += ns_flops(min(u), max(u), steps)
    times = [_ns_time(hw, us, steps) for us in per]
    w = max(range(ttp), key=lambda q: times[q])
    recv = (ttp - 1) / ttp * local_elems * elem_bytes
    comm = 2 * collective_time(hw, "all_to_all", Group(ttp, 1, gpus_per_node), recv)
    return times[w], comm, 2 * recv, per[w]


def _cost_mcore(st, hw, run, mode) -> _Costs:
    """Megatron-Core layer-wise distributed Muon, muon_tp_mode='duplicated'.

    ``run.mcore_layout == '0.16'``: ``shard_params`` deals every parameter (Muon and AdamW
    ones) ping-pong over DP by size; DDP all-reduces full gradients; ``allgather_params()``
    all-gathers the updated parameters inside ``step()`` (never overlapped).
    ``'0.19'``: the Muon matrices get a shard-aligned buffer (``mcore19_layout``), so
    gradients are reduce-scattered and parameters all-gathered by the distributed
    optimizer's bucketed collectives (padded to the largest shard; overlappable); AdamW
    parameters keep Megatron's usual distributed optimizer.
    Either way each TP rank all-gathers its owned matrices' TP shards and runs the same NS;
    ``mode='mcore_layer_sharded'`` (Megatron's TP mode 'layer_sharded', 0.19 layout) spreads
    them over the TP ranks instead (``_tp_sharded_ns``).
    """
    sharded = mode == "mcore_layer_sharded"
    c = _Costs()
    lay = st.layout
    pb, gb, cb = run.param_bytes, run.grad_bytes, run.muon_comm_bytes
    v19 = run.mcore_layout == "0.19" or sharded
    c.param_gather_overlappable = v19
    c.weights = (pb + gb) * st.local_total  # full params and full fp32 grads
    ns = elem = tp_comm = pg = 0.0
    ws_units: list = []
    for expert in st.kinds:
        ts, n, group, ttp = st.part(expert)
        total = sum(t.local_numel for t in ts)
        muon_ts = [t for t in ts if t.muon]
        adam_total = total - sum(t.local_numel for t in muon_ts)
        if v19:
            own, padded = mcore19_layout([(t.name, t.local_numel) for t in muon_ts], n,
                                         st.bucket)
            shard_pad = sum(padded)  # per rank, Muon buffer
            adam_shard = adam_total / n
            # the shard-aligned buffer holds n x the padded shard on every rank
            c.weights += (pb + gb) * max(0.0, n * shard_pad - (total - adam_total))
            c.grad_sync += collective_time(hw, "reduce_scatter", group,
                                           (n - 1) * (shard_pad + adam_shard) * gb)
            recv = (n - 1) * (shard_pad + adam_shard) * pb
            pg += collective_time(hw, "all_gather", group, recv)
            c.pg_recv += recv
        else:
            own = pingpong_owners([(t.name, t.local_numel) for t in ts], n)
            c.grad_sync += collective_time(hw, "all_reduce", group, (n - 1) / n * total * gb)
        elems, muon_elems, flops = [0.0] * n, [0] * n, [0.0] * n
        units_of: list = [[] for _ in range(n)]
        for t in ts:
            if t.name not in own:
                continue
            r = own[t.name]
            elems[r] += t.local_numel
            if t.muon:
                muon_elems[r] += t.local_numel
                for _, u in t.units:
                    flops[r] += ns_flops(u[0], u[1], run.ns_steps)
                    units_of[r].append(u)
        if v19:
            elems = [e + adam_total / n for e in elems]
        else:  # uneven all-gather of the updated params (all_gather with a list of sizes)
            recv = (total - min(elems)) * pb
            pg += collective_time(hw, "all_gather_v", group, recv)
            c.pg_recv += recv
        times = [_ns_time(hw, us, run.ns_steps) for us in units_of]
        w = max(range(n), key=lambda q: times[q])
        mean = sum(flops) / n
        c.imbalance = max(c.imbalance, max(flops) / mean - 1 if mean else 0.0)
        big = max(range(n), key=lambda q: elems[q])
        adam_own = elems[big] - muon_elems[big]
        elem += hw.muon_elem_time(muon_elems[big]) + hw.adam_time(adam_own) + \
            run.main_copy_passes * hw.copy_time(elems[big])
        c.opt_state += 4 * muon_elems[big] + 8 * adam_own
        c.main_state += 4 * elems[big] + 4 * muon_elems[big] + 8 * adam_own
        c.muon_state += 4 * max(muon_elems)
        if sharded and ttp > 1:
            t_ns, t_comm, moved, busiest = _tp_sharded_ns(
                hw, units_of[w], ttp, run.ns_steps, max(muon_elems), cb, lay.gpus_per_node)
            ns, tp_comm, ws_units = ns + t_ns, tp_comm + t_comm, ws_units + busiest
            c.muon_recv += moved
            c.muon_sent += moved
            c.workspace += 4 * max(muon_elems)
            continue
        ns += times[w]
        ws_units += units_of[w]
        # TP all-gather of the owned matrices' shards; every TP rank runs the same NS
        tp_recv = (ttp - 1) * max(muon_elems) * cb
        tp_comm += collective_time(hw, "all_gather", Group(ttp, 1, lay.gpus_per_node), tp_recv)
        c.muon_recv += tp_recv
        c.muon_sent += tp_recv
        c.workspace += 4 * ttp * max(muon_elems)
    c.bd.update(elementwise=elem, ns=ns, muon_comm=tp_comm, param_gather=pg)
    c.workspace += _ns_workspace(ws_units, run.ns_dtype_bytes)
    c.notes.append("owners: Megatron-Core " + (
        "0.19 shard-aligned layout (LPT by size per bucket)" if v19 else
        "0.16 ping-pong deal of params sorted by size") +
        ("; NS spread over the TP ranks (layer_sharded)" if sharded else ""))
    return c


def _cost_matrix(st, hw, run, mode) -> _Costs:
    """MatrixFSDP placement (ZeRO-1 / ZeRO-3) and the FSDP2 'reconstruct' baseline."""
    c = _Costs()
    lay = st.layout
    pb, gb, cb = run.param_bytes, run.grad_bytes, run.muon_comm_bytes
    ns = elem = tp_comm = rs = ag = 0.0
    owned_total = 0.0
    ws_units: list = []
    for expert in st.kinds:
        ts, n, group, ttp = st.part(expert)
        total = sum(t.local_numel for t in ts)
        muon_total = sum(t.local_numel for t in ts if t.muon)
        if mode == "fsdp2_reconstruct":
            owned = [total / n] * n  # FSDP2: every tensor cut evenly on dim 0
            units = [u for t in ts if t.muon for _, u in t.units]
            ns += _ns_time(hw, units, run.ns_steps)
            ws_units += units
            full = sum(t.numel for t in ts if t.muon)
            gg = Group(n * ttp, group.stride // ttp if ttp > 1 else group.stride,
                       lay.gpus_per_node)
            recv = naive_exchange_bytes(full, gg.size, cb)
            calls = sum(1 for t in ts if t.muon)  # full_tensor() per parameter
            tp_comm += collective_time(hw, "all_gather", gg, recv) + \
                (calls - 1) * collective_time(hw, "all_gather", gg, 0.0)
            c.muon_recv += recv
            c.muon_sent += recv
            c.workspace = max(c.workspace, 4 * 2 * full)
            muon_share = [muon_total / n] * n
        else:
            tasks = [UnitTask(t.name, t.units[0][1],
                              sum(ns_flops(u[0], u[1], run.ns_steps) for _, u in t.units),
                              4 * t.local_numel) for t in ts if t.muon]
            plan = plan_owners(tasks, n)
            c.imbalance = max(c.imbalance, plan.imbalance)
            owned = [b / 4 for b in plan.bytes_owned]
            muon_share = list(owned)
            # non-matrix tensors need no whole placement: they fill the lightest ranks
            owned = water_fill(owned, sum(t.local_numel for t in ts if not t.muon))
            per_rank: list = [[] for _ in range(n)]
            for t in ts:
                if t.muon:
                    per_rank[plan.owners[t.name]].extend(u for _, u in t.units)
            times = [_ns_time(hw, us, run.ns_steps) for us in per_rank]
            w = max(range(n), key=lambda q: times[q])
            if ttp > 1 and mode == "canzona":  # TP micro-groups: NS spread over TP
                t_ns, t_comm, moved, busiest = _tp_sharded_ns(
                    hw, per_rank[w], ttp, run.ns_steps, max(muon_share), cb,
                    lay.gpus_per_node)
                ns += t_ns
                ws_units += busiest
                tp_comm += t_comm
                c.muon_recv += moved
                c.muon_sent += moved
                c.workspace = max(c.workspace, 4 * max(muon_share))
            else:
                ns += times[w]
                ws_units += per_rank[w]
                if ttp > 1:  # a whole matrix is TP shards: gather them, NS duplicated on TP
                    tp_recv = (ttp - 1) * max(muon_share) * cb
                    tp_comm += collective_time(hw, "all_gather",
                                               Group(ttp, 1, lay.gpus_per_node), tp_recv)
                    c.muon_recv += tp_recv
                    c.muon_sent += tp_recv
                    c.workspace = max(c.workspace, 4 * ttp * max(muon_share))
        big = max(range(n), key=lambda q: owned[q])
        pad = max(owned)
        # uneven collectives: NCCL all-gather-v / reduce-scatter-v (grouped broadcasts /
        # reduces) move what a rank lacks; padding to the largest shard (gloo) moves n x max
        vol = (n - 1) * pad if run.pad_uneven_collectives else total - min(owned)
        rs += collective_time(hw, "reduce_scatter", group, vol * gb)
        ag += collective_time(hw, "all_gather", group, vol * pb)
        c.pg_recv += (total - min(owned)) * pb
        owned_total += owned[big]
        mu = muon_share[big]
        elem += hw.muon_elem_time(mu) + hw.adam_time(owned[big] - mu)
        c.opt_state += 4 * mu + 8 * (owned[big] - mu)
        c.muon_state += 4 * max(muon_share)
        c.main_state += 4 * owned[big] + 4 * mu + 8 * (owned[big] - mu)
        if n > 1 and mode != "fsdp2_reconstruct" and pad > 1.1 * total / n:
            c.notes.append(f"{'expert' if expert else 'dense'} shards uneven: largest "
                           f"{pad / (total / n):.2f} x mean")
    c.bd.update(elementwise=elem, ns=ns, muon_comm=tp_comm)
    c.workspace = max(c.workspace, _ns_workspace(ws_units, run.ns_dtype_bytes))
    layers = max(1, len(_layers_of_stage(st.model, lay.pp)))
    if mode in ("matrix_zero1", "canzona"):  # ZeRO-1 geometry
        c.grad_sync = rs
        c.bd["param_gather"] = ag
        c.weights = (pb + gb) * st.local_total
    else:  # ZeRO-3: gather params in forward and in backward, reduce-scatter grads, per layer
        c.zero3_comm = 2 * ag + rs
        c.bd["param_gather"] = 0.0
        c.pg_recv = 0.0
        c.weights = (pb + gb) * owned_total + 2 * (pb + gb) * st.local_total / layers
    return c


def water_fill(levels: Sequence[float], amount: float) -> list:
    """Pour ``amount`` onto the lowest ``levels`` until they are level (or it runs out)."""
    out = list(levels)
    if amount <= 0 or not out:
        return out
    order = sorted(out)
    filled, k = amount, 0
    level = order[0]
    while k < len(order):
        nxt = order[k + 1] if k + 1 < len(order) else math.inf
        need = (nxt - level) * (k + 1)
        if need >= filled:
            level += filled / (k + 1)
            break
        filled -= need
        level = nxt
        k += 1
    return [max(v, level) for v in out]


_MODE_COSTS = {"adamw": _cost_adamw, "muon_naive": _cost_zero1_muon, "dmuon": _cost_zero1_muon,
               "dmuon_overlap": _cost_zero1_muon, "mcore_layerwise": _cost_mcore,
               "matrix_zero1": _cost_matrix, "matrix_zero3": _cost_matrix,
               "fsdp2_reconstruct": _cost_matrix, "mcore_layer_sharded": _cost_mcore,
               "canzona": _cost_matrix}


def predict(model: ModelConfig, layout: Layout, hw: Hardware, mode: str,
            run: RunConfig = RunConfig()) -> Prediction:
    """Cost of one training step of ``mode`` on ``layout`` x ``hw`` (see the module doc).

    ``opt_s`` is ``optimizer.step()`` as Megatron runs it: the ZeRO param all-gather is in
    it unless ``overlap_param_gather`` moves it into the next forward.  Exposed time:
    - the ZeRO param all-gather hides under the next forward when ``overlap_param_gather``
      (bucket by bucket: all but the last bucket's share can hide), except in
      ``mcore_layerwise`` whose step gathers the params itself;
    - ``dmuon_overlap``: the Muon work W = exchange + NS + owned-buffer handling runs bucket
      by bucket during the backward pass, once a bucket's gradients are reduce-scattered,
      except the scatter of the results (half the exchange), which runs in the step.
      Window assumption: window = overlap_efficiency x (1 - 1/buckets) x (backward compute
      - gradient reduce-scatter time); the last bucket's share W / buckets never hides;
      exposed = max(W / buckets, W - window).  overlap_efficiency (0.5) is the share of the
      backward in which NS GEMMs and all-to-alls run without slowing the backward kernels
      they share the GPU and the network with: an assumption, not a measurement.  NS run
      early is speculative: a clipped step redoes it (``run.clip_rate``), and
      ``run.overlap_policy`` says when it speculates at all (``overlap_exposed``).
    """
    if mode not in _MODE_COSTS:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES + EXTRA_MODES}")
    st = _stage(model, layout, run)
    fb = fwd_bwd_seconds(model, layout, run, hw)
    c = _MODE_COSTS[mode](st, hw, run, mode)
    bd = c.bd
    bd["grad_norm"] = run.grad_norm_calls * collective_time(hw, "all_reduce", st.g_world, 8)
    bd["overhead"] = run.step_overhead_s if run.step_overhead_s is not None else \
        hw.step_overhead_s
    for k in ("elementwise", "owned", "ns", "muon_comm", "param_gather"):
        bd.setdefault(k, 0.0)
    pg = bd["param_gather"]
    pg_in_step = not (c.param_gather_overlappable and run.overlap_param_gather)
    core = sum(bd.values()) - pg
    opt_s = core + (pg if pg_in_step else 0.0)
    nb = st.nbuckets
    notes = list(c.notes)
    if mode == "dmuon_overlap":
        work = bd["muon_comm"] + bd["ns"] + bd["owned"]
        scatter = bd["muon_comm"] / 2  # a used speculation's scatter runs in the step
        window = run.overlap_efficiency * (1 - 1 / nb) * max(0.0, fb["bwd"] - c.grad_sync)
        exposed_work, policy = overlap_exposed(work, _hidden(work - scatter, window, nb), run,
                                               layout.pp, in_step=scatter)
        core = core - work + exposed_work
        notes.append(f"overlap ({policy}, clip rate {run.clip_rate:g}): window "
                     f"{window * 1e3:.2f} ms over {nb} buckets")
    pg_exposed = pg if pg_in_step else _hidden(pg, fb["fwd"] * (1 - 1 / nb), nb)
    exposed = core + pg_exposed
    if run.overlap_grad_reduce:
        gs_exposed = _hidden(c.grad_sync, fb["bwd"] * (1 - 1 / nb), nb)
    else:
        gs_exposed = c.grad_sync
    layers = max(1, len(_layers_of_stage(model, layout.pp)))
    z3_exposed = _hidden(c.zero3_comm, fb["compute"] * (1 - 1 / layers), layers)
    bd["grad_sync_exposed"] = gs_exposed
    bd["zero3_exposed"] = z3_exposed
    memory = c.weights + c.main_state + c.workspace
    if memory > hw.memory_gib * 2**30:
        notes.append(f"does not fit: {memory / 2**30:.0f} GiB > {hw.memory_gib:.0f} GiB "
                     "before activations")
    return Prediction(
        mode=mode, model=model.name, hardware=hw.name, layout=asdict(layout), opt_s=opt_s,
        exposed_s=exposed, step_s=fb["compute"] + gs_exposed + exposed + z3_exposed,
        fwd_bwd_s=fb["compute"], muon_recv_bytes=c.muon_recv, muon_sent_bytes=c.muon_sent,
        opt_recv_bytes=c.muon_recv + c.pg_recv, memory_bytes=memory, state_bytes=c.opt_state,
        muon_state_bytes=c.muon_state,
        imbalance=c.imbalance, breakdown=bd, notes=notes)


# SpeculationGate's defaults (megatron_muon.megatron.overlap): a probe window runs RUN
# iterations of each mode every EVERY steps, so the worse mode takes RUN / EVERY of the steps.
PROBE_RUN, PROBE_EVERY = 5, 100
OVERLAP_POLICIES = ("on", "auto", "off")


def overlap_exposed(work: float, hidden: float, run: RunConfig, pp: int,
                    in_step: float = 0.0) -> tuple:
    """(exposed seconds of DMuon's owner work ``work``, the policy that ran) under
    ``run.overlap_policy``; ``hidden``: what stays exposed of the speculative part;
    ``in_step``: what a used speculation still does in the step (the scatter of its
    results, ``overlap.py``).

    - 'off' (and 'auto' without PP): the plain step, all of ``work`` in the step;
    - 'on': every step speculates; a used one pays ``hidden + in_step``; a share
      ``clip_rate`` of the steps redoes the owner work in the step after its speculation
      ran, so they pay ``hidden + work``:
      ``hidden + (1 - clip_rate) * in_step + clip_rate * work``;
    - 'auto' with PP > 1 (``measured``): the gate keeps the cheaper mode and probes the
      other one RUN of every EVERY steps: ``best + RUN / EVERY * (worst - best)``.
    """
    if run.overlap_policy not in OVERLAP_POLICIES:
        raise ValueError(f"overlap_policy must be one of {OVERLAP_POLICIES}, got "
                         f"{run.overlap_policy!r}")
    if not 0.0 <= run.clip_rate <= 1.0:
        raise ValueError(f"clip_rate is a share of steps in [0, 1], got {run.clip_rate}")
    on = hidden + (1.0 - run.clip_rate) * in_step + run.clip_rate * work
    if run.overlap_policy == "off" or (run.overlap_policy == "auto" and pp == 1):
        return work, "off"
    if run.overlap_policy == "on":
        return on, "on"
    best, worst = sorted((on, work))
    return best + PROBE_RUN / PROBE_EVERY * (worst - best), "measured"


def layout_for(world: int, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
               gpus_per_node: int = 8) -> Optional[Layout]:
    """The layout with DP = world / (TP x PP), or None when it does not divide."""
    if world % (tp * pp):
        return None
    lay = Layout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep, etp=etp,
                 gpus_per_node=gpus_per_node)
    try:
        lay.check()
    except ValueError:
        return None
    return lay


def sweep(model: ModelConfig, hw: Hardware, modes: Sequence[str], worlds: Sequence[int],
          run: RunConfig = RunConfig(), tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
          gpus_per_node: int = 8) -> list[Prediction]:
    out = []
    for w in worlds:
        lay = layout_for(w, tp, pp, ep, etp, gpus_per_node)
        if lay is None:
            continue
        for m in modes:
            out.append(predict(model, lay, hw, m, run))
    return out

