"""Other Muon implementations (the peers) for the tests that compare them with ours.

``import_peer`` imports a peer module: a skip where the peer is not installed, an error
where CI says it must be (``MEGATRON_MUON_REQUIRE_PEERS=1``, set by ``.ci/run`` in the lane
that installs emerging_optimizers), so that a broken install fails instead of skipping.

``mcore_muon_train`` is a rank entry point: the tiny GPT trained by Megatron-Core's own
Muon (``get_megatron_optimizer`` with ``optimizer='muon'``: emerging_optimizers'
``TensorParallelMuon`` on the matrices, in Megatron-Core's layer-wise distributed
optimizer, AdamW's DistributedOptimizer on the rest), built the way
``tools/bench_optimizer.py``'s ``mcore_muon_*`` rows build it.  megatron-core >= 0.19 with
emerging_optimizers only.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

import torch

from megatron_muon.megatron.cpu_run import alias_typing_override

__all__ = ["REQUIRE_PEERS", "import_peer", "mcore_muon_config", "mcore_muon_train"]

#: the environment variable that turns a missing peer from a skip into a failure
REQUIRE_PEERS = "MEGATRON_MUON_REQUIRE_PEERS"


def import_peer(module: str):
    """``module``, imported; skips the test if it is missing, unless ``REQUIRE_PEERS=1``."""
    import pytest

    alias_typing_override()
    if os.environ.get(REQUIRE_PEERS) == "1":
        return importlib.import_module(module)  # ImportError: the test fails
    return pytest.importorskip(module, reason=f"{module} is not installed (set {REQUIRE_PEERS}=1 "
                                              "to make that a failure)")


def mcore_muon_config(opt: Optional[dict] = None, tp_mode: str = "duplicated"):
    """Megatron-Core's OptimizerConfig for its Muon on the layer-wise distributed optimizer,
    with ``make_optimizer_config``'s defaults (the reference's) under ``opt``."""
    from megatron.core.optimizer import OptimizerConfig

    base = dict(lr=1e-3, min_lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                adam_eps=1e-8, clip_grad=0.0, bf16=False)
    base.update(opt or {})
    return OptimizerConfig(optimizer="muon", use_layer_wise_distributed_optimizer=True,
                           use_distributed_optimizer=False, muon_tp_mode=tp_mode, **base)


def _fp32_layer_wise_workaround(optim, config):
    """megatron-core 0.19.2 wraps the layer-wise optimizer's torch optimizers only for bf16;
    in fp32 they stay raw and ``step()`` fails: wrap them in FP32Optimizer."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    stack = [optim]
    while stack:
        o = stack.pop()
        subs = getattr(o, "chained_optimizers", None)
        if subs is None:
            continue
        if getattr(o, "config", None) is None:
            o.config = config
        for i, sub in enumerate(subs):
            if isinstance(sub, torch.optim.Optimizer) and not isinstance(sub, MegatronOptimizer):
                subs[i] = FP32Optimizer(sub, config, None)
            else:
                stack.append(sub)
    return optim


def _layer_wise_ddp(gcfg) -> list:
    """The GPT in Megatron DDP laid out as megatron-core 0.19 lays it out for its layer-wise
    optimizer (``LayerWiseDistributedOptimizer.compute_full_param_layout``: every matrix
    whole in one DP shard, even shards)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.layer_wise_optimizer import (LayerWiseDistributedOptimizer,
                                                              tag_params_for_buffer_routing)

    from megatron_muon.testing.gpt import build_gpt, wire_ddp_hooks

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               grad_reduce_in_fp32=True)
    chunks = build_gpt(gcfg, wrap_ddp=False)
    tag_params_for_buffer_routing(chunks)  # Muon matrices vs AdamW buffers (Megatron's own)
    wrapped = []
    for chunk in chunks:
        layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
            [p for p in chunk.parameters() if p.requires_grad], None,
            parallel_state.get_data_parallel_world_size(with_context_parallel=True), ddp_config)
        wrapped.append(DistributedDataParallel(config=chunk.config, ddp_config=ddp_config,
                                               module=chunk, full_param_layout=layout))
    wire_ddp_hooks(chunks[0].config, wrapped, ddp_config)
    return wrapped


def build_mcore_muon(gcfg, ocfg) -> tuple:
    """``(model chunks, optimizer)``: the tiny GPT in the layer-wise DDP layout and
    Megatron-Core's own Muon (``get_megatron_optimizer`` with ``ocfg``) over it, usable in
    fp32 (``_fp32_layer_wise_workaround``).  Also what ``tools/bench_optimizer.py`` times."""
    import megatron.core.optimizer as mcore_optimizer

    from megatron_muon.megatron.compat import megatron_attr

    model = _layer_wise_ddp(gcfg)
    # fix the layer-wise optimizer up as soon as it is built, before megatron-core 0.19.2
    # chains it with the AdamW DistributedOptimizer (ChainedOptimizer asserts both configs)
    layer_wise = mcore_optimizer.LayerWiseDistributedOptimizer
    with megatron_attr(mcore_optimizer, "LayerWiseDistributedOptimizer",
                       lambda *a, **k: _fp32_layer_wise_workaround(layer_wise(*a, **k), ocfg)):
        optim = _fp32_layer_wise_workaround(mcore_optimizer.get_megatron_optimizer(ocfg, model),
                                            ocfg)
    return model, optim


def mcore_muon_train(cfg: dict, tp: int = 1, steps: int = 3, opt: Optional[dict] = None,
                     tp_mode: str = "duplicated") -> dict:
    """Train the tiny GPT ``steps`` steps with Megatron-Core's Muon (module docstring);
    returns losses, the (TP-gathered) parameters and the class of the Muon optimizer."""
    alias_typing_override()
    import torch.distributed as dist

    from megatron_muon.testing.gpt import (TinyGPTConfig, full_named_params, init_parallel,
                                           layout_ranks, train_step)
    from megatron_muon.testing.workers import constant_scheduler

    gcfg = TinyGPTConfig(**cfg)
    init_parallel(tp=tp, pp=1, seed=gcfg.seed)
    ocfg = mcore_muon_config(opt, tp_mode)
    model, optim = build_mcore_muon(gcfg, ocfg)
    # the torch optimizers doing the work, to show which classes ran
    inner, stack = [], [optim]
    while stack:
        o = stack.pop()
        if hasattr(o, "chained_optimizers"):
            stack.extend(o.chained_optimizers)
        else:
            inner.append(o.optimizer)
    sched = constant_scheduler(optim, ocfg)
    lr = layout_ranks()
    losses = []
    for step in range(steps):
        sched.step(1)
        out = train_step(model, optim, gcfg, step, lr["dp"], lr["dp_size"])
        losses.append(out.get("loss"))
    muon = [o for o in inner if type(o).__name__ == "TensorParallelMuon"]
    return dict(layout=lr, rank=dist.get_rank(), losses=losses,
                params=full_named_params(model),
                optimizers=sorted({type(o).__name__ for o in inner}),
                muon_tp_mode=[o.tp_mode for o in muon],
                muon_numel=sum(p.numel() for o in muon for g in o.param_groups
                               for p in g["params"]))
