"""LoRA on Transformer Engine layers (docs/design.md#smuon-and-lora), with CPU stand-ins.

Transformer Engine needs CUDA, so the classes below stand in for Megatron-Core's TE wrappers
(megatron/core/extensions/transformer_engine.py): the same class names, constructor-set
attributes (``config``, ``te_return_bias``, ``_tp_group``, ``tp_size``, ``parallel_mode``,
``sequence_parallel``, ``weight`` / ``weight<i>``, ``layer_norm_weight``,
``return_layernorm_output`` / ``_gathered``, ``num_gemms``, ``_pg_collection``) and the same
forward contract: TE's module returns ``out``, ``(out, bias)``, ``(out, ln_out)`` or
``(out, bias, ln_out)`` and Megatron's wrapper hands back ``out`` when TE returns the bias,
else ``(out, None)``; under sequence parallelism the column layers all-gather their
(normalised) input along the sequence and the row layers reduce-scatter their output, with
Megatron's differentiable mappings.  The real classes are exercised by ``tools/gpu_check.sh``
only (megatron_muon/testing/lora_te_check.py).

Every comparison is against the dense float64 reference ``z (W + gamma B A)^T`` of the full
(TP-gathered) matrices, ``z`` the normalised input for the fused layernorm-linear; the
stand-ins and adapters run in float64 too, and the tolerance is derived per entry: a sum of
K products in binary64 is off by at most K u (u = 2^-53) times the same sum of absolute
values (the reference evaluated on |z|, |W|, |A|, |B|, |G|), with K the longest summation
(the layernorm's, the matmuls' and the gradients' over tokens).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_muon.testing.launch import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)}
DT = torch.float64
U = torch.finfo(DT).eps / 2
RANK, ALPHA = 4, 8.0
GAMMA = ALPHA / RANK
SEQ, BATCH, HIDDEN = 8, 2, 16


# ============================================================================== stand-ins
class _Config(SimpleNamespace):
    """The TransformerConfig fields the layers and apply_lora read."""

    def __init__(self, **kw):
        super().__init__(**{**dict(sequence_parallel=False, gated_linear_unit=False,
                                   gradient_accumulation_fusion=False,
                                   layernorm_epsilon=1e-5, normalization="LayerNorm",
                                   use_transformer_engine_op_fuser=False), **kw})


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _full(name: str, *shape) -> torch.Tensor:
    """A deterministic full tensor: the same on every rank and layout."""
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(*shape, generator=g, dtype=DT)


class _TEBase(torch.nn.Module):
    """What Megatron's TE wrappers set in their constructors."""

    def __init__(self, config, tp_group, parallel_mode, bias, skip_bias_add):
        super().__init__()
        self.config = config
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = False
        self._tp_group = tp_group
        self.tp_group = tp_group  # TE's own copy
        self.tp_size = _size(tp_group)
        self.parallel_mode = parallel_mode
        self.sequence_parallel = config.sequence_parallel and self.tp_size > 1
        self.fuse_wgrad_accumulation = config.gradient_accumulation_fusion
        self.use_bias = bias

    def _matmul(self, x, weight):
        """TE Linear's parallel GEMM: column gathers (SP) / all-reduces the input's
        gradient; row reduces (SP: reduce-scatters) the output."""
        from megatron.core.tensor_parallel import mappings

        g = self._tp_group
        if self.parallel_mode == "column" and self.tp_size > 1:
            x = (mappings.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=True, group=g) if self.sequence_parallel
                else mappings.copy_to_tensor_model_parallel_region(x, group=g))
        out = torch.nn.functional.linear(x, weight)
        if self.parallel_mode == "row" and self.tp_size > 1:
            out = (mappings.reduce_scatter_to_sequence_parallel_region(out, group=g)
                   if self.sequence_parallel
                   else mappings.reduce_from_tensor_model_parallel_region(out, group=g))
        return x, out

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """As Megatron's: weight (and a column layer's bias) split along TP."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {"weight": 0, "bias": 0} if self.parallel_mode == "column" else {"weight": 1}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axis, sharded_offsets,
            tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    def _finish(self, out):
        """TE returns ``(out, bias)`` only with return_bias; Megatron always two values."""
        if self.use_bias and not self.te_return_bias:
            out = out + self.bias
        te_out = (out, self.bias) if self.te_return_bias else out
        return te_out if self.te_return_bias else (te_out, None)


class TELinear(_TEBase):
    """megatron.core.extensions.transformer_engine.TELinear (here: 'duplicated' only)."""

    def __init__(self, config, n, m):
        super().__init__(config, None, None, False, False)
        self.weight = torch.nn.Parameter(_full("dup", m, n))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


class TEColumnParallelLinear(_TEBase):
    def __init__(self, config, n, m, name, tp_group, bias=False, skip_bias_add=False):
        super().__init__(config, tp_group, "column", bias, skip_bias_add)
        t, r = self.tp_size, _rank(tp_group)
        self.in_features, self.out_features = n, m // t
        self.weight = torch.nn.Parameter(_full(name + ".w", m, n).chunk(t, 0)[r].clone())
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, 0
        self.weight.allreduce = True
        if bias:
            self.bias = torch.nn.Parameter(_full(name + ".b", m).chunk(t, 0)[r].clone())

    def forward(self, x):
        return self._finish(self._matmul(x, self.weight)[1])


class TELayerNormColumnParallelLinear(TEColumnParallelLinear):
    """LayerNorm fused into the column-parallel linear (TE's LayerNormLinear)."""

    def __init__(self, config, n, m, name, tp_group, bias=False, skip_bias_add=False):
        super().__init__(config, n, m, name, tp_group, bias, skip_bias_add)
        self.eps = config.layernorm_epsilon
        self.normalization = config.normalization
        self.zero_centered_gamma = False
        self.layer_norm_weight = torch.nn.Parameter(1 + 0.5 * _full(name + ".lnw", n))
        self.layer_norm_bias = torch.nn.Parameter(0.3 * _full(name + ".lnb", n))
        self.return_layernorm_output = False  # Megatron's constructor value
        self.return_layernorm_output_gathered = False

    def forward(self, x):
        ln = torch.nn.functional.layer_norm(x, (x.shape[-1],), self.layer_norm_weight,
                                            self.layer_norm_bias, self.eps)
        ln_total, out = self._matmul(ln, self.weight)
        if self.use_bias and not self.te_return_bias:
            out = out + self.bias
        if self.return_layernorm_output:
            ln_ret = ln_total if self.return_layernorm_output_gathered else ln
            te_out = (out, self.bias, ln_ret) if self.te_return_bias else (out, ln_ret)
        else:
            te_out = (out, self.bias) if self.te_return_bias else out
        return te_out if self.te_return_bias else (te_out, None)


class TERowParallelLinear(_TEBase):
    def __init__(self, config, n, m, name, tp_group, bias=False, skip_bias_add=False):
        super().__init__(config, tp_group, "row", bias, skip_bias_add)
        t, r = self.tp_size, _rank(tp_group)
        self.in_features, self.out_features = n // t, m
        self.weight = torch.nn.Parameter(_full(name + ".w", m, n).chunk(t, 1)[r].clone())
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, 1
        self.weight.allreduce = True
        if bias:
            self.bias = torch.nn.Parameter(_full(name + ".b", m))

    def forward(self, x):
        return self._finish(self._matmul(x, self.weight)[1])


class _TEGroupedLinear(_TEBase):
    """TEGroupedLinear: ``num_gemms`` local experts, ``weight<i>``, ``forward(x, m_splits)``;
    expert communication is Megatron's (explicit), so no TP inside."""

    def __init__(self, config, num_gemms, n, m, name, pg, parallel_mode):
        super().__init__(config, pg.expt_tp, parallel_mode, False, False)
        self._pg_collection = pg
        self.num_gemms = num_gemms
        self.explicit_expert_comm = True
        self.sequence_parallel = False
        self.in_features, self.out_features = n, m
        first = dist.get_rank(pg.ep) * num_gemms
        for i in range(num_gemms):
            w = torch.nn.Parameter(_full(f"{name}.w{first + i}", m, n))
            w.allreduce = False
            setattr(self, f"weight{i}", w)

    def forward(self, x, m_splits):
        outs = [torch.nn.functional.linear(xi, getattr(self, f"weight{i}"))
                for i, xi in enumerate(torch.split(x, list(m_splits)))]
        return torch.cat(outs), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The weights, one expert-axis entry each (as Megatron's _sharded_state_dict_grouped)."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        ep_rank, ep = dist.get_rank(self._pg_collection.ep), dist.get_world_size(
            self._pg_collection.ep)
        out = {}
        for i in range(self.num_gemms):
            offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank * self.num_gemms + i,
                                          ep * self.num_gemms))
            sub = make_sharded_tensors_for_checkpoint(
                {f"{i}.weight": getattr(self, f"weight{i}")}, "", {}, offsets,
                tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
        return out


class TEColumnParallelGroupedLinear(_TEGroupedLinear):
    def __init__(self, config, num_gemms, n, m, name, pg):
        super().__init__(config, num_gemms, n, m, name, pg, "column")


class TERowParallelGroupedLinear(_TEGroupedLinear):
    def __init__(self, config, num_gemms, n, m, name, pg):
        super().__init__(config, num_gemms, n, m, name, pg, "row")


class TEGroupedMLP(torch.nn.Module):
    def __init__(self, config, num_local, ffn, pg):
        super().__init__()
        self.num_local_experts, self.ep_group, self.tp_group = num_local, pg.ep, pg.expt_tp
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        self.linear_fc1 = TEColumnParallelGroupedLinear(config, num_local, HIDDEN, fc1_out,
                                                        "fc1", pg)
        self.linear_fc2 = TERowParallelGroupedLinear(config, num_local, ffn, HIDDEN, "fc2", pg)


class TEFusedMLP(torch.nn.Module):
    """An MLP whose forward goes through TE's op fuser (never calls linear_fc1.forward)."""

    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = TELayerNormColumnParallelLinear(config, HIDDEN, 32, "fused", None)


def _tree(**children) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in children.items():
        m.add_module(k, v)
    return m


def _model(*layers) -> torch.nn.Module:
    return _tree(decoder=_tree(layers=torch.nn.ModuleList(layers)))


# ============================================================================== reference
def _reference(z, W, A, B, G):
    """y = z (W + gamma B A)^T and the gradients of sum(G y) w.r.t. A, B, z (dense)."""
    z, A, B = (t.detach().clone().requires_grad_(True) for t in (z, A, B))
    y = torch.nn.functional.linear(z, W + GAMMA * B @ A)
    (y * G).sum().backward()
    return {"y": y.detach(), "A": A.grad, "B": B.grad, "z": z.grad}


def _bounds(z, W, A, B, G) -> dict:
    """Per-entry error bounds of the float64 forward and gradients: K u |.|-products."""
    k = 2 * z.shape[-1] + W.shape[0] + A.shape[0] + z[..., 0].numel() + 16
    return {key: k * U * v for key, v in
            _reference(z.abs(), W.abs(), A.abs(), B.abs(), G.abs()).items()}


def _ratio(got, ref, bound) -> float:
    """max |got - ref| / bound (<= 1: within the derived tolerance)."""
    return float(((got - ref).abs() / bound.clamp(min=1e-300)).max())


def _layer_norm_ref(layer, x):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), layer.layer_norm_weight.detach(),
                                          layer.layer_norm_bias.detach(), layer.eps)


