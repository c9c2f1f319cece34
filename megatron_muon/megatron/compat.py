"""Everything that differs between Megatron-Core 0.16.x and 0.19.x lives here."""

from __future__ import annotations

import contextlib
import inspect
from contextlib import contextmanager
from typing import Callable

import torch
from packaging.version import Version

import megatron.core
import megatron.core.optimizer as mcore_optimizer

__all__ = ["MCORE_VERSION", "device", "ns_function", "get_param_groups",
           "build_distributed_optimizer", "check_supported", "prepare_torch_adam_for_load",
           "load_optimizer_state", "DDP_TAKES_PARAM_LAYOUT", "ddp_buffer_class",
           "relayout_buffer", "initialize_island_model_parallel", "unshare_adam_steps"]

MCORE_VERSION = Version(getattr(megatron.core, "__version__", "0.0.0"))


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def ns_method(cfg) -> str:
    """``muon_ns_method`` resolved: 'auto' is the tuner's choice when there is a tuner
    (``dmuon_plan_cost='tuner'``), else 'standard' (bitwise the reference Muon's NS)."""
    method = getattr(cfg, "muon_ns_method", "auto")
    if method == "auto" and getattr(cfg, "dmuon_plan_cost", "flops") != "tuner":
        return "standard"
    return method


def ns_function(cfg) -> Callable:
    """The batched NS implementation DMuon's owners call (kernels when available).

    ``muon_ns_method``: 'standard' / 'gram' fix the algorithm (the tuner, if any, then picks
    among that method's backends); 'auto' with the tuner lets it choose between them.
    ``muon_fp32_matmul_prec='high'`` runs fp32 NS with TF32 matmuls on CUDA.

    ``fn.matmul_context(device)``: the context every NS matmul of the run needs (TF32 or
    nothing), which split units (``split_ns``) enter as well.

    ``fn.in_workspace``: where the call is the plain torch standard NS (no tuner, not
    Triton, not Gram), the same NS computed in a caller's workspace
    (``newton_schulz_in_workspace``, bitwise the same result); else None.  The owners then
    run every batch in one bounded workspace (docs/memory.md).
    """
    from megatron_muon.core.newton_schulz import newton_schulz, newton_schulz_in_workspace

    backend = getattr(cfg, "dmuon_ns_backend", "auto")
    method = ns_method(cfg)
    fixed = "gram" if method == "gram" else "standard"  # 'auto': the tuner may pick Gram
    tf32 = getattr(cfg, "muon_fp32_matmul_prec", "highest") == "high"
    try:
        from megatron_muon.kernels import batched_newton_schulz
    except ImportError:
        if backend == "triton":
            raise ValueError("dmuon_ns_backend='triton' needs megatron_muon.kernels and triton")
        batched_newton_schulz = None
    tuner = None
    if batched_newton_schulz is not None and backend == "auto" and \
            getattr(cfg, "dmuon_plan_cost", "flops") == "tuner":
        from megatron_muon.kernels.tuner import default_candidates

        candidates = None
        if method != "auto":  # keep the tuner to the chosen method's backends
            gram = method == "gram"
            candidates = [n for n in default_candidates(device())
                          if n.startswith("torch_gram") == gram]
        tuner = ns_tuner(cfg, candidates)

    def fn(x, steps, coefficients, eps, dtype):
        with _tf32_matmuls(x.device) if tf32 else contextlib.nullcontext():
            if batched_newton_schulz is None or (backend == "torch" and tuner is None):
                return newton_schulz(x, steps=steps, coefficients=coefficients, eps=eps,
                                     dtype=dtype, method=fixed)
            return batched_newton_schulz(x, steps=steps, coefficients=coefficients, eps=eps,
                                         dtype=dtype, backend=backend, tuner=tuner, method=fixed)

    def in_workspace(x, workspace, steps, coefficients, eps, dtype):
        with _tf32_matmuls(x.device) if tf32 else contextlib.nullcontext():
            return newton_schulz_in_workspace(x, workspace, steps=steps,
                                              coefficients=coefficients, eps=eps, dtype=dtype)

    # fn's torch path ('auto' without a tuner is batched_newton_schulz's torch_batched)
    plain = fixed == "standard" and tuner is None and backend != "triton"
    fn.in_workspace = in_workspace if plain else None
    # the same matmul precision for the units split across ranks (split_ns.SplitNS.run)
    fn.matmul_context = _tf32_matmuls if tf32 else (lambda device: contextlib.nullcontext())
    return fn


