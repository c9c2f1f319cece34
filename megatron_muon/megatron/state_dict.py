"""Checkpoints of DMuon and of its AdamW companion: model-space optimizer state.

Megatron's own distributed-optimizer formats key the state by DP shard, which does not
survive a change of layout; these optimizers save every managed parameter's main value
and optimizer state (``exp_avg``/``exp_avg_sq``, or DMuon's ``momentum_buffer``) under the
parameter's own ``ShardedTensor`` key and global shape, so Megatron's
``dist_checkpointing`` reshards them to any DP / TP / PP layout on load. Each rank saves
and loads only the flat range it holds, cut into rectangular blocks that are views of its
state (``core.flat_blocks``): nothing is gathered or densified (docs/memory.md).

* ``ModelSpaceStateMixin``: the format itself (blocks of the own range on save and load) and
  the non-parameter state (param groups, step, grad scaler);
* ``AdamStateMixin``: ``state_dict``/``load_state_dict`` of the AdamW subset optimizer;
* ``DMuonStateMixin``: those of DMuon (which finishes any deferred update first);
* ``LionStateMixin``: those of the Lion subset optimizer (``muon_scalar_optimizer='lion'``),
  DMuon's own format with Lion's state key (``exp_avg``).

The scalar optimizer's name is saved with the non-parameter state: resuming an AdamW
subset from a Lion checkpoint or the other way round is an error (the state tensors mean
different things).

The mixins sit in front of ``DistributedOptimizer`` in the classes of
``megatron_muon.megatron.dmuon``; they use its range maps and ``_managed`` (the
parameters the optimizer manages).
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_muon.megatron import compat

__all__ = ["ModelSpaceStateMixin", "AdamStateMixin", "DMuonStateMixin", "LionStateMixin",
           "check_scalar_optimizer", "model_pieces"]

SCALAR_OPTIMIZER_KEY = "scalar_optimizer"  # in the non-parameter state of the subset


def check_scalar_optimizer(state_dict: dict, expected: str) -> None:
    """A checkpoint of the non-matrix parameters' optimizer must be of the same kind (AdamW
    checkpoints written before this key existed count as 'adam')."""
    saved = state_dict.get(SCALAR_OPTIMIZER_KEY, "adam")
    if saved != expected:
        raise ValueError(f"the checkpoint's non-matrix parameters were trained with {saved}, "
                         f"this run uses muon_scalar_optimizer={expected!r}: resume with "
                         f"--muon-scalar-optimizer {saved}")


def model_pieces(entry, param: torch.Tensor) -> list:
    """``[(flat start, ShardedTensor)]``: where each part of ``param`` (as this rank holds
    it) sits in the checkpoint, in flat order.  A ``ShardedTensor`` is one part.  A
    ``ShardedTensorFactory`` (Megatron's GLU ``linear_fc1``, dense and expert:
    ``apply_swiglu_sharded_factory`` saves gate and up as two row blocks, so that TP
    reshards them) is built on ``param`` itself: its tensors are views of it, and their
    storage offsets say which elements each part holds.  The parts must tile ``param``."""
    if isinstance(entry, ShardedTensor):
        return [(0, entry)]
    parts = []
    for sh in nested_values(entry.build()):
        if not isinstance(sh, ShardedTensor) or not sh.data.is_contiguous() or \
                sh.data.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
            raise ValueError(f"checkpoint entry {entry.key!r} ({type(entry).__name__}) is not "
                             f"made of contiguous views of its parameter; megatron_muon cannot "
                             f"save its optimizer state in model space")
        parts.append((sh.data.storage_offset() - param.storage_offset(), sh))
    parts.sort(key=lambda t: t[0])
    at = 0
    for start, sh in parts:
        if start != at:
            break
        at += sh.data.numel()
    if at != param.numel():
        raise ValueError(f"checkpoint entry {entry.key!r}: its parts do not tile the "
                         f"parameter of shape {tuple(param.shape)}")
    return parts


class ModelSpaceStateMixin:
    """The model-space checkpoint format shared by both optimizers (module docstring)."""

    CHECKPOINT_FORMAT = "megatron_muon_model_space_blocks"
    # The previous format saved the same keys as whole TP-local tensors (summed over DP);
    # DCP reads this format's blocks out of them, so those checkpoints still load.
    READABLE_FORMATS = (CHECKPOINT_FORMAT, "megatron_muon_model_space")
    state_keys: tuple = ("exp_avg", "exp_avg_sq")  # saved next to the main param

    def _group_state_dict(self, step) -> dict:
        """Megatron's non-parameter optimizer state, without needing per-parameter state."""
        groups = []
        for g in self.optimizer.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "step": step})
        sd = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        return sd

    def _load_group_state(self, state_dict, name: str) -> None:
        """Non-parameter state of an inner optimizer that keeps no per-parameter step (DMuon,
        Lion): each param group's settings, the completed steps, the grad scaler."""
        self.optimizer.init_state()
        saved = state_dict["optimizer"]["param_groups"]
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(saved)} {name} param groups, this model "
                             f"{len(self.optimizer.param_groups)}")
        for group, sg in zip(self.optimizer.param_groups, saved):
            group.update({k: v for k, v in sg.items() if k not in ("params", "step")})
        self.completed_steps = int(saved[0].get("step", 0)) if saved else 0
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _managed_in_order(self) -> list:
        return [p for chunk in self.model_chunks for _, p in chunk.named_parameters()
                if p in self._managed]

    def _held_in_order(self, missing_as_zeros: bool = False) -> list:
        """(param, flat range, {key: flat shard tensor}) of the managed params this rank
        holds a DP slice of, in model order.  ``missing_as_zeros`` (saving only): state that
        no step has created yet (a save before the first step: ``--train-iters 0``, an
        exit signal, fp16 steps all skipped) is saved as the zeros the first step starts
        from; a load always needs the real tensors, to fill them."""
        if self.is_stub_optimizer:
            return []
        keys = ("param",) + tuple(self.state_keys)
        out = []
        for p in self._managed_in_order():
            if p not in self.model_param_gbuf_map:
                continue
            r = self._get_model_param_range_map(p)["param"]
            tensors = self._get_main_param_and_optimizer_states(p)
            if missing_as_zeros:
                tensors = {k: tensors[k] if k in tensors else torch.zeros_like(tensors["param"])
                           for k in keys}
            out.append((p, r, {k: tensors[k].view(-1) for k in keys}))
        return out

    def _model_space_state(self, model_sharded_state_dict, saving: bool) -> dict:
        """{index: {key: {piece: ShardedTensor}}}: this rank's slice of every main param and
        state tensor, as views, in model space (the parameter's own key and global shape).

        A DP rank holds one flat range of each TP-local tensor; ``flat_range_blocks`` cuts it
        into at most 2 ndim - 1 rectangular blocks, each a ShardedTensor at its place in the
        global tensor (irregular sharding, which ``dist_checkpointing`` leaves to torch DCP).
        Every element is saved once, by the rank that holds it, with no collective and no
        copy; on load each rank reads only its own blocks, from any DP / TP / PP layout.
        """
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

        from megatron_muon.core.flat_blocks import flat_range_blocks

        meta = {}
        sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
        for sh in nested_values(sharded):
            meta[sh.data] = sh
        out = {}
        for i, (p, r, flat) in enumerate(self._held_in_order(missing_as_zeros=saving)):
            if p not in meta:
                raise ValueError("model parameter missing from the model sharded_state_dict")
            # [(flat start, ShardedTensor, offset in it, shape)]: the own range cut at the
            # model's parts (one for a ShardedTensor, gate and up for a GLU factory), then
            # into blocks
            blocks = []
            for start, sh in model_pieces(meta[p], p):
                lo, hi = max(r.start, start), min(r.end, start + sh.data.numel())
                if lo < hi:
                    blocks += [(start + b, sh, offset, shape) for b, offset, shape in
                               flat_range_blocks(tuple(sh.local_shape), lo - start, hi - start)]
            out[i] = {}
            for key, t in flat.items():
                pieces = {}
                for j, (lo, sh, offset, shape) in enumerate(blocks):
                    pre = sh.prepend_axis_num
                    n = 1
                    for d in shape:
                        n *= d
                    # prepended axes are folded into the block as leading 1s
                    view = t[lo - r.start: lo - r.start + n].view((1,) * pre + shape)
                    goff = tuple(sh.global_offset[:pre]) + tuple(
                        o + b for o, b in zip(sh.global_offset[pre:], offset))
                    pieces[j] = ShardedTensor(
                        key=f"optimizer.state.{key}.{sh.key}", data=view, dtype=view.dtype,
                        local_shape=tuple(view.shape), global_shape=tuple(sh.global_shape),
                        global_offset=goff, axis_fragmentations=None,
                        replica_id=(*sh.replica_id[:2], 0))
                out[i][key] = pieces
        return out

    @torch.no_grad()
    def _load_model_space_state(self, param_state: dict) -> None:
        """Copy the loaded blocks into this rank's flat state (a no-op where DCP already
        loaded into the views handed out by ``_model_space_state``)."""
        for i, (p, r, flat) in enumerate(self._held_in_order()):
            for key, pieces in param_state[i].items():
                lo = r.start
                for j in range(len(pieces)):  # the blocks, in flat order
                    src = pieces[j].reshape(-1)
                    dst = flat[key][lo - r.start: lo - r.start + src.numel()]
                    if src.data_ptr() != dst.data_ptr():
                        dst.copy_(src)
                    lo += src.numel()
                if lo != r.end:
                    raise ValueError(f"checkpoint blocks of a parameter cover {lo - r.start} "
                                     f"of this rank's {r.end - r.start} elements")

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           sharding_type=None, metadata=None):
        state_dict = self.state_dict()
        if is_loading:
            self.load_state_dict(self.state_dict())  # allocate state before it is filled
        state_dict["param_state"] = self._model_space_state(model_sharded_state_dict or {},
                                                            saving=not is_loading)
        state_dict["param_state_sharding_type"] = self.CHECKPOINT_FORMAT
        return state_dict

    def _split_param_state(self, state_dict) -> tuple:
        state_dict = dict(state_dict)
        param_state = state_dict.pop("param_state", None)
        kind = state_dict.pop("param_state_sharding_type", None)
        if param_state is not None and kind not in self.READABLE_FORMATS:
            raise ValueError(f"optimizer checkpoint format {kind!r} is not supported here; "
                             f"megatron_muon writes {self.CHECKPOINT_FORMAT!r}")
        return state_dict, param_state