def _gather(t, dim, group):
    if _size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# ============================================================================== TP2 workers
def _dense_model(cfg, tp):
    return _model(
        _tree(self_attention=_tree(
                  linear_qkv=TELayerNormColumnParallelLinear(cfg, HIDDEN, 24, "l0.qkv", tp),
                  linear_proj=TERowParallelLinear(cfg, 16, HIDDEN, "l0.proj", tp, bias=True)),
              mlp=_tree(
                  linear_fc1=TELayerNormColumnParallelLinear(
                      cfg, HIDDEN, 32, "l0.fc1", tp, bias=True, skip_bias_add=True),
                  linear_fc2=TERowParallelLinear(cfg, 16, HIDDEN, "l0.fc2", tp, bias=True,
                                                 skip_bias_add=True))),
        _tree(self_attention=_tree(
            linear_qkv=TEColumnParallelLinear(cfg, HIDDEN, 24, "l1.qkv", tp, bias=True),
            linear_proj=TERowParallelLinear(cfg, 16, HIDDEN, "l1.proj", tp))))


def _random_factors(ads) -> None:
    for ad in ads:
        m, n = ad.shape
        ad.load_full(_full(ad.global_name + ".A", RANK, n) / n ** 0.5,
                     _full(ad.global_name + ".B", m, RANK) * 0.3, canonical=True)


