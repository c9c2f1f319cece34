"""Optimizers for (TP-sharded) LoRA adapters: sMuon, Riemannion, AdamW-LoRA, per-factor Muon.

``LoRAOptimizer(model, "smuon" | "riemannion" | "adam" | "muon_factors", lr=...)`` keeps an
fp32 *full* (TP-unsharded, canonical layout) master copy of every adapter's A and B on each
rank and runs a plain single-device optimizer on them --
:class:`~megatron_muon.peft.smuon.SMuon`, :class:`~megatron_muon.peft.riemannion.Riemannion`,
``torch.optim.AdamW`` or :class:`~megatron_muon.core.muon.Muon` (on A and B separately) -- so the
maths is exactly the tested single-device maths whatever the TP layout.  Per step:

1. gradients: the replicated factor's gradient is already complete on every TP rank (the
   adapter branch all-reduces its r-wide activations, see ``lora.py``); the sharded factor's
   gradient shards are all-gathered -- one batched ``all_gather`` per TP group for all
   adapters.  With Megatron DDP the gradients are read from ``param.main_grad`` after its
   data-parallel all-reduce (wrap with ``use_distributed_optimizer=False``: adapters are
   small, so ZeRO buys nothing here).
2. optional global-norm clipping (norm over all adapters; summed over PP stages and EP ranks).
3. the optimizer step on the full masters.  For sMuon the 2r x 2r-core work
   (``smuon_direction``: thin QRs, r x r solves, Newton-Schulz) is **distributed** by default
   (``smuon_work="distribute"``): every rank of the work group (the TP group, or TP x DP with
   ``work_group="tp_dp"``) updates all momenta (cheap, elementwise, so the optimizer state
   stays replicated and layout-independent), computes the directions of the adapters it
   owns (a greedy balance of ``(m + n) r^2``), and one ``all_gather`` of the packed
   directions gives every rank all of them.  ``smuon_work="replicate"`` runs
   ``SMuon.step`` redundantly on every rank instead.  Both give bitwise the same update.
   ``tools/bench_lora_smuon.py`` measured (CPU, TP2, hidden 1024): one layer set's directions
   take 4.0 / 10.9 / 81.5 ms at r = 8 / 16 / 64, the direction all-gather 1.2 / 0.8 / 3.6 ms,
   and a 2-layer step 16.0 vs 18.3, 22.4 vs 30.3, 104 vs 181 ms (distribute vs replicate):
   the work is worth distributing at every LoRA size, hence the default.  Riemannion
   (docs/relora.md#riemannion) uses the same machinery (``smuon_work`` applies to it too):
   its owner computes the whole pair update (basis, tangent momentum, direction, retraction)
   and the all-gather carries the new factors and momentum state, 3 r (m + n) numbers per
   adapter instead of sMuon's r (m + n).
4. every rank writes its shards of the updated masters back into the model's parameters.

The returned ``step()`` value is Megatron's ``(update_successful, grad_norm, num_zeros)``; a
non-finite gradient norm skips the step (``update_successful = False``), as Megatron's
optimizers do.

``last_timing`` holds the host-clock seconds of the last step's phases (gradient gather,
directions, exchange, total); each phase is also a ``megatron_muon.distributed.trace`` span (and so a
``torch.profiler`` range).  On GPUs the host clock times kernel launches, not the kernels:
``profile=True`` synchronises the device around each phase so that it measures the work --
at the cost of those synchronisations, hence off by default.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_muon.core.muon import Muon
from megatron_muon.peft.resets import check_reset, prune_by_magnitude
from megatron_muon.peft.riemannion import Riemannion
from megatron_muon.peft.smuon import SMuon
from megatron_muon.distributed.trace import span
from megatron_muon.peft.lora import LoRAAdapter, _as_chunks, lora_adapters

__all__ = ["LoRAOptimizer", "LORA_OPTIMIZERS"]

LORA_OPTIMIZERS = ("smuon", "adam", "muon_factors", "riemannion")
PAIR_OPTIMIZERS = {"smuon": SMuon, "riemannion": Riemannion}  # LoRAPairOptimizer subclasses


def _grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    g = getattr(p, "main_grad", None)
    if g is None:
        g = p.grad
    return g


class LoRAOptimizer:
    """sMuon / Riemannion / AdamW / per-factor Muon over a model's LoRA adapters (any layout).

    Args:
        model: the model (module or list of pipeline chunks, DDP-wrapped or not) after
            :func:`~megatron_muon.peft.lora.apply_lora` (and after loading adapters).
        optimizer: ``smuon``, ``riemannion`` (Muon on the rank-r manifold,
            docs/relora.md#riemannion), ``adam`` (AdamW on A and B) or ``muon_factors`` (Muon
            on A and B separately, each factor orthogonalised on its own).
        lr, weight_decay, clip_grad (0 = off): as usual.
        momentum, nesterov, ns_steps, coefficient_type, scale_mode, extra_scale_factor,
        damping, exact_sign: sMuon / Riemannion / Muon settings (docs/design.md#muon,
            #smuon-and-lora; Riemannion has no damping).
        adam_betas, adam_eps: AdamW settings.
        smuon_work: ``distribute`` (default) or ``replicate`` (see the module docstring);
            sMuon and Riemannion.
        work_group: ``tp`` (default) or ``tp_dp``: over which ranks sMuon's / Riemannion's
            per-pair work is spread (expert adapters always use their own TP group).
        profile: synchronise the device around the timed phases (``last_timing``), see the
            module docstring.
    """

    def __init__(self, model, optimizer: str = "smuon", *, lr: float, weight_decay: float = 0.0,
                 clip_grad: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, coefficient_type="simple", scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, damping: float = 1e-6,
                 exact_sign: bool = False, adam_betas=(0.9, 0.999), adam_eps: float = 1e-8,
                 smuon_work: str = "distribute", work_group: str = "tp", profile: bool = False):
        if optimizer not in LORA_OPTIMIZERS:
            raise ValueError(f"unknown LoRA optimizer {optimizer!r}; choose one of "
                             f"{list(LORA_OPTIMIZERS)}")
        if smuon_work not in ("distribute", "replicate"):
            raise ValueError(f"smuon_work must be 'distribute' or 'replicate', got {smuon_work!r}")
        if work_group not in ("tp", "tp_dp"):
            raise ValueError(f"work_group must be 'tp' or 'tp_dp', got {work_group!r}")
        if not (isinstance(clip_grad, (int, float)) and math.isfinite(clip_grad)
                and clip_grad >= 0):
            raise ValueError(f"clip_grad must be >= 0, got {clip_grad!r}")
        for chunk in _as_chunks(model):
            ddp_config = getattr(chunk, "ddp_config", None)
            if ddp_config is not None and getattr(ddp_config, "use_distributed_optimizer", False):
                raise ValueError(
                    "LoRAOptimizer reads full data-parallel gradients: wrap the model in "
                    "DistributedDataParallel with use_distributed_optimizer=False")
        self.adapters: list[LoRAAdapter] = lora_adapters(model)
        if not self.adapters:
            raise ValueError("the model has no LoRA adapters; call apply_lora first")
        for ad in self.adapters:
            if ad.merged:
                raise ValueError(f"{ad.global_name} is merged; unmerge before training")
        self.kind = optimizer
        self.clip_grad = float(clip_grad)
        self.smuon_work = smuon_work
        self.work_group = work_group
        self.profile = bool(profile)
        self.masters: list[tuple[torch.Tensor, torch.Tensor]] = []
        for ad in self.adapters:
            A, B = ad.gather_full(canonical=True)
            self.masters.append((A.to(ad.A.device), B.to(ad.B.device)))
        flat = [t for pair in self.masters for t in pair]
        if optimizer in PAIR_OPTIMIZERS:
            groups: dict[float, list] = {}
            for ad, pair in zip(self.adapters, self.masters):
                groups.setdefault(ad.gamma, []).append(pair)
            extra = {"damping": damping} if optimizer == "smuon" else {}
            self.inner = PAIR_OPTIMIZERS[optimizer](
                [{"pairs": pairs, "gamma": g} for g, pairs in groups.items()], lr=lr,
                momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                ns_steps=ns_steps, coefficient_type=coefficient_type, scale_mode=scale_mode,
                extra_scale_factor=extra_scale_factor, exact_sign=exact_sign, **extra)
        elif optimizer == "muon_factors":
            self.inner = Muon(flat, lr=lr, momentum=momentum, nesterov=nesterov,
                              weight_decay=weight_decay, ns_steps=ns_steps,
                              coefficient_type=coefficient_type, scale_mode=scale_mode,
                              extra_scale_factor=extra_scale_factor)
        else:
            self.inner = torch.optim.AdamW(flat, lr=lr, betas=tuple(adam_betas), eps=adam_eps,
                                           weight_decay=weight_decay)
        self._index = {id(A): i for i, (A, _) in enumerate(self.masters)}
        self._gather_plan = self._plan_gathers()
        self._work_plan = self._plan_work() if optimizer in PAIR_OPTIMIZERS else None
        self.last_timing: dict[str, float] = {}

    # ------------------------------------------------------------------ Megatron-ish API
    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for A, B in self.masters:
            A.grad = None
            B.grad = None
        for ad in self.adapters:
            for p in (ad.A, ad.B):
                p.grad = None

    def state_dict(self) -> dict:
        """Layout-independent: full canonical masters and the inner optimizer's state."""
        return {"kind": self.kind, "inner": self.inner.state_dict(),
                "masters": {ad.global_name: (A.cpu().clone(), B.cpu().clone())
                            for ad, (A, B) in zip(self.adapters, self.masters)}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"optimizer state is for {state.get('kind')!r}, not {self.kind!r}")
        for ad, (A, B) in zip(self.adapters, self.masters):
            A_s, B_s = state["masters"][ad.global_name]
            A.copy_(A_s)
            B.copy_(B_s)
        self.inner.load_state_dict(state["inner"])
        self._write_back()

    @torch.no_grad()
    def restart_adapters(self, factors: list, reset: str = "zero",
                         prune_ratio: float = 0.0) -> None:
        """After the adapters were merged and re-initialised (``peft/relora.py``): set the
        masters to ``factors`` (full canonical ``(A, B)`` per adapter, in order, the values
        just loaded into the adapters) and reset the inner optimizer's state: ``zero`` drops
        it (a fresh optimizer), ``prune`` zeroes all but the ``1 - prune_ratio``
        largest-magnitude entries of each state tensor (step counters are kept, and so is
        Riemannion's ``basis``: the frame its momentum components refer to), ``keep`` leaves
        it.  Local: the state is replicated, so every rank does the same."""
        check_reset(reset, prune_ratio)
        if len(factors) != len(self.masters):
            raise ValueError(f"restart_adapters got {len(factors)} factor pairs for "
                             f"{len(self.masters)} adapters")
        for (A, B), (A_new, B_new) in zip(self.masters, factors):
            A.copy_(A_new)
            B.copy_(B_new)
        if reset == "zero":
            self.inner.state.clear()
        elif reset == "prune":
            for state in self.inner.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0 and \
                            key not in ("step", "basis"):
                        prune_by_magnitude(value, prune_ratio)

    # ------------------------------------------------------------------ plans
    def _plan_gathers(self):
        """Adapters grouped by TP group (size > 1): one all_gather per group and step."""
        plan: dict[int, dict] = {}
        for i, ad in enumerate(self.adapters):
            if ad.tp_size > 1:
                entry = plan.setdefault(id(ad.tp_group), {"group": ad.tp_group,
                                                           "size": ad.tp_size, "items": []})
                entry["items"].append(i)
        return list(plan.values())

    def _plan_work(self):
        """Owner of each adapter's pair work (sMuon direction, Riemannion update) within its
        work group (greedy LPT); ``offset`` / ``slot``: where its result goes in the packed
        all-gather buffer."""
        groups: dict[int, dict] = {}
        for i, ad in enumerate(self.adapters):
            group, size = ad.tp_group, ad.tp_size
            if self.work_group == "tp_dp" and not ad.is_expert and dist.is_initialized():
                from megatron.core import parallel_state as ps

                group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
                size = dist.get_world_size(group)
            if self.smuon_work == "replicate" or not dist.is_initialized():
                size = 1
            entry = groups.setdefault(id(group) if size > 1 else 0,
                                      {"group": group, "size": size, "items": []})
            entry["items"].append(i)
        plans = []
        for entry in groups.values():
            size = entry["size"]
            rank = dist.get_rank(entry["group"]) if size > 1 else 0
            load = [0.0] * size
            numel = [0] * size
            owner, offset = {}, {}

            def cost(i):
                m, n = self.adapters[i].shape
                r = self.adapters[i].rank
                return (m + n) * r * r + 10 * r ** 3

            for i in sorted(entry["items"], key=lambda i: (-cost(i), i)):
                o = min(range(size), key=lambda k: (load[k], k))
                owner[i], offset[i] = o, numel[o]
                load[o] += cost(i)
                numel[o] += sum(math.prod(s) for s in self.inner.result_shapes(*self.masters[i]))
            plans.append(dict(entry, rank=rank, owner=owner, offset=offset,
                              slot=max(numel) if numel else 0))
        return plans

    # ------------------------------------------------------------------ gradients
    def _load_grads(self) -> None:
        full = {}
        for plan in self._gather_plan:
            items = plan["items"]
            shards = []
            for i in items:
                ad = self.adapters[i]
                p = ad.B if ad.sharded == "B" else ad.A
                g = _grad_of(p)
                shards.append(torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                              if g is None else g.detach().float())
            flat = torch.cat([s.reshape(-1) for s in shards])
            parts = [torch.empty_like(flat) for _ in range(plan["size"])]
            dist.all_gather(parts, flat, group=plan["group"])
            off = 0
            for i, s in zip(items, shards):
                ad = self.adapters[i]
                pieces = [part[off: off + s.numel()].view(s.shape) for part in parts]
                full[i] = torch.cat(pieces, dim=ad.shard_dim)
                off += s.numel()
        for i, (ad, (A, B)) in enumerate(zip(self.adapters, self.masters)):
            grads = []
            for p, master, factor in ((ad.A, A, "A"), (ad.B, B, "B")):
                if i in full and ad.sharded == factor:
                    g = full[i]
                    if factor == "B":
                        g = ad._from_tp_order(g)
                else:
                    g = _grad_of(p)
                    g = torch.zeros_like(master) if g is None else g.detach().float().clone()
                grads.append(g)
            A.grad, B.grad = grads

    def _grad_norm(self) -> float:
        dev = self.masters[0][0].device
        sq = torch.zeros(2, dtype=torch.float64, device=dev)  # [dense, expert]
        for ad, (A, B) in zip(self.adapters, self.masters):
            sq[int(ad.is_expert)] += A.grad.double().square().sum() + B.grad.double().square().sum()
        if dist.is_initialized():
            from megatron.core import parallel_state as ps

            try:
                if ps.get_expert_model_parallel_world_size() > 1:
                    e = sq[1:].clone()
                    dist.all_reduce(e, group=ps.get_expert_model_parallel_group())
                    sq[1:] = e
                if ps.get_pipeline_model_parallel_world_size() > 1:
                    dist.all_reduce(sq, group=ps.get_pipeline_model_parallel_group())
            except AssertionError:  # parallel_state not initialised: a single stage
                pass
        return float(sq.sum().sqrt())

    # ------------------------------------------------------------------ the step
    def _sync(self) -> None:
        """Wait for the device when profiling (see the module docstring)."""
        if self.profile and torch.cuda.is_available():
            torch.cuda.synchronize()

    @torch.no_grad()
    def step(self, closure=None):
        self._sync()
        t0 = time.perf_counter()
        with span("lora.grad_gather", "lora"):
            self._load_grads()
            self._sync()
        t1 = time.perf_counter()
        norm = self._grad_norm()
        if not math.isfinite(norm):
            self.zero_grad()
            self.last_timing = dict(grad_gather_s=t1 - t0, total_s=time.perf_counter() - t0)
            return False, norm, None
        if self.clip_grad > 0 and norm > self.clip_grad:
            coef = self.clip_grad / (norm + 1e-6)
            for A, B in self.masters:
                A.grad.mul_(coef)
                B.grad.mul_(coef)
        timing = {}
        with span("lora.step", "lora"):
            if self.kind in PAIR_OPTIMIZERS and self.smuon_work == "distribute":
                timing = self._distributed_step()
            else:
                self.inner.step()
            self._write_back()
            self._sync()
        self.last_timing = dict(grad_gather_s=t1 - t0, total_s=time.perf_counter() - t0,
                                **timing)
        return True, norm, None

    @torch.no_grad()
    def _write_back(self) -> None:
        for ad, (A, B) in zip(self.adapters, self.masters):
            A_loc, B_loc = ad.shard(A, B, canonical=True)
            ad.A.copy_(A_loc.to(ad.A.dtype))
            ad.B.copy_(B_loc.to(ad.B.dtype))

    def _distributed_step(self) -> dict:
        """The inner LoRAPairOptimizer's step with the pair work spread over owners (same
        maths, same order): ``pair_prepare`` everywhere (sMuon: the momenta, replicated and
        cheap), ``pair_work`` on each pair's owner, one all-gather, ``pair_finish``
        everywhere."""
        inner = self.inner
        jobs = {}
        for group in inner.param_groups:
            for A, B in inner._pairs(group):
                # the gradients are finite (step checked their norm)
                jobs[self._index[id(A)]] = (group, A, B,
                                            inner.pair_prepare(group, A, B, check_finite=False))
        self._sync()
        t0 = time.perf_counter()
        results, t_exchange = {}, 0.0
        for plan in self._work_plan:
            mine = [i for i in plan["items"] if plan["size"] == 1 or plan["owner"][i] == plan["rank"]]
            with span("lora.directions", "lora"):
                for i in mine:
                    group, A, B, job = jobs[i]
                    results[i] = inner.pair_work(group, A, B, job)
            if plan["size"] == 1:
                continue
            self._sync()
            te = time.perf_counter()
            with span("lora.exchange", "lora"):
                self._exchange(plan, mine, jobs, results)
            self._sync()
            t_exchange += time.perf_counter() - te
        t_dir = time.perf_counter() - t0 - t_exchange
        for i, (group, A, B, job) in jobs.items():
            inner.pair_finish(group, A, B, job, results[i])
        return dict(direction_s=t_dir, exchange_s=t_exchange)

    def _exchange(self, plan: dict, mine: list, jobs: dict, results: dict) -> None:
        """One all_gather of the packed results of ``plan``'s owners: every rank gets all."""
        dev = self.masters[0][0].device
        buf = torch.zeros(plan["slot"], dtype=torch.float32, device=dev)
        for i in mine:
            o = plan["offset"][i]
            for t in results[i]:
                buf[o: o + t.numel()] = t.reshape(-1)
                o += t.numel()
        parts = [torch.empty_like(buf) for _ in range(plan["size"])]
        dist.all_gather(parts, buf, group=plan["group"])
        for i in plan["items"]:
            if plan["owner"][i] == plan["rank"]:
                continue
            _, A, B, _ = jobs[i]
            part, o = parts[plan["owner"][i]], plan["offset"][i]
            out = []
            for shape in self.inner.result_shapes(A, B):
                k = math.prod(shape)
                out.append(part[o: o + k].view(shape))
                o += k
            results[i] = tuple(out)
