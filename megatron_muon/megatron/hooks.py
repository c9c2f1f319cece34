"""The one place where megatron_muon hooks into Megatron objects' methods.

DMuon's overlap, MatrixFSDP ZeRO-3 and the timeline (``tracing``) all act at the same few
points of Megatron's DDP: a bucket group's ``start_grad_sync`` / ``start_param_sync`` /
``register_grad_ready`` ..., a chunk's ``finish_grad_sync``, a buffer's ``reset``, the
optimizer's ``step``.  Each used to replace those methods on the instance by itself, so the
result depended on who wrapped whom (the trace timed ZeRO-3's no-op ``start_grad_sync`` or
the real one, depending on the order of installation).  Here every such method gets one
dispatcher per object, installed once, and features register with it:

* ``before(obj, name, fn)`` / ``after(obj, name, fn)``: ``fn()`` runs before / after the
  call (in registration order); the events the features use have names of their own:
  ``on_grad_sync_started`` (a bucket group's gradients are being reduced),
  ``before_param_sync`` (a bucket group's parameters are about to be all-gathered) and
  ``on_backward_done`` (a DDP chunk's ``finish_grad_sync``: the stage's backward is over);
* ``replace(obj, name, fn, owner)``: ``fn(*args, **kwargs)`` runs *instead of* Megatron's
  method (ZeRO-3's reduce and gather); at most one replacement per method;
* ``observe(obj, name, span)``: ``span()`` is a context manager around the *effective*
  call (the replacement if there is one, else Megatron's method), whatever the order in
  which the replacement and the observer were registered (the trace).

A call runs: the ``before`` callbacks, then the effective method inside every observer,
then the ``after`` callbacks.  Every registration returns a handle whose ``remove()``
takes it back; when an object's last registration for a method goes, the method is
restored (the instance attribute is deleted, or the module function put back), and
``remove_all(obj)`` does that at once.

Each wrapped Megatron method's signature is compared, on first installation, with the one
this package was written against for the installed megatron-core version (``SIGNATURES``):
a Megatron release that changes it fails with an error naming the version and the method
instead of passing arguments to the wrong parameters.

Only this module and ``compat`` assign attributes on Megatron modules, classes and methods
(``tests/test_hooks.py`` checks the package source for it).
"""

from __future__ import annotations

import contextlib
import inspect
import types
import weakref
from typing import Callable, ContextManager, Optional

from megatron_muon.megatron.compat import MCORE_VERSION

__all__ = ["before", "after", "replace", "observe", "remove_all", "installed",
           "on_grad_sync_started", "before_param_sync", "on_backward_done", "Registration",
           "SIGNATURES", "TE_SIGNATURES", "HookSignatureError"]

_PG = "megatron.core.distributed.param_and_grad_buffer."
_DDP = "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel."
_OPT = "megatron.core.optimizer."
_SCHED = "megatron.core.pipeline_parallel.schedules."
_MOD = "megatron.core.transformer.module.Float16Module."
_TP = "megatron.core.tensor_parallel.layers."

# Parameter names of every Megatron function or method this package wraps, per
# megatron-core "major.minor"; "*" applies to every version not listed.
SIGNATURES: dict[str, dict[str, tuple]] = {
    _PG + "_ParamAndGradBucketGroup.start_grad_sync": {"*": ("self", "force_all_reduce")},
    _PG + "_ParamAndGradBucketGroup.finish_grad_sync": {"*": ("self", "force_all_reduce")},
    _PG + "_ParamAndGradBucketGroup.start_param_sync": {"*": ("self", "force_sync")},
    _PG + "_ParamAndGradBucketGroup.finish_param_sync": {
        "*": ("self", "skip_next_bucket_dispatch")},
    _PG + "_ParamAndGradBucketGroup.register_grad_ready": {
        "*": ("self", "param", "force_all_reduce")},
    _PG + "_ParamAndGradBucketGroup.reset": {"*": ("self",)},
    _PG + "_ParamAndGradBuffer.reset": {"*": ("self",)},
    _PG + "_ParamAndGradBuffer.scale_gradients": {"*": ("self", "scaling_factor")},
    _DDP + "finish_grad_sync": {"*": ("self", "force_all_reduce")},
    _OPT + "optimizer.ChainedOptimizer.step": {"*": ("self",)},
    _OPT + "optimizer.MixedPrecisionOptimizer.step": {"*": ("self",)},
    _OPT + "optimizer.FP32Optimizer.step": {"*": ("self",)},
    _MOD + "state_dict": {"*": ("self", "destination", "prefix", "keep_vars")},
    _MOD + "sharded_state_dict": {"*": ("self", "prefix", "args", "kwargs")},
    _MOD + "load_state_dict": {"*": ("self", "state_dict", "strict")},
    _TP + "ColumnParallelLinear.forward": {
        "*": ("self", "input_", "weight", "runtime_gather_output")},
    _TP + "RowParallelLinear.forward": {"*": ("self", "input_")},
    _TP + "ColumnParallelLinear.sharded_state_dict": {
        "*": ("self", "prefix", "sharded_offsets", "metadata")},
    _TP + "RowParallelLinear.sharded_state_dict": {
        "*": ("self", "prefix", "sharded_offsets", "metadata")},
    "megatron.core.models.gpt.gpt_model.GPTModel.sharded_state_dict": {
        "*": ("self", "prefix", "sharded_offsets", "metadata")},
    _SCHED + "forward_step": {"*": (
        "forward_step_func", "data_iterator", "model", "num_microbatches", "input_tensor",
        "forward_data_store", "config", "cp_group_size", "collect_non_loss_data",
        "checkpoint_activations_microbatch", "is_first_microbatch", "current_microbatch",
        "vp_stage", "is_last_stage")},
    _SCHED + "backward_step": {
        "0.16": ("input_tensor", "output_tensor", "output_tensor_grad", "model_type", "config"),
        "*": ("input_tensor", "output_tensor", "output_tensor_grad", "config")},
}

