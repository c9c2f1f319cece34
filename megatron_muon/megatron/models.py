"""Megatron-Core model plumbing shared by the library, the example training jobs and the tests.

What a training job does around its ``GPTModel`` that is not the model itself:

* ``init_parallel``: Megatron's model-parallel groups and RNG for an initialised world;
* ``wire_ddp_hooks``: the grad-sync / param-sync / finalisation hooks that Megatron-LM's
  training loop puts on the ``TransformerConfig`` of a DDP-wrapped model;
* ``global_param_name``: a parameter's name with the pipeline-local layer index (and the
  EP-local expert index) replaced by the global one, so that the names of a TP/PP/EP layout
  match those of a single-process model (the islands' outer step and the tests key on them).

And a small deterministic GPT (``TinyGPTConfig``, ``build_gpt``): ``GPTModel`` chunks for this
rank's pipeline stage(s), optionally wrapped in Megatron DDP, whose initial weights are the
same full matrices for every TP/PP layout (``layout_invariant_init`` seeds every parameter
by its global name).  The examples (``examples/isoloco_islands.py``) and the tests build it.

It lives here, not in ``megatron_muon.testing`` (the test harness), because library code
(``islands``) and the example jobs need it too; ``megatron_muon.testing.gpt`` re-exports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["init_parallel", "wire_ddp_hooks", "global_param_name", "tp_of", "TinyGPTConfig",
           "transformer_config", "build_gpt", "layout_invariant_init"]


def init_parallel(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, ep: int = 1,
                  seed: int = 1234, etp: Optional[int] = None) -> None:
    """Megatron model-parallel groups + RNG for an already initialised world (``etp``:
    expert TP, default ``tp`` as in Megatron)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(f"TP x PP = {tp} x {pp} does not divide the world size {world}")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp)
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


@dataclass
class TinyGPTConfig:
    """Shape, precision and seeds of the GPT that ``build_gpt`` builds (``seed``: the
    initial weights, ``layout_invariant_init``; ``data_seed``: the tests' synthetic batches)."""

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
    # multi-latent attention (DeepSeek-V3 / Kimi-K2): q and kv LoRA down / up projections
    multi_latent_attention: bool = False
    tie_embeddings: bool = False  # share the embedding with the output layer (PP = 1 only)
    seed: int = 1234
    data_seed: int = 42
    extra: dict = field(default_factory=dict)  # more TransformerConfig fields


def _dtype(cfg: TinyGPTConfig) -> torch.dtype:
    if cfg.bf16 and cfg.fp16:
        raise ValueError("choose at most one of bf16 and fp16")
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32


def transformer_config(cfg: TinyGPTConfig):
    """The ``TransformerConfig`` of ``build_gpt``'s model in the current parallel layout."""
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
    config_cls = TransformerConfig
    if cfg.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_cls = MLATransformerConfig
        head = cfg.hidden_size // cfg.num_attention_heads
        kwargs.update(q_lora_rank=cfg.hidden_size // 2, kv_lora_rank=cfg.hidden_size // 2,
                      qk_head_dim=head, qk_pos_emb_head_dim=head // 2, v_head_dim=head,
                      rope_type="rope", normalization="RMSNorm", num_query_groups=None)
    kwargs.update(cfg.extra)
    return config_cls(**kwargs)


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
    spec = layer_spec or get_gpt_layer_local_spec(
        num_experts=cfg.num_moe_experts, qk_layernorm=tcfg.qk_layernorm,
        multi_latent_attention=cfg.multi_latent_attention)
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


def tp_of(param) -> tuple:
    """``(group, size, rank)`` of the tensor-parallel group that shards ``param``: expert TP
    for MoE experts (Megatron marks their parameters ``allreduce=False``), else TP."""
    from megatron.core import parallel_state as ps

    if getattr(param, "allreduce", True) is False:
        return (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_rank())
    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank())


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

    for name, p in model.named_parameters():
        gname = global_param_name(model, name)
        _, tp, tp_rank = tp_of(p)
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
