"""Everything that differs between Megatron-Core 0.16.x and 0.19.x lives here."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional

import torch
from packaging.version import Version

import megatron.core
import megatron.core.optimizer as mcore_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection

__all__ = ["MCORE_VERSION", "device", "ns_function", "get_param_groups",
           "build_distributed_optimizer", "check_supported", "prepare_torch_adam_for_load",
           "load_optimizer_state", "DDP_TAKES_PARAM_LAYOUT", "ddp_buffer_class",
           "relayout_buffer"]

MCORE_VERSION = Version(getattr(megatron.core, "__version__", "0.0.0"))


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def ns_function(cfg) -> Callable:
    """The batched NS implementation DMuon's owners call (kernels when available)."""
    from ..newton_schulz import newton_schulz

    backend = getattr(cfg, "dmuon_ns_backend", "auto")
    try:
        from ..kernels import batched_newton_schulz
    except ImportError:
        if backend == "triton":
            raise ValueError("dmuon_ns_backend='triton' needs megatron_muon.kernels and triton")
        return newton_schulz
    if backend == "torch":
        return newton_schulz
    tuner = None
    if backend == "auto" and getattr(cfg, "dmuon_plan_cost", "flops") == "tuner":
        from ..kernels import NSTuner

        tuner = NSTuner(cache_path=cfg.dmuon_tuner_cache)

    def fn(x, steps, coefficients, eps, dtype):
        return batched_newton_schulz(x, steps=steps, coefficients=coefficients, eps=eps,
                                     dtype=dtype, backend=backend if backend != "torch" else "torch",
                                     tuner=tuner)

    return fn


def get_param_groups(model_chunks, config, config_overrides=None):
    """Megatron's own parameter groups (lr/wd multipliers, no-decay for biases and norms)."""
    if config_overrides is None and hasattr(mcore_optimizer, "get_standard_config_overrides"):
        config_overrides = mcore_optimizer.get_standard_config_overrides(config)
    return mcore_optimizer._get_param_groups(model_chunks, config, config_overrides)


@contextmanager
def _distributed_optimizer_class(cls):
    """Let Megatron's own construction code build ``cls`` instead of DistributedOptimizer."""
    saved = mcore_optimizer.DistributedOptimizer
    mcore_optimizer.DistributedOptimizer = cls
    try:
        yield
    finally:
        mcore_optimizer.DistributedOptimizer = saved


def build_distributed_optimizer(config, model_chunks, param_groups, cls, use_gloo: bool = True,
                                pg_collection: Optional[ProcessGroupCollection] = None,
                                expert: bool = False):
    """Build a DistributedOptimizer subclass over ``param_groups`` exactly as Megatron would.

    Megatron's ``_get_megatron_optimizer_based_on_param_groups`` picks the Adam
    implementation (TE / apex / torch), the grad scaler and the process groups; we only
    substitute the class.
    """
    groups = ProcessGroupCollection.setup_process_groups_for_optimizer(
        pg_collection, model_chunks, use_gloo)
    dp_cp, intra = groups["dp_cp_group"], groups["intra_dp_cp_group"]
    if dp_cp.size() > intra.size():
        raise ValueError("optimizer='dmuon' does not support num_distributed_optimizer_instances > 1")
    attr = "expert_parallel_buffers" if expert else "buffers"
    buffers = {i: getattr(c, attr) for i, c in enumerate(model_chunks) if getattr(c, attr, None)}
    if expert:
        mp, dp = groups["expt_tp_pp_group"], groups["intra_expt_dp_group"]
        dp_gloo = groups["intra_expt_dp_group_gloo"] if use_gloo else None
    else:
        mp, dp, dp_gloo = groups["mp_group"], intra, groups["intra_dp_cp_group_gloo"]
    with _distributed_optimizer_class(cls):
        return mcore_optimizer._get_megatron_optimizer_based_on_param_groups(
            config=config, model_chunks=model_chunks, param_groups=param_groups,
            per_model_buffers=buffers, model_parallel_group=mp, data_parallel_group=dp,
            data_parallel_group_gloo=dp_gloo, data_parallel_group_idx=mp.rank(),
            intra_dist_opt_group=groups["intra_dist_opt_group"],
            distributed_optimizer_instance_id=0, pg_collection=pg_collection)


def check_supported(config, model_chunks) -> None:
    """Clear errors for layouts DMuon does not handle (instead of a hang or a wrong result)."""
    from megatron.core import parallel_state

    if not getattr(config, "use_distributed_optimizer", False):
        raise ValueError(f"optimizer={config.optimizer!r} needs use_distributed_optimizer=True")
    for chunk in model_chunks:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is None:
            raise ValueError(f"optimizer={config.optimizer!r} needs model chunks wrapped in "
                             "megatron.core.distributed.DistributedDataParallel")
        if not ddp.use_distributed_optimizer:
            raise ValueError("DistributedDataParallelConfig.use_distributed_optimizer must be True "
                             f"for optimizer={config.optimizer!r}")
        if getattr(ddp, "use_megatron_fsdp", False) or getattr(ddp, "use_custom_fsdp", False):
            raise ValueError(f"optimizer={config.optimizer!r} does not run on Megatron-FSDP yet; "
                             "use the distributed optimizer (ZeRO-1) with Megatron DDP")
        if type(chunk).__name__ in ("FullyShardedDataParallel", "FSDPModule"):
            raise ValueError(f"optimizer={config.optimizer!r} does not support torch FSDP2; "
                             "wrap the model in Megatron DDP with use_distributed_optimizer=True")
    if parallel_state.get_context_parallel_world_size() > 1:
        raise ValueError(f"optimizer={config.optimizer!r} does not support context parallelism yet")



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


@torch.no_grad()
def load_optimizer_state(optimizer, state_dict) -> None:
    """``optimizer.load_state_dict(state_dict)``, also on Megatron's torch-Adam path.

    There, ``DistributedOptimizer.load_state_dict`` first puts the checkpoint's 'step' into
    every per-parameter Adam state and then copies the saved tensors into *every* state key,
    'step' included, which the saved parameter state does not have (KeyError: 'step').  For
    such optimizers the parameter state is loaded with the step tensors set aside, and
    each parameter gets a step tensor of its own: Megatron hands them all one shared tensor,
    which torch's AdamW would then advance once per parameter in every step.
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
                sub.optimizer.state[p]["step"] = step.clone()
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