_TE = "megatron.core.extensions.transformer_engine."
_STATE = ("self", "prefix", "sharded_offsets", "metadata")
#: The Transformer Engine wrappers whose methods LoRA replaces (peft/lora.py), checked like
#: SIGNATURES; apart because they resolve only where transformer_engine imports (CUDA):
#: tests/test_lora_te.py reads them from the installed megatron-core's source instead.
TE_SIGNATURES: dict[str, dict[str, tuple]] = {
    _TE + "TELinear.forward": {"*": ("self", "x")},
    _TE + "TELayerNormColumnParallelLinear.forward": {"*": ("self", "x")},
    _TE + "TELMHeadColumnParallelLinear.forward": {
        "*": ("self", "input_", "weight", "runtime_gather_output")},
    _TE + "TEGroupedLinear.forward": {"*": ("self", "x", "m_splits")},
    **{_TE + f"{cls}.sharded_state_dict": {"*": _STATE} for cls in (
        "TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear",
        "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")},
}


class HookSignatureError(RuntimeError):
    pass


def _version_key() -> str:
    return f"{MCORE_VERSION.major}.{MCORE_VERSION.minor}"


def _definition(obj, name: str):
    """(qualified name, function) of what ``obj.name`` runs when nothing is hooked."""
    if isinstance(obj, types.ModuleType):
        fn = getattr(obj, name)
        return f"{obj.__name__}.{name}", fn
    for cls in type(obj).__mro__:
        if name in cls.__dict__:
            return f"{cls.__module__}.{cls.__qualname__}.{name}", cls.__dict__[name]
    raise AttributeError(f"{type(obj).__name__} has no method {name!r}")


def check_signature(obj, name: str) -> None:
    """Compare a Megatron method's parameters with the ones this package was written for."""
    qual, fn = _definition(obj, name)
    if not qual.startswith("megatron."):
        return  # defined by torch, by this package or by a test: not Megatron's to change
    known = SIGNATURES.get(qual) or TE_SIGNATURES.get(qual)
    if known is None:
        raise HookSignatureError(
            f"megatron_muon hooks {qual} but has no expected signature for it: add it to "
            "megatron_muon/megatron/hooks.py SIGNATURES")
    fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
    got = tuple(inspect.signature(fn).parameters)
    want = known.get(_version_key(), known.get("*"))
    if got != want:
        raise HookSignatureError(
            f"megatron-core {MCORE_VERSION}: {qual}{got} differs from the signature "
            f"megatron_muon expects for this version, {want}; megatron_muon's hooks "
            "(megatron_muon/megatron/hooks.py) must be updated for this Megatron release")


class Registration:
    """One registered callback; ``remove()`` takes it back (idempotent)."""

    def __init__(self, slot: "_Slot", kind: str, item):
        self._slot, self._kind, self._item = slot, kind, item

    def remove(self) -> None:
        if self._slot is not None:
            self._slot.unregister(self._kind, self._item)
            self._slot = None


