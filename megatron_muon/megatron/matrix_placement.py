"""MatrixFSDP placement in Megatron DDP's buffers (ZeRO-1/2, docs/design.md).

Megatron shards every bucket of a DDP buffer into equal contiguous ranges, one per
data-parallel rank, cutting through matrices.  With ``matrix_placement(...)`` each bucket
is laid out by ``megatron_muon.core.placement.place_bucket`` instead: every Muon matrix (the
TP-local shard of a unit) lies whole inside one DP rank's range, the 1-D non-Muon tensors
(norms, biases) fill the gaps, and 2-D non-Muon tensors (embeddings, output layer) get
plain, evenly sharded buckets of their own (``matrix_layout``).
Megatron's own reduce-scatter then leaves each matrix's full gradient on its owner, its
``DistributedOptimizer`` gives the owner the whole matrix as its shard, and DMuon
(``dmuon_placement='matrix'``) runs Newton-Schulz locally: no data-parallel collective in
the Muon step, only the TP exchange that joins a unit's TP shards.

Megatron versions: ``MatrixPlacement.ddp(...)`` builds the DDP model.  On megatron-core
>= 0.19 it computes a ``FullParamLayout`` (one ``PerBufferParamLayout`` per buffer key)
and hands it to DDP's own ``full_param_layout`` argument; 0.16.1 computes its layout
inline, so the buffers are re-laid out right after Megatron built them
(``compat.ddp_buffer_class`` / ``compat.relayout_buffer``).  The context-manager form
(``with matrix_placement(...): DistributedDataParallel(...)``) covers DDP models built by
code out of our reach on either version, through the same ``compat`` seam.

Compared with Megatron's own shard-aligned layout (megatron-core 0.19.2,
``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout``, used with
``use_layer_wise_distributed_optimizer``): both keep a bucket a contiguous run in backprop
order and every placed tensor whole in one shard.  Megatron bin-packs every tensor of the
bucket (LPT by element count, per bucket) in a buffer of its own for the layer-wise
optimizer's parameters; here only Muon matrices are placed whole, weighted by their
Newton-Schulz cost (``cost``) with the LPT loads carried from bucket to bucket, the 1-D
tensors fill the padding gaps, embeddings/output layers keep plain even shards, and a
bucket is cut only once it holds enough matrices per rank; with ``whole`` (ZeRO-3) the
shards are also permuted so each rank's stored total balances.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Optional

import torch

from megatron_muon.core.placement import BucketPlacement, Item, permute_shards, place_bucket
from megatron_muon.megatron import compat

logger = logging.getLogger(__name__)

__all__ = ["matrix_placement", "matrix_placement_for", "matrix_layout", "MatrixLayout",
           "MatrixPlacement"]

ALIGN = 64  # elements; Megatron aligns distributed-optimizer params to 64 as well
MIN_MATRICES_PER_RANK = 2


class MatrixLayout:
    """``param_index_map`` / ``bucket_indices`` / ``per_bucket_numel_unpadded`` of one buffer."""

    def __init__(self):
        self.param_index_map: dict = {}
        self.bucket_indices: list = []
        self.per_bucket_numel_unpadded: list = []
        self.placements: list[Optional[BucketPlacement]] = []  # None: the plain bucket

    def summary(self) -> str:
        lines = []
        for i, pl in enumerate(self.placements):
            s, e = self.bucket_indices[i]
            lines.append(f"bucket {i} [{s}, {e}): " + (pl.summary() if pl else
                                                         "non-Muon tensors, even shards"))
        return "\n".join(lines)


def _pad(n: int, k: int) -> int:
    return -(-n // k) * k


def matrix_layout(params: list, names: dict, world: int, bucket_size: Optional[int],
                  is_muon: Callable, cost: Optional[Callable] = None,
                  whole: bool = False) -> MatrixLayout:
    """The layout of one buffer whose ``params`` are in Megatron's order (bucket 0 holds the
    last ones, whose gradients are ready first).

    Megatron needs every bucket to be a contiguous run of ``params[::-1]``.  Runs are cut
    as Megatron cuts them (>= ``bucket_size`` elements) but only once they hold
    MIN_MATRICES_PER_RANK x world Muon matrices (whole matrices in equal shards pad heavily
    when a bucket holds only a few); a 2-D non-Muon tensor (embedding, output layer) gets a
    plain, evenly sharded bucket of its own.  Inside a matrix bucket, the 1-D tensors
    (norms, biases) fill the gaps around the matrices.  ``cost(param)`` weighs the NS load
    (default: its size).

    ``whole`` (ZeRO-3): every parameter lies whole in one shard (2-D non-Muon tensors are
    placed like matrices, with no NS cost), and each bucket's shards are handed to the ranks
    so that the totals per rank balance (``permute_shards``): under ZeRO-3 a rank stores
    only what it owns, over all buckets.
    """
    cost = cost or (lambda p: float(p.numel()))
    muon = {p: bool(is_muon(names[p], p)) for p in params}
    whole_item = {p: muon[p] or (whole and p.dim() >= 2) for p in params}
    runs, cur, size, mats = [], [], 0, 0

    def close():
        nonlocal cur, size, mats
        if cur:
            runs.append(("matrix" if mats or whole else "plain", cur))
        cur, size, mats = [], 0, 0

    for p in list(params)[::-1]:
        if not muon[p] and p.dim() >= 2 and not whole:
            close()
            runs.append(("plain", [p]))
            continue
        cur.append(p)
        size += p.numel()
        mats += whole_item[p]
        if bucket_size is not None and size >= bucket_size and \
                mats >= MIN_MATRICES_PER_RANK * world:
            close()
    close()
    # merge neighbouring plain runs (fewer buckets)
    merged = []
    for kind, run in runs:
        if merged and kind == "plain" and merged[-1][0] == "plain":
            merged[-1] = ("plain", merged[-1][1] + run)
        else:
            merged.append((kind, run))
    held = [0] * world  # ZeRO-3: elements each rank stores so far
    layout = MatrixLayout()
    offset = 0
    carry = [(0, 0.0)] * world  # LPT loads carried across buckets
    for kind, run in merged:
        bid = len(layout.bucket_indices)
        if kind == "plain":  # contiguous, cut anywhere, padded to the DP size
            start = offset
            for p in run:
                layout.param_index_map[p] = (offset, offset + p.numel(), bid)
                offset = _pad(offset + p.numel(), ALIGN)
            offset = start + _pad(offset - start, world * ALIGN)
            layout.placements.append(None)
        else:
            mats = [p for p in run if whole_item[p]]
            fills = [p for p in run if not whole_item[p]]
            pl = place_bucket([Item(id(p), p.numel(), cost(p) if muon[p] else 0.0) for p in mats],
                              [Item(id(p), p.numel()) for p in fills], world, align=ALIGN,
                              carry=carry, place_all=True)
            if whole:
                pl = permute_shards(pl, held)
            start = offset
            for p in run:
                pos = offset + pl.offsets[id(p)]
                layout.param_index_map[p] = (pos, pos + p.numel(), bid)
            offset += pl.numel
            layout.placements.append(pl)
        layout.bucket_indices.append((start, offset))
        layout.per_bucket_numel_unpadded.append(sum(p.numel() for p in run))
    return layout


class MatrixPlacement:
    """Whole-matrix DP shards for the DDP models it builds (see the module docstring).

    ``is_muon(name, param)`` says which parameters are Muon matrices (use
    ``megatron_muon.megatron.params.is_muon_matrix`` with the optimizer's
    ``dmuon_adam_params``); ``cost(param)`` weighs the NS load (default: its size);
    ``whole``: every parameter whole on one DP rank (the layout ZeRO-3 needs,
    ``megatron_muon.megatron.zero3``).
    """

    def __init__(self, is_muon: Callable, cost: Optional[Callable] = None, log: bool = True,
                 whole: bool = False):
        self.is_muon, self.cost, self.log, self.whole = is_muon, cost, log, whole
        self._entered = []

    def layout(self, params: list, names: dict, world: int,
               bucket_size: Optional[int]) -> MatrixLayout:
        return matrix_layout(params, names, world, bucket_size, self.is_muon, self.cost,
                             whole=self.whole)

    # -- building DDP ----------------------------------------------------------------------
    def ddp(self, config, ddp_config, module, disable_bucketing: bool = False,
            pg_collection=None, ddp_class=None, **kwargs):
        """``DistributedDataParallel(config=..., ddp_config=..., module=..., ...)`` with this
        placement's buffer layout."""
        from megatron.core.distributed import DistributedDataParallel

        cls = ddp_class or DistributedDataParallel
        _check_ddp_config(ddp_config)
        if pg_collection is not None:
            kwargs["pg_collection"] = pg_collection
        if not compat.DDP_TAKES_PARAM_LAYOUT:  # 0.16: re-lay out the buffers DDP builds
            with self:
                return cls(config=config, ddp_config=ddp_config, module=module,
                           disable_bucketing=disable_bucketing, **kwargs)
        full, layouts, bucket_size = self._full_param_layout(config, ddp_config, module,
                                                             disable_bucketing, pg_collection)
        model = cls(config=config, ddp_config=ddp_config, module=module,
                    disable_bucketing=disable_bucketing, full_param_layout=full, **kwargs)
        if model.bucket_size != bucket_size:
            raise RuntimeError(
                f"matrix placement laid the buffers out for bucket_size={bucket_size}, DDP "
                f"uses {model.bucket_size} (megatron-core {compat.MCORE_VERSION}): update "
                "MatrixPlacement._full_param_layout to DDP's bucket-size rule")
        for buf in list(model.buffers) + list(model.expert_parallel_buffers):
            buf.matrix_layout = layouts[buf.params[0]]
            buf.matrix_whole = self.whole
        return model

    def _full_param_layout(self, config, ddp_config, module, disable_bucketing, pg_collection):
        """megatron-core >= 0.19: DDP's ``full_param_layout`` for ``module``, computed from the
        same parameters, buffer keys, bucket size and DP groups DDP uses."""
        from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
        from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = ProcessGroupCollection.setup_process_groups_for_ddp(pg_collection, config,
                                                                     ddp_config)
        bucket_size = ddp_config.bucket_size  # DDP's rule (DistributedDataParallel.__init__)
        if bucket_size is None:
            bucket_size = max(40000000, 1000000 * groups["dp_group"].size())
        if not ddp_config.overlap_grad_reduce:
            bucket_size = None
        pp = groups["pp_group"]
        if disable_bucketing or (pp[0] if isinstance(pp, list) else pp).rank() > 0:
            bucket_size = None
        names = {p: n for n, p in module.named_parameters() if p.requires_grad}
        layouts, by_param = {}, {}
        for key, (params, indices) in group_params_for_buffers(
                list(names), ddp_config.grad_reduce_in_fp32).items():
            dp = groups["intra_expt_dp_group" if key.is_expert_parallel else "intra_dp_cp_group"]
            world = dp.size()
            lay = self.layout(params, names, world, bucket_size)
            layouts[key] = PerBufferParamLayout(
                param_index_map=lay.param_index_map, bucket_indices=lay.bucket_indices,
                per_bucket_numel_unpadded=lay.per_bucket_numel_unpadded,
                param_indices=indices, num_optimizer_shards=world)
            by_param.update(dict.fromkeys(params, lay))
            self._log(world, lay)
        return FullParamLayout(layouts=layouts), by_param, bucket_size

    def _buffer_subclass(self, base):
        placement = self
        takes_layout = "param_layout" in inspect.signature(base.__init__).parameters

        class MatrixPlacedBuffer(base):
            def __init__(self, ddp_config, param_dtype, grad_dtype, params, data_parallel_group,
                         bucket_size, param_to_name, *args, **kwargs):
                _check_ddp_config(ddp_config)
                plist = [p for p, _ in params] if params and isinstance(params[0], tuple) \
                    else list(params)  # 0.19: (param, name) pairs
                world = data_parallel_group.size()
                layout = placement.layout(plist, param_to_name, world, bucket_size)
                self.matrix_layout = layout
                self.matrix_whole = placement.whole
                if takes_layout:
                    from megatron.core.optimizer.param_layout import PerBufferParamLayout

                    kwargs["param_layout"] = PerBufferParamLayout(
                        param_index_map=layout.param_index_map,
                        bucket_indices=layout.bucket_indices,
                        per_bucket_numel_unpadded=layout.per_bucket_numel_unpadded,
                        param_indices=args[1] if len(args) > 1 else [],
                        num_optimizer_shards=world)
                super().__init__(ddp_config, param_dtype, grad_dtype, params,
                                 data_parallel_group, bucket_size, param_to_name, *args, **kwargs)
                if not takes_layout:
                    compat.relayout_buffer(self, layout.param_index_map, layout.bucket_indices,
                                           layout.per_bucket_numel_unpadded)
                placement._log(world, layout)

        return MatrixPlacedBuffer

    def _log(self, world: int, layout: MatrixLayout) -> None:
        if self.log and torch.distributed.get_rank() == 0:
            logger.info("matrix placement (DP %d):\n%s", world, layout.summary())

    # -- context-manager form --------------------------------------------------------------
    def __enter__(self):
        cm = compat.ddp_buffer_class(self._buffer_subclass)
        cm.__enter__()
        self._entered.append(cm)
        return self

    def __exit__(self, *exc):
        return self._entered.pop().__exit__(*exc)