def _check_layer(layer, ad, x_full, sp, tp, use_ln=True) -> dict:
    """Forward + backward of one adapted layer on this rank's part of ``x_full`` against
    the dense reference of the gathered matrices; returns ratios to the derived bounds."""
    t, r = _size(tp), _rank(tp)
    column = ad.kind == "column"
    fused = hasattr(layer, "layer_norm_weight")
    W = _gather(layer.weight.detach(), 0 if column else 1, tp)
    # full factors in float64 (gather_full gives fp32), in TP order like the weight's rows
    A = _gather(ad.A.detach(), 1, tp) if ad.sharded == "A" else ad.A.detach()
    B = _gather(ad.B.detach(), 0, tp) if ad.sharded == "B" else ad.B.detach()
    z = _layer_norm_ref(layer, x_full) if fused and use_ln else x_full
    if column:
        x_loc = x_full.chunk(t, 0)[r] if sp else x_full
    else:
        x_loc = x_full.chunk(t, -1)[r]
    x_loc = x_loc.clone().requires_grad_(True)
    G = _full(ad.global_name + ".G", *z.shape[:-1], W.shape[0])
    out, bias = layer(x_loc)
    if column:  # this rank's output columns; the sequence is whole (TE gathered it)
        G_loc = G.chunk(t, -1)[r]
    else:
        G_loc = G.chunk(t, 0)[r] if sp else G
    ad.A.grad = ad.B.grad = None
    (out * G_loc).sum().backward()
    gA, gB = ad.A.grad.clone(), ad.B.grad.clone()
    for g, p in ((gA, ad.A), (gB, ad.B)):
        if getattr(p, "sequence_parallel", False):  # what finalize_model_grads does
            dist.all_reduce(g, group=tp)
    gA = _gather(gA, 1, tp) if ad.sharded == "A" else gA
    gB = _gather(gB, 0, tp) if ad.sharded == "B" else gB
    y = _gather(out.detach(), -1, tp) if column else (
        _gather(out.detach(), 0, tp) if sp else out.detach())
    added = 0  # the bias the layer adds itself (not returned with skip_bias_add)
    if bias is None and layer.use_bias:
        added = _gather(layer.bias.detach(), 0, tp) if column else layer.bias.detach()
    ref, bound = _reference(z, W, A, B, G), _bounds(z, W, A, B, G)
    res = {"y": _ratio(y, ref["y"] + added, bound["y"]),
           "A": _ratio(gA, ref["A"], bound["A"]), "B": _ratio(gB, ref["B"], bound["B"]),
           "branch_max": float((GAMMA * (z @ A.T) @ B.T).abs().max() / bound["y"].max()),
           "bias_returned": bias is not None and torch.equal(bias, layer.bias)}
    if not fused:  # the branch's input gradient (the fused layer's goes through TE's norm)
        if column:
            part = (lambda t_: t_.chunk(t, 0)[r]) if sp else (lambda t_: t_)
        else:
            part = lambda t_: t_.chunk(t, -1)[r]  # noqa: E731
        res["x"] = _ratio(x_loc.grad, part(ref["z"]), part(bound["z"]))
    return res


