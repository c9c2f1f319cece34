"""DMuon: Megatron-Core's ``DistributedOptimizer`` with an owner-centric Muon step.

The ZeRO-1 machinery is Megatron's own: fp32 main-param shards per DP rank, grad
reduce-scatter, clipping, found-inf, param all-gather, checkpoints.  Only the inner step
changes: each rank updates the momentum of its shard (element-wise, so state stays
sharded exactly like Adam's ``exp_avg``), the owner-centric executor gathers every unit on
one owner in the stage's DP x TP group, orthogonalises it there and sends the pieces
back, and each rank applies ``W <- W (1 - lr wd) - lr * scale * O`` to its shard.

Construction flows one way. ``factory.build_dmuon_optimizer`` builds the process groups once
(``groups.DMuonGroups``) and constructs the distributed optimizers itself
(``compat.build_distributed_optimizer``). A DMuon optimizer turns its shard geometry into
``ShardedMatrix`` descriptions (``sharded_matrices``), builds the executor from them
(``build_engine``) and hands it to its inner ``ShardedMuonStep``, together with the overlap's
inputs (a read-only ``DMuonView``). Checkpoint code lives in ``state_dict``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

from megatron_muon.core.lion import LION_STATE_KEYS, Lion
from megatron_muon.core.moment2 import (moment2_expand, moment2_init, moment2_normalize,
                                        moment2_reduce)
from megatron_muon.core.muon import decoupled_update, decoupled_update_, momentum_update_
from megatron_muon.distributed.comm import failed_ranks
from megatron_muon.distributed.owner_centric import OwnerCentricNS
from megatron_muon.core.plan import SplitPolicy, UnitTask, flops_cost, plan_owners
from megatron_muon.megatron import compat
from megatron_muon.megatron.geometry import MuonParam, matrices_from_slices, slice_info
from megatron_muon.megatron.params import tp_partition_dim
from megatron_muon.megatron.state_dict import AdamStateMixin, DMuonStateMixin, LionStateMixin

logger = logging.getLogger(__name__)

__all__ = ["DMuonDistributedOptimizer", "SubsetDistributedOptimizer", "LionSubsetDistributedOptimizer", "ShardedMuonStep", "DMuonView", "flat_offsets", "exchange_group", "sharded_matrices", "plan_matrices", "engine_for", "build_engine"]


class _SubsetMixin:
    """A DistributedOptimizer that manages only the parameters of its inner optimizer.

    Megatron's buffers hold every parameter of a model chunk; two distributed optimizers
    (DMuon for the matrices, AdamW for the rest) share them, each keeping its own subset
    of every bucket's ``param_map``.
    """

    def _init_subset(self, optimizer) -> None:
        self._managed = {p for g in optimizer.param_groups for p in g["params"]}

    completed_steps = 0

    def step_with_ready_grads(self) -> bool:
        self.completed_steps += 1
        return super().step_with_ready_grads()

    # -- ZeRO-3 (megatron_muon.megatron.zero3): owned parameters live in per-bucket shards --
    @functools.cached_property
    def zero3(self) -> bool:
        """Fixed once built: ``factory.build_dmuon_optimizer`` shards the chunks first."""
        from megatron_muon.megatron.zero3 import zero3s

        return bool(zero3s(self.model_chunks))

    @functools.cached_property
    def _even_zero3(self) -> dict:
        """{model param: its ZeRO-3 bucket} under even shards (zero3.py's reconstruction
        layout, where no parameter has storage between its uses and this rank's slice of a
        bucket is the bucket's ``pshard``); empty otherwise."""
        from megatron_muon.megatron.zero3 import zero3s

        return {p: zb for z in zero3s(self.model_chunks) if z.even
                for p, zb in z.bucket_of.items()}

    def _even_slice(self, model_param, ranges=None) -> slice:
        ranges = ranges or self._get_model_param_range_map(model_param)
        w = ranges["gbuf_world_in_bucket"]
        return self._even_zero3[model_param].shard_range(w.start, w.end)

    def _model_shard(self, model_param) -> torch.Tensor:
        """Where this rank's slice of ``model_param`` is published after the step: the DP
        shard of its bucket's param buffer (all-gathered after the step), or under ZeRO-3
        the owned parameter itself or, with even shards, its slice of the bucket's stored
        shard (which nothing needs to gather)."""
        if self.zero3:
            zb = self._even_zero3.get(model_param)
            if zb is not None:
                return zb.pshard[self._even_slice(model_param)]
            r = self._get_model_param_range_map(model_param)["param"]
            return model_param.detach().view(-1)[r.start: r.end]
        world_range = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
        gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
        buf = self.buffers[gbuf_index].buckets[bucket_id].param_data
        return buf.view(-1)[world_range.start: world_range.end]

    def _main_groups(self):
        """(model params, their shard main params) group by group, fp16/bf16 then fp32."""
        return ((self.model_float16_groups, self.shard_fp32_from_float16_groups),
                (self.model_fp32_groups, self.shard_fp32_groups))

    def _build_model_and_main_param_groups(self, gbuf_ranges, param_gbuf_map, opt_group_ranges,
                                           config):
        """Megatron's (a classmethod there); under even-shard ZeRO-3 the parameters have no
        storage here, so it runs with the buckets gathered (the fp16 main params are copies of
        the gathered values) and the model-shard views it takes (the fp32 main params
        themselves) are re-pointed from the gather buffer at the stored shard."""
        build = super()._build_model_and_main_param_groups
        even = self._even_zero3
        if not even:
            return build(gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        from megatron.core import tensor_parallel

        from megatron_muon.megatron.zero3 import gathered_params

        with gathered_params(self.model_chunks):
            groups = build(gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        model16, model32, shard16, shard32, _ = groups
        moved = {}
        for models, views in ((model16, shard16), (model32, shard32)):
            for model_group, view_group in zip(models, views):
                for i, model in enumerate(model_group):
                    gi, dtype, bid = param_gbuf_map[model]
                    where = self._even_slice(model, gbuf_ranges[gi][dtype][bid]["param_map"][model])
                    view = even[model].pshard[where]
                    tensor_parallel.copy_tensor_model_parallel_attributes(view, model)
                    if hasattr(model, "shared"):
                        view.shared = model.shared
                    moved[id(view_group[i])] = view
                    view_group[i] = view
        for g in opt_group_ranges:
            g["orig_group"]["params"] = [moved.get(id(p), p) for p in g["orig_group"]["params"]]
        return groups

    @torch.no_grad()
    def _copy_model_grads_to_main_grads(self):
        """Under even-shard ZeRO-3 a parameter has no whole gradient after its bucket's
        reduce-scatter: its shard main param's gradient is its slice of the bucket's stored
        gradient shard."""
        if not self._even_zero3 or self.is_stub_optimizer:
            return super()._copy_model_grads_to_main_grads()
        for models, mains in self._main_groups():
            for model_group, main_group in zip(models, mains):
                for model, main in zip(model_group, main_group):
                    zb = self._even_zero3[model]
                    main.grad = zb.gshard[self._even_slice(model)].float()

    @torch.no_grad()
    def _copy_model_params_to_main_params(self, state_dict=None):
        if not self._even_zero3 or self.is_stub_optimizer:
            return super()._copy_model_params_to_main_params(state_dict)
        if state_dict is not None:
            raise NotImplementedError("ZeRO-3 with even shards cannot initialise the main "
                                      "params from a state dict's model weights")
        for models, mains in self._main_groups():
            for model_group, main_group in zip(models, mains):
                for model, main in zip(model_group, main_group):
                    src = self._model_shard(model)
                    if src.data_ptr() != main.data_ptr():  # fp32: the main param is the shard
                        main.copy_(src)

    @torch.no_grad()
    def _copy_main_params_to_model_params(self):
        if not self.zero3:
            return super()._copy_main_params_to_model_params()
        for models, mains in self._main_groups():
            for model_group, main_group in zip(models, mains):
                for model, main in zip(model_group, main_group):
                    dst = self._model_shard(model)
                    if dst.data_ptr() != main.data_ptr():  # fp32: the main param is the shard
                        dst.copy_(main)
        from megatron_muon.megatron.zero3 import zero3s

        for z in zero3s(self.model_chunks):
            z.release_all()  # whatever is still gathered is stale now

    def _build_gbuf_range_map(self, param_and_grad_buffer):
        ranges = super()._build_gbuf_range_map(param_and_grad_buffer)
        for bucket_maps in ranges.values():
            for m in bucket_maps:
                m["param_map"] = {p: r for p, r in m["param_map"].items() if p in self._managed}
        return ranges


class SubsetDistributedOptimizer(AdamStateMixin, _SubsetMixin, DistributedOptimizer):
    """Megatron's AdamW distributed optimizer restricted to the non-Muon parameters."""

    def __init__(self, optimizer, *args, **kwargs):
        self._init_subset(optimizer)
        super().__init__(optimizer, *args, **kwargs)


class LionSubsetDistributedOptimizer(LionStateMixin, _SubsetMixin, DistributedOptimizer):
    """The non-Muon parameters with Lion (``muon_scalar_optimizer='lion'``, core/lion.py).

    Megatron's constructor accepts only Adam as the inner optimizer, so it is built around
    the inner AdamW (which never steps and allocates no state) and the inner optimizer is
    then Lion over the same param groups, i.e. the fp32 main-param shards: everything
    around the step (grad reduce-scatter, clipping, found-inf, param all-gather, the
    scheduler's lr / wd per group) stays Megatron's.  Lion is element-wise, so each DP
    shard's update equals the whole tensor's.
    """

    state_keys = LION_STATE_KEYS

    def __init__(self, optimizer, config, *args, **kwargs):
        self._init_subset(optimizer)
        super().__init__(optimizer, config, *args, **kwargs)
        if self.is_stub_optimizer:
            return
        betas = (config.lion_beta1, config.lion_beta2)
        lion = Lion([torch.zeros(1, requires_grad=True)], lr=config.lr, betas=betas,
                    weight_decay=config.weight_decay)
        # Installed directly, as ShardedMuonStep does: fp32 shard main params are views
        # (non-leaf), which torch's add_param_group refuses.  The group dicts still carry
        # Adam's betas; no 'step' in them (see ShardedMuonStep: completed_steps counts).
        lion.param_groups = list(self.optimizer.param_groups)
        for g in lion.param_groups:
            g["betas"] = betas
            g.pop("step", None)
        self.optimizer = lion
        self.init_state_fn = lambda opt, config=None: opt.init_state()

    @property
    def optimizer_state_keys(self):
        return LION_STATE_KEYS

    def _get_state_key_dtype(self, key):
        return torch.float32


@dataclass(frozen=True)
class DMuonView:
    """What DMuon's overlap (``overlap.DMuonOverlap``) reads of the optimizer, read-only.

    ``shards``: {model param: (shard main param, start, end)} of the Muon parameters this
    rank holds a slice of; ``bucket_of``: {model param: engine bucket key}; ``publish``:
    copies one updated main param into the model's param buffer.
    """

    model_chunks: tuple
    bucket_of: Mapping
    shards: Mapping
    grad_scaler: Any
    publish: Callable


def flat_offsets(param_groups) -> tuple:
    """({main param: offset}, total): where each shard main param sits in the flat buffer
    of DMuon's step (group by group, parameter by parameter)."""
    offsets, off = {}, 0
    for group in param_groups:
        for p in group["params"]:
            offsets[p] = off
            off += p.numel()
    return offsets, off


class ShardedMuonStep(torch.optim.Optimizer):
    """Inner optimizer of DMuon: momentum on the shards, NS on the owners, update on the shards."""

    def __init__(self, param_groups, engine: OwnerCentricNS, *, momentum: float, nesterov: bool,
                 check_finite: bool, overlap: Optional[dict] = None,
                 moment2: Optional[str] = None, beta2: float = 0.95, moment2_eps: float = 1e-8,
                 finite_group=None):
        # The shard main params are views (non-leaf for fp32 models), which torch's
        # add_param_group refuses; Megatron installs its groups the same direct way.
        super().__init__([torch.zeros(1, requires_grad=True)], dict(lr=0.0, weight_decay=0.0))
        self.param_groups = list(param_groups)
        self.momentum, self.nesterov, self.check_finite = momentum, nesterov, check_finite
        self.offsets, self.numel = flat_offsets(self.param_groups)
        self.engine = engine
        # where the ranks agree on a non-finite U (``_check_finite``): the exchange group, or,
        # where that has one rank (matrix placement with blockwise TP), the group whose
        # param all-gather follows the step
        self.finite_group = engine.group if engine.world > 1 or finite_group is None \
            else finite_group
        # AdaMuon / NorMuon (docs/variants.md#adaptive-second-moments): {unit key: state}
        # of the units this rank owns, updated on the owner between NS and the scatter.
        self.moment2, self.beta2, self.moment2_eps = moment2, beta2, moment2_eps
        self.moment2_state: dict = {}
        if moment2 is not None and overlap is not None:
            raise ValueError("DMuon: the overlap does not support dmuon_moment2; "
                             "set dmuon_overlap='off'")
        # overlap: DMuonOverlap's keyword arguments (a DMuonView and its flags), or None
        self.overlap = None
        if overlap is not None:
            from megatron_muon.megatron.overlap import DMuonOverlap

            self.overlap = DMuonOverlap(step=self, **overlap)
        # No 'step' in the param groups: Megatron's ChainedOptimizer._synchronize_steps
        # compares every group's 'step', and after a checkpoint load the AdamW groups hold a
        # 'step' that torch's AdamW never advances (it counts per parameter).  A counter here
        # would drift from it and the next save would fail; the owning DMuon optimizer
        # counts completed steps instead (``completed_steps``).
        for group in self.param_groups:
            group.pop("step", None)

    def init_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        if self.overlap is not None:
            self.overlap.flush_all()  # a deferred update that no param all-gather took yet
        self.init_state()
        # One shard-sized transient: U is written straight into its slice of ``flat``, and
        # the engine writes the NS pieces back over it (docs/design.md, DMuon's memory).
        # ``flat_offsets`` tiles it with the parameters, so every element is written: no
        # zero-fill.
        spec_flat = self.overlap.pending_flat() if self.overlap is not None else None
        matches = False  # nothing speculated to compare with
        # Without the overlap the whole step runs in one buffer whose first ``numel``
        # elements are ``flat`` (``OwnerCentricNS.arena_numel``: the owned units, the
        # exchange staging and the NS workspace follow it), allocated once here.
        arena = None
        if spec_flat is None:
            size = self.engine.arena_numel() if self.overlap is None else None
            if size is not None:
                arena = torch.empty(size, dtype=torch.float32, device=self.engine.device)
                flat = arena[: self.numel]
            else:
                flat = torch.empty(self.numel, dtype=torch.float32, device=self.engine.device)
            for group in self.param_groups:  # momentum of the whole group (foreach)
                ps = group["params"]
                momentum_update_([self.state[p]["momentum_buffer"] for p in ps],
                                 [self._grad(p) for p in ps], self.momentum, self.nesterov,
                                 [self._slice(flat, p) for p in ps])
        else:  # compare with the speculated U in place, then keep the true U there
            flat, matches = spec_flat, self._momentum_into_speculated(spec_flat)
        if self.check_finite:
            self._check_finite(flat)
        out = None
        if self.overlap is not None:
            out = self.overlap.take({p: (g["lr"], g["weight_decay"])
                                     for g in self.param_groups for p in g["params"]}, matches)
            if self.overlap.deferred is not None:
                return  # each bucket's update lands before its param all-gather
        if out is None:  # U is not needed once gathered
            out = self.engine.run(flat, out=flat,
                                  post=self._moment2_post if self.moment2 is not None else None,
                                  arena=arena)
        for group in self.param_groups:
            ps = group["params"]
            lr, wd = group["lr"], group["weight_decay"]
            # W <- W (1 - lr wd) - lr O for the whole group (``apply_update``'s ops, foreach)
            decoupled_update_(ps, [self._slice(out, p) for p in ps], lr, 1.0 - lr * wd)

    def _check_finite(self, flat: torch.Tensor) -> None:
        """``dmuon_check_finite``: raise on every rank of the exchange group if any rank's U
        is non-finite.  The ranks agree first (``failed_ranks``: one all-reduce over the
        group of the collectives that follow, ``finite_group``): a NaN in one rank's shard
        raised there alone would leave the others waiting in the owners' all-to-all (or, with
        no exchange, Megatron's param all-gather) until the NCCL timeout."""
        bad = failed_ranks(not bool(torch.isfinite(flat).all()), self.finite_group,
                           self.engine.device)
        if bad:
            raise FloatingPointError(
                f"DMuon: non-finite (NaN/Inf) Muon gradient or momentum (found on rank"
                f"{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}); with fp16 use a "
                "loss scaler, otherwise check the data and the learning rate "
                "(dmuon_check_finite)")

    @staticmethod
    def _grad(p: torch.Tensor) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _momentum_into_speculated(self, spec_flat: torch.Tensor) -> bool:
        """The momentum step (M <- mu M + G, U) with U compared bit for bit against the
        speculated U in ``spec_flat`` and written over it from the first difference on, so
        that ``spec_flat`` ends holding this step's U either way.  U is computed in chunks
        of parameters (at most an eighth of the shard or of the owned units, whichever is
        smaller, or one parameter), foreach within a chunk: the overlap then adds no
        shard-sized buffer to the step.  Returns whether every element matched."""
        same = True
        limit = max(min(self.numel, self.engine.owned_numel) // 8, 1)
        for group in self.param_groups:
            ps, start = group["params"], 0
            while start < len(ps):
                end, size = start, 0
                while end < len(ps) and (end == start or size + ps[end].numel() <= limit):
                    size += ps[end].numel()
                    end += 1
                chunk = ps[start:end]
                us = [torch.empty_like(p, dtype=torch.float32) for p in chunk]
                momentum_update_([self.state[p]["momentum_buffer"] for p in chunk],
                                 [self._grad(p) for p in chunk], self.momentum, self.nesterov,
                                 us)
                for p, u in zip(chunk, us):
                    dst = self._slice(spec_flat, p)
                    if same and not torch.equal(u, dst):
                        same = False
                    if not same:
                        dst.copy_(u)
                del us
                start = end
        return same

    def _slice(self, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """``p``'s slice of DMuon's flat step buffer, shaped like ``p``."""
        return flat[self.offsets[p]: self.offsets[p] + p.numel()].view_as(p)

    def _moment2_state_of(self, key: str, m: int, n: int) -> torch.Tensor:
        st = self.moment2_state.get(key)
        if st is None:
            st = self.moment2_state[key] = moment2_init(m, n, self.moment2, self.engine.device)
        return st

    def _moment2_post(self, keys: list, o: torch.Tensor) -> torch.Tensor:
        """The owner's second-moment step on one NS batch (``OwnerCentricNS``'s ``post``),
        unit by unit as the reference does."""
        m, n = o.shape[-2:]
        for i, key in enumerate(keys):
            o[i] = moment2_normalize(o[i], self._moment2_state_of(key, m, n), self.moment2,
                                     self.beta2, self.moment2_eps)
        return o

    def moment2_to_shards(self) -> None:
        """Checkpoint save/load: the owners' second moments, expanded to element shape
        (``moment2_expand``), scattered to the holders as ``state[p]['moment2_buffer']`` (laid
        out like the momentum), so the model-space format saves and reshards them."""
        owned = torch.zeros(self.engine.owned_numel, dtype=torch.float32,
                            device=self.engine.device)
        for (off, count, m, n), keys in zip(self.engine.batches, self.engine.batch_keys):
            for i, key in enumerate(keys):
                owned[off + i * m * n: off + (i + 1) * m * n].view(m, n).copy_(
                    moment2_expand(self._moment2_state_of(key, m, n), m, n))
        flat = self.engine.to_holders(owned, torch.empty(self.numel, dtype=torch.float32,
                                                         device=self.engine.device))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["moment2_buffer"] = self._slice(flat, p)

    def moment2_from_shards(self) -> None:
        """Inverse of ``moment2_to_shards`` (after a load): gather each unit's element-shaped
        state to its owner, reduce it to the unit's state, drop the shard buffers."""
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.engine.device)
        for group in self.param_groups:
            for p in group["params"]:
                self._slice(flat, p).copy_(self.state[p].pop("moment2_buffer"))
        owned = self.engine.to_owners(flat)
        for (off, count, m, n), keys in zip(self.engine.batches, self.engine.batch_keys):
            for i, key in enumerate(keys):
                self.moment2_state[key] = moment2_reduce(
                    owned[off + i * m * n: off + (i + 1) * m * n].view(m, n), self.moment2)

    def drop_moment2_shards(self) -> None:
        for st in self.state.values():
            st.pop("moment2_buffer", None)

    @staticmethod
    def apply_update(p: torch.Tensor, o: torch.Tensor, lr: float, wd: float) -> None:
        """W <- W (1 - lr wd) - lr O (O already carries the Muon scale)."""
        decoupled_update(p, o, lr, 1.0 - lr * wd)


class DMuonDistributedOptimizer(DMuonStateMixin, _SubsetMixin, DistributedOptimizer):
    """``DistributedOptimizer`` whose inner step is owner-centric Muon (``optimizer='dmuon'``).

    Built by ``factory.build_dmuon_optimizer``; ``replicate=True`` gives the ``'muon_naive'``
    baseline (every rank gathers and orthogonalises every matrix).
    """

    publish_params = True  # False when a later optimizer in the chain all-gathers params
    state_keys = ("momentum_buffer",)

    def __init__(self, optimizer, config, grad_scaler, init_state_fn, model_chunks,
                 per_model_buffers, data_parallel_group, *args, muon_config=None,
                 replicate: bool = False, expert: bool = False, groups=None, **kwargs):
        if groups is None:
            raise ValueError("DMuonDistributedOptimizer needs groups= (a DMuonGroups); build it "
                             "with megatron_muon.megatron.factory.get_megatron_optimizer")
        self.expert, self.groups = expert, groups
        self._init_subset(optimizer)
        super().__init__(optimizer, config, grad_scaler, init_state_fn, model_chunks,
                         per_model_buffers, data_parallel_group, *args, **kwargs)
        self.muon_config = muon_config
        self.replicate = replicate
        if self.is_stub_optimizer:
            return
        param_groups = self.optimizer.param_groups
        offsets, _ = flat_offsets(param_groups)
        held, mains, bucket_of = self._shard_geometry(offsets)
        matrices, group = sharded_matrices(self.model_chunks, self._managed, held, bucket_of,
                                           self.groups, muon_config, expert=expert)
        engine, self.plan = build_engine(matrices, group, muon_config, replicate=replicate,
                                         local_numel=sum(p.numel() for p in offsets))
        overlap = None
        policy = muon_config.overlap_policy(self.groups.pp_size)  # 'auto': PP > 1, adaptive
        moment2 = getattr(muon_config, "dmuon_moment2", None)
        if moment2 is not None:
            self.state_keys = ("momentum_buffer", "moment2_buffer")  # see state_dict.py
            if self.groups.pp_size > 1 and dist.get_rank() == 0 and \
                    muon_config.dmuon_overlap == "auto":
                logger.info("DMuon: dmuon_moment2=%r turns the overlap off (dmuon_overlap "
                            "'auto' would have used it with PP > 1)", moment2)
        if policy != "off":
            ddp = self.ddp_config
            param_update = muon_config.dmuon_overlap_param_update and not (
                getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "use_megatron_fsdp", False)
                or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
            view = DMuonView(
                model_chunks=tuple(self.model_chunks), bucket_of=MappingProxyType(bucket_of),
                shards=MappingProxyType({p: (mains[p], held[p][0], held[p][1]) for p in held}),
                grad_scaler=self.grad_scaler, publish=self.publish_param)
            overlap = dict(view=view, bucket_gather=muon_config.dmuon_overlap_bucket_gather,
                           param_update=param_update, adaptive=policy == "adaptive")
        self.optimizer = ShardedMuonStep(
            param_groups, engine, momentum=muon_config.muon_momentum,
            nesterov=muon_config.muon_nesterov, check_finite=muon_config.dmuon_check_finite,
            overlap=overlap, moment2=moment2,
            beta2=getattr(muon_config, "adaptive_muon_beta2", 0.95),
            moment2_eps=getattr(muon_config, "adaptive_muon_eps", 1e-8),
            finite_group=self.data_parallel_group)
        self.init_state_fn = lambda opt, config=None: opt.init_state()

    def _shard_geometry(self, offsets: dict) -> tuple:
        """This rank's slice of every Muon parameter it holds, from Megatron's range maps:
        ``held`` {model param: (start, end, offset in the flat shard buffer)}, ``mains``
        {model param: its shard main param} and ``bucket_of`` {model param: (buffer index,
        bucket id)}."""
        bucket_of = {}
        for bi, buffer in enumerate(self.buffers):
            for p, (_, _, bucket_id) in buffer.param_index_map.items():
                if p in self._managed:
                    bucket_of[p] = (bi, bucket_id)
        held, mains = {}, {}
        for p in self._managed:
            if p not in self.model_param_gbuf_map:
                continue
            r = self._get_model_param_range_map(p)["param"]
            gi, go = self.model_param_group_index_map[p]
            mains[p] = self.optimizer.param_groups[gi]["params"][go]
            held[p] = (r.start, r.end, offsets[mains[p]])
        return held, mains, bucket_of

    @torch.no_grad()
    def publish_param(self, model_param, main_param) -> None:
        """Megatron's main -> param-buffer copy (``_copy_main_params_to_model_params``) of one
        parameter."""
        self._model_shard(model_param).copy_(main_param)

    def finish_deferred(self) -> None:
        """Apply any DMuon update still waiting for its bucket's param all-gather."""
        if not self.is_stub_optimizer and self.optimizer.overlap is not None:
            self.optimizer.overlap.flush_all()

    def close(self) -> None:
        """Take back what this optimizer hooked into the DDP chunks (the overlap's grad-sync
        and param-sync hooks), after landing a deferred update: another optimizer built on
        the same model then runs alone.  This one still steps afterwards, without the
        overlap (bitwise the same update).  Idempotent; the chained optimizer's teardown is
        ``factory.close_optimizer``."""
        if self.is_stub_optimizer or self.optimizer.overlap is None:
            return
        self.optimizer.overlap.close()
        self.optimizer.overlap = None

    # -- Megatron hooks ---------------------------------------------------------------
    @property
    def optimizer_state_keys(self):
        return ("momentum_buffer",)

    def _get_state_key_dtype(self, key):
        return torch.float32

    def step_with_ready_grads(self) -> bool:
        if self.publish_params:
            return super().step_with_ready_grads()
        # The AdamW optimizer after us in the chain all-gathers the (shared) param buffers.
        return MixedPrecisionOptimizer.step_with_ready_grads(self)

    def dmuon_stats(self) -> dict:
        if self.is_stub_optimizer:
            return {}
        eng = self.optimizer.engine
        state_bytes = sum(st["momentum_buffer"].numel() * 4 for st in self.optimizer.state.values()
                          if "momentum_buffer" in st)
        state_bytes += sum(t.numel() * 4 for t in self.optimizer.moment2_state.values())
        overlap = self.optimizer.overlap
        return dict(comm=eng.stats.as_dict(), plan_imbalance=self.plan.imbalance,
                    plan_digest=self.plan.digest, owned_numel=eng.owned_numel,
                    shard_numel=self.optimizer.numel, state_bytes=state_bytes,
                    ns_workspace_bytes=eng.ns_workspace_bytes(),
                    ns_batch_numel=eng.ns_batch_numel,
                    gather_into_input=eng.gather_into_input,
                    step_arena_bytes=None if eng.arena_numel() is None or
                    self.optimizer.overlap is not None else 4 * eng.arena_numel(),
                    index_bytes=eng.index_bytes(), split_parts=len(eng.split.parts),
                    split_units=len(self.plan.splits),
                    muon_numel=sum(m.shape[0] * m.shape[1] for m in eng.matrices),
                    overlap=overlap.stats.as_dict() if overlap is not None else None)


# ---------------------------------------------------------------------- geometry
def exchange_group(groups, cfg, expert: bool) -> tuple:
    """``(group, tp_size, tp_rank)``: the group DMuon's owners and holders exchange over, and
    how the matrices' TP shards are counted in it (``groups``: a ``DMuonGroups``)."""
    matrix = cfg.dmuon_placement == "matrix"
    if expert:  # experts: their own TP (expert TP) and DP groups, else as dense TP x DP
        etp, etp_rank = groups.expt_tp_size, groups.expt_tp_rank
        if matrix:  # every expert matrix is whole on one expert-DP rank's expert-TP group
            return groups.expt_tp, etp, etp_rank
        return groups.expt_exchange, etp, etp_rank
    if cfg.dmuon_tp_mode == "blockwise":  # each TP shard is a matrix of its own
        return (None if matrix else groups.dp), 1, 0
    # matrix placement: a unit's TP shards sit on one DP rank's TP group
    return (groups.tp if matrix else groups.tp_dp), groups.tp_size, groups.tp_rank


def sharded_matrices(model_chunks, managed, held: dict, bucket_of: dict, groups, cfg, *,
                     expert: bool = False) -> tuple:
    """``(matrices, group)``: every Muon matrix of this pipeline stage as a ``ShardedMatrix``
    (which rank of ``group`` holds which piece where), in an order all ranks agree on.

    ``managed``: the Muon parameters; ``held``: {param: (start, end, local offset)} of the
    slices this rank holds; ``bucket_of``: {param: bucket key}. One ``all_gather_object``
    over the exchange group collects every rank's slices; ``geometry.matrices_from_slices``
    (which ``tools/bench_scale.py`` runs on emulated slices) turns them into matrices.
    """
    group, tp_size, tp_rank = exchange_group(groups, cfg, expert)
    world = dist.get_world_size(group) if group is not None else 1
    names = {}
    for ci, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            names[p] = (ci, name)
    muon_params = sorted((p for p in names if p in managed), key=lambda p: names[p])
    params = [MuonParam(key=f"{names[p][0]}:{names[p][1]}", name=names[p][1],
                        shape=tuple(p.shape), tp_dim=tp_partition_dim(p), bucket=bucket_of[p])
              for p in muon_params]
    info = slice_info(params, {m.key: held[p] for m, p in zip(params, muon_params) if p in held},
                      tp_rank)
    gathered = [info]
    if group is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, info, group=group)
    matrices = matrices_from_slices(params, gathered, tp_size=tp_size,
                                    model_config=model_chunks[0].config, cfg=cfg, expert=expert,
                                    real_tp_size=groups.tp_size)
    return matrices, group


def plan_matrices(matrices, world: int, cfg, cost, *, replicate: bool = False):
    """The owner plan of ``matrices`` over a group of ``world`` ranks: pure (no
    communication), so ``tools/bench_scale.py`` runs it for any rank of any layout.
    ``cost``: the planner's cost of one unit by shape (``_unit_cost``)."""
    tasks = [UnitTask(m.unit_key(i), u.shape, cost(u.shape), 4 * u.numel)
             for m in matrices for i, u in enumerate(m.units)]
    holdings = {}
    for m in matrices:
        total = m.shape[0] * m.shape[1]
        for i, u in enumerate(m.units):
            held = [0] * world
            for pc in m.pieces:  # proportional estimate for split (QKV, gate/up) units
                held[pc.rank] += (pc.end - pc.start) * u.numel // total
            holdings[m.unit_key(i)] = held
    return plan_owners(tasks, world, holdings=None if replicate else holdings,
                       locality_slack=cfg.dmuon_locality_slack,
                       split=None if replicate else split_policy(cfg))


def split_policy(cfg) -> Optional[SplitPolicy]:
    """How the planner may split units' NS across ranks (``dmuon_split``): None where it may
    not (off; matrix placement, whose point is that no unit moves; a second moment, which
    needs whole units; Gram NS or tuner costs, which the split's cost formulas do not
    describe)."""
    forced = cfg.dmuon_split_parts
    if forced is None and (cfg.dmuon_split == "off" or cfg.dmuon_placement == "matrix"
                           or cfg.dmuon_moment2 is not None or cfg.dmuon_plan_cost == "tuner"
                           or compat.ns_method(cfg) == "gram"):
        return None
    return SplitPolicy(cfg.muon_num_ns_steps, cfg.dmuon_split_flops_per_byte, parts=forced,
                       ay=ns_dtype(cfg) == torch.float32,
                       element_size=torch.finfo(ns_dtype(cfg)).bits // 8)


def engine_for(matrices, plan, group, cfg, *, replicate: bool = False,
               local_numel: Optional[int] = None, check_exchange: bool = True) -> OwnerCentricNS:
    """The ``OwnerCentricNS`` executor of ``plan`` on this rank of ``group``."""
    return OwnerCentricNS(
        matrices, plan, group, ns_steps=cfg.muon_num_ns_steps,
        coefficients=cfg.muon_coefficient_type, scale_mode=cfg.muon_scale_mode,
        extra_scale_factor=cfg.muon_extra_scale_factor, ns_dtype=ns_dtype(cfg),
        device=compat.device(), replicate=replicate, ns_fn=compat.ns_function(cfg),
        local_numel=local_numel, check_exchange=check_exchange)


def build_engine(matrices, group, cfg, *, replicate: bool = False,
                 local_numel: Optional[int] = None) -> tuple:
    """``(engine, plan)``: the owner plan of ``matrices`` over ``group`` (checked identical on
    every rank) and the ``OwnerCentricNS`` executor that runs it."""
    world = dist.get_world_size(group) if group is not None else 1
    cost = _unit_cost(cfg, [u.shape for m in matrices for u in m.units], group)
    plan = plan_matrices(matrices, world, cfg, cost, replicate=replicate)
    digests = [plan.digest] * world
    if group is not None:
        dist.all_gather_object(digests, plan.digest, group=group)
    if len(set(digests)) != 1:
        raise RuntimeError(f"DMuon: owner plans differ across ranks ({digests}); the plan "
                           "must be deterministic (the same model and dmuon_* settings on "
                           "every rank)")
    if cfg.dmuon_log_plan and dist.get_rank() == 0:
        logger.info("DMuon %s\n%s", "naive (replicated)" if replicate else "", plan.summary())
    engine = engine_for(matrices, plan, group, cfg, replicate=replicate,
                        local_numel=local_numel)
    return engine, plan


def _unit_cost(cfg, shapes, group):
    """The owner planner's cost of NS on one unit, by shape: flops, or (``dmuon_plan_cost=
    'tuner'``) seconds measured once and shared by every rank of ``group``."""
    if cfg.dmuon_plan_cost == "tuner":
        return _shared_tuner_costs(cfg, sorted(set(shapes)), group).__getitem__
    method = compat.ns_method(cfg)
    coefficients = cfg.muon_coefficient_type if isinstance(cfg.muon_coefficient_type, str) \
        else "simple"
    return flops_cost(cfg.muon_num_ns_steps, method="standard" if method == "auto" else method,
                      coefficients=coefficients)


def ns_dtype(cfg) -> torch.dtype:
    """The dtype the owners' Newton-Schulz runs in: bf16 with ``muon_fp32_matmul_prec=
    'medium'`` (Megatron's default), fp32 otherwise."""
    return torch.bfloat16 if cfg.muon_fp32_matmul_prec == "medium" else torch.float32


def _shared_tuner_costs(cfg, shapes: list, group) -> dict:
    """{unit shape: seconds of NS on it}, timed on rank 0 of ``group`` alone and shared with
    every rank (one all-reduce).

    Timings differ by rank and by run on real GPUs: ranks that each timed the kernels
    themselves would plan differently, and ``build_engine``'s plan digest check would
    refuse them.  One measuring rank is also one writer of the tuner cache per group.  The
    others wait in the all-reduce while it tunes keys it has no cache entry for (seconds per
    shape); if it fails, every rank raises (``failed_ranks``' pattern: no rank is left
    waiting in a collective)."""
    rank = dist.get_rank(group) if group is not None else 0
    # [seconds per shape..., failed]: MAX over the group, where only rank 0 writes
    out = torch.zeros(len(shapes) + 1, dtype=torch.float64, device=compat.device())
    error = None
    if rank == 0:
        try:
            tuner = compat.ns_tuner(cfg)
            dtype, dev = ns_dtype(cfg), compat.device()
            for i, (m, n) in enumerate(shapes):
                out[i] = tuner.time(m, n, 1, dtype, dev)
        except Exception as exc:  # raised below, after the others know
            error, out[-1] = exc, 1.0
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    if out[-1] > 0:
        where = dist.get_global_rank(group, 0) if group is not None else \
            dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(f"DMuon: dmuon_plan_cost='tuner': timing the Newton-Schulz kernels "
                           f"on rank {where} failed (the cause is chained there); fix "
                           "dmuon_tuner_cache or use dmuon_plan_cost='flops'") from error
    return dict(zip(shapes, out[:-1].tolist()))
