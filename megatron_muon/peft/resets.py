"""How ReLoRA resets an adapter optimizer's state at a restart (``zero``, ``prune``, ``keep``).

A leaf module: ``lora_optimizer`` applies a reset, ``relora`` chooses when; both import
this, neither the other's internals.
"""

from __future__ import annotations

import math

import torch

__all__ = ["RESETS", "check_reset", "prune_by_magnitude"]

RESETS = ("zero", "prune", "keep")


@torch.no_grad()
def prune_by_magnitude(t: torch.Tensor, ratio: float) -> None:
    """Zero the ``floor(ratio * numel)`` smallest-magnitude entries of ``t`` in place (ties at
    the threshold are zeroed too, so the result does not depend on the order of equal
    values)."""
    k = int(math.floor(ratio * t.numel()))
    if k <= 0:
        return
    if k >= t.numel():
        t.zero_()
        return
    threshold = t.abs().reshape(-1).kthvalue(k).values
    t.masked_fill_(t.abs() <= threshold, 0)


def check_reset(reset: str, prune_ratio: float) -> None:
    """A clear error for an unknown reset or a prune ratio outside [0, 1]."""
    if reset not in RESETS:
        raise ValueError(f"ReLoRA reset must be one of {list(RESETS)}, got {reset!r}")
    if isinstance(prune_ratio, bool) or not isinstance(prune_ratio, (int, float)) \
            or not 0 <= prune_ratio <= 1:
        raise ValueError(f"ReLoRA prune ratio must be in [0, 1], got {prune_ratio!r}")
