"""``DMuonOptimizerConfig``: Megatron-Core's ``OptimizerConfig`` plus the DMuon fields.

Muon fields carry Megatron-Core 0.19's names (``muon_momentum``, ``muon_nesterov``, ...).
On 0.16.1, whose config calls Nesterov ``muon_use_nesterov``, both names are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from megatron.core.optimizer import OptimizerConfig

from ..muon import check_muon_hyperparameters

__all__ = ["DMuonOptimizerConfig", "MUON_OPTIMIZERS", "NS_PRECISIONS"]

MUON_OPTIMIZERS = ("dmuon", "muon_naive")
NS_PRECISIONS = ("highest", "high", "medium")
PLACEMENTS = ("dmuon", "matrix")
TP_MODES = ("exact", "blockwise")
_BASE_FIELDS = {f.name for f in fields(OptimizerConfig)}


@dataclass
class DMuonOptimizerConfig(OptimizerConfig):
    """Optimizer config for ``optimizer='dmuon'`` (owner-centric Muon) and ``'muon_naive'``.

    Everything not listed here is Megatron-Core's ``OptimizerConfig`` (lr, weight_decay,
    clip_grad, bf16, use_distributed_optimizer, adam_* for the AdamW part, ...).
    """

    optimizer: str = "dmuon"

    # --- Muon maths (Megatron-Core 0.19 names and defaults) ---
    muon_momentum: float = 0.95
    muon_nesterov: bool = False
    muon_num_ns_steps: int = 5
    muon_coefficient_type: str = "quintic"
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 1.0
    muon_split_qkv: bool = True
    muon_fp32_matmul_prec: str = "medium"
    """'highest': fp32 NS; 'high': fp32 with TF32 matmuls (GPU); 'medium': bf16 NS."""

    # --- DMuon ---
    dmuon_split_fc1: bool = False
    """Orthogonalise a SwiGLU linear_fc1 as separate gate and up units."""
    dmuon_adam_params: Optional[str] = None
    """Regex of extra parameter names that go to AdamW even if they are hidden 2-D matrices."""
    dmuon_plan_cost: str = "flops"
    """Owner-plan cost model: 'flops' (k (2 m n s + s^3)) or 'tuner' (measured NS times)."""
    dmuon_tuner_cache: Optional[str] = None
    dmuon_ns_backend: str = "auto"
    """'auto' (tuner if dmuon_plan_cost == 'tuner', else torch batched), 'torch', 'triton'."""
    dmuon_locality_slack: float = 0.03
    """Owner plan: a unit goes to the rank holding most of it if that keeps the rank within
    (1 + slack) x the mean NS load; 0 still prefers local owners among equally loaded ranks."""
    dmuon_log_plan: bool = True
    dmuon_check_finite: bool = False
    """Raise a clear error if a Muon gradient is NaN/Inf (costs one reduction per step)."""
    dmuon_placement: str = "dmuon"
    """'dmuon': owners anywhere in the stage's DP x TP group, Megatron's even buffer shards;
    'matrix': MatrixFSDP placement, every unit whole on one DP rank (build the DDP model
    inside ``megatron_muon.megatron.matrix_placement``): no DP bytes in the Muon step."""
    dmuon_zero3: bool = False
    """With dmuon_placement='matrix': ZeRO-3, the parameters themselves sharded whole: each
    parameter is stored only on its owner, gathered bucket by bucket for forward and
    backward, gradients reduce-scattered per bucket and microbatch
    (``megatron_muon.megatron.zero3``; DDP needs overlap_grad_reduce=True)."""

    dmuon_tp_mode: str = "exact"
    """'exact': NS on whole (TP-unsharded) units, TP-invariant; 'blockwise': NS on each TP
    rank's shard of a unit separately, as Megatron's muon_tp_mode='blockwise'. NOT
    TP-invariant (the update changes with the TP size); explicit opt-in, no TP exchange."""

    # --- DMuon overlap (docs/design.md#overlap); exact: a bitwise check decides ---
    dmuon_overlap: bool = True
    """Run the owner work (gather, NS, scatter launch) speculatively at the end of each
    stage's backward pass (inside the pipeline cool-down) instead of in optimizer.step();
    the step uses it only if its gradients are bit-identical (no clipping), else redoes it."""
    dmuon_overlap_bucket_gather: bool = True
    """With dmuon_overlap: start each bucket's gather to the owners as soon as that bucket's
    gradient reduce-scatter is done, while the backward pass goes on."""
    dmuon_overlap_param_update: bool = True
    """With dmuon_overlap: optimizer.step() does not wait for the scatters; each bucket's
    scatter and update finish just before its param all-gather (under the next forward
    pass with Megatron's overlap_param_gather)."""
    dmuon_trace_dir: Optional[str] = None
    """Write a per-rank Chrome trace (trace_rank<R>.json, Perfetto) of forward/backward,
    grad reduce-scatter, DMuon gather/NS/scatter, param gather and optimizer step."""

    def __post_init__(self):
        if "muon_use_nesterov" in _BASE_FIELDS and getattr(self, "muon_use_nesterov", False):
            self.muon_nesterov = True  # 0.16.1 spelling
        super().__post_init__()
        if self.optimizer not in MUON_OPTIMIZERS + ("adam", "sgd"):
            raise ValueError(
                f"DMuonOptimizerConfig.optimizer must be one of {MUON_OPTIMIZERS + ('adam', 'sgd')}, "
                f"got {self.optimizer!r}")
        check_muon_hyperparameters(momentum=self.muon_momentum, ns_steps=self.muon_num_ns_steps,
                                   coefficient_type=self.muon_coefficient_type,
                                   scale_mode=self.muon_scale_mode)
        if self.muon_fp32_matmul_prec not in NS_PRECISIONS:
            raise ValueError(f"muon_fp32_matmul_prec must be one of {NS_PRECISIONS}, "
                             f"got {self.muon_fp32_matmul_prec!r}")
        if self.dmuon_plan_cost not in ("flops", "tuner"):
            raise ValueError(f"dmuon_plan_cost must be 'flops' or 'tuner', got {self.dmuon_plan_cost!r}")
        if self.dmuon_ns_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"dmuon_ns_backend must be 'auto', 'torch' or 'triton', "
                             f"got {self.dmuon_ns_backend!r}")
        if self.dmuon_tp_mode not in TP_MODES:
            raise ValueError(f"dmuon_tp_mode must be one of {TP_MODES}, got {self.dmuon_tp_mode!r}")
        if self.dmuon_placement not in PLACEMENTS:
            raise ValueError(f"dmuon_placement must be one of {PLACEMENTS}, got {self.dmuon_placement!r}")
        if self.dmuon_zero3 and (self.dmuon_placement != "matrix" or self.optimizer != "dmuon"):
            raise ValueError("dmuon_zero3=True needs optimizer='dmuon' and "
                             f"dmuon_placement='matrix' (got {self.optimizer!r}, "
                             f"{self.dmuon_placement!r})")
        if self.dmuon_zero3:  # the Muon step has no DP collective left to hide
            self.dmuon_overlap = False
        if not self.dmuon_overlap:  # the refinements need the speculative owner work
            self.dmuon_overlap_bucket_gather = self.dmuon_overlap_param_update = False
        if self.optimizer in MUON_OPTIMIZERS and not self.use_distributed_optimizer:
            raise ValueError(
                f"optimizer={self.optimizer!r} is a distributed optimizer: set "
                "use_distributed_optimizer=True (--use-distributed-optimizer)")
