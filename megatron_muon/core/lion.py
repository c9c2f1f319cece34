"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), framework-free.

The maths of ``muon_scalar_optimizer='lion'``: DMuon's companion optimizer for the
parameters Muon does not take (embeddings, output layer, norms, biases), as Megatron-Core
0.19's ``--muon-scalar-optimizer lion`` (which uses emerging_optimizers' ``Lion`` with
decoupled weight decay).  Per element, with gradient g and state m (``exp_avg``):

    p <- p - lr wd p                     decoupled weight decay (skipped when wd = 0)
    c  = b1 m + (1 - b1) g               (torch.lerp(m, g, 1 - b1))
    p <- p - lr sign(c)
    m <- b2 m + (1 - b2) g               (in place, torch.lerp_)

which is the paper's p <- p - lr (sign(c) + wd p) with the weight decay applied first.
``lion_update`` keeps emerging_optimizers' op order: the parameters come out the same
bitwise and the state within an fp32 ulp per step (emerging_optimizers torch.compiles the
update, which may fuse a rounding; checked in tests/test_scalars.py where it is installed).  The update is
element-wise: a DP shard of a parameter updated with the shard of its gradient and state
gives exactly the same values as the whole tensor.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from megatron_muon.core.muon import evaluate_closure

__all__ = ["Lion", "lion_update", "check_lion_betas", "LION_STATE_KEYS"]

LION_STATE_KEYS = ("exp_avg",)  # Megatron-Core's name for Lion's one state tensor


def check_lion_betas(beta1: float, beta2: float) -> None:
    for name, b in (("lion_beta1", beta1), ("lion_beta2", beta2)):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b}")


def lion_update(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
                weight_decay: float, beta1: float, beta2: float) -> None:
    """One Lion step of ``p`` and its state ``exp_avg``, in place (module docstring)."""
    if weight_decay != 0.0:
        p.add_(p, alpha=-weight_decay * lr)
    update = torch.sign(exp_avg.lerp(grad, 1 - beta1))
    exp_avg.lerp_(grad, 1 - beta2)
    p.add_(update, alpha=-lr)


class Lion(torch.optim.Optimizer):
    """Single-device Lion; also the inner optimizer of the distributed Lion subset (which
    hands it the fp32 main-param shards).  State per parameter: ``exp_avg`` (zeros at
    first).  ``betas``: (lion_beta1, lion_beta2), Megatron-Core's defaults (0.95, 0.98)."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple = (0.95, 0.98),
                 weight_decay: float = 0.0):
        if lr < 0.0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        check_lion_betas(*betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def init_state(self) -> None:
        """Allocate every parameter's ``exp_avg`` (before a checkpoint fills it)."""
        for group in self.param_groups:
            for p in group["params"]:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                lion_update(p, p.grad, state["exp_avg"], lr=group["lr"],
                            weight_decay=group["weight_decay"], beta1=beta1, beta2=beta2)
        return loss
