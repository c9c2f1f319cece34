"""``get_megatron_optimizer``: Megatron-Core's factory, plus ``'dmuon'`` and ``'muon_naive'``.

``build_dmuon_optimizer`` builds the process groups once (``DMuonGroups``, from the caller's
``pg_collection`` or Megatron's ``parallel_state``), splits Megatron's parameter groups into
Muon matrices and the rest, and constructs the distributed optimizers directly
(``compat.build_distributed_optimizer``: nothing of Megatron's is replaced), handing each
the groups it works over.

What a build changes outside the optimizer, and what ``close_optimizer`` (also the chained
optimizer's ``close()``) undoes:

* hooks: DMuon's overlap on the DDP bucket groups and chunks (``dmuon_overlap``), the
  per-head max-logit recorders on local core attention (``qk_clip``), the timeline's
  observers (``dmuon_trace_dir``; the trace is then written at ``close()``, not at exit):
  all removed, so that a second optimizer built on the same DDP model runs alone;
* ``dmuon_zero3``: the DDP chunks are converted to ZeRO-3 in place (``zero3.shard_model``:
  each rank keeps only the parameters it owns).  That is the model's, not the optimizer's:
  it stays, a later build reuses it, and ``MatrixZeRO3.close()`` removes its hooks when the
  model itself is discarded (its storage stays sharded);
* Megatron's own: the distributed optimizer sets ``param.main_param`` on the model's
  parameters (the next build sets them again).
"""

from __future__ import annotations

import copy
import logging

import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer import get_megatron_optimizer as _mcore_get_megatron_optimizer

from megatron_muon.megatron import compat
from megatron_muon.megatron.dmuon import (DMuonDistributedOptimizer, LionSubsetDistributedOptimizer,
                                          SubsetDistributedOptimizer)
from megatron_muon.megatron.groups import DMuonGroups
from megatron_muon.megatron.params import check_expert_layout, is_muon_matrix, layer_weights_not_2d

logger = logging.getLogger(__name__)

__all__ = ["DMuonChainedOptimizer", "get_megatron_optimizer", "build_dmuon_optimizer",
           "close_optimizer"]


def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
    """Same signature and return type as ``megatron.core.optimizer.get_megatron_optimizer``."""
    name = getattr(config, "optimizer", None)
    if name in ("dmuon", "muon_naive"):
        return build_dmuon_optimizer(config, model_chunks, *args, **kwargs)
    return _mcore_get_megatron_optimizer(config, model_chunks, *args, **kwargs)


def _split_groups(param_groups, is_muon):
    muon, adam = [], []
    for g in param_groups:
        muon.append({**g, "params": [p for p in g["params"] if is_muon(p)]})
        adam.append({**g, "params": [p for p in g["params"] if not is_muon(p)]})
    return muon, adam