def _check_ddp_config(ddp_config) -> None:
    if not ddp_config.use_distributed_optimizer:
        raise ValueError("matrix placement shards the distributed optimizer's buffers: "
                         "set use_distributed_optimizer=True")


def matrix_placement(is_muon: Callable, cost: Optional[Callable] = None, log: bool = True,
                     whole: bool = False) -> MatrixPlacement:
    """A ``MatrixPlacement``: build DDP with ``placement.ddp(config=..., ddp_config=...,
    module=...)`` (or, for code that builds DDP itself, inside ``with placement:``)."""
    return MatrixPlacement(is_muon, cost, log=log, whole=whole)


def matrix_placement_for(config, log: bool = True) -> MatrixPlacement:
    """``matrix_placement`` with the Muon/AdamW split of a ``DMuonOptimizerConfig`` or of
    Megatron-LM ``args`` (``--dmuon-adam-params``), so the buffers and DMuon agree; with
    ``dmuon_zero3`` the whole-parameter layout of ZeRO-3."""
    from megatron_muon.megatron.params import is_muon_matrix

    extra = getattr(config, "dmuon_adam_params", None)
    return matrix_placement(lambda name, p: is_muon_matrix(name, p, extra), log=log,
                            whole=bool(getattr(config, "dmuon_zero3", False)))
