"""Single-process reference training: the oracle for every distributed optimizer test.

The same tiny GPT (TP = PP = 1, no DDP) sees the whole global batch of every step and is
updated by ``megatron_muon.Muon`` on the hidden matrices (units as DMuon splits them) and
``torch.optim.AdamW`` (or ``Lion``, ``muon_scalar_optimizer='lion'``) on the rest (no weight decay on biases and 1-D tensors, as Megatron's
standard parameter groups), with the same global-norm clipping as Megatron.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_muon.megatron.compat import ns_method

from megatron_muon.megatron.params import is_muon_matrix, muon_units, tp_partition_dim
from megatron_muon.core.lion import Lion
from megatron_muon.core.muon import Muon
from megatron_muon.core.units import shard_units
from megatron_muon.testing.gpt import TinyGPTConfig, build_gpt, full_named_params, init_parallel, train_step

__all__ = ["reference_train", "reference_variants"]


def _blockwise(units, name: str, p, model, tp: int) -> list:
    """The per-TP-shard units Megatron's TP = ``tp`` would hold (TP1 coordinates)."""
    dim = tp_partition_dim(p)
    if dim is None or tp == 1:
        return units
    size = p.shape[dim]
    if name.endswith("linear_fc1.weight") and model.config.gated_linear_unit:
        h = size // (2 * tp)  # TP shard t holds gate_t and up_t
        blocks = [((t * h, h), (size // 2 + t * h, h)) for t in range(tp)]
    else:
        blocks = [((t * size // tp, size // tp),) for t in range(tp)]
    return shard_units(units, dim, blocks)


def reference_train(cfg: dict, dp_size: int, steps: int = 3, opt: Optional[dict] = None,
                    muon: bool = True, grad_hook_inf_step: Optional[int] = None,
                    tp_blockwise: int = 1, ns_eps: Optional[float] = None) -> dict:
    """``tp_blockwise > 1``: Newton-Schulz per TP shard of that TP size (the oracle of
    ``dmuon_tp_mode='blockwise'``).  ``ns_eps``: Newton-Schulz's normalisation eps
    (X / (||X||_F + eps); None: ``Muon``'s default, 1e-7)."""
    from megatron_muon.testing.workers import make_optimizer_config

    gcfg = TinyGPTConfig(**cfg)
    init_parallel(1, 1, seed=gcfg.seed)
    model = build_gpt(gcfg, wrap_ddp=False)
    o = make_optimizer_config("dmuon", **(opt or {}))
    named = dict(model[0].named_parameters())
    muon_params = {n: p for n, p in named.items() if muon and is_muon_matrix(n, p, o.dmuon_adam_params)}
    rest = {n: p for n, p in named.items() if n not in muon_params}
    no_wd = [p for n, p in rest.items() if p.ndim == 1 or n.endswith(".bias")]
    wd = [p for n, p in rest.items() if not (p.ndim == 1 or n.endswith(".bias"))]
    rest_groups = [{"params": wd, "weight_decay": o.weight_decay},
                   {"params": no_wd, "weight_decay": 0.0}]
    if o.muon_scalar_optimizer == "lion":
        adam = Lion(rest_groups, lr=o.lr, betas=(o.lion_beta1, o.lion_beta2))
    else:
        adam = torch.optim.AdamW(rest_groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                 eps=o.adam_eps)
    opts = [adam]
    if muon_params:
        units = {p: _blockwise(muon_units(n, tuple(p.shape), model[0].config,
                                          split_qkv=o.muon_split_qkv,
                                          split_fc1=o.dmuon_split_fc1, tp_size=1,
                                          qkv_split=o.dmuon_qkv_split),
                               n, p, model[0], tp_blockwise)
                 for n, p in muon_params.items()}
        opts.append(Muon(list(muon_params.values()), lr=o.lr, momentum=o.muon_momentum,
                         nesterov=o.muon_nesterov, weight_decay=o.weight_decay,
                         ns_steps=o.muon_num_ns_steps, coefficient_type=o.muon_coefficient_type,
                         scale_mode=o.muon_scale_mode, extra_scale_factor=o.muon_extra_scale_factor,
                         units=units, ns_method=ns_method(o), moment2=o.dmuon_moment2,
                         beta2=o.adaptive_muon_beta2, moment2_eps=o.adaptive_muon_eps,
                         ns_dtype=torch.bfloat16 if o.muon_fp32_matmul_prec == "medium" else None,
                         **({} if ns_eps is None else dict(eps=ns_eps))))
    qk_clip = bool(gcfg.extra.get("qk_clip"))
    if qk_clip:
        from megatron_muon.megatron.qk_clip import clip_qk, install_max_logit_recorders

        install_max_logit_recorders(model)
    losses, max_logits = [], []
    m = gcfg.num_microbatches * dp_size
    for step in range(steps):
        for p in named.values():
            p.grad = None
        out = train_step(model, None, gcfg, step, 0, 1, num_microbatches=m)
        losses.append(out.get("loss"))
        params = [p for p in named.values() if p.grad is not None]
        if o.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        for opt_ in opts:
            opt_.step()
        if qk_clip:  # after the step, as Megatron; no main params here
            max_logits.append(clip_qk(model, None))
    return dict(losses=losses, params=full_named_params(model), max_logits=max_logits)


def reference_variants(variants: list) -> list:
    """``reference_train(**v)`` for each v, in one process (saves a launch each)."""
    return [reference_train(**v) for v in variants]