class _Slot:
    """The dispatcher of one method of one object."""

    def __init__(self, hooks: "_Hooks", name: str):
        obj = hooks.obj
        self.hooks, self.name = hooks, name
        self.own = isinstance(obj, types.ModuleType) or name in getattr(obj, "__dict__", {})
        self.original = getattr(obj, name)  # bound method, module function or instance attr
        self.before: list = []
        self.after: list = []
        self.observers: list = []
        self.replacement: Optional[tuple] = None  # (owner, fn)

        slot = self

        def dispatch(*args, **kwargs):
            return slot(*args, **kwargs)

        dispatch.__wrapped__ = self.original
        dispatch._megatron_muon_slot = self
        self.dispatch = dispatch
        setattr(obj, name, dispatch)

    def __call__(self, *args, **kwargs):
        for fn in list(self.before):
            fn()
        effective = self.replacement[1] if self.replacement else self.original
        with contextlib.ExitStack() as stack:
            for span in list(self.observers):
                stack.enter_context(span())
            result = effective(*args, **kwargs)
        for fn in list(self.after):
            fn()
        return result

    def empty(self) -> bool:
        return not (self.before or self.after or self.observers or self.replacement)

    def unregister(self, kind: str, item) -> None:
        if kind == "replace":
            if self.replacement is item:
                self.replacement = None
        else:
            lst = getattr(self, kind)
            if item in lst:
                lst.remove(item)
        if self.empty():
            self.hooks.restore(self.name)

    def restore(self) -> None:
        obj = self.hooks.obj
        now = (vars(obj) if isinstance(obj, types.ModuleType) else obj.__dict__).get(self.name)
        if now is not self.dispatch:
            raise RuntimeError(f"{_label(obj)}.{self.name} was replaced outside "
                               "megatron_muon.megatron.hooks; cannot restore it")
        if self.own:
            setattr(obj, self.name, self.original)
        else:
            delattr(obj, self.name)


def _label(obj) -> str:
    return obj.__name__ if isinstance(obj, types.ModuleType) else type(obj).__name__


class _Hooks:
    def __init__(self, obj):
        self.obj = obj
        self.slots: dict[str, _Slot] = {}

    def slot(self, name: str) -> _Slot:
        s = self.slots.get(name)
        if s is None:
            check_signature(self.obj, name)
            current = getattr(self.obj, name)
            if getattr(current, "_megatron_muon_slot", None) is not None:
                raise RuntimeError(f"{_label(self.obj)}.{name} is hooked twice")
            s = self.slots[name] = _Slot(self, name)
        return s

    def restore(self, name: str) -> None:
        s = self.slots.pop(name, None)
        if s is not None:
            s.restore()
        if not self.slots:
            _REGISTRY.pop(self.obj, None)


_REGISTRY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _hooks(obj) -> _Hooks:
    h = _REGISTRY.get(obj)
    if h is None:
        h = _REGISTRY[obj] = _Hooks(obj)
    return h


def _register(obj, name: str, kind: str, item) -> Registration:
    s = _hooks(obj).slot(name)
    getattr(s, kind).append(item)
    return Registration(s, kind, item)


def before(obj, name: str, fn: Callable[[], None]) -> Registration:
    """``fn()`` before every call of ``obj.name``."""
    return _register(obj, name, "before", fn)


def after(obj, name: str, fn: Callable[[], None]) -> Registration:
    """``fn()`` after every call of ``obj.name`` (when it returns)."""
    return _register(obj, name, "after", fn)


def observe(obj, name: str, span: Callable[[], ContextManager]) -> Registration:
    """``with span():`` around the effective call of ``obj.name`` (its replacement if any)."""
    return _register(obj, name, "observers", span)


def replace(obj, name: str, fn: Callable, owner: str) -> Registration:
    """Run ``fn(*args, **kwargs)`` instead of Megatron's ``obj.name``; one owner per method."""
    s = _hooks(obj).slot(name)
    if s.replacement is not None:
        raise RuntimeError(f"{_label(obj)}.{name} is already replaced by {s.replacement[0]}; "
                           f"{owner} cannot replace it as well")
    s.replacement = (owner, fn)
    return Registration(s, "replace", s.replacement)


def remove_all(obj) -> None:
    """Every hook on ``obj`` taken back; its methods are Megatron's again."""
    h = _REGISTRY.get(obj)
    if h is not None:
        for name in list(h.slots):
            h.restore(name)


def installed(obj) -> list:
    """Names of ``obj``'s methods that currently go through a dispatcher."""
    h = _REGISTRY.get(obj)
    return sorted(h.slots) if h is not None else []


# -- the events the features use ---------------------------------------------------------
def on_grad_sync_started(bucket_group, fn: Callable[[], None]) -> Registration:
    """After a bucket group launched (or, without overlap, ran) its gradient reduction."""
    return after(bucket_group, "start_grad_sync", fn)


def before_param_sync(bucket_group, fn: Callable[[], None]) -> Registration:
    """Before a bucket group's parameter all-gather is started."""
    return before(bucket_group, "start_param_sync", fn)


def on_backward_done(chunk, fn: Callable[[], None]) -> Registration:
    """After a DDP chunk's ``finish_grad_sync`` (its backward and reductions are over)."""
    return after(chunk, "finish_grad_sync", fn)
