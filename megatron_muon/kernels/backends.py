"""Newton-Schulz backends behind one signature, and the batched entry point.

Every backend is ``fn(x [b, m, n], coeffs [(a, b, c)] * steps, eps, dtype) -> [b, m, n]``
(result in x's dtype) so that the tuner can time and validate them interchangeably:

- ``torch_batched``: the reference maths over the whole batch (``bmm``/``baddbmm``,
  X X^T once per step, tall inputs transposed) - one launch per op for all matrices.
- ``torch_loop``: one matrix at a time; the baseline a per-parameter optimizer pays.
- ``torch_gram`` / ``torch_gram:rR``: Gram Newton-Schulz over the whole batch
  (``newton_schulz(method='gram')``, docs/design.md#gram-newton-schulz): the same
  polynomial iterated on the s x s Gram matrix, restarting every R steps (default:
  ``default_gram_restart`` of the coefficients; ``r0``: never).  Fewer flops for
  N / s > ~1.5.
- ``triton`` / ``triton:BLOCKxBLOCK_K:wW:sS``: the kernels of ``triton_ns`` (symmetric
  Gram product on upper-triangle tiles only, fused polynomial and fused update).

Triton is imported only when a triton backend is first used, so this module (and
``megatron_muon.kernels``) imports on machines without triton.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable, Optional, Sequence, Union

import torch

from megatron_muon.core.newton_schulz import (Coefficients, check_ns_method, newton_schulz,
                                             resolve_coefficients)

from megatron_muon.kernels.triton_config import TritonConfig

__all__ = [
    "Backend",
    "TritonConfig",
    "BACKEND_NAMES",
    "torch_batched",
    "torch_loop",
    "torch_gram",
    "gram_backend",
    "get_backend",
    "available_backends",
    "triton_usable",
    "batched_newton_schulz",
]

Backend = Callable[[torch.Tensor, Sequence[tuple[float, float, float]], float, Optional[torch.dtype]],
                   torch.Tensor]

#: Plain names; ``triton:...`` names with an explicit tile config are accepted too.
BACKEND_NAMES = ("torch_batched", "torch_loop", "torch_gram", "triton")


def torch_batched(x: torch.Tensor, coeffs: Sequence[tuple[float, float, float]], eps: float,
                  dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Whole batch at once: the reference implementation is already batched via bmm."""
    return newton_schulz(x, steps=len(coeffs), coefficients=list(coeffs), eps=eps, dtype=dtype)


def torch_loop(x: torch.Tensor, coeffs: Sequence[tuple[float, float, float]], eps: float,
               dtype: Optional[torch.dtype]) -> torch.Tensor:
    """One matrix at a time (baseline): what a per-parameter Muon loop costs."""
    outs = [newton_schulz(x[i], steps=len(coeffs), coefficients=list(coeffs), eps=eps, dtype=dtype)
            for i in range(x.shape[0])]
    if not outs:
        return torch.empty_like(x)
    return torch.stack(outs)


def gram_backend(restart: Optional[int] = None, looped: bool = False) -> Backend:
    """Gram NS restarting every ``restart`` steps (None: the coefficients' default), over
    the whole batch (or, ``looped``, one matrix at a time)."""
    check_ns_method("gram", restart)

    def run(x: torch.Tensor, coeffs: Sequence[tuple[float, float, float]], eps: float,
            dtype: Optional[torch.dtype]) -> torch.Tensor:
        def ns(t: torch.Tensor) -> torch.Tensor:
            return newton_schulz(t, steps=len(coeffs), coefficients=list(coeffs), eps=eps, dtype=dtype,
                                 method="gram", gram_restart=restart)

        if not looped:
            return ns(x)
        outs = [ns(x[i]) for i in range(x.shape[0])]
        return torch.stack(outs) if outs else torch.empty_like(x)

    run.__name__ = ("torch_gram" if restart is None else f"torch_gram:r{restart}") \
        + (" (looped)" if looped else "")
    return run


#: Gram NS with the coefficients' default restart period, as a plain backend function.
torch_gram = gram_backend()


def _parse_gram(spec: str) -> int:
    """Restart period of a ``torch_gram:rR`` name."""
    if spec.startswith("r") and spec[1:].isdigit():
        return int(spec[1:])
    raise ValueError(f"bad torch_gram config {spec!r}; expected e.g. 'torch_gram:r2' "
                     "(restart every R steps, r0: never)")


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")  # as triton parses it


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: Union[torch.device, str, None] = None) -> bool:
    """Triton can run here: it is installed and either the tensors are on CUDA or
    TRITON_INTERPRET=1 is set (CPU tensors, numpy-simulated kernels)."""
    if not _triton_importable():
        return False
    if _interpret_env():
        return True
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _triton_backend(config: Optional[str]) -> Backend:
    """A triton backend with a fixed tile config (``None``: per-dtype default)."""

    def run(x: torch.Tensor, coeffs: Sequence[tuple[float, float, float]], eps: float,
            dtype: Optional[torch.dtype]) -> torch.Tensor:
        if not triton_usable(x.device):
            raise RuntimeError(
                "the triton NS backend needs triton installed and a CUDA tensor "
                f"(or TRITON_INTERPRET=1 for CPU tensors); got a tensor on {x.device}"
            )
        from megatron_muon.kernels import triton_ns  # lazy: decorates the kernels (reads TRITON_INTERPRET) now

        cfg = TritonConfig.parse(config) if config else None
        return triton_ns.triton_newton_schulz(x, list(coeffs), eps, dtype, cfg)

    run.__name__ = "triton" if config is None else f"triton:{config}"
    return run


