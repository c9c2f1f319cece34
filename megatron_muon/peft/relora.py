"""ReLoRA: low-rank pretraining by repeated merge-and-restart of LoRA adapters (docs/relora.md).

A ReLoRA run trains LoRA adapters (``lora.py``) with :class:`~megatron_muon.peft.lora_optimizer.
LoRAOptimizer` (sMuon, AdamW or per-factor Muon) on a base whose targeted linears are frozen
between merges.  Every ``restart_every`` steps :meth:`ReLoRA.restart`:

1. merges every adapter into its base weight, ``W0 += gamma B A`` (each rank its own shards,
   no communication: ``LoRAAdapter.merge``);
2. re-initialises the adapters as at the start (``A`` drawn again -- from a generator seeded
   by ``(seed, restart number, the layer's global name)``, so every TP / PP layout draws the
   same full ``A`` -- and ``B = 0``, so the model's function does not change);
3. resets the adapter optimizer's state (``reset="zero"``: the momenta / Adam moments are
   dropped, as if the optimizer were new; ``"prune"``: each state tensor keeps only its
   ``1 - prune_ratio`` largest-magnitude entries, the rest set to 0, as the ReLoRA paper does
   with 99 %; ``"keep"``: untouched) and re-reads its fp32 masters from the new adapters.

:func:`jagged_lr` is the ReLoRA learning-rate schedule: a warm-up then cosine decay, multiplied
after every restart by a short linear re-warm-up.  :class:`TrainableAdamW` is the AdamW for the
parameters ReLoRA trains at full rank (embeddings, norms, output layer; TP-aware clipping).
:func:`save_training_state` / :func:`load_training_state` write and read one file per rank
with everything a run needs to continue bit for bit (model incl. merged base weights,
adapters, both optimizers, the restart count, the iteration).

Nothing here knows about the training loop: the caller calls ``restart()`` after its step.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_muon.peft.lora import LoRAConfig, _lora_layers
from megatron_muon.peft.lora_optimizer import LoRAOptimizer
from megatron_muon.peft.resets import RESETS, check_reset, prune_by_magnitude

__all__ = ["ReLoRA", "RESETS", "jagged_lr", "prune_by_magnitude", "TrainableAdamW",
           "trainable_base_parameters", "save_training_state", "load_training_state"]

STATE_FORMAT = "megatron_muon.relora/1"


# ============================================================================== schedule
def jagged_lr(it: int, *, lr: float, min_lr: float, warmup: int, total: int,
              restart_every: int, restart_warmup: int) -> float:
    """Learning rate of (0-based) step ``it``: linear warm-up over ``warmup`` steps, cosine
    decay from ``lr`` to ``min_lr`` at step ``total``; after each restart (steps
    ``k * restart_every``, k >= 1) multiplied by ``(s + 1) / (restart_warmup + 1)`` for the
    first ``restart_warmup`` steps ``s`` since it."""
    if it < warmup:
        value = lr * (it + 1) / (warmup + 1)
    else:
        frac = min(1.0, (it - warmup) / max(1, total - warmup))
        value = min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * frac))
    if restart_every > 0 and it >= restart_every:
        since = it % restart_every
        if since < restart_warmup:
            value *= (since + 1) / (restart_warmup + 1)
    return value


# ============================================================================== the restarts
class ReLoRA:
    """Merge-and-restart of a model's LoRA adapters and their optimizer.

    Args:
        model: the model after ``apply_lora`` (module or list of chunks, DDP-wrapped or not).
        optimizer: the adapters' :class:`LoRAOptimizer`.
        restart_every: merge and restart after every this many steps (>= 1).
        reset: ``zero``, ``prune`` or ``keep`` (module docstring); ``prune_ratio`` for prune.
        seed, init: the LoRA init of the restarts (default: the model's LoRA config's).
    """

    def __init__(self, model, optimizer: LoRAOptimizer, *, restart_every: int,
                 reset: str = "zero", prune_ratio: float = 0.99, seed: Optional[int] = None,
                 init: Optional[str] = None):
        if isinstance(restart_every, bool) or not isinstance(restart_every, int) \
                or restart_every < 1:
            raise ValueError(f"ReLoRA restart_every must be an integer >= 1, got "
                             f"{restart_every!r}")
        check_reset(reset, prune_ratio)
        if not isinstance(optimizer, LoRAOptimizer):
            raise ValueError("ReLoRA needs the adapters' LoRAOptimizer")
        self.layers = _lora_layers(model)
        if not self.layers:
            raise ValueError("the model has no LoRA adapters; call apply_lora first")
        if [ad for _, ad in self.layers] != optimizer.adapters:
            raise ValueError("the optimizer was built for other adapters than the model's")
        from megatron.core.utils import unwrap_model

        chunks = model if isinstance(model, (list, tuple)) else [model]
        cfg = dict(getattr(unwrap_model(chunks[0]), "lora_config", {}) or {})
        self.seed = int(cfg.get("seed", 0) if seed is None else seed)
        self.init = str(cfg.get("init", "kaiming") if init is None else init)
        self.optimizer = optimizer
        self.restart_every = restart_every
        self.reset = reset
        self.prune_ratio = float(prune_ratio)
        self.restarts = 0

    def due(self, steps_done: int) -> bool:
        """Whether a restart follows the ``steps_done``-th step."""
        return steps_done > 0 and steps_done % self.restart_every == 0

    def init_config(self, restart: int, rank: int, alpha: float) -> LoRAConfig:
        """The LoRA init of restart number ``restart`` (1, 2, ...): the seed advances with it."""
        return LoRAConfig(rank=rank, alpha=alpha, targets=["restart"], init=self.init,
                          seed=(self.seed + 7919 * restart) % (2 ** 31))

    @torch.no_grad()
    def restart(self) -> None:
        """Merge, re-initialise, reset (collective only through the optimizer's masters)."""
        self.restarts += 1
        new = []
        for module, ad in self.layers:
            if ad.merged:
                raise ValueError(f"{ad.global_name} is already merged; ReLoRA owns the merges")
            ad.merge(module)       # W0 += gamma B A on this rank's shards
            ad.merged = False      # B is set to 0 below: the branch adds nothing again
            A_full = ad._init_A(self.init_config(self.restarts, ad.rank, ad.alpha),
                                ad.A.device)
            B_full = torch.zeros(ad.shape[0], ad.rank, device=ad.B.device)
            ad.load_full(A_full, B_full, canonical=True)
            new.append((A_full, B_full))
        self.optimizer.restart_adapters(new, self.reset, self.prune_ratio)

    def state_dict(self) -> dict:
        return {"restarts": self.restarts, "restart_every": self.restart_every,
                "reset": self.reset, "prune_ratio": self.prune_ratio, "seed": self.seed,
                "init": self.init}

    def load_state_dict(self, state: dict) -> None:
        for key in ("restart_every", "reset", "prune_ratio", "seed", "init"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"ReLoRA state has {key} = {state.get(key)!r}, this run "
                                 f"{getattr(self, key)!r}")
        self.restarts = int(state["restarts"])


# ============================================================================== full-rank part
def trainable_base_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every trainable non-LoRA parameter, in module order."""
    from megatron.core.utils import unwrap_model

    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for i, chunk in enumerate(chunks):
        for name, p in unwrap_model(chunk).named_parameters():
            if p.requires_grad and not getattr(p, "is_lora", False):
                out.append((f"{i}.{name}", p))
    return out


class TrainableAdamW:
    """AdamW on the parameters ReLoRA trains at full rank (e.g. embeddings, norms, output).

    Reads Megatron DDP's data-parallel-reduced ``main_grad`` (``use_distributed_optimizer=
    False``); clips by the global norm of these gradients (TP-sharded ones summed over the TP
    group, replicated ones counted once, PP stages summed), separately from the adapters.
    Elementwise, so the update of a TP shard is the shard of the TP1 update.
    """

    def __init__(self, model, *, lr: float, weight_decay: float = 0.0, clip_grad: float = 0.0,
                 betas: Sequence[float] = (0.9, 0.95), eps: float = 1e-8):
        self.named = trainable_base_parameters(model)
        if not self.named:
            raise ValueError("no trainable non-LoRA parameters")
        self.clip_grad = float(clip_grad)
        self.masters = [p for _, p in self.named]  # fp32 models only (checked below)
        for name, p in self.named:
            if p.dtype != torch.float32:
                raise ValueError(f"{name}: TrainableAdamW needs fp32 parameters, got {p.dtype}")
        self.inner = torch.optim.AdamW(self.masters, lr=lr, betas=tuple(betas), eps=eps,
                                       weight_decay=weight_decay)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def _grad_norm(self) -> float:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        dev = self.masters[0].device
        sq = torch.zeros(1, dtype=torch.float64, device=dev)
        for p in self.masters:
            if param_is_not_tensor_parallel_duplicate(p):
                sq += p.grad.double().square().sum()
        if dist.is_initialized():
            from megatron.core import parallel_state as ps

            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return float(sq.sqrt())

    @torch.no_grad()
    def step(self):
        for p in self.masters:
            g = getattr(p, "main_grad", None)
            p.grad = torch.zeros_like(p) if g is None else g.detach().float().clone()
        norm = self._grad_norm()
        ok = math.isfinite(norm)
        if ok:
            if self.clip_grad > 0 and norm > self.clip_grad:
                coef = self.clip_grad / (norm + 1e-6)
                for p in self.masters:
                    p.grad.mul_(coef)
            self.inner.step()
        for p in self.masters:
            p.grad = None
        return ok, norm, None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.masters:
            p.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


# ============================================================================== checkpoints
def _rank_file(directory: str) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return os.path.join(directory, f"rank{rank:05d}.pt")


def save_training_state(directory: str, model, optimizers: dict, relora: ReLoRA,
                        iteration: int, meta: Optional[dict] = None) -> None:
    """One ``torch.save`` file per rank under ``directory`` (this rank's model shards incl.
    the merged base, the optimizers' states, the restart count, ``iteration``, ``meta``).
    Collective (barriers); the same layout resumes it bit for bit."""
    from megatron.core.utils import unwrap_model

    chunks = model if isinstance(model, (list, tuple)) else [model]
    os.makedirs(directory, exist_ok=True)
    blob = {"format": STATE_FORMAT, "iteration": int(iteration), "meta": dict(meta or {}),
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "model": [{k: v.detach().clone() if torch.is_tensor(v) else v
                       for k, v in unwrap_model(c).state_dict().items()} for c in chunks],
            "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
            "relora": relora.state_dict()}
    path = _rank_file(directory)
    torch.save(blob, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    if dist.is_initialized():
        dist.barrier()


def load_training_state(directory: str, model, optimizers: dict, relora: ReLoRA,
                        meta: Optional[dict] = None) -> int:
    """Read :func:`save_training_state`'s file of this rank; returns the iteration.  A file
    written by another world size, or with other ``meta``, is a ``ValueError``."""
    from megatron.core.utils import unwrap_model

    path = _rank_file(directory)
    if not os.path.isfile(path):
        raise ValueError(f"no ReLoRA training state at {path!r}")
    blob = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(blob, dict) or blob.get("format") != STATE_FORMAT:
        raise ValueError(f"{path!r} is not a {STATE_FORMAT} file")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if blob["world"] != world:
        raise ValueError(f"{directory}: saved by {blob['world']} ranks, this run has {world} "
                         f"(resume with the same layout)")
    for key, value in (meta or {}).items():
        if blob["meta"].get(key) != value:
            raise ValueError(f"{directory}: saved with {key} = {blob['meta'].get(key)!r}, this "
                             f"run has {value!r}")
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk, state in zip(chunks, blob["model"]):
        unwrap_model(chunk).load_state_dict(state, strict=True)
    if set(blob["optimizers"]) != set(optimizers):
        raise ValueError(f"{directory}: optimizers {sorted(blob['optimizers'])}, this run "
                         f"{sorted(optimizers)}")
    for key, opt in optimizers.items():
        opt.load_state_dict(blob["optimizers"][key])
    relora.load_state_dict(blob["relora"])
    return int(blob["iteration"])