def ns_tuner(cfg, candidates=None):
    """The run's NS auto-tuner (the owners' kernel choice and, with
    ``dmuon_plan_cost='tuner'``, the planner's costs): it validates and times the candidates
    on the run's NS problem (``muon_num_ns_steps``, ``muon_coefficient_type``), not on the
    tuner's defaults (5 steps of 'simple'), which another step count or coefficient set would
    make a different problem with other timings and other failures."""
    from megatron_muon.kernels import NSTuner

    return NSTuner(cache_path=cfg.dmuon_tuner_cache, candidates=candidates,
                   steps=cfg.muon_num_ns_steps, coefficients=cfg.muon_coefficient_type)


def _tf32_matmuls_on(device_type: str, flags=None) -> Callable[[], None]:
    """Turn TF32 on for fp32 matmuls of ``device_type`` ('cuda'; nothing elsewhere) and
    return the function that restores the previous setting exactly.

    ``flags``: the matmul backend flags (``torch.backends.cuda.matmul``).  torch >= 2.9 has
    ``fp32_precision`` ('ieee', 'tf32' or 'none': inherit) and raises when it and the legacy
    ``allow_tf32`` are mixed, so where it exists only it is read and written; restoring it
    leaves a user's own setting as it was.  Older torch: ``allow_tf32``.
    """
    if device_type != "cuda":
        return lambda: None
    flags = torch.backends.cuda.matmul if flags is None else flags
    name, value = ("fp32_precision", "tf32") if hasattr(flags, "fp32_precision") \
        else ("allow_tf32", True)
    saved = getattr(flags, name)
    setattr(flags, name, value)
    return lambda: setattr(flags, name, saved)


@contextmanager
def _tf32_matmuls(device):
    """fp32 matmuls on TF32 tensor cores inside the block (CUDA; nothing elsewhere)."""
    restore = _tf32_matmuls_on(torch.device(device).type)
    try:
        yield
    finally:
        restore()


def get_param_groups(model_chunks, config, config_overrides=None):
    """Megatron's own parameter groups (lr/wd multipliers, no-decay for biases and norms)."""
    if config_overrides is None and hasattr(mcore_optimizer, "get_standard_config_overrides"):
        config_overrides = mcore_optimizer.get_standard_config_overrides(config)
    return mcore_optimizer._get_param_groups(model_chunks, config, config_overrides)


