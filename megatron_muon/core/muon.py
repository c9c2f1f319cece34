"""Reference Muon: the single-process oracle every distributed path is tested against.

docs/design.md#muon, written to be obviously correct rather than fast:

    M <- mu * M + G
    U <- G + mu * M   (nesterov)  |  U <- M
    O <- NS_k(U)      per unit (QKV blocks, experts, gate/up, or the whole matrix)
    O <- moment2(O)   optional AdaMuon / NorMuon, per unit (core/moment2.py)
    W <- W * (1 - lr * wd) - lr * scale(unit) * O
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

import torch

from megatron_muon.core.moment2 import (check_moment2_hyperparameters, moment2_init,
                                        moment2_normalize)
from megatron_muon.core.newton_schulz import muon_scale, newton_schulz, resolve_coefficients, SCALE_MODES
from megatron_muon.core.units import Unit, extract_unit, insert_unit, whole_units

__all__ = ["Muon", "muon_update_direction", "check_muon_hyperparameters", "momentum_update",
           "momentum_update_", "momentum_step", "decoupled_update", "decoupled_update_",
           "check_finite_gradient", "evaluate_closure"]


def momentum_update(buf: torch.Tensor, grad: torch.Tensor, momentum: float,
                    nesterov: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """M <- mu M + G in place; returns U = G + mu M (Nesterov) or M.  Shared by every Muon
    (one tensor of ``momentum_update_``: the same ops, so every Muon agrees bitwise).

    ``out``: write U there (same values, no temporary) and return it.
    """
    return momentum_update_([buf], [grad], momentum, nesterov,
                            None if out is None else [out])[0]


def momentum_update_(bufs: list, grads: list, momentum: float, nesterov: bool,
                     outs: Optional[list] = None) -> list:
    """``momentum_update`` of many tensors at once: M <- mu M + G with two ``torch._foreach_*``
    ops over all of them (one multi-tensor kernel each on GPUs), then U per tensor.

    U = G + mu M is one ``torch.add(..., out=)`` per tensor: it reads G and M and writes U
    once, where a foreach copy + add would pass over U twice (there is no foreach ``out=``).
    """
    if not bufs:
        return []
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    if outs is None:
        return torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else list(bufs)
    for buf, grad, out in zip(bufs, grads, outs):
        if nesterov:
            torch.add(grad, buf, alpha=momentum, out=out)
        else:
            out.copy_(buf)
    return outs


def momentum_step(state: dict, grad: torch.Tensor, momentum: float,
                  nesterov: bool) -> torch.Tensor:
    """``momentum_update`` on ``state["momentum_buffer"]`` (zeros like ``grad`` at first)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad)
    return momentum_update(state["momentum_buffer"], grad, momentum, nesterov)


def evaluate_closure(closure: Optional[Callable]):
    """What ``optimizer.step(closure)`` returns: the closure's loss (gradients on), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def decoupled_update(p: torch.Tensor, direction: torch.Tensor, step: float,
                     decay: float = 1.0) -> None:
    """W <- W * decay - step * direction in place: decoupled weight decay, then the step.

    The parameter update of every Muon here (``Muon``, ``SMuon``, the LoRA optimizer's
    distributed sMuon, ``DMuon``), one op order for all, so that they agree bitwise:
    ``decay`` is ``1 - lr * wd`` (sMuon: its square root, on each factor) and ``step`` is
    ``lr``, times the Muon scale where ``direction`` does not carry it.  A ``decay`` of
    exactly 1 skips the multiply (``x * 1.0 == x``).  ``direction`` is added as given: cast it
    to ``p.dtype`` first where the direction is to be rounded before the add.
    """
    if decay != 1.0:
        p.mul_(decay)
    p.add_(direction, alpha=-step)


def decoupled_update_(params: list, directions: list, step: float, decay: float = 1.0) -> None:
    """``decoupled_update`` of many parameters sharing ``step`` and ``decay`` (one param
    group): the same two ops as ``torch._foreach_*`` (multi-tensor kernels on GPUs), so the
    result is bitwise that of ``decoupled_update`` on each."""
    if not params:
        return
    if decay != 1.0:
        torch._foreach_mul_(params, decay)
    torch._foreach_add_(params, directions, alpha=-step)


def check_finite_gradient(grad: torch.Tensor, who: str, what: str) -> None:
    if not torch.isfinite(grad).all():
        raise ValueError(f"{who} got a non-finite (NaN/Inf) gradient for a {what} of shape "
                         f"{tuple(grad.shape)}; check the loss scale or the data")


def check_muon_hyperparameters(*, momentum: float, ns_steps: int, coefficient_type,
                               scale_mode: str) -> None:
    """Validate the Muon settings shared by every optimizer in this package."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"muon momentum must be in [0, 1), got {momentum}")
    resolve_coefficients(coefficient_type, ns_steps)  # raises on bad names / steps
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown muon scale mode {scale_mode!r}; choose one of {list(SCALE_MODES)}")


