"""Megatron-Core model plumbing shared by the library, the example training jobs and the tests.

What a training job does around its ``GPTModel`` that is not the model itself:

* ``init_parallel``: Megatron's model-parallel groups and RNG for an initialised world;
* ``wire_ddp_hooks``: the grad-sync / param-sync / finalisation hooks that Megatron-LM's
  training loop puts on the ``TransformerConfig`` of a DDP-wrapped model;
* ``global_param_name``: a parameter's name with the pipeline-local layer index (and the
  EP-local expert index) replaced by the global one, so that the names of a TP/PP/EP layout
  match those of a single-process model (the islands' outer step and the tests key on them).

It lives here, not in ``megatron_muon.testing`` (the test harness), because library code
(``islands``) and the example jobs need it too.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["init_parallel", "wire_ddp_hooks", "global_param_name"]


def init_parallel(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, ep: int = 1,
                  seed: int = 1234) -> None:
    """Megatron model-parallel groups + RNG for an already initialised world."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(f"TP x PP = {tp} x {pp} does not divide the world size {world}")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep)
    torch.manual_seed(seed)  # CPU init (use_cpu_initialization) draws from this generator
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())


def wire_ddp_hooks(tcfg, model: list, ddp_config) -> None:
    """What Megatron-LM's training loop sets on the config: grad sync and finalisation."""
    from megatron.core.distributed import finalize_model_grads

    no_sync = [m.no_sync for m in model]
    tcfg.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
    if ddp_config.overlap_grad_reduce:
        sync = [m.start_grad_sync for m in model]
        tcfg.grad_sync_func = sync[0] if len(model) == 1 else sync
    if ddp_config.overlap_param_gather:
        psync = [m.start_param_sync for m in model]
        tcfg.param_sync_func = psync[0] if len(model) == 1 else psync
    tcfg.finalize_model_grads_func = finalize_model_grads


_LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"local_experts\.(\d+)\.")


def global_param_name(model_chunk, name: str) -> str:
    """Parameter name with the pipeline-local layer index replaced by the global one."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(model_chunk)
    ex = _EXPERT_RE.search(name)
    if ex and gpt.config.num_moe_experts:  # local expert index -> global expert index
        local_n = gpt.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        g = ps.get_expert_model_parallel_rank() * local_n + int(ex.group(1))
        name = name[: ex.start(1)] + str(g) + name[ex.end(1):]
    match = _LAYER_RE.search(name)
    if not match:
        return name
    local = int(match.group(2))
    layer = gpt.decoder.layers[local]
    glob = layer.layer_number - 1
    return name[: match.start(2)] + str(glob) + name[match.end(2):]