def _inner_adam(config, model_chunks, param_groups) -> tuple:
    """``(torch optimizer, init_state_fn)`` exactly as Megatron picks them for ``'adam'``.

    0.19 exposes this step (``skip_megatron_wrapping=True``); on 0.16 the same lines of its
    ``_get_megatron_optimizer_based_on_param_groups`` (Adam from TE / apex / torch, the
    precision-aware options, the state initialiser) are repeated here.
    """
    if config.optimizer != "adam":
        raise ValueError(f"internal: the inner optimizer is Adam, not {config.optimizer!r}")
    if getattr(config, "optimizer_cpu_offload", False):
        raise ValueError("optimizer='dmuon' does not support optimizer_cpu_offload; turn it off")
    build = mcore_optimizer._get_megatron_optimizer_based_on_param_groups
    if "skip_megatron_wrapping" in inspect.signature(build).parameters:
        return build(config=config, model_chunks=model_chunks, param_groups=param_groups,
                     skip_megatron_wrapping=True)
    if not param_groups:
        return None, None
    kwargs = dict(params=param_groups, lr=config.lr, weight_decay=config.weight_decay,
                  betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    if mcore_optimizer.USING_PYTORCH_OPTIMIZER:
        adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
    else:
        kwargs["adam_w_mode"] = config.decoupled_weight_decay
        adam_cls = mcore_optimizer.Adam
    if config.use_precision_aware_optimizer:
        kwargs.update(exp_avg_dtype=config.exp_avg_dtype, exp_avg_sq_dtype=config.exp_avg_sq_dtype)
        if config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            kwargs.update(master_weights=True, use_decoupled_grad=True,
                          master_weight_dtype=config.main_params_dtype)
        from megatron.core.utils import is_te_min_version

        if is_te_min_version("2.1.0.dev0"):
            kwargs["store_param_remainders"] = config.store_param_remainders
    optimizer = adam_cls(**kwargs)

    def init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    if config is None or not config.use_precision_aware_optimizer:
                        opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
                    else:
                        opt.initialize_state(p)

    return optimizer, init_state_fn


def _grad_scaler(config):
    """Megatron's choice: a constant scaler for ``loss_scale``, a dynamic one for fp16."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(initial_scale=config.initial_loss_scale,
                                 min_scale=config.min_loss_scale, growth_factor=2.0,
                                 backoff_factor=0.5, growth_interval=config.loss_scale_window,
                                 hysteresis=config.hysteresis)
    return None


def build_distributed_optimizer(config, model_chunks, param_groups, cls, groups,
                                expert: bool = False, cls_kwargs=None):
    """Build ``cls`` (a DistributedOptimizer subclass) over ``param_groups`` as Megatron would.

    The same steps as Megatron's ``_get_megatron_optimizer_based_on_param_groups`` for a
    distributed optimizer -- the inner Adam (``_inner_adam``), the grad scaler, the buffers
    and process groups, ``grad_stats_parallel_group`` and ``tp_group`` -- with ``cls``
    constructed here directly (no Megatron attribute is replaced). ``groups`` is the
    factory's ``DMuonGroups`` (its ``optimizer`` dict: Megatron's
    ``setup_process_groups_for_optimizer``); ``cls_kwargs`` go to ``cls``.
    """
    pg = groups.optimizer
    dp_cp, intra = pg["dp_cp_group"], pg["intra_dp_cp_group"]
    if dp_cp.size() > intra.size():
        raise ValueError("optimizer='dmuon' does not support num_distributed_optimizer_instances > 1")
    attr = "expert_parallel_buffers" if expert else "buffers"
    buffers = {i: getattr(c, attr) for i, c in enumerate(model_chunks) if getattr(c, attr, None)}
    if expert:
        mp, dp = pg["expt_tp_pp_group"], pg["intra_expt_dp_group"]
        dp_gloo = pg.get("intra_expt_dp_group_gloo")
    else:
        mp, dp, dp_gloo = pg["mp_group"], intra, pg.get("intra_dp_cp_group_gloo")
    inner, init_state_fn = _inner_adam(config, model_chunks, param_groups)
    opt = cls(inner, config, _grad_scaler(config), init_state_fn, model_chunks=model_chunks,
              per_model_buffers=buffers, data_parallel_group=dp, data_parallel_group_gloo=dp_gloo,
              data_parallel_group_idx=mp.rank(), distributed_optimizer_instance_id=0,
              **(cls_kwargs or {}))
    opt.grad_stats_parallel_group = pg["intra_dist_opt_group"]
    opt.tp_group = groups.tp
    if MCORE_VERSION >= Version("0.19"):
        opt.expert_tp_group = groups.expt_tp if groups.expt_tp is not None else groups.tp
    return opt


def check_supported(config, model_chunks, groups) -> None:
    """Clear errors for layouts DMuon does not handle (instead of a hang or a wrong result);
    ``groups``: the factory's ``DMuonGroups``.  The config's own settings are checked again
    (``config.check_muon_setup``: a field set after construction, e.g.
    ``use_precision_aware_optimizer``), then what only the model and the groups show."""
    from megatron_muon.megatron.config import check_muon_setup

    if not getattr(config, "use_distributed_optimizer", False):
        raise ValueError(f"optimizer={config.optimizer!r} needs use_distributed_optimizer=True")
    check_muon_setup(lambda name: getattr(config, name, None), cli=False)
    try:
        from torch.distributed.fsdp import FSDPModule  # torch's fully_shard (FSDP2)
    except ImportError:
        FSDPModule = ()
    for chunk in model_chunks:
        ddp = getattr(chunk, "ddp_config", None)
        # FSDP first: Megatron's FSDP wrappers carry a ddp_config too, without the optimizer
        if getattr(ddp, "use_megatron_fsdp", False) or getattr(ddp, "use_custom_fsdp", False):
            raise ValueError(f"optimizer={config.optimizer!r} does not run on Megatron-FSDP yet; "
                             "use the distributed optimizer (ZeRO-1) with Megatron DDP")
        if isinstance(chunk, FSDPModule) or type(chunk).__name__ in (
                "TorchFullyShardedDataParallel", "FullyShardedDataParallel", "FSDPModule"):
            raise ValueError(f"optimizer={config.optimizer!r} does not support torch FSDP2; "
                             "wrap the model in Megatron DDP with use_distributed_optimizer=True")
        if ddp is None:
            raise ValueError(f"optimizer={config.optimizer!r} needs model chunks wrapped in "
                             "megatron.core.distributed.DistributedDataParallel")
        if not ddp.use_distributed_optimizer:
            raise ValueError("DistributedDataParallelConfig.use_distributed_optimizer must be True "
                             f"for optimizer={config.optimizer!r}")
    if groups.cp_size > 1:
        raise ValueError(f"optimizer={config.optimizer!r} does not support context parallelism "
                         f"yet (context parallel size {groups.cp_size}); use 1")
    mcfg = getattr(model_chunks[0], "config", None)
    etp, tp = (getattr(mcfg, k, None) or 1 for k in ("expert_tensor_parallel_size",
                                                     "tensor_model_parallel_size"))
    if etp != tp and any(".experts." in name and getattr(p, "allreduce", True)
                         for c in model_chunks for name, p in c.named_parameters()):
        raise ValueError(f"optimizer={config.optimizer!r}: this Megatron-Core keeps MoE experts "
                         f"sharded by expert TP {etp} in the dense buffers (expert parallel size "
                         f"1), reducing their gradients over the dense data-parallel group of TP "
                         f"{tp}; use expert_model_parallel_size > 1 or "
                         f"expert_tensor_parallel_size={tp} (megatron-core >= 0.19 gives them "
                         "expert groups)")
    experts = any(getattr(c, "expert_parallel_buffers", None) for c in model_chunks)
    if experts and groups.expt_tp_size > 1 and \
            getattr(config, "dmuon_tp_mode", "exact") == "blockwise":
        raise ValueError(f"optimizer={config.optimizer!r}: dmuon_tp_mode='blockwise' treats "
                         "dense TP shards only; with expert tensor parallel size "
                         f"{groups.expt_tp_size} use dmuon_tp_mode='exact' (Megatron-LM: "
                         "--muon-tp-mode duplicated) or expert_tensor_parallel_size=1")
    if getattr(config, "dmuon_ns_backend", "auto") == "triton":
        _check_triton_usable(config, model_chunks)


def _check_triton_usable(config, model_chunks) -> None:
    """The Triton NS backend (``dmuon_ns_backend='triton'``, or Megatron's
    ``--muon-use-syrk`` mapped onto it) refused at setup where it cannot run, instead of at
    the first step."""
    from megatron_muon.kernels.backends import triton_usable  # torch only; triton lazily

    device = next((p.device for c in model_chunks for p in c.parameters()), None)
    if device is not None and not triton_usable(device):
        what = "muon_use_syrk=True (Megatron-LM: --muon-use-syrk)" if \
            getattr(config, "muon_use_syrk", False) else "dmuon_ns_backend='triton'"
        raise ValueError(f"optimizer={config.optimizer!r} with {what} runs dmuon's Triton "
                         f"Newton-Schulz kernels, which need triton and CUDA parameters "
                         f"(these are on {device}); drop it")


def _torch_adam_distributed(sub) -> bool:
    """Megatron's own DistributedOptimizer over torch's Adam/AdamW (neither Apex nor TE)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return (type(sub) is DistributedOptimizer and not sub.is_stub_optimizer
            and isinstance(getattr(sub, "optimizer", None), torch.optim.Adam))


