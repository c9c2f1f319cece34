"""Run real Megatron-Core on CPU with gloo when CUDA is absent (test and demo infrastructure).

Megatron-Core assumes CUDA in a handful of places (docs/design.md#cpu-mode): ``device="cuda"``
literals and ``.cuda()`` calls, ``torch.cuda.current_device()`` as a device, string checks
such as ``param.type() == 'torch.cuda.FloatTensor'``, streams and ``synchronize``.
``enable_cpu_mode()`` maps all of these onto the CPU:

* a ``TorchFunctionMode`` rewrites cuda devices to cpu in every torch call, turns
  ``Tensor.cuda()`` into a no-op, and answers ``Tensor.type()`` with the CUDA type names;
* ``torch.cuda.current_device/current_stream/synchronize/Stream/Event`` and the CUDA RNG
  entry points get CPU stand-ins;
* the local spec's torch norms accept sequence parallelism (``_patch_megatron_norms``), and
  its core attention multi-latent attention's separate q/k and value head dims
  (``_patch_megatron_core_attention``).

It does nothing (and returns False) when CUDA is available, so the same code runs on GPUs
with NCCL unchanged.  Call it once per process before building Megatron objects.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["enable_cpu_mode", "cpu_mode_active", "default_backend",
           "cpu_transformer_config"]

_ACTIVE = False
_LOCK = threading.Lock()
_CPU = torch.device("cpu")


def cpu_mode_active() -> bool:
    return _ACTIVE


def default_backend() -> str:
    """NCCL on GPUs, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def cpu_transformer_config() -> dict:
    """``TransformerConfig`` fields a CPU (gloo) run needs; ``{}`` when CUDA is present.

    Fused kernels and p2p syncs need CUDA.  ``batch_p2p_comm=False``: gloo runs a batched
    p2p as isend/irecv in the order [send_prev, recv_prev, send_next, recv_next] and pairs
    same-peer messages by order, so with PP = 2 under the interleaved schedule (prev ==
    next) a backward grad lands in a forward-activation buffer; Megatron's unbatched p2p
    orders the two sides consistently (PP2 x VPP2 is then bitwise PP2).
    """
    if torch.cuda.is_available():
        return {}
    return dict(use_cpu_initialization=True, bias_dropout_fusion=False,
                masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                batch_p2p_sync=False, batch_p2p_comm=False)


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU; answers type() with CUDA names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _TYPE_NAMES.get(args[0].dtype, func(*args))
        if func is torch.Tensor.is_cuda.__get__:
            return False
        dev = kwargs.get("device")
        if dev is not None and _is_cuda(dev):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for torch.cuda.Stream / current_stream / Event on CPU: everything is
    synchronous, so every wait, record and synchronize is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def _nothing(self, *args, **kwargs):
        pass

    wait_stream = wait_event = record = wait = synchronize = _nothing

    def record_event(self, *args, **kwargs):
        return _NullEvent()

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NullEvent = _NullStream  # an event needs the same no-ops (record, wait, synchronize, query)


def _patch_megatron_without_te() -> None:
    """MoE router gating references ``te_general_gemm``, undefined when TE is absent."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        from megatron_muon.megatron.compat import set_megatron_attr

        set_megatron_attr(moe_utils, "te_general_gemm", None)


def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    """CPU stand-in for Megatron's ``tensor_parallel.random._set_cuda_rng_state``: the
    "CUDA" generator is the CPU one here (``torch.cuda.get_rng_state`` above returns its
    state).  Megatron's own goes through ``torch.cuda._lazy_call``, which without CUDA queues
    the call and a formatted stack for an initialisation that never comes: one entry per
    recomputed layer and microbatch, and an RNG tracker fork that does not fork."""
    torch.set_rng_state(new_state)


def _patch_megatron_rng() -> None:
    """Activation recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA RNG
    through ``torch.cuda.random.get_rng_state`` and Megatron's ``_set_cuda_rng_state``."""
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_muon.megatron.compat import set_megatron_attr

    torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    set_megatron_attr(mrandom, "_set_cuda_rng_state", _set_cuda_rng_state)


def _patch_megatron_norms() -> None:
    """The local spec's torch norms (``WrappedTorchNorm``) refuse sequence parallelism.
    Under it each TP rank normalises its own slice of the sequence with the TP-replicated
    weights, so their gradients are partial sums, which Megatron all-reduces over TP for
    every parameter marked ``sequence_parallel`` (``finalize_model_grads``), as it does for
    Transformer Engine's and Apex's norms.  The stand-in builds the same torch norm and
    marks its parameters."""
    import copy

    from megatron.core.transformer import torch_norm

    from megatron_muon.megatron.compat import set_megatron_attr

    original = torch_norm.WrappedTorchNorm.__new__
    if getattr(original, "megatron_muon_cpu", False):
        return

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    __new__.megatron_muon_cpu = True
    set_megatron_attr(torch_norm.WrappedTorchNorm, "__new__", staticmethod(__new__))


def _patch_megatron_core_attention() -> None:
    """The local spec's core attention (``DotProductAttention``) takes one head dim for
    queries, keys and values; multi-latent attention builds it with ``k_channels`` (q/k head
    dim, rope part included) and ``v_channels`` (value head dim) and its own softmax scale.
    Its forward already works per head in whatever dims the inputs have; only the output
    width (heads x value dim) and the default scale (1 / sqrt(q/k dim)) depend on them."""
    import math

    from megatron.core.transformer import dot_product_attention as dpa

    from megatron_muon.megatron.compat import set_megatron_attr

    original = dpa.DotProductAttention.__init__
    if getattr(original, "megatron_muon_cpu", False):
        return

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        if k_channels is not None and kwargs.get("softmax_scale") is None:
            self.softmax_scale = 1.0 / math.sqrt(k_channels)
            if self.config.apply_query_key_layer_scaling:
                self.softmax_scale /= self.layer_number

    __init__.megatron_muon_cpu = True
    set_megatron_attr(dpa.DotProductAttention, "__init__", __init__)


def enable_cpu_mode() -> bool:
    """Patch torch.cuda entry points for CPU-only Megatron-Core; no-op when CUDA exists."""
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _ACTIVE:
            return True
        cuda = torch.cuda
        cuda.current_device = lambda: _CPU
        cuda.current_stream = lambda *a, **k: _NullStream()
        cuda.default_stream = lambda *a, **k: _NullStream()
        cuda.Stream = _NullStream
        cuda.Event = _NullEvent
        cuda.stream = lambda *a, **k: contextlib.nullcontext()
        cuda.set_stream = lambda *a, **k: None
        cuda.synchronize = lambda *a, **k: None
        cuda.empty_cache = lambda: None
        cuda.set_device = lambda *a, **k: None
        cuda.device_count = lambda: 0
        cuda.manual_seed = lambda seed: None
        cuda.manual_seed_all = lambda seed: None
        cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
        cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        cuda.memory_allocated = lambda *a, **k: 0
        cuda.max_memory_allocated = lambda *a, **k: 0
        cuda.memory_reserved = lambda *a, **k: 0
        cuda.nvtx.range_push = lambda *a, **k: None
        cuda.nvtx.range_pop = lambda *a, **k: None
        _CudaToCpu().__enter__()  # stays on the mode stack for the life of the process
        _patch_megatron_without_te()
        _patch_megatron_rng()
        _patch_megatron_norms()
        _patch_megatron_core_attention()
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        _ACTIVE = True
    return True
