"""Fast batched Newton-Schulz: backends (torch batched / looped / Gram / Triton) and an autotuner.

``import megatron_muon.kernels`` never imports triton: the Triton kernels are built on
first use of a triton backend (``triton.jit`` reads ``TRITON_INTERPRET`` at that moment).
"""

from megatron_muon.kernels.backends import (
    BACKEND_NAMES,
    TritonConfig,
    available_backends,
    batched_newton_schulz,
    get_backend,
    gram_backend,
    torch_batched,
    torch_gram,
    torch_loop,
)
from megatron_muon.kernels.tuner import NSTuner

__all__ = [
    "batched_newton_schulz",
    "NSTuner",
    "available_backends",
    "get_backend",
    "torch_batched",
    "torch_loop",
    "torch_gram",
    "gram_backend",
    "TritonConfig",
    "BACKEND_NAMES",
]