def muon_update_direction(update: torch.Tensor, units: list[Unit], *, ns_steps: int,
                          coefficient_type, scale_mode: str, extra_scale_factor: float,
                          eps: float = 1e-7, ns_dtype: Optional[torch.dtype] = None,
                          ns_method: str = "standard", moment2: Optional[str] = None,
                          moment2_states: Optional[list] = None, beta2: float = 0.95,
                          moment2_eps: float = 1e-8) -> torch.Tensor:
    """scale(unit) * NS(unit) for every unit of a momentum-updated matrix, unit by unit
    (``ns_method``: 'standard' or 'gram', see ``newton_schulz``).  ``moment2``: 'adamuon' /
    'normuon' normalise each unit's NS output before the scale, updating
    ``moment2_states[i]`` (one per unit, ``moment2_init``) in place."""
    out = torch.empty_like(update, dtype=torch.float32)
    for i, unit in enumerate(units):
        u = extract_unit(update, unit).float()
        o = newton_schulz(u, steps=ns_steps, coefficients=coefficient_type, eps=eps,
                          dtype=ns_dtype or torch.float32, method=ns_method).float()
        if moment2 is not None:
            o = moment2_normalize(o, moment2_states[i], moment2, beta2, moment2_eps)
        m, n = unit.shape
        insert_unit(out, unit, o * muon_scale(m, n, scale_mode, extra_scale_factor))
    return out


class Muon(torch.optim.Optimizer):
    """Single-device Muon (docs/design.md#muon) for 2-D parameters.

    Args:
        params: 2-D parameters (or param groups).
        lr, weight_decay: decoupled weight decay, ``W *= 1 - lr * wd``.
        momentum, nesterov: momentum buffer ``M = mu M + G``; Nesterov uses ``G + mu M``.
        ns_steps, coefficient_type: Newton-Schulz iteration count and coefficient set
            (``simple``, ``quintic``, ``polar_express``, ``cubic`` or explicit triples).
        scale_mode, extra_scale_factor: update scale per unit (Megatron-Core names).
        units: optional ``{param: [Unit, ...]}`` (QKV split, experts, gate/up); default is
            the whole matrix.
        ns_dtype: compute dtype of NS (default fp32; ``torch.bfloat16`` as most Muon codes).
        ns_method: 'standard' or 'gram' Newton-Schulz (``newton_schulz``'s ``method``).
        moment2, beta2, moment2_eps: None (plain Muon), 'adamuon' or 'normuon' second moment
            of each unit's NS output (``core/moment2.py``; Megatron's ``adaptive_muon_*``).
    """

    def __init__(self, params: Iterable, lr: float = 0.02, momentum: float = 0.95,
                 nesterov: bool = True, weight_decay: float = 0.0, ns_steps: int = 5,
                 coefficient_type="simple", scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, eps: float = 1e-7,
                 units: Optional[Mapping[torch.Tensor, list[Unit]]] = None,
                 ns_dtype: Optional[torch.dtype] = None, ns_method: str = "standard",
                 moment2: Optional[str] = None, beta2: float = 0.95, moment2_eps: float = 1e-8):
        if lr < 0.0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        check_muon_hyperparameters(momentum=momentum, ns_steps=ns_steps,
                                   coefficient_type=coefficient_type, scale_mode=scale_mode)
        check_moment2_hyperparameters(moment2, beta2, moment2_eps)
        self.moment2 = moment2
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, coefficient_type=coefficient_type,
                        scale_mode=scale_mode, extra_scale_factor=extra_scale_factor, eps=eps,
                        ns_method=ns_method, beta2=beta2, moment2_eps=moment2_eps)
        super().__init__(params, defaults)
        self._units = {}
        units = units or {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon only takes 2-D parameters; got one of shape {tuple(p.shape)} "
                        "(give embeddings' 1-D/ND tensors, norms and biases to AdamW)"
                    )
                self._units[p] = list(units.get(p, whole_units(p.shape)))
                for u in self._units[p]:
                    if u.param_shape != tuple(p.shape):
                        raise ValueError(f"unit {u} does not match parameter shape {tuple(p.shape)}")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                check_finite_gradient(g, "Muon", "parameter")
                st = self.state[p]
                update = momentum_step(st, g, group["momentum"], group["nesterov"])
                if self.moment2 is not None and "moment2" not in st:
                    st["moment2"] = [moment2_init(*u.shape, self.moment2, g.device)
                                     for u in self._units[p]]
                direction = muon_update_direction(
                    update, self._units[p], ns_steps=group["ns_steps"],
                    coefficient_type=group["coefficient_type"], scale_mode=group["scale_mode"],
                    extra_scale_factor=group["extra_scale_factor"], eps=group["eps"],
                    ns_dtype=self.ns_dtype, ns_method=group.get("ns_method", "standard"),
                    moment2=self.moment2, moment2_states=st.get("moment2"),
                    beta2=group["beta2"], moment2_eps=group["moment2_eps"])
                decoupled_update(p, direction.to(p.dtype), group["lr"],
                                 1.0 - group["lr"] * group["weight_decay"])
        return loss
