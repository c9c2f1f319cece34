"""Tiny real Megatron-Core GPT for tests, benchmarks and examples.

Deterministic: weights come from ``use_cpu_initialization`` (the same full matrices for
every TP size) and the data of step ``s`` is a fixed global batch of
``dp * num_microbatches`` microbatches, of which DP rank ``d`` takes its contiguous share.
A single-process reference that takes all of them sees exactly the same mean gradient.
``init_parallel``, ``wire_ddp_hooks`` and ``global_param_name`` come from the library
(``megatron_muon.megatron.models``) and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_muon.megatron.models import global_param_name, init_parallel, wire_ddp_hooks

__all__ = [
    "TinyGPTConfig",
    "init_parallel",
    "build_gpt",
    "global_batch",
    "train_step",
    "full_named_params",
    "layout_ranks",
]


@dataclass
class TinyGPTConfig:
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = 2
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    num_microbatches: int = 2
    swiglu: bool = False
    add_bias_linear: bool = False
    bf16: bool = False
    fp16: bool = False
    num_moe_experts: Optional[int] = None
    tie_embeddings: bool = False  # share the embedding with the output layer (PP = 1 only)
    seed: int = 1234
    data_seed: int = 42
    extra: dict = field(default_factory=dict)  # more TransformerConfig fields


def _dtype(cfg: TinyGPTConfig) -> torch.dtype:
    if cfg.bf16 and cfg.fp16:
        raise ValueError("choose at most one of bf16 and fp16")
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32


def transformer_config(cfg: TinyGPTConfig):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    from megatron_muon.megatron.cpu_mode import cpu_transformer_config

    kwargs = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=_dtype(cfg), params_dtype=_dtype(cfg), bf16=cfg.bf16, fp16=cfg.fp16,
        add_bias_linear=cfg.add_bias_linear, gated_linear_unit=cfg.swiglu,
        hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=cfg.num_moe_experts,
        gradient_accumulation_fusion=False,
    )
    kwargs.update(cpu_transformer_config())
    if cfg.swiglu:
        kwargs["activation_func"] = torch.nn.functional.silu
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp:
        kwargs["virtual_pipeline_model_parallel_size"] = vpp
    if cfg.num_moe_experts:
        kwargs.update(moe_router_topk=1, moe_router_pre_softmax=True,
                      moe_token_dispatcher_type="alltoall",
                      moe_aux_loss_coeff=0.0,
                      expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size())
    kwargs.update(cfg.extra)
    return TransformerConfig(**kwargs)


def build_gpt(cfg: TinyGPTConfig, *, wrap_ddp: bool = True, ddp_config=None,
              layer_spec=None, placement=None) -> list:
    """GPTModel chunks for this rank's pipeline stage(s), optionally wrapped in Megatron DDP.

    ``placement``: a ``megatron_muon.megatron.matrix_placement.MatrixPlacement`` that builds
    the DDP models (its ``ddp(...)``).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tcfg = transformer_config(cfg)
    spec = layer_spec or get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for v in range(vpp):
        kw = {}
        if vpp > 1:
            kw["vp_stage"] = v
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, **kw) if vpp > 1 \
            else parallel_state.is_pipeline_first_stage()
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, **kw) if vpp > 1 \
            else parallel_state.is_pipeline_last_stage()
        model = GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                         max_sequence_length=cfg.seq_length, pre_process=pre, post_process=post,
                         share_embeddings_and_output_weights=cfg.tie_embeddings,
                         position_embedding_type="rope", **kw)
        layout_invariant_init(model, cfg)
        if cfg.bf16 or cfg.fp16:
            model = model.to(_dtype(cfg))
        chunks.append(model)
    if not wrap_ddp:
        return chunks
    ddp_config = ddp_config or DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False, bucket_size=None,
        grad_reduce_in_fp32=True)
    build = placement.ddp if placement is not None else DistributedDataParallel
    wrapped = [build(config=tcfg, ddp_config=ddp_config, module=model, disable_bucketing=i > 0)
               for i, model in enumerate(chunks)]
    wire_ddp_hooks(tcfg, wrapped, ddp_config)
    return wrapped


def _gated_fc1(name: str, model) -> bool:
    from megatron.core.utils import unwrap_model

    return (name.endswith("linear_fc1.weight")
            and bool(unwrap_model(model).config.gated_linear_unit))


def _to_tp_order(name, model, full: torch.Tensor, tp: int) -> torch.Tensor:
    """TP1 layout -> concatenation of TP shards (differs only for a gated fc1: [g;u] -> [g_t;u_t]...)."""
    if tp == 1 or not _gated_fc1(name, model):
        return full
    g, u = full.chunk(2, dim=0)
    return torch.cat([torch.cat([gt, ut]) for gt, ut in zip(g.chunk(tp), u.chunk(tp))])


def _from_tp_order(name, model, cat: torch.Tensor, tp: int) -> torch.Tensor:
    if tp == 1 or not _gated_fc1(name, model):
        return cat
    parts = [p.chunk(2, dim=0) for p in cat.chunk(tp)]
    return torch.cat([torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])])


@torch.no_grad()
def layout_invariant_init(model, cfg: TinyGPTConfig) -> None:
    """Re-initialise every parameter from a generator seeded by its *global* name.

    Megatron's CPU initialisation draws layers in order, so a pipeline stage that starts at
    layer 2 gets other weights than a single-stage model; seeding per global name makes
    the initial model identical for every TP/PP layout.
    """
    import zlib

    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in model.named_parameters():
        gname = global_param_name(model, name)
        shape = list(p.shape)
        dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
        if dim is not None:
            shape[dim] *= tp
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + zlib.crc32(gname.encode()))
        if name.endswith("bias"):
            full = torch.zeros(shape)
        elif p.ndim == 1:
            full = torch.ones(shape)
        else:
            full = torch.randn(shape, generator=gen) * 0.02
        if dim is not None:
            full = _to_tp_order(name, model, full, tp).chunk(tp, dim=dim)[tp_rank]
        p.copy_(full.to(p.dtype))


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
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for chunk in model:
        gpt = unwrap_model(chunk)
        for name, p in gpt.named_parameters():
            t = p.detach().float()
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = _from_tp_order(name, chunk, torch.cat(parts, dim=p.partition_dim), tp)
            out[global_param_name(chunk, name)] = t.cpu().clone()
    return out