def dense_worker(sp: bool) -> dict:
    """TP2: every TE dense layer type, adapted, against the dense reference; plus merge,
    lora_disabled, the parameter attributes and the wrong-input control."""
    from megatron.core import parallel_state as ps

    from megatron_muon.peft.lora import (LoRAConfig, apply_lora, lora_disabled, merge_lora,
                                         unmerge_lora)
    from megatron_muon.testing.gpt import init_parallel

    init_parallel(tp=2)
    tp = ps.get_tensor_model_parallel_group()
    cfg = _Config(sequence_parallel=sp, gated_linear_unit=True)
    model = _dense_model(cfg, tp)
    layers = {n: m for n, m in model.named_modules() if n.endswith(("qkv", "proj", "fc1", "fc2"))}
    x = {n: 2.0 + 3.0 * _full(n + ".x", SEQ, BATCH, HIDDEN if "qkv" in n or "fc1" in n else 16)
         for n in layers}

    def local_in(n, m):
        if m.parallel_mode == "column":
            return x[n].chunk(2, 0)[ps.get_tensor_model_parallel_rank()] if sp else x[n]
        return x[n].chunk(2, -1)[ps.get_tensor_model_parallel_rank()]

    with torch.no_grad():
        base = {n: m(local_in(n, m))[0].clone() for n, m in layers.items()}
    ads = apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA))
    _random_factors(ads)
    by_name = {ad.global_name: ad for ad in ads}
    out = {"names": sorted(by_name), "layers": {}, "wrong_input": {}}
    for n, m in layers.items():
        out["layers"][n] = _check_layer(m, by_name[n], x[n], sp, tp)
        if hasattr(m, "layer_norm_weight"):  # the control: a branch fed the raw input
            out["wrong_input"][n] = _check_layer(m, by_name[n], x[n], sp, tp, use_ln=False)["y"]
        out["layers"][n]["return_layernorm_output"] = getattr(m, "return_layernorm_output", None)
    with torch.no_grad():
        lora_out = {n: m(local_in(n, m))[0].clone() for n, m in layers.items()}
        with lora_disabled(model):
            out["disabled_equal"] = all(torch.equal(m(local_in(n, m))[0], base[n])
                                        for n, m in layers.items())
        out["merged"] = merge_lora(model)
        merged = {n: m(local_in(n, m))[0] for n, m in layers.items()}
        unmerge_lora(model)
    out["merged_vs_lora"] = {n: float((merged[n] - lora_out[n]).abs().max() /
                                      lora_out[n].abs().max()) for n in layers}
    out["lora_vs_base"] = {n: float((lora_out[n] - base[n]).abs().max() / base[n].abs().max())
                           for n in layers}
    out["attrs"] = {ad.global_name: {f: (bool(getattr(p, "tensor_model_parallel", False)),
                                         int(getattr(p, "partition_dim", -1)),
                                         bool(getattr(p, "sequence_parallel", False)))
                                     for f, p in (("A", ad.A), ("B", ad.B))} for ad in ads}
    out["trainable"] = sorted(k for k, p in model.named_parameters() if p.requires_grad)
    return out