@torch.no_grad()
def prepare_torch_adam_for_load(optimizer) -> None:
    """Give torch-Adam states a 'step' before Megatron builds a loading state dict.

    Megatron's ``DistributedOptimizer.state_dict()`` on the torch-Adam path (neither Apex nor
    Transformer Engine installed, e.g. CPU) reads 'step' from per-parameter Adam state, which
    exists only after a first step, so ``sharded_state_dict(is_loading=True)`` on a freshly
    built optimizer fails an assertion.  Zero states with step 0 stand in; the load then
    overwrites all of them.  This package's own optimizers handle it themselves.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not _torch_adam_distributed(sub):
            continue
        inner = sub.optimizer
        if sub.init_state_fn is not None:
            sub.init_state_fn(inner, sub.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))


_PARAM_STATE_LOADERS = {"fully_reshardable": "load_parameter_state_from_fully_reshardable",
                        "dp_reshardable": "load_parameter_state_from_dp_reshardable",
                        "fully_sharded_model_space": "load_parameter_state_from_fs_model_space"}


def unshare_adam_steps(torch_optimizer) -> None:
    """Give every parameter's Adam state a 'step' tensor of its own.  Megatron's torch-Adam
    load path hands them all one shared tensor, which torch's AdamW would then advance once
    per parameter in every step."""
    for st in torch_optimizer.state.values():
        if torch.is_tensor(st.get("step")):
            st["step"] = st["step"].clone()


@torch.no_grad()
def load_optimizer_state(optimizer, state_dict) -> None:
    """``optimizer.load_state_dict(state_dict)``, also on Megatron's torch-Adam path.

    There, ``DistributedOptimizer.load_state_dict`` first puts the checkpoint's 'step' into
    every per-parameter Adam state and then copies the saved tensors into *every* state key,
    'step' included, which the saved parameter state does not have (KeyError: 'step').  For
    such optimizers the parameter state is loaded with the step tensors set aside, and
    each parameter gets a step tensor of its own (``unshare_adam_steps``).
    """
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if not any(_torch_adam_distributed(s) for s in subs):
        optimizer.load_state_dict(state_dict)
        return
    if len(subs) == 1:
        states = [state_dict]
    elif isinstance(state_dict, dict):
        states = [v for _, v in sorted(state_dict.items())]
    else:
        states = list(state_dict)
    if len(states) != len(subs):
        raise RuntimeError(f"optimizer checkpoint has {len(states)} optimizers, this run "
                           f"{len(subs)}")
    for sub, sd in zip(subs, states):
        if not _torch_adam_distributed(sub) or "param_state" not in sd:
            sub.load_state_dict(sd)
            continue
        sd = dict(sd)
        param_state, kind = sd.pop("param_state"), sd.pop("param_state_sharding_type", None)
        if kind not in _PARAM_STATE_LOADERS:
            raise ValueError(f"optimizer checkpoint: unknown parameter-state format {kind!r}")
        sub.load_state_dict(sd)  # groups, step, grad scaler; allocates the state tensors
        steps = {p: st.pop("step") for p, st in sub.optimizer.state.items() if "step" in st}
        try:
            getattr(sub, _PARAM_STATE_LOADERS[kind])(param_state)
        finally:
            for p, step in steps.items():
                sub.optimizer.state[p]["step"] = step
            unshare_adam_steps(sub.optimizer)
    if len(subs) > 1:
        optimizer._synchronize_steps()


# -- DDP buffer layout (matrix placement) -----------------------------------------------------
def _ddp_takes_param_layout() -> bool:
    from megatron.core.distributed import DistributedDataParallel

    import inspect

    return "full_param_layout" in inspect.signature(DistributedDataParallel.__init__).parameters


DDP_TAKES_PARAM_LAYOUT = _ddp_takes_param_layout()  # megatron-core >= 0.19


@contextmanager
def ddp_buffer_class(make_subclass: Callable):
    """DDP models built inside the block get ``make_subclass(_ParamAndGradBuffer)`` buffers.

    The seam for code that lays DDP buffers out differently on megatron-core 0.16, whose DDP
    computes every buffer's layout inline (0.19 takes a ``full_param_layout`` instead: see
    ``matrix_placement.MatrixPlacement.ddp``); also used by ``matrix_placement``'s
    context-manager form, for DDP models built by code out of our reach.
    """
    from megatron.core.distributed import distributed_data_parallel as ddp_mod

    base = ddp_mod._ParamAndGradBuffer
    ddp_mod._ParamAndGradBuffer = make_subclass(base)
    try:
        yield
    finally:
        ddp_mod._ParamAndGradBuffer = base


def relayout_buffer(buf, param_index_map: dict, bucket_indices: list,
                    per_bucket_numel_unpadded: list) -> None:
    """megatron-core 0.16: re-map an already built ``_ParamAndGradBuffer`` onto a layout."""
    from megatron.core.distributed.param_and_grad_buffer import BufferType

    buf.param_index_map = param_index_map
    buf.bucket_indices = bucket_indices
    buf.numel = bucket_indices[-1][1]
    buf.numel_unpadded = sum(per_bucket_numel_unpadded)
    dev = buf.grad_data.device
    if buf.param_data is not None:
        buf.param_data = torch.zeros(buf.numel, dtype=buf.param_dtype, device=dev)
    buf.grad_data = torch.zeros(buf.numel, dtype=buf.grad_dtype, device=dev)
    for p in buf.params:
        start = param_index_map[p][0]
        if buf.param_data is not None:
            new = buf._get(p.data.shape, start, buffer_type=BufferType.PARAM)
            new.copy_(p.data)
            p.data = new
        p.main_grad = buf._get(p.data.shape, start, buffer_type=BufferType.GRAD)
    buf.buckets, buf.param_to_bucket = [], {}
    for bid, (s, e) in enumerate(bucket_indices):
        members = [p for p in buf.params[::-1] if param_index_map[p][2] == bid]
        buf.buckets.append(buf._new_bucket(bucket_params=members, start_index=s, end_index=e,
                                           numel_unpadded=per_bucket_numel_unpadded[bid],
                                           bucket_id=bid))


# -- Rebinding Megatron globals ---------------------------------------------------------------
# The CPU test bed's shims and a few test fixtures rebind Megatron module globals or class
# attributes.  They do it only through these functions (``tests/test_hooks.py`` checks
# that nothing else in the package assigns attributes of Megatron modules or classes);
# methods of Megatron *objects* are hooked through ``megatron_muon.megatron.hooks``.
def set_megatron_attr(owner, name: str, value) -> None:
    """``owner.name = value`` for a Megatron module or class."""
    setattr(owner, name, value)


@contextmanager
def megatron_attr(owner, name: str, value):
    """``owner.name`` is ``value`` inside the block (a Megatron module or class)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def replace_everywhere(prefix: str, original, replacement) -> None:
    """Point every attribute of the loaded ``prefix.*`` modules that is ``original`` at
    ``replacement`` (``from x import f`` copies the name into the importing module)."""
    import sys

    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


