"""Tiny real Megatron-Core GPT for tests, benchmarks and examples.

Deterministic: weights come from ``use_cpu_initialization`` (the same full matrices for
every TP size) and the data of step ``s`` is a fixed global batch of
``dp * num_microbatches`` microbatches, of which DP rank ``d`` takes its contiguous share.
A single-process reference that takes all of them sees exactly the same mean gradient.
``TinyGPTConfig``, ``build_gpt`` (with ``transformer_config`` and ``layout_invariant_init``),
``init_parallel``, ``wire_ddp_hooks`` and ``global_param_name`` come from the library
(``megatron_muon.megatron.models``; the examples build the same model) and are re-exported
here.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_muon.megatron.models import (TinyGPTConfig, _from_tp_order, build_gpt,
                                           global_param_name, init_parallel,
                                           layout_invariant_init, tp_of, transformer_config,
                                           wire_ddp_hooks)

__all__ = [
    "TinyGPTConfig",
    "init_parallel",
    "build_gpt",
    "global_batch",
    "train_step",
    "full_named_params",
    "layout_ranks",
    "transformer_config",
    "layout_invariant_init",
    "wire_ddp_hooks",
    "global_param_name",
]


def global_batch(cfg: TinyGPTConfig, step: int, index: int) -> dict:
    """Microbatch ``index`` of the global batch of ``step`` (same on every layout)."""
    g = torch.Generator().manual_seed(cfg.data_seed * 1_000_003 + step * 10_007 + index)
    # A learnable pattern (shifted copies) plus noise, so the loss can go down.
    base = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, 1), generator=g)
    ramp = torch.arange(cfg.seq_length + 1)[None, :]
    noise = torch.randint(0, 3, (cfg.micro_batch_size, cfg.seq_length + 1), generator=g)
    x = (base + ramp * 7 + noise) % cfg.vocab_size
    tokens, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    pos = torch.arange(cfg.seq_length)[None, :].expand(cfg.micro_batch_size, -1).contiguous()
    return {"tokens": tokens, "labels": labels, "position_ids": pos,
            "loss_mask": torch.ones_like(labels, dtype=torch.float32)}


def _forward_step(data_iterator: Iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(loss_mask, output_tensor):
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return output, partial(loss_func, batch["loss_mask"])


def train_step(model: list, optimizer, cfg: TinyGPTConfig, step: int, dp_rank: int, dp_size: int,
               num_microbatches: Optional[int] = None, forward_only: bool = False,
               grad_hook: Optional[Callable] = None) -> dict:
    """One training step (forward/backward over this DP rank's microbatches + optimizer.step)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    m = num_microbatches or cfg.num_microbatches
    batches = [global_batch(cfg, step, dp_rank * m + j) for j in range(m)]
    vpp = len(model)
    iters = [iter(batches) for _ in range(vpp)] if vpp > 1 else iter(batches)
    for chunk in model:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()
    fb = get_forward_backward_func()
    losses = fb(forward_step_func=_forward_step, data_iterator=iters,
                model=model if vpp > 1 else model[0], num_microbatches=m,
                seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size,
                forward_only=forward_only)
    if grad_hook is not None:
        grad_hook()
    out = {}
    if losses:
        out["loss"] = float(torch.stack([l["lm loss"] for l in losses]).mean())
    if optimizer is not None and not forward_only:
        ok, grad_norm, _ = optimizer.step()
        out.update(update_successful=bool(ok), grad_norm=grad_norm)
    return out


def layout_ranks() -> dict:
    from megatron.core import parallel_state as ps

    return dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                dp=ps.get_data_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                pp_size=ps.get_pipeline_model_parallel_world_size(),
                dp_size=ps.get_data_parallel_world_size())


def full_named_params(model: list, use_main_params: bool = False) -> dict:
    """{global name: full (TP-gathered) fp32 tensor} for this rank's stage, on CPU."""
    from megatron_muon.megatron.zero3 import gathered_params

    with gathered_params(model):
        return _full_named_params(model)


def _full_named_params(model: list) -> dict:
    from megatron.core.utils import unwrap_model

    out = {}
    for chunk in model:
        gpt = unwrap_model(chunk)
        for name, p in gpt.named_parameters():
            t = p.detach().float()
            tp_group, tp, _ = tp_of(p)
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = _from_tp_order(name, chunk, torch.cat(parts, dim=p.partition_dim), tp)
            out[global_param_name(chunk, name)] = t.cpu().clone()
    return out