def _init_experts():
    """TP2 for dense layers, EP2 x ETP1 for experts (the layout expert LoRA needs)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size(),
                                 expert_model_parallel_size=dist.get_world_size(),
                                 expert_tensor_parallel_size=1)
    return SimpleNamespace(ep=ps.get_expert_model_parallel_group(),
                           expt_tp=ps.get_expert_tensor_parallel_group(),
                           expt_dp=ps.get_expert_data_parallel_group())


def _expert_model(num_local, gated=True):
    pg = _init_experts()
    cfg = _Config(gated_linear_unit=gated)
    return _model(_tree(mlp=_tree(experts=TEGroupedMLP(cfg, num_local, 8, pg)))), pg


def grouped_worker(num_local: int, splits: list, save: str) -> dict:
    """EP2: TE grouped experts, each expert's rows against its own dense reference; merge;
    global names; an adapter file and a dist checkpoint of the grouped layers' adapters."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_muon.peft.lora import (LoRAConfig, apply_lora, full_lora_factors,
                                         merge_lora, save_lora, unmerge_lora)

    model, pg = _expert_model(num_local)
    ep_rank = dist.get_rank(pg.ep)
    experts = model.decoder.layers[0].mlp.experts
    split = splits[ep_rank]
    ads = apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, targets=["experts"]))
    _random_factors(ads)
    out = {"names": [ad.global_name for ad in ads], "experts": {}, "flags": {}}
    for lname in ("linear_fc1", "linear_fc2"):
        layer = getattr(experts, lname)
        group = layer.lora
        n = layer.in_features
        x = _full(f"{lname}.x{ep_rank}", sum(split), n).requires_grad_(True)
        y, bias = layer(x, split)
        G = _full(f"{lname}.G{ep_rank}", *y.shape)
        for ad in group:
            ad.A.grad = ad.B.grad = None
        (y * G).sum().backward()
        for i, (ad, xi, yi, Gi) in enumerate(zip(group, torch.split(x.detach(), split),
                                                 torch.split(y.detach(), split),
                                                 torch.split(G, split))):
            W = getattr(layer, f"weight{i}").detach()
            ref, bound = _reference(xi, W, ad.A, ad.B, Gi), _bounds(xi, W, ad.A, ad.B, Gi)
            out["experts"][ad.global_name] = {
                "rows": int(xi.shape[0]), "y": _ratio(yi, ref["y"], bound["y"]) if
                xi.shape[0] else 0.0,
                "A": _ratio(ad.A.grad, ref["A"], bound["A"]),
                "B": _ratio(ad.B.grad, ref["B"], bound["B"]),
                "zero_grad": bool(ad.A.grad.abs().max() == 0 and ad.B.grad.abs().max() == 0),
                "weight_name": ad.weight_name, "is_expert": ad.is_expert, "gated": ad.gated}
        with torch.no_grad():
            lora_y = layer(x.detach(), split)[0]
            merge_lora(model)
            merged_y = layer(x.detach(), split)[0]
            unmerge_lora(model)
        out["flags"][lname] = float((merged_y - lora_y).abs().max() / lora_y.abs().max())
    factors = full_lora_factors(model)
    save_lora(os.path.join(save, "adapters.pt"), model)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(save, "dist"), exist_ok=True)
    dist.barrier()
    meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    sharded = {}
    for lname in ("linear_fc1", "linear_fc2"):
        prefix = f"decoder.layers.0.mlp.experts.{lname}."
        sharded.update(getattr(experts, lname).sharded_state_dict(prefix, (), meta))
    out["sharded_keys"] = sorted({getattr(v, "key", None) for k, v in sharded.items()
                                  if ".lora." in k})
    dist_checkpointing.save(sharded, os.path.join(save, "dist"))
    out["factors"] = factors
    return out