def build_dmuon_optimizer(config, model_chunks, config_overrides=None,
                          use_gloo_process_groups: bool = True, pg_collection=None,
                          dump_param_to_param_group_map=None):
    """``ChainedOptimizer([DMuon for hidden matrices, AdamW (or Lion, ``muon_scalar_optimizer``)
    DistributedOptimizer for the rest])``."""
    from megatron_muon.megatron.config import DMuonOptimizerConfig

    if not isinstance(config, DMuonOptimizerConfig):
        raise ValueError(f"optimizer={config.optimizer!r} needs a megatron_muon.DMuonOptimizerConfig")
    groups = DMuonGroups.build(pg_collection, model_chunks, use_gloo_process_groups)
    compat.check_supported(config, model_chunks, groups)
    if config.dmuon_zero3:
        from megatron_muon.megatron.zero3 import shard_model

        shard_model(model_chunks, even=config.dmuon_placement != "matrix",
                    prefetch=config.dmuon_zero3_prefetch)
    names, not_2d = {}, []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            names[p] = name
        check_expert_layout(chunk.named_parameters(), chunk.named_modules(),
                            config.dmuon_adam_params)
        not_2d += layer_weights_not_2d(chunk.named_parameters())
    muon_set = {p for p, n in names.items()
                if p.requires_grad and is_muon_matrix(n, p, config.dmuon_adam_params)}
    if dist.get_rank() == 0 and not_2d:
        logger.warning("%s: %d layer weights are not 2-D and go to %s, not Muon: %s",
                       config.optimizer, len(not_2d),
                       "Lion" if config.muon_scalar_optimizer == "lion" else "AdamW",
                       ", ".join(sorted(set(not_2d)))[:2000])
    if dist.get_rank() == 0:
        logger.info("%s: Muon takes %d matrices: %s", config.optimizer, len(muon_set),
                    ", ".join(sorted({names[p] for p in muon_set}))[:2000])
        logger.info("%s: %s takes %s", config.optimizer,
                    "Lion" if config.muon_scalar_optimizer == "lion" else "AdamW",
                    ", ".join(sorted({n for p, n in names.items() if p not in muon_set}))[:2000])

    adam_config = copy.copy(config)
    adam_config.optimizer = "adam"
    param_groups = compat.get_param_groups(model_chunks, adam_config, config_overrides)
    replicate = config.optimizer == "muon_naive"
    scalar_cls = SubsetDistributedOptimizer  # muon_scalar_optimizer: AdamW or Lion
    if config.muon_scalar_optimizer == "lion":
        if config.use_precision_aware_optimizer:
            raise ValueError("muon_scalar_optimizer='lion' does not support "
                             "use_precision_aware_optimizer; turn one of them off")
        scalar_cls = LionSubsetDistributedOptimizer

    # Dense and expert parameters live in separate DDP buffers with their own DP groups;
    # each gets a DMuon (Muon matrices) and an AdamW (the rest) over its buffers.  DMuons
    # come first: the last AdamW's param all-gather publishes every buffer.
    muon_opts, adam_opts = [], []
    for expert in (False, True):
        selected = [g for g in param_groups if bool(g.get("is_expert_parallel")) == expert]
        if not any(g["params"] for g in selected):
            continue
        muon_groups, adam_groups = _split_groups(selected, lambda p: p in muon_set)
        muon_kw = dict(muon_config=config, replicate=replicate, expert=expert, groups=groups)
        for gs, cls, kw, dst in ((muon_groups, DMuonDistributedOptimizer, muon_kw, muon_opts),
                                 (adam_groups, scalar_cls, {}, adam_opts)):
            if not expert or any(g["params"] for g in gs):
                opt = compat.build_distributed_optimizer(adam_config, model_chunks, gs, cls,
                                                         groups, expert=expert, cls_kwargs=kw)
                opt.config = config  # ChainedOptimizer wants one shared config
                dst.append(opt)
    for opt in muon_opts:
        opt.publish_params = False
    chained = DMuonChainedOptimizer(muon_opts + adam_opts)
    from megatron_muon.megatron.qk_clip import record_max_logits

    # what close_optimizer takes back besides the sub-optimizers' own hooks, in build order
    teardown = [record_max_logits(model_chunks)]  # QK-clip on local attention: megatron/qk_clip.py
    if config.dmuon_trace_dir:
        from megatron_muon.megatron.tracing import trace_run

        teardown.append(trace_run(model_chunks, chained, config.dmuon_trace_dir))
    chained.dmuon_teardown.extend(teardown)
    return chained


class DMuonChainedOptimizer(ChainedOptimizer):
    """Megatron's ``ChainedOptimizer`` over dmuon's parts (DMuon and AdamW / Lion, for dense
    and for expert parameters), whose checkpoint load names a change in the number of parts.

    Megatron gives MoE experts their own process groups (and so dmuon its expert optimizers)
    only when ``--expert-model-parallel-size`` > 1 or ``--expert-tensor-parallel-size``
    differs from ``--tensor-model-parallel-size``; the parameter state reshards either way
    (it is keyed by parameter), but the parts' list does not.

    ``dmuon_teardown``: what the build installed besides the parts' own hooks (QK-clip's
    recorders, trace hooks), in build order; ``close()`` takes all of it back."""

    def __init__(self, chained_optimizers):
        super().__init__(chained_optimizers)
        self.dmuon_teardown: list = []

    def close(self) -> None:
        close_optimizer(self)

    def load_state_dict(self, state_dict):
        if len(self.chained_optimizers) > 1 and len(state_dict) != len(self.chained_optimizers):
            raise ValueError(
                f"the checkpoint's optimizer has {len(state_dict)} parts and this run's "
                f"{len(self.chained_optimizers)}: MoE experts get optimizers of their own only "
                "with --expert-model-parallel-size > 1 or --expert-tensor-parallel-size other "
                "than --tensor-model-parallel-size, on both sides or neither; resume at such a "
                "layout, or with --no-load-optim (the optimizer state restarts)")
        super().load_state_dict(state_dict)


def close_optimizer(optimizer) -> None:
    """Undo what ``build_dmuon_optimizer`` installed (the module docstring lists it): every
    sub-optimizer's ``close()`` (DMuon's overlap hooks, after landing a deferred update),
    then the build's recorders and trace hooks, last installed first.  Build a second
    optimizer on the same model only after closing the first: both would otherwise react
    to the model's hooks.  Idempotent; a no-op for an optimizer this factory did not build."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(sub, "close"):
            sub.close()
    teardown = getattr(optimizer, "dmuon_teardown", [])
    while teardown:
        teardown.pop().close()