class AdamStateMixin(ModelSpaceStateMixin):
    """``state_dict`` / ``load_state_dict`` of the AdamW subset optimizer."""

    def state_dict(self):
        # Megatron reads 'step' from per-parameter Adam state, which a rank whose DP shard
        # holds none of the non-Muon parameters does not have.
        if not self.is_stub_optimizer and len(self.optimizer.state) == 0:
            return self._group_state_dict(self.completed_steps)
        return super().state_dict()

    def load_state_dict(self, state_dict):
        check_scalar_optimizer(state_dict, "adam")
        state_dict, param_state = self._split_param_state(state_dict)
        steps = {g.get("step") for g in state_dict["optimizer"]["param_groups"]} - {None}
        if len(steps) == 1:
            self.completed_steps = int(steps.pop())
        super().load_state_dict(state_dict)
        compat.unshare_adam_steps(self.optimizer)  # Megatron's torch-Adam path shares one step
        if param_state is not None:
            self._load_model_space_state(param_state)


class DMuonStateMixin(ModelSpaceStateMixin):
    """``state_dict`` / ``load_state_dict`` / ``sharded_state_dict`` of DMuon."""

    state_keys = ("momentum_buffer",)

    def state_dict(self):
        return self._group_state_dict(self.completed_steps)

    def load_state_dict(self, state_dict):
        """Non-parameter state (groups, step, grad scaler) plus the sharded param state."""
        self.finish_deferred()
        state_dict, param_state = self._split_param_state(state_dict)
        if self.is_stub_optimizer:
            return
        self._load_group_state(state_dict, "DMuon")
        if param_state is not None:
            moment2 = self.optimizer.moment2 is not None
            if moment2:  # the shard buffers the load fills
                self.optimizer.moment2_to_shards()
            self._load_model_space_state(param_state)
            if moment2:
                self.optimizer.moment2_from_shards()

    def sharded_state_dict(self, *args, **kwargs):
        """DMuon's AdaMuon / NorMuon state lives with the unit owners; for the checkpoint it
        is scattered to the holders in element shape (``ShardedMuonStep.moment2_to_shards``)
        and saved as ``moment2_buffer`` next to the momentum, so it reshards like it."""
        self.finish_deferred()
        moment2 = not self.is_stub_optimizer and self.optimizer.moment2 is not None
        if moment2:
            self.optimizer.moment2_to_shards()
        try:
            return super().sharded_state_dict(*args, **kwargs)
        finally:
            if moment2:
                self.optimizer.drop_moment2_shards()


class LionStateMixin(ModelSpaceStateMixin):
    """``state_dict`` / ``load_state_dict`` / ``sharded_state_dict`` of the Lion subset:
    non-parameter state as DMuon's (its inner optimizer keeps no per-parameter step), Lion's
    ``exp_avg`` as the parameter state, plus the scalar optimizer's name."""

    state_keys = ("exp_avg",)

    def state_dict(self):
        return {**self._group_state_dict(self.completed_steps), SCALAR_OPTIMIZER_KEY: "lion"}

    def load_state_dict(self, state_dict):
        check_scalar_optimizer(state_dict, "lion")
        state_dict = {k: v for k, v in state_dict.items() if k != SCALAR_OPTIMIZER_KEY}
        state_dict, param_state = self._split_param_state(state_dict)
        if self.is_stub_optimizer:
            return
        self._load_group_state(state_dict, "Lion")
        if param_state is not None:
            self._load_model_space_state(param_state)