def grouped_reload_worker(num_local: int, save: str) -> dict:
    """EP1 (one rank, all experts local): the EP2 adapter file and dist checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_muon.peft.lora import LoRAConfig, apply_lora, full_lora_factors, load_lora

    out = {}
    for how in ("file", "dist"):
        model, _ = _expert_model(num_local)
        apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, targets=["experts"]))
        experts = model.decoder.layers[0].mlp.experts
        if how == "file":
            out["loaded"] = load_lora(os.path.join(save, "adapters.pt"), model)
        else:
            meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
            sharded = {}
            for lname in ("linear_fc1", "linear_fc2"):
                prefix = f"decoder.layers.0.mlp.experts.{lname}."
                sharded.update({k: v for k, v in getattr(experts, lname).sharded_state_dict(
                    prefix, (), meta).items() if ".lora." in k})
            state = dist_checkpointing.load(sharded, os.path.join(save, "dist"))
            prefix = "decoder.layers.0.mlp.experts."
            result = experts.load_state_dict(
                {k[len(prefix):]: v for k, v in state.items()}, strict=False)
            out["dist_unexpected"] = list(result.unexpected_keys)
        out[how] = full_lora_factors(model)
    return out


# ============================================================================== tests
@pytest.fixture(scope="module")
def dense():
    return {sp: run_ranks("test_lora_te:dense_worker", 2, dict(sp=sp), timeout=240, env=ENV)
            for sp in (False, True)}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_te_layers_equal_the_dense_reference_at_tp2(dense, sp):
    """TELayerNormColumnParallelLinear (with and without a returned bias, gated fc1),
    TEColumnParallelLinear and TERowParallelLinear with adapters: the forward, the factor
    gradients (gathered over TP) and the branch's input gradient equal the dense float64
    reference ``z (W + gamma B A)^T`` within the derived bound, on both TP ranks."""
    for rank_result in dense[sp]:
        assert len(rank_result["layers"]) == 6
        for name, r in rank_result["layers"].items():
            for key in ("y", "A", "B", "x"):
                if key in r:
                    assert r[key] <= 1.0, (name, key, r[key])
            assert r["branch_max"] > 1e6, name  # the branch is far above the tolerance
        fused = rank_result["layers"]["decoder.layers.0.mlp.linear_fc1"]
        assert fused["bias_returned"] and fused["return_layernorm_output"] is True
        assert not rank_result["layers"]["decoder.layers.0.self_attention.linear_qkv"][
            "bias_returned"]
        assert rank_result["disabled_equal"] and rank_result["merged"] == 6
        for name, rel in rank_result["merged_vs_lora"].items():
            # merge adds gamma B A formed in fp32 (LoRAAdapter.local_delta): fp32 rounding
            assert rel < 1e-6 and rank_result["lora_vs_base"][name] > 1e-2, name
        assert all(".lora." in k for k in rank_result["trainable"])
        assert len(rank_result["trainable"]) == 12


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_fused_layernorm_branch_sees_the_normalised_input(dense, sp):
    """The control for the fused layernorm-linear: the dense reference fed the raw
    (pre-layernorm) input is off by >1e6 derived bounds, so a branch that multiplied the
    raw input would fail the equality above."""
    for rank_result in dense[sp]:
        assert set(rank_result["wrong_input"]) == {"decoder.layers.0.self_attention.linear_qkv",
                                                   "decoder.layers.0.mlp.linear_fc1"}
        for name, ratio in rank_result["wrong_input"].items():
            assert ratio > 1e6, (name, ratio)
            assert rank_result["layers"][name]["y"] <= 1.0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_te_tp_attributes_follow_the_local_layers(dense):
    """Column: B sharded on rows, A replicated; row: A sharded on columns, B replicated;
    with sequence parallelism the replicated factor's gradient is a partial sum."""
    for sp, results in dense.items():
        for name, a in results[0]["attrs"].items():
            column = name.endswith(("linear_qkv", "linear_fc1"))
            sharded, replicated = ("B", "A") if column else ("A", "B")
            assert a[sharded][:2] == (True, 0 if column else 1), (name, a)
            assert not a[replicated][0]
            assert a[replicated][2] == sp and not a[sharded][2], (name, sp)


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("lora_te_grouped"))
    ep2 = run_ranks("test_lora_te:grouped_worker", 2,
                    dict(num_local=3, splits=[[3, 0, 5], [2, 4, 1]], save=save), timeout=240,
                    env=ENV)
    ep1 = run_ranks("test_lora_te:grouped_reload_worker", 1, dict(num_local=6, save=save),
                    timeout=240, env=ENV)[0]
    return ep2, ep1


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_te_grouped_experts_each_get_their_own_adapter(grouped):
    """TEColumnParallelGroupedLinear / TERowParallelGroupedLinear at EP2: one adapter per
    weight<i>, applied to that expert's rows only (an expert without tokens included), equal
    to each expert's dense reference; SequentialMLP's global names; merge exact."""
    ep2, _ = grouped
    for ep_rank, r in enumerate(ep2):
        assert r["names"] == [f"decoder.layers.0.mlp.experts.local_experts.{3 * ep_rank + i}."
                              f"{fc}" for fc in ("linear_fc1", "linear_fc2") for i in range(3)]
        for name, e in r["experts"].items():
            assert e["y"] <= 1.0 and e["A"] <= 1.0 and e["B"] <= 1.0, (name, e)
            assert e["zero_grad"] == (e["rows"] == 0), name
            assert e["is_expert"] and e["gated"] == name.endswith("fc1")
        assert [e["weight_name"] for e in r["experts"].values()] == \
            [f"weight{i}" for i in range(3)] * 2
        for lname, rel in r["flags"].items():
            assert rel < 1e-6, lname  # merged weight<i> == adapter output (fp32 delta)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_te_grouped_adapters_reload_at_another_expert_layout(grouped):
    """An EP2 adapter file and an EP2 dist checkpoint of the grouped adapters (keys
    ``...experts.linear_fc1.lora.A`` with the global expert axis, as SequentialMLP's) load
    into an EP1 model holding all six experts, factor for factor."""
    ep2, ep1 = grouped
    saved = {}
    for r in ep2:
        saved.update(r["factors"])
    assert len(saved) == 12 and ep1["loaded"] == 12 and not ep1["dist_unexpected"]
    assert ep2[0]["sharded_keys"] == [f"decoder.layers.0.mlp.experts.{fc}.lora.{f}"
                                      for fc in ("linear_fc1", "linear_fc2") for f in "AB"]
    for how in ("file", "dist"):
        assert set(ep1[how]) == set(saved), how
        for k, (A, B) in saved.items():
            assert torch.equal(ep1[how][k][0], A) and torch.equal(ep1[how][k][1], B), (how, k)