# ----------------------------------------------------------------------------- islands
@contextmanager
def _island_groups(num_islands: int, island_size: int, island: int):
    """While active, every group Megatron's ``parallel_state`` creates is made K times.

    Megatron asks ``create_group`` for a group over ranks of *this* island (global ranks,
    the island's offset applied); ``torch.distributed.new_group`` must be entered by every
    rank of the world in the same order, and the islands ask for different rank sets at
    the same moment. The wrapper therefore creates the group over the same island-local
    ranks in every island ``j`` (``+ j S``), in island order, and hands Megatron the copy
    of its own island. ``parallel_state.create_group`` is the one function through which
    ``initialize_model_parallel`` creates groups (0.16.1 and 0.19.2).

    On megatron-core < 0.19 ``initialize_model_parallel`` has no ``rank_offset`` /
    ``local_world_size``: it sizes the layout from ``torch.distributed.get_world_size()``
    and builds ranks with ``RankGenerator(rank_offset=0)``. There, while active, the
    default world size reads ``S`` and ``RankGenerator`` gets the island's offset (the
    parameter exists in 0.16). ``torch.distributed.get_rank`` is left alone: the ranks
    Megatron compares it with are global already.
    """
    from megatron.core import parallel_state as ps

    offset = island * island_size
    real_create = ps.create_group
    native = "rank_offset" in inspect.signature(ps.initialize_model_parallel).parameters

    def create_group(ranks=None, *args, **kwargs):
        if ranks is None:
            raise RuntimeError("initialize_islands: Megatron asked for a group without ranks")
        local = [int(r) - offset for r in ranks]
        if any(r < 0 or r >= island_size for r in local):
            raise RuntimeError(f"initialize_islands: group ranks {list(ranks)} are outside "
                               f"island {island} (ranks {offset}..{offset + island_size - 1})")
        mine = None
        for j in range(num_islands):
            group = real_create([r + j * island_size for r in local], *args, **kwargs)
            if j == island:
                mine = group
        return mine

    saved = {"create_group": (ps, real_create)}
    ps.create_group = create_group
    if not native:
        import torch.distributed as dist

        real_ws, real_gen = dist.get_world_size, ps.RankGenerator

        def world_size(group=None):
            return island_size if group is None else real_ws(group)

        class IslandRankGenerator(real_gen):
            def __init__(self, *args, **kwargs):
                kwargs["rank_offset"] = offset
                super().__init__(*args, **kwargs)

        dist.get_world_size, ps.RankGenerator = world_size, IslandRankGenerator
        saved.update(get_world_size=(dist, real_ws), RankGenerator=(ps, real_gen))
    try:
        yield {} if not native else dict(rank_offset=offset, local_world_size=island_size)
    finally:
        for name, (owner, value) in saved.items():
            setattr(owner, name, value)


def initialize_island_model_parallel(num_islands: int, island_size: int, island: int,
                                     **kwargs) -> None:
    """``parallel_state.initialize_model_parallel`` for island ``island`` of ``num_islands``
    contiguous blocks of ``island_size`` ranks: every group it creates is island-local.

    Megatron-Core's model building (GPTModel, its layers, DDP and the pipeline schedules on
    0.16) reads ``parallel_state``, so an island needs its ``parallel_state`` to *be* the
    island's; 0.19 also takes ``pg_collection`` in most places, which
    ``megatron_muon.islands.runtime`` builds from the same groups.
    """
    from megatron.core import parallel_state as ps

    with _island_groups(num_islands, island_size, island) as extra:
        ps.initialize_model_parallel(**kwargs, **extra)
