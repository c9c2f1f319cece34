"""MatrixFSDP placement in Megatron DDP's buffers (ZeRO-1/2, SPEC section 3).

Megatron shards every bucket of a DDP buffer into equal contiguous ranges, one per
data-parallel rank, cutting through matrices.  Under ``matrix_placement(...)`` each bucket
is laid out by ``megatron_muon.placement.place_bucket`` instead: every Muon matrix (the
TP-local shard of a unit) lies whole inside one DP rank's range, the 1-D non-Muon tensors
(norms, biases) fill the gaps, and 2-D non-Muon tensors (embeddings, output layer) get
plain, evenly sharded buckets of their own (``matrix_layout``).
Megatron's own reduce-scatter then leaves each matrix's full gradient on its owner, its
``DistributedOptimizer`` gives the owner the whole matrix as its shard, and DMuon
(``dmuon_placement='matrix'``) runs Newton-Schulz locally: no data-parallel collective in
the Muon step, only the TP exchange that joins a unit's TP shards.

Megatron versions: 0.19 buffers take a ``PerBufferParamLayout`` (the type behind DDP's
``full_param_layout``), which the buffer subclass passes in; 0.16.1 computes its layout
inline, so the subclass re-lays the buffer out right after Megatron built it.  Either way
the layout is installed where DDP creates its buffers, which covers Megatron-LM's
``get_model`` as well as direct DDP construction.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from typing import Callable, Optional

import torch

from ..placement import BucketPlacement, Item, permute_shards, place_bucket

logger = logging.getLogger(__name__)

__all__ = ["matrix_placement", "matrix_placement_for", "matrix_layout", "MatrixLayout"]

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


def _relayout(buf, layout: MatrixLayout) -> None:
    """Megatron 0.16.1: re-map an already built ``_ParamAndGradBuffer`` onto ``layout``."""
    from megatron.core.distributed.param_and_grad_buffer import BufferType

    buf.param_index_map = layout.param_index_map
    buf.bucket_indices = layout.bucket_indices
    buf.numel = layout.bucket_indices[-1][1]
    buf.numel_unpadded = sum(layout.per_bucket_numel_unpadded)
    device = buf.grad_data.device
    if buf.param_data is not None:
        buf.param_data = torch.zeros(buf.numel, dtype=buf.param_dtype, device=device)
    buf.grad_data = torch.zeros(buf.numel, dtype=buf.grad_dtype, device=device)
    for p in buf.params:
        start = layout.param_index_map[p][0]
        if buf.param_data is not None:
            new = buf._get(p.data.shape, start, buffer_type=BufferType.PARAM)
            new.copy_(p.data)
            p.data = new
        p.main_grad = buf._get(p.data.shape, start, buffer_type=BufferType.GRAD)
    buf.buckets, buf.param_to_bucket = [], {}
    for bid, (s, e) in enumerate(layout.bucket_indices):
        members = [p for p in buf.params[::-1] if layout.param_index_map[p][2] == bid]
        buf.buckets.append(buf._new_bucket(bucket_params=members, start_index=s, end_index=e,
                                           numel_unpadded=layout.per_bucket_numel_unpadded[bid],
                                           bucket_id=bid))


@contextmanager
def matrix_placement(is_muon: Callable, cost: Optional[Callable] = None, log: bool = True,
                     whole: bool = False):
    """Build Megatron DDP models inside this block to get whole-matrix DP shards.

    ``is_muon(name, param)`` says which parameters are Muon matrices (use
    ``megatron_muon.megatron.params.is_muon_matrix`` with the optimizer's
    ``dmuon_adam_params``); ``cost(param)`` weighs the NS load (default: its size);
    ``whole``: every parameter whole on one DP rank (the layout ZeRO-3 needs,
    ``megatron_muon.megatron.zero3``).
    """
    from megatron.core.distributed import distributed_data_parallel as ddp_mod

    base = ddp_mod._ParamAndGradBuffer
    takes_layout = "param_layout" in inspect.signature(base.__init__).parameters

    class MatrixPlacedBuffer(base):
        def __init__(self, ddp_config, param_dtype, grad_dtype, params, data_parallel_group,
                     bucket_size, param_to_name, *args, **kwargs):
            if not ddp_config.use_distributed_optimizer:
                raise ValueError("matrix placement shards the distributed optimizer's buffers: "
                                 "set use_distributed_optimizer=True")
            plist = [p for p, _ in params] if params and isinstance(params[0], tuple) \
                else list(params)  # 0.19: (param, name) pairs
            world = data_parallel_group.size()
            layout = matrix_layout(plist, param_to_name, world, bucket_size, is_muon, cost,
                                   whole=whole)
            self.matrix_layout = layout
            self.matrix_whole = whole
            if takes_layout:
                from megatron.core.optimizer.param_layout import PerBufferParamLayout

                kwargs["param_layout"] = PerBufferParamLayout(
                    param_index_map=layout.param_index_map, bucket_indices=layout.bucket_indices,
                    per_bucket_numel_unpadded=layout.per_bucket_numel_unpadded,
                    param_indices=args[1] if len(args) > 1 else [], num_optimizer_shards=world)
            super().__init__(ddp_config, param_dtype, grad_dtype, params, data_parallel_group,
                             bucket_size, param_to_name, *args, **kwargs)
            if not takes_layout:
                _relayout(self, layout)
            if log and torch.distributed.get_rank() == 0:
                logger.info("matrix placement (DP %d):\n%s", world, layout.summary())

    ddp_mod._ParamAndGradBuffer = MatrixPlacedBuffer
    try:
        yield
    finally:
        ddp_mod._ParamAndGradBuffer = base


def matrix_placement_for(config, log: bool = True):
    """``matrix_placement`` with the Muon/AdamW split of a ``DMuonOptimizerConfig`` or of
    Megatron-LM ``args`` (``--dmuon-adam-params``), so the buffers and DMuon agree; with
    ``dmuon_zero3`` the whole-parameter layout of ZeRO-3."""
    from .params import is_muon_matrix

    extra = getattr(config, "dmuon_adam_params", None)
    return matrix_placement(lambda name, p: is_muon_matrix(name, p, extra), log=log,
                            whole=bool(getattr(config, "dmuon_zero3", False)))
