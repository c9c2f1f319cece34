"""ZeRO-3 on Megatron DDP: MatrixFSDP (whole matrices over data parallel) or even shards.

Built on Megatron's DDP buffers laid out by ``matrix_placement`` with ``whole=True`` (every
parameter, matrix or not, lies whole inside one DP rank's shard of its bucket).  Then:

- each rank keeps, per bucket, only the parameters it owns, in a compact persistent tensor
  (``pshard``); the owned parameters' ``.data`` are views of it, so the optimizer (Megatron's
  ``DistributedOptimizer`` main-param shards) reads and writes them in place.  Every other
  parameter is a view of a per-bucket gather buffer whose storage is freed when unused: the
  rank holds nothing of it;
- a forward pre-hook on every module with parameters all-gathers their buckets (a padded,
  equal-shard ``all_gather_into_tensor``: gloo has no uneven all-gather) and the buffer is
  freed once every module of the bucket has run its forward; a hook on the module's outputs
  gathers it again before the module's backward;
- gradients accumulate into a per-bucket gradient buffer that exists only during the
  bucket's backward; when every parameter of the bucket has its gradient (Megatron's
  ``register_grad_ready``) the bucket is reduce-scattered, the owner adds its part to its
  persistent gradient shard (``gshard``) and both buffers are freed; this happens for every
  microbatch, so no full gradient outlives a bucket's backward;
- the optimizer step is local: each Muon matrix's whole gradient and parameter are on its
  owner (DMuon with ``dmuon_placement='matrix'``), and nothing is gathered after the step.

Why not Megatron-FSDP: on megatron-core 0.16.1 its constructor asserts a CUDA device and
creates ``torch.cuda.Stream``s, and its buffers cut every item into even per-rank slices, so
it can neither run on the CPU test bed nor carry whole-matrix ownership.  Megatron DDP's
buffers, hooks and ``DistributedOptimizer`` carry it with a few explicit replacements,
registered with ``megatron_muon.megatron.hooks`` (so the trace and the overlap see the
effective behaviour): bucket groups (``register_grad_ready``, ``start/finish_grad_sync``,
``start/finish_param_sync``, ``reset``) and buffers (``reset``, ``scale_gradients``);
``MatrixZeRO3.remove()`` takes them back (the sharded storage stays).

Even shards (``shard_model(..., even=True)``; ``dmuon_zero3`` with the default placement):
the same machinery on Megatron's own buffer layout, where every rank stores its 1/DP slice of
every bucket (``pshard`` = the bucket's DP shard) and no parameter is stored whole anywhere.
With ``optimizer='muon_naive'`` this is the reconstruction baseline MatrixFSDP is measured
against: the step gathers every matrix on every rank, orthogonalises it and keeps its slice.
The distributed optimizer reads its gradient and writes its parameter slices through
``pshard`` / ``gshard`` (``dmuon._SubsetMixin``); checkpoints gather the buckets (DP rank 0
writes Megatron's replicas, each rank keeps its slice of what it loads).  No sequence
parallelism with even shards (the TP all-reduce of layer-norm gradients needs whole ones).

Limits: one distributed-optimizer instance, no FP8 / MXFP8 / NVFP4 params, no Megatron-FSDP,
no MoE expert buffers (dense buffers only); activation recomputation is untested.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron_muon.megatron import hooks

logger = logging.getLogger(__name__)

__all__ = ["MatrixZeRO3", "shard_model", "zero3_of", "zero3s", "gathered_params",
           "owner_only", "mark_owner_replicas", "drop_non_owned", "zero3_memory"]


def _free(t: torch.Tensor) -> None:
    if t.untyped_storage().size() > 0:
        t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> bool:
    """Give ``t`` (whose storage may be freed) its storage back; True if it was freed."""
    need = t.numel() * t.element_size()
    if t.untyped_storage().size() == need:
        return False
    t.untyped_storage().resize_(need)
    return True


class _Bucket:
    """One DDP bucket under ZeRO-3: persistent owned shards + transient full buffers."""

    def __init__(self, zero3: "MatrixZeRO3", bucket, bucket_group, start: int, even: bool):
        self.z = zero3
        self.bucket = bucket
        self.bucket_group = bucket_group
        self.group = bucket_group.intra_distributed_optimizer_instance_group
        self.world = bucket_group.intra_distributed_optimizer_instance_size
        self.rank = bucket_group.intra_distributed_optimizer_instance_rank
        self.even = even  # Megatron's even shards (the reconstruction layout), not whole
        numel = bucket.grad_data.numel()
        if numel % self.world:
            raise ValueError(f"bucket of {numel} elements does not split into {self.world} shards")
        self.shard = numel // self.world
        self.lo = lo = self.rank * self.shard
        hi = lo + self.shard
        self.params = list(bucket.params_list)
        self.owned, self.others = [], []
        used = self.shard if even else 0
        for p in self.params:
            s = self.z.buffer_of[p].param_index_map[p][0] - start  # within the bucket
            if even:
                self.others.append((p, s))  # every parameter lives in the gather buffer
                continue
            e = s + p.numel()
            owner = s // self.shard
            if (e - 1) // self.shard != owner:
                raise ValueError(
                    f"ZeRO-3: parameter {self.z.names.get(p, '?')} ({tuple(p.shape)}) crosses a "
                    "data-parallel shard boundary. Build the DDP model with "
                    "matrix_placement_for(config).ddp(...) and dmuon_zero3=True "
                    "(whole-parameter layout)")
            if lo <= s < hi:
                self.owned.append((p, s - lo))
                used = max(used, e - lo)
            else:
                self.others.append((p, s))
        self.used = used
        param_data, grad_data = bucket.param_data, bucket.grad_data
        dev = grad_data.device
        # persistent: the owned parameters (whole, or this rank's even slice of the bucket)
        # and their reduced gradients
        self.pshard = param_data[lo: lo + used].detach().clone() if even else \
            torch.zeros(used, dtype=param_data.dtype, device=dev)
        self.gshard = torch.zeros(used, dtype=grad_data.dtype, device=dev)
        # transient: the gathered bucket and its unreduced gradients
        self.pfull = param_data.detach().clone()
        self.gfull = torch.zeros(numel, dtype=grad_data.dtype, device=dev)
        with torch.no_grad():
            for p, off in self.owned:
                self.pshard[off: off + p.numel()].copy_(p.data.view(-1))
                p.data = self.pshard[off: off + p.numel()].view(p.shape)
            for p, s in self.others:
                p.data = self.pfull[s: s + p.numel()].view(p.shape)
        bucket.param_data, bucket.grad_data = self.pfull, self.gfull
        # views of a freed storage cannot be made later: keep them
        self.full_grads = {p: self.gfull[s: s + p.numel()].view(p.shape)
                           for p, s in self.others}
        self.full_grads.update({p: self.gfull[lo + off: lo + off + p.numel()].view(p.shape)
                                for p, off in self.owned})
        self.shard_grads = {p: self.gshard[off: off + p.numel()].view(p.shape)
                            for p, off in self.owned}
        self.point_grads_to_full()
        self.modules: set = set()  # modules whose parameters live here
        self.fwd_done: set = set()
        self.ready: set = set()
        self.accumulated = False  # gshard holds this step's earlier microbatches
        self.sq_norm = None  # this step's squared local gradient norm (check_grads)
        self.pending = None  # (work, send buffer) of a prefetch in flight
        _free(self.pfull)
        _free(self.gfull)

    def shard_range(self, start: int, end: int) -> slice:
        """Where the bucket range [start, end) (a DP shard's part of a parameter, as
        Megatron's ``gbuf_world_in_bucket``) lies in this rank's ``pshard`` / ``gshard``
        (even shards only)."""
        if not (self.even and self.lo <= start <= end <= self.lo + self.shard):
            raise ValueError(f"range [{start}, {end}) is not in this rank's shard "
                             f"[{self.lo}, {self.lo + self.shard})")
        return slice(start - self.lo, end - self.lo)

    # -- parameters ----------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, async_op: bool = False) -> bool:
        """Materialise the bucket; ``async_op``: only start the all-gather (a prefetch),
        which the next ``gather`` or ``release`` waits for.  False if it was already
        gathered (or, with ``async_op``, already being gathered)."""
        if self.pending is not None:
            if not async_op:
                self.wait()
            return not async_op
        if not _alloc(self.pfull):
            return False
        if self.used == self.shard:
            send = self.pshard
        else:
            send = torch.zeros(self.shard, dtype=self.pshard.dtype, device=self.pshard.device)
            send[: self.used].copy_(self.pshard)
        work = dist.all_gather_into_tensor(self.pfull, send, group=self.group, async_op=async_op)
        if async_op:
            self.pending = (work, send)  # the send buffer lives until the gather is done
            self.z.stats["prefetches"] += 1
        self.z.count("gathers", self.pfull)
        return True

    def wait(self) -> None:
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None

    def release(self) -> None:
        self.wait()  # a prefetch still reads pshard and writes pfull
        _free(self.pfull)

    @torch.no_grad()
    def keep_gathered_values(self) -> None:
        """Even shards: take this rank's slice of the gathered bucket back into ``pshard``
        (after something wrote the gathered parameters, e.g. a checkpoint load)."""
        self.wait()
        if self.even and self.pfull.untyped_storage().size() > 0:
            self.pshard.copy_(self.pfull[self.lo: self.lo + self.shard])

    # -- gradients -----------------------------------------------------------------------
    def point_grads_to_full(self) -> None:
        for p, view in self.full_grads.items():
            p.main_grad = view

    def point_grads_to_shard(self) -> None:
        """After the last reduction: owned main grads are the gradient shard, the others None
        (Megatron's finalize helpers skip a None main_grad)."""
        for p in self.params:
            p.main_grad = self.shard_grads.get(p)

    @torch.no_grad()
    def ensure_grad_buffer(self) -> None:
        if _alloc(self.gfull):
            self.gfull.zero_()

    @torch.no_grad()
    def reduce(self) -> None:
        """Reduce-scatter this microbatch's gradients; the owner accumulates its part."""
        self.ensure_grad_buffer()
        cfg = self.z.ddp_config
        if cfg.check_for_nan_in_grad or getattr(cfg, "check_for_large_grads", False):
            # this microbatch's squared local norm, summed over the step's microbatches on
            # the device; checked once per step (``check_grads``): no host sync per
            # microbatch
            sq = self.gfull.float().square().sum()
            self.sq_norm = sq if self.sq_norm is None else self.sq_norm + sq
        if self.bucket.gradient_scaling_factor != 1.0:
            self.gfull.mul_(self.bucket.gradient_scaling_factor)
        op = dist.ReduceOp.AVG if cfg.average_in_collective else dist.ReduceOp.SUM
        out = torch.empty(self.shard, dtype=self.gfull.dtype, device=self.gfull.device)
        dist.reduce_scatter_tensor(out, self.gfull, op=op, group=self.group)
        if self.accumulated:
            self.gshard.add_(out[: self.used])
        else:
            self.gshard.copy_(out[: self.used])
        self.accumulated = True
        self.ready.clear()
        _free(self.gfull)
        self.release()  # every use of these parameters in this backward is done
        self.z.count("reductions", self.gfull)

    def check_grads(self) -> None:
        """Megatron's pre-reduction gradient check (``_ParamAndGradBucketGroup.check_grads``)
        on this bucket alone, once per step (from ``finish_grad_sync``): the same
        rerun-state-machine validations, of the local norm over the step's microbatches
        (a NaN or Inf in any microbatch makes it NaN or Inf)."""
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        if self.sq_norm is None:
            return
        cfg = self.z.ddp_config
        check_for_nan_or_inf = cfg.check_for_nan_in_grad
        check_for_large = getattr(cfg, "check_for_large_grads", False)
        rsm = get_rerun_state_machine()
        norm, self.sq_norm = self.sq_norm.sqrt(), None
        where = (f"bucket #{self.bucket.bucket_id} in backward pass before data-parallel "
                 "communication collective")
        if check_for_nan_or_inf:
            rsm.validate_result(result=norm, rejection_func=torch.isnan,
                                message=f"found NaN in local grad norm for {where}",
                                tolerance=0.001, fatal=True)
            rsm.validate_result(result=norm, rejection_func=torch.isinf,
                                message=f"found Inf in local grad norm for {where}",
                                tolerance=0.001, fatal=True)
        if check_for_large:
            rsm.validate_result(
                result=norm, rejection_func=partial(rsm.is_unexpectedly_large, threshold=10,
                                                    context="grads"),
                message=f"found unexpected large grads in {where}", tolerance=0.001, fatal=False)

    def reset(self) -> None:
        self.gshard.zero_()
        self.accumulated = False
        self.sq_norm = None
        self.ready.clear()
        _free(self.gfull)
        self.point_grads_to_full()
        self.release()  # the parameters may have changed since they were gathered


class MatrixZeRO3:
    """ZeRO-3 state of one Megatron DDP model chunk (see the module docstring)."""

    def __init__(self, ddp_model, even: bool = False, prefetch: bool = True):
        ddp = ddp_model.ddp_config
        if not ddp.use_distributed_optimizer:
            raise ValueError("ZeRO-3 shards the distributed optimizer's buffers: set "
                             "use_distributed_optimizer=True")
        if not ddp.overlap_grad_reduce:
            raise ValueError("ZeRO-3 reduces gradients bucket by bucket during the backward: build "
                             "DDP with overlap_grad_reduce=True (the bucket is also the unit that "
                             "is gathered, so choose bucket_size accordingly)")
        if getattr(ddp, "num_distributed_optimizer_instances", 1) != 1:
            raise ValueError("ZeRO-3 supports num_distributed_optimizer_instances=1 only")
        for flag in ("fp8_param_gather", "use_megatron_fsdp", "reuse_grad_buf_for_mxfp8_param_ag",
                     "fp4_param_gather"):
            if getattr(ddp, flag, False):
                raise ValueError(f"ZeRO-3 does not support {flag}=True")
        if list(getattr(ddp_model, "expert_parallel_buffers", [])):
            raise ValueError("ZeRO-3 (dmuon_zero3) supports dense models only (no MoE experts)")
        from megatron.core.utils import unwrap_model

        self.model = unwrap_model(ddp_model)  # the GPTModel (under DDP and Float16Module)
        config = getattr(self.model, "config", None)
        if even and getattr(config, "qk_layernorm", False) and \
                getattr(config, "tensor_model_parallel_size", 1) > 1:
            # main_grad is None on even shards: Megatron's TP all-reduce of the q/k-norm
            # gradients (after finish_grad_sync) would skip them, the replicas would drift
            raise ValueError("ZeRO-3 on even shards (dmuon_placement='dmuon') does not support "
                             "qk_layernorm at tensor parallel size > 1: use "
                             "dmuon_placement='matrix'")
        if getattr(self.model, "share_embeddings_and_output_weights", False):
            from megatron.core import parallel_state

            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                # the first and last stage all-reduce the tied weight's gradient, which under
                # ZeRO-3 lives on different DP ranks of the two stages
                raise ValueError("ZeRO-3 with embeddings tied to the output layer needs "
                                 "pipeline parallel size 1 (untie them: "
                                 "--untie-embeddings-and-output-weights)")
        if even and getattr(self.model.config, "sequence_parallel", False):
            # finalize_model_grads all-reduces the layer norms' main_grad over TP; with even
            # shards no rank has a parameter's whole gradient after the reduce-scatter
            raise ValueError("ZeRO-3 with even shards (the reconstruction baseline) does not "
                             "support sequence parallelism; use --dmuon-placement matrix")
        self.ddp = ddp_model
        self.ddp_config = ddp
        # prefetch: while a bucket's modules compute, the bucket used after it (in the
        # forward, or the backward) is already being gathered; at most two are gathered
        self.prefetch = prefetch
        self.forward_order, self.backward_order = _UseOrder(), _UseOrder()
        # collectives and the bytes each sends from this rank (a ring all-gather or
        # reduce-scatter of a bucket of n elements over W ranks sends (W - 1) n / W of them)
        self.stats = {"gathers": 0, "reductions": 0, "gather_bytes": 0, "reduce_bytes": 0,
                      "prefetches": 0}  # gathers started ahead of their use
        self.names = {p: n for n, p in ddp_model.module.named_parameters()}
        self.buffer_of = {}
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict = {}
        # gradient accumulators, taken while every parameter still has its storage
        self._grad_accs = {p: p.expand_as(p).grad_fn.next_functions[0][0]
                           for p in ddp_model.module.parameters() if p.requires_grad}
        for buf in ddp_model.buffers:
            for p in buf.params:
                self.buffer_of[p] = buf
        for bg in ddp_model.bucket_groups:
            for bucket in bg.buckets:
                if list(getattr(bucket, "params_with_extra_main_grads", [])):
                    raise ValueError("ZeRO-3 does not support separate high-precision main grads")
                buf = self.buffer_of[bucket.params_list[0]]
                zb = _Bucket(self, bucket, bg, buf.bucket_indices[bucket.bucket_id][0],
                             even=even)
                self.buckets.append(zb)
                for p in zb.params:
                    self.bucket_of[p] = zb
        for buf in ddp_model.buffers:  # the flat buffers are replaced by the per-bucket ones
            for t in (buf.param_data, buf.grad_data):
                if t is not None:
                    _free(t)
        self.registrations = []
        for buf in ddp_model.buffers:
            self._replace(buf, "reset", lambda: None)
            self._replace(buf, "scale_gradients", self._scaler(buf))
        for bg in ddp_model.bucket_groups:
            self._override(bg)
        self._install_hooks()
        ddp_model.matrix_zero3 = self

    @property
    def even(self) -> bool:
        """Megatron's even shards (every rank a slice of every parameter: the reconstruction
        baseline's layout) rather than whole parameters on their owners."""
        return bool(self.buckets) and self.buckets[0].even

    def count(self, kind: str, full: torch.Tensor) -> None:
        world = self.buckets[0].world
        self.stats[kind] += 1
        key = {"gathers": "gather_bytes", "reductions": "reduce_bytes"}[kind]
        self.stats[key] += (world - 1) * full.numel() * full.element_size() // world

    # -- Megatron overrides -----------------------------------------------------------------
    def _replace(self, obj, name: str, fn) -> None:
        self.registrations.append(hooks.replace(obj, name, fn, owner="ZeRO-3"))

    def remove(self) -> None:
        """Take back everything ZeRO-3 installed: its replacements of Megatron's bucket-group
        and buffer methods, the model's state-dict hooks, the modules' forward hooks and the
        gradient accumulators' pre-hooks.  The storage stays sharded (the parameters that
        another rank owns have none here), so the model cannot train afterwards: this is
        for discarding it, not for a second optimizer on it (``shard_model`` reuses a live
        ZeRO-3 state for that).  Idempotent."""
        for r in self.registrations:
            r.remove()
        self.registrations = []
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []

    close = remove  # the teardown name of the package's other hook owners

    def _scaler(self, buf):
        mine = [zb for zb in self.buckets if self.buffer_of[zb.params[0]] is buf]

        def scale_gradients(factor: float) -> None:
            for zb in mine:
                zb.gshard.mul_(factor)
        return scale_gradients

    def _override(self, bg) -> None:
        zbs = [self.bucket_of[b.params_list[0]] for b in bg.buckets]

        def register_grad_ready(param, *args, **kwargs):
            zb = self.bucket_of[param]
            zb.ready.add(param)
            if len(zb.ready) == len(zb.params):
                zb.reduce()

        def finish_grad_sync(*args, **kwargs):
            for zb in zbs:  # buckets with parameters that got no gradient in a microbatch
                if zb.ready or zb.gfull.untyped_storage().size() > 0:
                    zb.reduce()
                zb.check_grads()
                zb.point_grads_to_shard()
                zb.release()

        def reset():
            for zb in zbs:
                zb.reset()

        def param_sync(*args, **kwargs):
            # The step wrote the owned shards in place; nothing is gathered after it, and
            # whatever is still gathered is stale.
            for zb in zbs:
                zb.release()

        for name, fn in (("register_grad_ready", register_grad_ready),
                         ("start_grad_sync", lambda *a, **k: None),
                         ("finish_grad_sync", finish_grad_sync),
                         ("start_param_sync", param_sync),
                         ("finish_param_sync", lambda *a, **k: None),
                         ("reset", reset)):
            self._replace(bg, name, fn)

    # -- hooks ----------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        self.hook_handles: list = []  # removed by remove() / close()
        for module in self.ddp.module.modules():
            params = [p for p in module.parameters(recurse=False) if p in self.bucket_of]
            params += self._tied_params(module)
            if not params:
                continue
            zbs = list({id(self.bucket_of[p]): self.bucket_of[p] for p in params}.values())
            for zb in zbs:
                zb.modules.add(module)
            self.hook_handles += [module.register_forward_pre_hook(self._pre_forward(zbs)),
                                  module.register_forward_hook(self._post_forward(module, zbs))]
        # a gradient never lands in a freed buffer: allocate it before AccumulateGrad runs
        for p, zb in self.bucket_of.items():
            if p in self._grad_accs:
                self.hook_handles.append(self._grad_accs[p].register_prehook(
                    lambda grads, zb=zb: zb.ensure_grad_buffer()))

    def _tied_params(self, module) -> list:
        """The output layer of a model with shared embeddings uses the embedding weight."""
        root = self.model
        if getattr(root, "share_embeddings_and_output_weights", False) and \
                module is getattr(root, "output_layer", None) and getattr(root, "pre_process", False):
            w = root.shared_embedding_or_output_weight()
            return [w] if w is not None and w in self.bucket_of else []
        return []

    def _use(self, zbs, order: "_UseOrder") -> None:
        """Gather ``zbs`` for their use now; with prefetch, start the all-gather of the bucket
        that came next in ``order`` (the order of first use in an earlier forward or
        backward of this chunk, recorded here) so it runs while these compute."""
        for zb in zbs:
            fresh = zb.gather()
            if not (self.prefetch and fresh):
                continue  # a bucket still gathered (tied weights) prefetches nothing
            following = order.next_after(zb)
            if following is not None:
                following.gather(async_op=True)

    def _pre_forward(self, zbs):
        def hook(module, args):
            if _in_backward():  # activation recompute: the forward order does not apply
                for zb in zbs:
                    zb.gather()
            else:
                self._use(zbs, self.forward_order)
        return hook

    def _post_forward(self, module, zbs):
        def pre_backward(grad):
            self._use(zbs, self.backward_order)
            for zb in zbs:
                zb.ensure_grad_buffer()
            return grad

        # the gather buffers' storages: freed and re-allocated in place (resize_), never
        # replaced, so their identities hold for the life of the hook
        gathered = {zb.pfull.untyped_storage()._cdata for zb in zbs}

        def hook(mod, args, output):
            # A module may return one of its own parameters (Megatron's linear layers with
            # skip_bias_add return the bias for the fused bias-dropout-add that follows): the
            # caller uses it after this hook frees the gather buffer it is a view of.  Hand
            # the caller a copy instead (bitwise the same; autograd still reaches the bias).
            output = _copy_views_of(output, gathered)
            for t in _tensors(output):
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(pre_backward)
            for zb in zbs:
                zb.fwd_done.add(module)
                if zb.fwd_done >= zb.modules:
                    zb.fwd_done.clear()
                    zb.release()  # reshard after forward
            return output
        return hook

    # -- whole-model access ----------------------------------------------------------------
    def gather_all(self) -> None:
        for zb in self.buckets:
            zb.gather()

    def release_all(self) -> None:
        for zb in self.buckets:
            zb.release()

    def keep_gathered_values(self) -> None:
        for zb in self.buckets:
            zb.keep_gathered_values()

    def memory(self) -> dict:
        """Bytes this rank holds between steps, and the largest transient bucket."""
        params = sum(zb.pshard.numel() * zb.pshard.element_size() for zb in self.buckets)
        grads = sum(zb.gshard.numel() * zb.gshard.element_size() for zb in self.buckets)
        model = sum(p.numel() * p.element_size() for p in self.bucket_of)
        gmodel = sum(p.numel() * zb.gshard.element_size() for p, zb in self.bucket_of.items())
        transient = max((zb.pfull.numel() * zb.pfull.element_size()
                         + zb.gfull.numel() * zb.gfull.element_size() for zb in self.buckets),
                        default=0)
        return dict(params=params, grads=grads, model_params=model, model_grads=gmodel,
                    largest_bucket=transient, world=self.buckets[0].world if self.buckets else 1,
                    buckets=len(self.buckets))

    def owns(self, p) -> bool:
        """Whether this rank stores ``p`` whole (never, with even shards)."""
        zb = self.bucket_of.get(p)
        return zb is not None and p in zb.shard_grads


class _UseOrder:
    """The order in which a chunk's buckets are first used in one kind of pass."""

    def __init__(self):
        self.buckets: list = []
        self.position: dict = {}

    def next_after(self, zb) -> Optional["_Bucket"]:
        """The bucket used after ``zb`` (None if none yet); records ``zb`` if it is new."""
        if zb not in self.position:
            self.position[zb] = len(self.buckets)
            self.buckets.append(zb)
        i = self.position[zb] + 1
        return self.buckets[i] if i < len(self.buckets) else None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a recomputed forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _copy_views_of(output, storages: set):
    """``output`` with every tensor whose storage is in ``storages`` replaced by a copy."""
    if torch.is_tensor(output):
        return output.clone() if output.untyped_storage()._cdata in storages else output
    if isinstance(output, (tuple, list)):
        copied = [_copy_views_of(o, storages) for o in output]
        if all(a is b for a, b in zip(copied, output)):
            return output
        return type(output)(copied) if not hasattr(output, "_fields") else type(output)(*copied)
    if isinstance(output, dict):
        return {k: _copy_views_of(v, storages) for k, v in output.items()}
    return output


def _tensors(output):
    if torch.is_tensor(output):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o)


def zero3_of(chunk) -> Optional[MatrixZeRO3]:
    return getattr(chunk, "matrix_zero3", None)


def zero3s(model_chunks) -> list:
    """The ZeRO-3 states of those chunks that have one (empty without ZeRO-3)."""
    return [z for z in map(zero3_of, model_chunks) if z is not None]


def shard_model(model_chunks, even: bool = False, prefetch: bool = True) -> list:
    """Convert DDP chunks to ZeRO-3; idempotent.  ``even=False`` (MatrixFSDP): the chunks are
    matrix-placed with whole parameters and each parameter is stored on its owner only;
    ``even=True`` (the reconstruction baseline): Megatron's own even layout, each rank
    stores its 1/DP slice of every bucket.  ``prefetch``: gather the next bucket while the
    current one computes (``MatrixZeRO3``)."""
    out = []
    for chunk in model_chunks:
        z = zero3_of(chunk)
        if z is None:
            if not even and not all(getattr(b, "matrix_whole", False) for b in chunk.buffers):
                raise ValueError(
                    "dmuon_zero3=True: build the DDP model with "
                    "megatron_muon.megatron.matrix_placement.matrix_placement_for(config).ddp(...) "
                    "(or inside `with matrix_placement_for(config):`) with "
                    "dmuon_placement='matrix' and dmuon_zero3=True (every parameter whole on one "
                    "data-parallel rank)")
            if even and any(getattr(b, "matrix_layout", None) is not None
                            for b in chunk.buffers):
                raise ValueError("dmuon_zero3=True with dmuon_placement='dmuon' (even shards) "
                                 "needs Megatron's own buffer layout, but the model was built "
                                 "under matrix placement: set dmuon_placement='matrix' or "
                                 "build the model without it")
            z = MatrixZeRO3(chunk, even=even, prefetch=prefetch)
            _wrap_state_dict(chunk)
        elif z.even != even:
            raise ValueError(f"the model is already sharded for ZeRO-3 with "
                             f"{'even' if z.even else 'whole-parameter'} shards")
        out.append(z)
    return out


def _wrap_state_dict(chunk) -> None:
    """Model (sharded) state dicts see gathered parameters: the buckets are gathered before
    and stay so until the next release (next forward, zero_grad_buffer or optimizer step);
    inside ``owner_only`` (checkpoints) the sharded state dict and the load see each rank's
    own parameters only, nothing gathered."""
    z = zero3_of(chunk)
    # the innermost model (under DDP and, with --bf16 / --fp16, Float16Module): Megatron-LM
    # main's save_checkpoint calls the unwrapped model's sharded_state_dict, which bypasses
    # the wrappers (with bf16 the save read freed gather buffers: SIGSEGV)
    inner = z.model
    z.owner_only = False

    def gather_unless_owner_only():
        if not z.owner_only:
            z.gather_all()

    z.registrations.append(hooks.before(inner, "state_dict", z.gather_all))
    for name in ("sharded_state_dict", "load_state_dict"):
        z.registrations.append(hooks.before(inner, name, gather_unless_owner_only))
    if z.even:  # the load wrote the gathered buckets: keep this rank's slices of them
        z.registrations.append(hooks.after(inner, "load_state_dict", z.keep_gathered_values))


def _storage_of(entry) -> Optional[int]:
    """The storage of a sharded state dict entry's data: a ShardedTensor's or a
    ShardedTensorFactory's tensor (None for any other entry)."""
    data = getattr(entry, "data", None)
    if hasattr(entry, "replica_id") and torch.is_tensor(data):
        return data.untyped_storage()._cdata
    return None


def _storages(model_chunks) -> tuple:
    """(storages of owned parameters, storages of gather buffers) of every ZeRO-3 bucket: an
    owned parameter is a view of its bucket's ``pshard``, any other of its gather buffer."""
    owned, others = set(), set()
    for z in zero3s(model_chunks):
        if z.even:  # Megatron's own replicas: DP rank 0 writes, every rank reads
            continue
        for zb in z.buckets:
            owned.add(zb.pshard.untyped_storage()._cdata)
            others.add(zb.pfull.untyped_storage()._cdata)
    return owned, others


def _zero3_params(model_chunks) -> int:
    return sum(len(zb.params) for z in zero3s(model_chunks) if not z.even for zb in z.buckets)


def mark_owner_replicas(model_chunks, sharded_state_dict) -> int:
    """Make each ZeRO-3 parameter's owner its checkpoint's writer: in the model's sharded
    state dict, a parameter's ShardedTensors (and factories) get replica_id ``(..., 0)`` on
    the DP rank that owns it and ``(..., 1)`` on the others, whose copies are never read
    (``dist_checkpointing`` writes main replicas only).  Megatron marks DP rank 0 the writer
    of every parameter, which under ZeRO-3 would need the whole stage gathered there.
    Returns how many entries it marked; raises if a ZeRO-3 parameter's entry is a copy
    whose owner it cannot tell."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    owned, others = _storages(model_chunks)
    if not owned:
        return 0
    marked = 0
    for sh in nested_values(sharded_state_dict):
        where = _storage_of(sh)
        if where in owned or where in others:
            sh.replica_id = (*tuple(sh.replica_id)[:-1], 0 if where in owned else 1)
            marked += 1
    if marked < _zero3_params(model_chunks):
        raise RuntimeError(f"ZeRO-3 checkpoint: {_zero3_params(model_chunks) - marked} "
                           "parameters' entries are not views of their buckets; cannot tell "
                           "their owners")
    return marked


def drop_non_owned(model_chunks, sharded_state_dict: dict) -> set:
    """Remove (in place) the entries of ZeRO-3 parameters this rank does not own from a
    model sharded state dict, so that a load reads only the owned ones (into their
    ``pshard`` views); returns the removed keys, for ``load_state_dict(strict=False)``."""
    _, others = _storages(model_chunks)

    def drop(d: dict) -> set:
        dropped = set()
        for key, sh in list(d.items()):
            if isinstance(sh, dict):
                dropped |= {f"{key}.{k}" for k in drop(sh)}
            elif _storage_of(sh) in others:
                del d[key]
                dropped.add(key)
        return dropped

    return drop(sharded_state_dict)


@contextlib.contextmanager
def owner_only(model_chunks):
    """Checkpoints without gathering: inside the block the model's sharded state dict is
    built from the parameters as they are (``mark_owner_replicas`` then makes each owner
    write its own; ``drop_non_owned`` makes each rank read only its own), and
    ``load_state_dict`` does not gather either.  No rank materialises the stage.  No-op
    without ZeRO-3.  With even shards (no rank holds a whole parameter) the buckets are
    gathered instead, as Megatron's ZeRO-1 buffers are: DP rank 0 writes, every rank
    reads and keeps its slice (``_wrap_state_dict``)."""
    zs = zero3s(model_chunks)
    for z in zs:
        if z.even:
            z.gather_all()
        else:
            z.release_all()  # non-owned parameters hold no data
            z.owner_only = True
    try:
        yield
    finally:
        for z in zs:
            z.owner_only = False
            if z.even:
                z.release_all()


@contextlib.contextmanager
def gathered_params(model_chunks):
    """Every parameter materialised (all buckets gathered) inside the block; no-op without
    ZeRO-3.  For evaluation outside hooks and tests (checkpoints use ``owner_only``)."""
    zs = zero3s(model_chunks)
    for z in zs:
        z.gather_all()
    try:
        yield
    finally:
        for z in zs:
            z.release_all()


def zero3_memory(model_chunks) -> Optional[dict]:
    zs = zero3s(model_chunks)
    if not zs:
        return None
    tot = {}
    for z in zs:
        for k, v in z.memory().items():
            tot[k] = max(tot.get(k, 0), v) if k in ("largest_bucket", "world") else tot.get(k, 0) + v
    return tot