def get_backend(name: str) -> Backend:
    """Backend callable by name; ValueError (listing the valid names) for anything else."""
    if not isinstance(name, str):
        raise ValueError(f"NS backend name must be a string, got {name!r}")
    if name == "torch_batched":
        return torch_batched
    if name == "torch_loop":
        return torch_loop
    if name == "torch_gram":
        return torch_gram
    if name.startswith("torch_gram:"):
        return gram_backend(_parse_gram(name[len("torch_gram:"):]))
    if name == "triton":
        return _triton_backend(None)
    if name.startswith("triton:"):
        spec = name[len("triton:"):]
        TritonConfig.parse(spec)  # validate now, without importing triton
        return _triton_backend(spec)
    raise ValueError(
        f"unknown NS backend {name!r}; choose one of {list(BACKEND_NAMES)}, "
        "'torch_gram:rRESTART', 'triton:BLOCKxBLOCK_K:wWARPS:sSTAGES' or 'auto'"
    )


def available_backends(device: Union[torch.device, str, None] = None) -> list[str]:
    """Backends that can run on ``device`` now (default: CUDA if present, else CPU)."""
    names = ["torch_batched", "torch_loop", "torch_gram"]
    if triton_usable(device):
        names.append("triton")
    return names


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"batched_newton_schulz expects a torch.Tensor, got {type(x).__name__}")
    if x.ndim not in (2, 3):
        raise ValueError(
            f"batched_newton_schulz expects a matrix [m, n] or a batch [b, m, n], "
            f"got a {x.ndim}-D tensor of shape {tuple(x.shape)}"
        )
    if x.shape[-1] == 0 or x.shape[-2] == 0:
        raise ValueError(f"batched_newton_schulz got an empty matrix shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"batched_newton_schulz needs a floating-point tensor, got {x.dtype}")


def batched_newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "simple",
    eps: float = 1e-7,
    dtype: Optional[torch.dtype] = None,
    backend: Union[str, Backend] = "auto",
    tuner=None,  # a kernels.tuner.NSTuner (not imported: the tuner imports this module)
    method: str = "standard",
    gram_restart: Optional[int] = None,
) -> torch.Tensor:
    """NS_k of one matrix [m, n] or of a batch [b, m, n] of same-shape matrices.

    ``backend='auto'`` asks ``tuner`` for the fastest validated backend for this
    (shape, batch, dtype, device) - the standard or the Gram method, torch or Triton -
    and falls back to ``torch_batched`` without a tuner; a name picks a backend
    explicitly (ValueError for unknown names).  ``dtype`` is the compute dtype
    (default x's).  Result: x's shape and dtype.

    ``method='gram'`` asks for Gram NS (restarting every ``gram_restart`` steps; None:
    ``newton_schulz.default_gram_restart(coefficients)``)
    whatever the tuner would pick: ``auto``, ``torch_batched`` and ``torch_gram`` run
    it batched, ``torch_loop`` per matrix; there is no Triton Gram kernel (ValueError).
    """
    _check_input(x)
    coeffs = resolve_coefficients(coefficients, steps)  # ValueError on bad steps / names
    check_ns_method(method, gram_restart)
    if method == "gram":
        if isinstance(backend, str) and (backend == "torch_gram" or backend.startswith("torch_gram:")):
            pass  # already Gram (a 'torch_gram:rR' name fixes its own restart period)
        elif isinstance(backend, str) and backend in ("auto", "torch_batched", "torch_loop"):
            backend = gram_backend(gram_restart, looped=backend == "torch_loop")
        else:
            raise ValueError(
                f"method='gram' runs on the torch backends only ('auto', 'torch_batched', "
                f"'torch_loop', 'torch_gram'), got backend {backend!r}; there is no Triton "
                "Gram kernel: pass method='standard' to use it"
            )
    X = x if x.ndim == 3 else x.unsqueeze(0)
    if X.shape[0] == 0:
        return x.clone()
    cdtype = dtype or x.dtype
    if callable(backend):
        fn = backend
    elif backend == "auto":
        if tuner is None:
            fn = torch_batched
        else:
            name = tuner.choose(X.shape[1], X.shape[2], X.shape[0], cdtype, X.device)
            fn = tuner.backend(name)
    else:
        fn = get_backend(backend)
    out = fn(X, coeffs, eps, cdtype)
    return out if x.ndim == 3 else out.squeeze(0)