def _refused(model, targets) -> str:
    from megatron_muon.peft.lora import apply_lora

    with pytest.raises(ValueError) as err:
        apply_lora(model, rank=2, alpha=2.0, targets=targets)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.timeout(60)
def test_other_te_layers_and_unsupported_configurations_are_refused_in_one_line():
    cfg = _Config()
    ok = TELayerNormColumnParallelLinear(cfg, HIDDEN, 32, "ok", None)
    model = _model(_tree(self_attention=_tree(linear_qkv=ok, linear_proj=TELinear(cfg, 16, 16))))
    x = _full("x", 4, HIDDEN)
    before = ok(x)[0].clone()
    msg = _refused(model, ["qkv", "proj"])
    assert "TELinear" in msg and "Transformer Engine layer LoRA does not adapt" in msg
    # the error left the model as it was: the layer that matched first has no adapter
    assert not hasattr(ok, "lora") and ok.return_layernorm_output is False
    assert torch.equal(ok(x)[0], before)

    fused = _model(_tree(mlp=TEFusedMLP(cfg)))
    assert "op fuser" in _refused(fused, ["fc1"]) and "TEFusedMLP" in _refused(fused, ["fc1"])
    shared = type("FusedSharedExpertMLP", (torch.nn.Module,), {})()
    shared.linear_fc1 = TEColumnParallelLinear(cfg, HIDDEN, 32, "shared", None)
    assert "FusedSharedExpertMLP" in _refused(_model(_tree(mlp=_tree(shared_experts=shared))),
                                              ["fc1"])
    grouped_fused = _tree(linear_fc2=TERowParallelLinear(cfg, 32, HIDDEN, "gf", None))
    grouped_fused._with_fused_impl = True  # TEGroupedMLP with use_transformer_engine_op_fuser
    assert "fused ops" in _refused(_model(_tree(mlp=_tree(experts=grouped_fused))),
                                   ["experts"])

    class Tapped(TELayerNormColumnParallelLinear):
        pass

    tapped = Tapped(cfg, HIDDEN, 32, "tapped", None)
    tapped.return_layernorm_output = True
    assert "already returns its layernorm output" in _refused(
        _model(_tree(mlp=_tree(linear_fc1=tapped))), ["fc1"])

    stacked = TEColumnParallelGroupedLinear.__new__(TEColumnParallelGroupedLinear)
    torch.nn.Module.__init__(stacked)
    stacked.config, stacked.num_gemms = cfg, 2
    stacked.weight = torch.nn.Parameter(torch.zeros(2, 8, HIDDEN, dtype=DT))
    msg = _refused(_model(_tree(mlp=_tree(experts=_tree(linear_fc1=stacked)))), ["experts"])
    assert "moe_single_grouped_weight" in msg and "TEColumnParallelGroupedLinear" in msg

    attention = _tree(core_attention=type("TEDotProductAttention", (torch.nn.Module,), {})())
    msg = _refused(_model(_tree(self_attention=attention)), ["core_attention"])
    assert "TEDotProductAttention" in msg and "does not adapt" in msg


@pytest.mark.timeout(60)
def test_te_signatures_match_the_installed_megatron_source():
    """The TE wrapper methods LoRA replaces (hooks.TE_SIGNATURES, checked at run time like
    hooks.SIGNATURES) have the expected parameters in the installed megatron-core, read from
    its source (the classes themselves need transformer_engine), and every class LoRA knows
    by name still exists there."""
    import ast
    import importlib.util

    from megatron_muon.megatron.hooks import TE_SIGNATURES
    from megatron_muon.peft.lora import TE_LAYERS

    spec = importlib.util.find_spec("megatron.core.extensions.transformer_engine")
    tree = ast.parse(open(spec.origin).read())
    methods = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef):
                    a = fn.args
                    names = [x.arg for x in (*a.posonlyargs, *a.args)]
                    names += [a.vararg.arg] if a.vararg else []
                    names += [x.arg for x in a.kwonlyargs] + ([a.kwarg.arg] if a.kwarg else [])
                    methods[(node.name, fn.name)] = tuple(names)
    classes = {c for c, _ in methods}
    assert set(TE_LAYERS) <= classes
    checked = 0
    for qual, versions in TE_SIGNATURES.items():
        cls, name = qual.rsplit(".", 2)[-2:]
        if cls == "TELMHeadColumnParallelLinear" and cls not in classes:
            continue  # megatron-core >= 0.19 only
        assert methods[(cls, name)] == versions["*"], qual
        checked += 1
    assert checked >= 8


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
