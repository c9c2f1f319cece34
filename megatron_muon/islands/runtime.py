"""DiLoCo / IsoLoCo islands over Megatron-Core (docs/design.md, distributed islands).

The world of ``W`` ranks is split into ``K`` islands of ``S = W / K`` ranks: island ``k`` is
the contiguous block of global ranks ``[k S, (k + 1) S)``. Each island is a complete
Megatron layout (TP x PP x DP inside it, ``S = TP PP DP``) that trains alone for ``H`` inner
steps; then the islands synchronise with the outer step (``IslandOuterStep``).

How islands map onto Megatron's process groups
----------------------------------------------
Megatron's ``parallel_state`` is global, and ``initialize_model_parallel`` builds its data-
parallel groups over the whole world: with ``DP = K x DP_island`` the gradient all-reduce of
every inner step would cross islands. Two Megatron mechanisms that look close do not fit:

* ``num_distributed_optimizer_instances = K`` does split the DP domain into K contiguous
  "partial" DP groups, but DDP still all-reduces gradients across the instances every step
  (and scales them by 1 / (K DP_island)); it is hierarchical data parallelism, not islands.
* passing a hand-made ``ProcessGroupCollection`` to DDP and the optimizer covers those two
  objects only: ``parallel_state.get_data_parallel_*`` stays global, so everything that reads
  it directly (DMuon's owner plan, the distributed optimizer's grad-norm group
  ``intra_distributed_optimizer_instance_group`` = the whole world when there is one
  instance, checkpoint code, data loaders) would still see K x DP_island.

What ``initialize_islands`` does instead (verified on megatron-core 0.16.1 and 0.19.2):
``initialize_model_parallel`` is run for the caller's island only
(``compat.initialize_island_model_parallel``): on 0.19 with its own ``rank_offset = k S`` and
``local_world_size = S``; on 0.16, which lacks them, the same two values are supplied while it
runs (the default world size reads ``S``, Megatron's ``RankGenerator`` gets the offset). The
ranks Megatron computes and stores (``_PIPELINE_GLOBAL_RANKS`` and co.) are therefore global
ranks of the island, checked afterwards against the ranks of their process groups.
``parallel_state.create_group`` (the single function through which it creates every group) is
wrapped so that each group over island-local ranks ``R`` is created K times, over ``R + j S``
for every island ``j`` -- every rank takes part in every ``new_group`` call, in the same
order, as torch requires -- and the copy of the caller's own island is kept. The result:
every Megatron group -- TP, PP, CP, EP, embedding, model-parallel, DP (plain, with CP,
partial, gloo), expert DP, the distributed-optimizer instance group -- is island-local;
``get_data_parallel_world_size()`` returns DP_island. The ``IslandLayout`` hands the island's
groups on explicitly: ``layout.pg_collection`` (Megatron's ``ProcessGroupCollection``, for
``get_megatron_optimizer(..., pg_collection=...)`` and, on 0.19, the model and DDP) and
``layout.groups`` (``DMuonGroups``, which the outer step uses).
Megatron DDP, the distributed optimizer (AdamW) and DMuon work unchanged inside an island.
Only the setup does world-wide collectives (Megatron's ``_get_param_groups`` gathers param-
group keys over the world), so all islands build their optimizers together.

The cross-island group of a rank joins the ranks with the same island-local rank (hence the
same TP/PP/DP coordinates): ``{j S + local : j < K}``; it is created here with
``torch.distributed.new_group`` (NCCL on GPUs, gloo on CPU).

The outer step (``IslandOuterStep.step``)
-----------------------------------------
Every H inner steps, on every rank:

1. ``D_k = theta_global - theta_k`` for the parameters this rank is responsible for. Inside
   an island the DP replicas hold the same parameters, so the parameters are split among
   the DP ranks of the island (``plan_owners``, by size and Iso-C cost): DP rank ``d`` works
   on its share only, over its own cross-island group, and broadcasts the new values to the
   other DP ranks of its island at the end. TP shards and PP stages stay where they are.
2. ``mean D``: one all-reduce of a flat buffer over the cross-island group, divided by K.
3. Outer optimizer: ``megatron_muon.islands.isoloco.OuterOptimizer`` over this rank's (sharded)
   parameters -- DiLoCo (Nesterov SGD) or IsoLoCo (Iso-C with ``svd`` or ``ns`` mode, both
   orders). Non-matrix parameters use mean D as is.
4. Iso-C needs the *full* matrix, and is computed once per matrix: ``plan_owners`` places
   every Iso-C matrix on one owner slot ``(island, TP rank)`` of the cross-island x TP
   plane. Inside the owner island the TP shards go to the owner TP rank (one all-to-all in
   the TP group), the owner computes ``iso_c`` of the full matrix, the shards go back (one
   all-to-all), and every island receives the result by one broadcast per owner island over
   the cross-island group. (Row/column order of the concatenated TP shards does not matter:
   Iso-C commutes with permutations.)
5. The new global parameters are written into the model (``param.data``; the param buffer
   of Megatron DDP) and ``optimizer.reload_model_params()`` refreshes the inner optimizer's
   main parameters. The inner optimizer state (AdamW moments) is kept, as in DiLoCo.

Bytes are counted in ``IslandOuterStep.comm_stats`` (``megatron_muon.distributed.comm.CommStats``) with
the usual ring-algorithm model: all-reduce ``2 (g-1)/g n``, broadcast ``(g-1)/g n``,
all-to-all exact (what leaves the rank).

Fault mode (opt-in, ``fault_tolerant=True``)
--------------------------------------------
Before round ``n``'s collectives every rank announces itself in a ``TCPStore`` (hosted by
global rank 0, port exchanged at construction): ``add("r{n}/arrived/{island}", 1)``; an
island is present when all its S ranks arrived. The first arrival of an up-to-date island
starts the round's clock. A round is decided when every island is present, or
``island_timeout`` seconds after the clock started (with at least one up-to-date island
present): the deciding rank writes the participant list with ``compare_set``, which is
atomic, so every rank adopts the same decision whoever wrote it. Then:

* the participants run the outer step over the present islands only: over the normal
  cross-island group when all islands are present, else over a ``ProcessGroupGloo`` built for
  that round from the store (CPU tensors; no global ``new_group`` call is needed, so the
  absent island is never waited for);
* an island that finds the decision made without it logs a warning, is marked stale and goes
  straight to the next round (its unfinished inner steps would be discarded anyway). In the
  round where it is back, it contributes nothing to mean D (zeros, and the mean is over the
  up-to-date islands), it first receives the global parameters, outer momentum and step count
  from an up-to-date island (one broadcast), and after the step its model is reset to the new
  global parameters. Training goes on throughout.

It never hangs: every wait has a deadline (``island_timeout`` for the decision,
``rejoin_timeout`` for a stale island waiting for the others, the store and gloo timeouts for
the collectives of a round whose members are all present) and raises ``IslandTimeoutError``
instead; an island that would rejoin after ``max_rounds`` returns at once.

Checkpointing: ``IslandOuterStep.state_dict()`` holds this rank's share of the global
parameters, the outer momentum, the round counter and the fault-mode state;
``load_state_dict`` restores it bitwise (same layout). ``save_island_checkpoint`` /
``load_island_checkpoint`` also write the model and the inner Megatron optimizer (its fp32
main-parameter shards and the torch optimizer state: AdamW moments and steps), one
``torch.save`` file per rank in one folder per island, with no collective, for an exact
resume on the same layout. Megatron's ``dist_checkpointing`` is not used: its collectives
span the whole world, and the K islands hold K different models under the same keys.

Limitations: dense models only (EP = 1, CP = 1); bf16 models keep fp32 global parameters but
the inner optimizer's main parameters are reloaded from the bf16 model parameters; in fault
mode ``island_timeout`` must exceed the normal spread of the islands' arrival times, and the
rounds of a partial set of islands run over gloo on CPU copies of the buffers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_muon.distributed.comm import CommStats, all_to_all_flat
from megatron_muon.islands.isoloco import OUTER_DEFAULTS, OuterOptimizer
from megatron_muon.core.plan import UnitTask, plan_owners
from megatron_muon.megatron import compat

__all__ = [
    "IslandLayout",
    "initialize_islands",
    "destroy_islands",
    "IslandOuterStep",
    "IslandTimeoutError",
    "add_outer_args",
    "validate_outer_args",
    "outer_kwargs_from_args",
    "OuterArgumentError",
    "save_island_checkpoint",
    "load_island_checkpoint",
    "island_param_names",
    "get_island_layout",
]

logger = logging.getLogger(__name__)


class IslandTimeoutError(RuntimeError):
    """A fault-mode wait ran past its deadline (raised instead of hanging)."""


# ==========================================================================================
# Layout: K islands, each a full Megatron layout
# ==========================================================================================

@dataclass
class IslandLayout:
    """Where this rank sits: island, local rank and the cross-island group."""

    num_islands: int
    island_size: int
    island: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    cross_ranks: list[int]  # global ranks of this rank's cross-island group, index = island
    cross_group: Optional[Any] = field(default=None, repr=False)
    # the island's own groups: Megatron's ProcessGroupCollection (for DDP, the model and
    # ``get_megatron_optimizer(..., pg_collection=...)``) and DMuon's view of them
    pg_collection: Optional[Any] = field(default=None, repr=False)
    groups: Optional[Any] = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return self.num_islands * self.island_size

    @property
    def island_ranks(self) -> list[int]:
        base = self.island * self.island_size
        return list(range(base, base + self.island_size))


_LAYOUT: Optional[IslandLayout] = None


# (rank-list global, getter of the group it describes) pairs checked after the set-up
_RANK_LIST_CHECKS = (
    ("_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "get_tensor_model_parallel_group", {}),
    ("_DATA_PARALLEL_GLOBAL_RANKS", "get_data_parallel_group", {}),
    ("_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "get_data_parallel_group",
     {"with_context_parallel": True}),
    ("_MODEL_PARALLEL_GLOBAL_RANKS", "get_model_parallel_group", {}),
    ("_CONTEXT_PARALLEL_GLOBAL_RANKS", "get_context_parallel_group", {}),
    ("_EMBEDDING_GLOBAL_RANKS", "get_embedding_group", {}),
    ("_POSITION_EMBEDDING_GLOBAL_RANKS", "get_position_embedding_group", {}),
)


def _check_rank_lists(ps) -> None:
    for list_name, getter, kw in _RANK_LIST_CHECKS:
        ranks = getattr(ps, list_name, None)
        fn = getattr(ps, getter, None)
        if ranks is None or fn is None:
            continue
        try:
            group = fn(**kw)
        except (AssertionError, RuntimeError):  # a group this layout does not have
            continue
        if group is None or isinstance(group, list):
            continue
        if sorted(dist.get_process_group_ranks(group)) != sorted(ranks):
            raise RuntimeError(f"initialize_islands: {list_name}={list(ranks)} does not match "
                               f"its group {dist.get_process_group_ranks(group)}; this "
                               "megatron-core version stores ranks in a way islands do not know")
    pp_ranks = getattr(ps, "_PIPELINE_GLOBAL_RANKS", None)
    if pp_ranks is not None and pp_ranks and isinstance(pp_ranks[0], int):
        group = ps.get_pipeline_model_parallel_group()
        if not isinstance(group, list) and \
                list(dist.get_process_group_ranks(group)) != list(pp_ranks):
            raise RuntimeError("initialize_islands: _PIPELINE_GLOBAL_RANKS does not match the "
                               "pipeline group")


def initialize_islands(num_islands: int, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                       seed: Optional[int] = 1234, **model_parallel_kwargs) -> IslandLayout:
    """Split the initialised world into ``num_islands`` Megatron layouts (see module doc).

    Every island gets TP x PP x DP_island with ``DP_island = world / (K TP PP)``; all groups
    of ``megatron.core.parallel_state`` are island-local afterwards. ``seed``: Megatron's RNG
    (``model_parallel_cuda_manual_seed``, same in every island so the islands start equal;
    ``None`` leaves the RNG alone). Extra keyword arguments go to
    ``initialize_model_parallel`` (``context_parallel_size`` and
    ``expert_model_parallel_size`` must stay 1). Returns the ``IslandLayout``.
    """
    global _LAYOUT
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("initialize_islands needs torch.distributed to be initialised")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(num_islands, int) or num_islands < 1:
        raise ValueError(f"num_islands must be an integer >= 1, got {num_islands!r}")
    if world % num_islands:
        raise ValueError(f"{num_islands} islands do not divide the world size {world}")
    size = world // num_islands
    if size % (tp * pp):
        raise ValueError(f"TP x PP = {tp} x {pp} does not divide the island size {size} "
                         f"(world {world} / {num_islands} islands)")
    for key in ("context_parallel_size", "expert_model_parallel_size"):
        if model_parallel_kwargs.get(key, 1) != 1:
            raise ValueError(f"islands support dense models without CP/EP for now ({key})")
    island, local = divmod(rank, size)
    ps.destroy_model_parallel()
    compat.initialize_island_model_parallel(
        num_islands, size, island, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        **model_parallel_kwargs)
    _check_rank_lists(ps)
    if ps.get_data_parallel_world_size() * tp * pp != size:
        raise RuntimeError("initialize_islands: Megatron's DP size is not island-local")
    cross = None
    mine = None
    for j in range(size):
        ranks = [k * size + j for k in range(num_islands)]
        group = dist.new_group(ranks) if num_islands > 1 else None
        if j == local:
            cross, mine = group, ranks
    if seed is not None:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_muon.megatron.groups import DMuonGroups

    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    _LAYOUT = IslandLayout(num_islands=num_islands, island_size=size, island=island,
                           local_rank=local, tp=tp, pp=pp, dp=size // (tp * pp),
                           cross_ranks=mine, cross_group=cross, pg_collection=pg_collection,
                           groups=DMuonGroups.from_parallel_state())
    return _LAYOUT


def destroy_islands() -> None:
    global _LAYOUT
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    _LAYOUT = None


def get_island_layout() -> IslandLayout:
    if _LAYOUT is None:
        raise RuntimeError("initialize_islands has not been called")
    return _LAYOUT


# ==========================================================================================
# Communication over the members of one cross-island group
# ==========================================================================================

def _ring(kind: str, nbytes: int, g: int) -> int:
    if g <= 1:
        return 0
    return int(round((2 if kind == "all_reduce" else 1) * (g - 1) / g * nbytes))


class _Comm:
    """All-reduce / broadcast over the participating islands of one cross-island group."""

    def __init__(self, size: int, index: int, stats: CommStats, group=None, ranks=None,
                 gloo=None):
        self.size, self.index, self.stats = size, index, stats
        self.group, self.ranks, self.gloo = group, ranks, gloo

    def all_reduce(self, t: torch.Tensor, kind: str = "outer_all_reduce") -> None:
        if self.size == 1:
            return
        n = _ring("all_reduce", t.numel() * t.element_size(), self.size)
        self.stats.add(kind, n, n)
        if self.gloo is not None:
            c = t.cpu()
            self.gloo.allreduce([c]).wait()
            if c.data_ptr() != t.data_ptr():
                t.copy_(c)
        else:
            dist.all_reduce(t, group=self.group)

    def broadcast(self, t: torch.Tensor, src: int, kind: str = "outer_broadcast") -> None:
        if self.size == 1 or t.numel() == 0:
            return
        n = _ring("broadcast", t.numel() * t.element_size(), self.size)
        self.stats.add(kind, n, n)
        if self.gloo is not None:
            c = t.cpu()
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self.gloo.broadcast([c], opts).wait()
            if c.data_ptr() != t.data_ptr():
                t.copy_(c)
        else:
            dist.broadcast(t, src=self.ranks[src], group=self.group)


def _flat(tensors: Sequence[torch.Tensor], dtype, device) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(device=device, dtype=dtype) for t in tensors])


def _unflat(buf: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for t in like:
        out.append(buf[off:off + t.numel()].view(t.shape))
        off += t.numel()
    return out


# ==========================================================================================
# The outer step
# ==========================================================================================

@dataclass
class _Entry:
    name: str  # global name (pipeline-global layer numbers)
    param: torch.Tensor  # the live model parameter (this rank's TP shard)
    full_shape: tuple
    tp_dim: Optional[int]  # partition dim when TP-sharded
    iso: bool
    slot: int = 0  # DP rank of the island that handles it in the outer step


def island_param_names(model: list) -> list[tuple[str, torch.Tensor]]:
    """(global name, parameter) of this rank's model chunks, names with global layer numbers."""
    from megatron.core.utils import unwrap_model

    from megatron_muon.megatron.models import global_param_name

    out = []
    for chunk in model:
        for name, p in unwrap_model(chunk).named_parameters():
            out.append((global_param_name(chunk, name), p))
    return out


def _iso_cost(shape) -> float:
    m, n = shape
    s = min(m, n)
    return float(m * n * s + s ** 3)


class IslandOuterStep:
    """The DiLoCo / IsoLoCo outer step across islands (module docstring has the design).

    Args:
        model: this rank's Megatron model chunks (DDP-wrapped or not).
        layout: from ``initialize_islands`` (default: the current one).
        method, lr, momentum, nesterov, order, iso_mode, ns_steps, ns_coefficients,
            ns_cleanup_steps, iso_filter: as ``megatron_muon.islands.isoloco.OuterOptimizer``
            (``iso_filter(name, full_shape)`` picks the Iso-C matrices; default all 2-D).
        inner_optimizer: the Megatron optimizer of the island; its ``reload_model_params``
            is called after the model parameters are replaced.
        delta_dtype: dtype of the pseudo-gradients and of their all-reduce (fp32; fp64 makes
            ``theta_global - D`` exact, e.g. to check that K = 1, lr 1, momentum 0 is a no-op).
        fault_tolerant, island_timeout, rejoin_timeout, max_rounds: fault mode (see module
            doc); ``max_rounds``: number of outer rounds of the run (a late island does not
            wait for a round beyond it).
        log: callable for messages (default: ``logging`` warning for fault events).
    """

    def __init__(self, model: list, layout: Optional[IslandLayout] = None,
                 method: str = "isoloco", lr: Optional[float] = None,
                 momentum: Optional[float] = None, *, nesterov: bool = True,
                 order: str = "iso_first", iso_mode: str = "svd",
                 ns_steps: Optional[int] = None, ns_coefficients=None,
                 ns_cleanup_steps: Optional[int] = None,
                 iso_filter: Optional[Callable[[str, tuple], bool]] = None,
                 inner_optimizer=None, delta_dtype: torch.dtype = torch.float32,
                 fault_tolerant: bool = False, island_timeout: float = 300.0,
                 rejoin_timeout: Optional[float] = None, max_rounds: Optional[int] = None,
                 poll_interval: float = 0.02, log: Optional[Callable[[str], None]] = None):
        self.layout = layout or get_island_layout()
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.delta_dtype = delta_dtype
        self.method = method
        self.fault_tolerant = bool(fault_tolerant)
        if self.fault_tolerant and not island_timeout > 0:
            raise ValueError(f"island_timeout must be > 0 seconds, got {island_timeout!r}")
        self.island_timeout = float(island_timeout)
        self.rejoin_timeout = float(rejoin_timeout if rejoin_timeout is not None
                                    else max(600.0, 10 * self.island_timeout))
        self.max_rounds = max_rounds
        self.poll_interval = poll_interval
        self._log = log or (lambda msg: logger.warning(msg))
        self.comm_stats = CommStats()
        self.round = 0  # next outer round
        self.stale = False  # missed a round; rejoins with zero weight and a state sync
        self.history: list[dict] = []
        self.iso_computed = 0  # Iso-C of full matrices computed on this rank (all rounds)
        L = self.layout
        G = L.groups
        if G is None or G.tp_size != L.tp or G.dp_size != L.dp:
            raise RuntimeError("IslandOuterStep: the layout's process groups do not match the "
                               "island layout (build it with initialize_islands)")
        self._tp_group, self._tp_rank = G.tp, G.tp_rank
        self._dp_group, self._dp_rank = G.dp, G.dp_rank
        self._dp_ranks = dist.get_process_group_ranks(self._dp_group)

        pick = iso_filter or (lambda name, shape: len(shape) == 2)
        entries = []
        for name, p in island_param_names(model):
            if not p.is_floating_point():
                continue
            tp_dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) \
                and L.tp > 1 else None
            shape = list(p.shape)
            if tp_dim is not None:
                shape[tp_dim] *= L.tp
            use = method == "isoloco" and bool(pick(name, tuple(shape)))
            if use and len(shape) != 2:
                raise ValueError(f"iso_filter picked {name!r} of shape {tuple(shape)}")
            entries.append(_Entry(name, p, tuple(shape), tp_dim, use))
        if len({e.name for e in entries}) != len(entries):
            raise ValueError("IslandOuterStep: duplicate parameter names in the model chunks")
        # split the parameters among the island's DP replicas (all replicas plan alike)
        if L.dp > 1:
            tasks = [UnitTask(e.name, (e.param.numel(), 1),
                              cost=float(e.param.numel()) + (_iso_cost(e.full_shape) / L.tp
                                                             if e.iso else 0.0))
                     for e in entries]
            plan = plan_owners(tasks, L.dp)
            for e in entries:
                e.slot = plan.owners[e.name]
        self.entries = entries
        self.owned = [e for e in entries if e.slot == self._dp_rank]
        if not self.owned:
            raise ValueError("IslandOuterStep: this DP rank owns no parameters (more DP ranks "
                             "per island than parameters)")
        iso_names = {e.name for e in self.owned if e.iso}
        self.opt = OuterOptimizer(
            {e.name: e.param.detach().float() if e.param.dtype != torch.float64
             else e.param.detach() for e in self.owned},
            method, lr, momentum, nesterov=nesterov, order=order, iso_mode=iso_mode,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients,
            ns_cleanup_steps=ns_cleanup_steps, iso_filter=lambda n, t: n in iso_names)
        self._device = self.owned[0].param.device
        self._full_comm = _Comm(L.num_islands, L.island, self.comm_stats,
                                group=L.cross_group, ranks=L.cross_ranks)
        self._store = None
        if self.fault_tolerant and L.num_islands > 1:
            self._store = self._make_store()

    # -- public ---------------------------------------------------------------------------
    @property
    def params(self) -> dict:
        """This rank's share of the global parameters (name -> tensor, live)."""
        return self.opt.params

    @torch.no_grad()
    def step(self) -> dict:
        """One outer round; returns a report (round, participants, stale, excluded, ...)."""
        t0 = time.perf_counter()
        L = self.layout
        skipped = []
        if self._store is None:
            participants, stale, comm = list(range(L.num_islands)), [], self._full_comm
        else:
            while True:
                decision = self._await_round(self.round)
                if decision is None:  # a late island past the last round
                    return self._report(t0, [], [], skipped, finished=True)
                if L.island in decision["islands"]:
                    break
                skipped.append(self.round)
                self._log(f"islands: island {L.island} missed outer round {self.round} "
                          f"(decided without it: {decision['islands']}); it rejoins at the "
                          "next round and is reset to the global parameters there")
                self.stale = True
                self.round += 1
            participants, stale = decision["islands"], decision["stale"]
            left_out = [k for k in range(L.num_islands) if k not in participants]
            if left_out and L.island == participants[0] and L.local_rank == 0:
                self._log(f"islands: outer round {self.round} left out islands {left_out} "
                          f"(not reported within {self.island_timeout:g} s)")
            comm = self._comm_for(participants)
        fresh = [i for i, k in enumerate(participants) if k not in stale]
        if stale:
            self._sync_state(comm, src=fresh[0])
        self._outer_update(comm, participants, n_fresh=len(fresh),
                           contribute=L.island not in stale)
        self.stale = False
        report = self._report(t0, participants, stale, skipped)
        self.round += 1
        self.history.append(report)
        return report

    def _report(self, t0, participants, stale, skipped, finished=False) -> dict:
        return dict(round=self.round, participants=list(participants), stale=list(stale),
                    excluded=[k for k in range(self.layout.num_islands)
                              if participants and k not in participants],
                    skipped_rounds=list(skipped), finished=finished,
                    seconds=time.perf_counter() - t0)

    def state_dict(self) -> dict:
        """This rank's outer state: global parameters (its share), momentum, round, layout."""
        L = self.layout
        return {"outer": self.opt.state_dict(), "round": self.round, "stale": self.stale,
                "layout": dict(num_islands=L.num_islands, island_size=L.island_size,
                               tp=L.tp, pp=L.pp, dp=L.dp, local_rank=L.local_rank),
                "owned": [e.name for e in self.owned]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        L = self.layout
        want = dict(num_islands=L.num_islands, island_size=L.island_size, tp=L.tp, pp=L.pp,
                    dp=L.dp, local_rank=L.local_rank)
        if dict(state.get("layout", {})) != want:
            raise ValueError(f"island outer state is for layout {state.get('layout')}, this "
                             f"run is {want}")
        if list(state["owned"]) != [e.name for e in self.owned]:
            raise ValueError("island outer state holds other parameters than this rank's share")
        self.opt.load_state_dict(state["outer"])
        self.round = int(state["round"])
        self.stale = bool(state["stale"])

    # -- the maths and the traffic ----------------------------------------------------------
    def _outer_update(self, comm: _Comm, participants, n_fresh: int, contribute: bool) -> None:
        L = self.layout
        for chunk in self.model:  # parameters of the last inner step must be in place
            ddp = getattr(chunk, "ddp_config", None)
            if ddp is not None and getattr(ddp, "overlap_param_gather", False):
                chunk.start_param_sync(force_sync=True)
        dd = self.delta_dtype
        glob = self.opt.params
        if contribute:
            deltas = [glob[e.name].to(dd) - e.param.detach().to(dd) for e in self.owned]
        else:
            deltas = [torch.zeros(e.param.shape, dtype=dd, device=self._device)
                      for e in self.owned]
        buf = _flat(deltas, dd, self._device)
        comm.all_reduce(buf)
        if n_fresh > 1:
            buf /= n_fresh
        mean = dict(zip([e.name for e in self.owned], _unflat(buf, deltas)))
        iso_results = None
        if any(e.iso for e in self.owned):
            inputs = self.opt.iso_inputs(mean)
            iso_results = self._distributed_iso_c(inputs, comm, len(participants))
        new = self.opt.step(mean, iso_results=iso_results if iso_results else None)
        for e in self.owned:
            e.param.data.copy_(new[e.name].to(e.param.dtype))
        if L.dp > 1:  # the island's other DP replicas take the new values from the owner
            for d in range(L.dp):
                mine = [e for e in self.entries if e.slot == d]
                tb = _flat([e.param.detach() for e in mine], mine[0].param.dtype,
                           self._device) if mine else None
                if tb is None:
                    continue
                n = _ring("broadcast", tb.numel() * tb.element_size(), L.dp)
                self.comm_stats.add("island_dp_broadcast", n, n)
                dist.broadcast(tb, src=self._dp_ranks[d], group=self._dp_group)
                if d != self._dp_rank:
                    for e, t in zip(mine, _unflat(tb, [e.param for e in mine])):
                        e.param.data.copy_(t)
        if self.inner_optimizer is not None and hasattr(self.inner_optimizer,
                                                        "reload_model_params"):
            self.inner_optimizer.reload_model_params()

    def _distributed_iso_c(self, inputs: dict, comm: _Comm, n_islands: int) -> dict:
        """iso_c of each full matrix, once, on an owner (island, TP rank); returns shards."""
        L = self.layout
        by_name = {e.name: e for e in self.owned}
        names = sorted(inputs)
        if not names:
            return {}
        tasks = [UnitTask(n, by_name[n].full_shape, cost=_iso_cost(by_name[n].full_shape))
                 for n in names]
        plan = plan_owners(tasks, n_islands * L.tp)
        owner = {n: divmod(plan.owners[n], L.tp) for n in names}  # (island index, tp rank)
        me = comm.index
        mine = [n for n in names if owner[n][0] == me]  # computed in this island
        full = {}
        if L.tp > 1 and mine:
            # shards -> owner TP rank (one all-to-all in the island's TP group)
            send, counts = [], [0] * L.tp
            for t in range(L.tp):
                for n in mine:
                    if owner[n][1] == t:
                        send.append(inputs[n].reshape(-1))
                        counts[t] += inputs[n].numel()
            recv_counts = [0] * L.tp
            for n in mine:
                if owner[n][1] == self._tp_rank:
                    for t in range(L.tp):
                        recv_counts[t] += inputs[n].numel()
            sb = torch.cat(send) if send else inputs[mine[0]].new_zeros(0)
            rb, _ = all_to_all_flat(sb, counts, recv_counts, self._tp_group, self.comm_stats,
                                    kind="tp_gather")
            off = [sum(recv_counts[:t]) for t in range(L.tp)]
            for n in mine:
                if owner[n][1] != self._tp_rank:
                    continue
                e = by_name[n]
                parts = []
                for t in range(L.tp):
                    k = inputs[n].numel()
                    parts.append(rb[off[t]:off[t] + k].view(inputs[n].shape))
                    off[t] += k
                full[n] = torch.cat(parts, dim=e.tp_dim) if e.tp_dim is not None else parts[0]
        else:
            for n in mine:
                if owner[n][1] == self._tp_rank:
                    full[n] = inputs[n]
        result_full = {n: self.opt._iso_c(x) for n, x in full.items()}
        self.iso_computed += len(result_full)
        shards = {}
        if L.tp > 1 and mine:
            # owner TP rank -> shards (one all-to-all)
            send, counts = [], [0] * L.tp
            for t in range(L.tp):
                for n in mine:
                    if owner[n][1] == self._tp_rank:
                        e = by_name[n]
                        r = result_full[n]
                        piece = r.chunk(L.tp, dim=e.tp_dim)[t] if e.tp_dim is not None else r
                        send.append(piece.reshape(-1))
                        counts[t] += piece.numel()
            recv_counts = [0] * L.tp
            for n in mine:
                recv_counts[owner[n][1]] += inputs[n].numel()
            sb = torch.cat(send) if send else inputs[mine[0]].new_zeros(0)
            rb, _ = all_to_all_flat(sb, counts, recv_counts, self._tp_group, self.comm_stats,
                                    kind="tp_scatter")
            off = [sum(recv_counts[:t]) for t in range(L.tp)]
            for n in mine:
                t = owner[n][1]
                k = inputs[n].numel()
                shards[n] = rb[off[t]:off[t] + k].view(inputs[n].shape)
                off[t] += k
        else:
            for n in mine:
                shards[n] = result_full[n]
        # every island receives the results of each owner island (one broadcast per owner)
        out = dict(shards)
        for src in range(n_islands):
            theirs = [n for n in names if owner[n][0] == src]
            if not theirs:
                continue
            like = [inputs[n] for n in theirs]
            if src == me:
                buf = _flat([shards[n] for n in theirs], like[0].dtype, self._device)
            else:
                buf = torch.empty(sum(t.numel() for t in like), dtype=like[0].dtype,
                                  device=self._device)
            comm.broadcast(buf, src, kind="iso_broadcast")
            if src != me:
                for n, t in zip(theirs, _unflat(buf, like)):
                    out[n] = t
        return out

    def _sync_state(self, comm: _Comm, src: int) -> None:
        """A stale island takes the global parameters, momentum and step count from ``src``."""
        sd = self.opt.state_dict()
        names = [e.name for e in self.owned]
        tensors = [sd["params"][n] for n in names] + [sd["momentum_buffer"][n] for n in names]
        buf = _flat(tensors, torch.float64, self._device)
        meta = torch.tensor([float(sd["step_count"])], dtype=torch.float64, device=self._device)
        comm.broadcast(buf, src, kind="rejoin_sync")
        comm.broadcast(meta, src, kind="rejoin_sync")
        parts = _unflat(buf, tensors)
        k = len(names)
        sd["params"] = {n: parts[i].to(tensors[i].dtype).clone() for i, n in enumerate(names)}
        sd["momentum_buffer"] = {n: parts[k + i].to(tensors[k + i].dtype).clone()
                                 for i, n in enumerate(names)}
        sd["step_count"] = int(meta.item())
        self.opt.load_state_dict(sd)

    # -- fault mode -------------------------------------------------------------------------
    def _make_store(self):
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        timeout = datetime.timedelta(seconds=max(60.0, self.rejoin_timeout))
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            and dist.get_backend() == "nccl" else torch.device("cpu")
        if dist.get_rank() == 0:
            store = dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)
            port = torch.tensor([store.port], dtype=torch.int64, device=dev)
        else:
            port = torch.tensor([0], dtype=torch.int64, device=dev)
        dist.broadcast(port, src=0)
        if dist.get_rank() != 0:
            store = dist.TCPStore(host, int(port.item()), None, False, timeout=timeout)
        return dist.PrefixStore("megatron_muon_islands/", store)

    def _await_round(self, n: int) -> Optional[dict]:
        """Block until round n is decided (or raise); None: a late island past the last round."""
        L, st = self.layout, self._store
        if self.max_rounds is not None and n >= self.max_rounds:
            return None
        key = f"r{n}/decision"
        if self.stale:
            st.set(f"r{n}/stale/{L.island}", "1")
        st.add(f"r{n}/arrived/{L.island}", 1)
        if not self.stale:
            st.compare_set(f"r{n}/t0", "", repr(time.time()))
        start = time.monotonic()
        while True:
            if st.check([key]):
                return json.loads(st.get(key).decode())
            counts = [st.add(f"r{n}/arrived/{k}", 0) for k in range(L.num_islands)]
            present = [k for k in range(L.num_islands) if counts[k] >= L.island_size]
            stale = [k for k in present if st.check([f"r{n}/stale/{k}"])]
            fresh = [k for k in present if k not in stale]
            decide = False
            if fresh and len(present) == L.num_islands:
                decide = True
            elif fresh and not self.stale and st.check([f"r{n}/t0"]):
                t_start = float(st.get(f"r{n}/t0").decode())
                decide = time.time() > t_start + self.island_timeout
            if decide:
                want = json.dumps({"islands": present, "stale": stale})
                got = st.compare_set(key, "", want)
                return json.loads(got.decode())
            limit = self.rejoin_timeout if self.stale else \
                max(self.rejoin_timeout, 2 * self.island_timeout)
            if time.monotonic() - start > limit:
                raise IslandTimeoutError(
                    f"island {L.island} waited {limit:g} s for outer round {n} without a "
                    f"decision (islands present: {present}); the other islands are gone")
            time.sleep(self.poll_interval)

    def _comm_for(self, participants: list[int]) -> _Comm:
        L = self.layout
        if len(participants) == L.num_islands:
            return self._full_comm
        index = participants.index(L.island)
        if len(participants) == 1:
            return _Comm(1, 0, self.comm_stats)
        prefix = f"r{self.round}/pg/{L.local_rank}/"
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), index,
                                   len(participants),
                                   datetime.timedelta(seconds=max(30.0, self.rejoin_timeout)))
        return _Comm(len(participants), index, self.comm_stats, gloo=pg)


# ==========================================================================================
# Checkpoints per island
# ==========================================================================================

def _island_dir(directory: str, layout: IslandLayout) -> str:
    return os.path.join(directory, f"island{layout.island:03d}")


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _inner_optimizer_state(optimizer) -> list:
    """This rank's inner optimizer state: main-param shards + torch optimizer state."""
    out = []
    for sub in _sub_optimizers(optimizer):
        torch_opt = getattr(sub, "optimizer", None)
        if torch_opt is None:
            out.append(None)
            continue
        mains = [p.detach().clone() for g in torch_opt.param_groups for p in g["params"]]
        out.append({"main_params": mains, "torch": torch_opt.state_dict()})
    return out


@torch.no_grad()
def _load_inner_optimizer_state(optimizer, states: list) -> None:
    subs = _sub_optimizers(optimizer)
    if len(subs) != len(states):
        raise ValueError("island checkpoint: the inner optimizer has another structure")
    for sub, st in zip(subs, states):
        torch_opt = getattr(sub, "optimizer", None)
        if st is None or torch_opt is None:
            continue
        params = [p for g in torch_opt.param_groups for p in g["params"]]
        if len(params) != len(st["main_params"]):
            raise ValueError("island checkpoint: the inner optimizer has other parameters")
        for p, v in zip(params, st["main_params"]):
            p.copy_(v)  # fp32 main shards (views of fp32 model params, or bf16 masters)
        torch_opt.load_state_dict(st["torch"])


def save_island_checkpoint(directory: str, model: list, optimizer, outer: IslandOuterStep,
                           extra: Optional[dict] = None) -> str:
    """Model, inner optimizer and outer state of this rank, one folder per island.

    Per rank (``island{k}/rank{local}.pt``): the model chunks' ``state_dict``, the inner
    optimizer's main-parameter shards and torch optimizer state (AdamW moments, steps), and
    ``outer.state_dict()``. No collective: it works while another island is stalled. Resume
    with ``load_island_checkpoint`` on the same layout; the learning-rate scheduler is the
    caller's (put its ``state_dict`` in ``extra``).
    """
    from megatron.core.utils import unwrap_model

    L = outer.layout
    path = _island_dir(directory, L)
    os.makedirs(path, exist_ok=True)
    state = {"model": [unwrap_model(m).state_dict() for m in model], "outer": outer.state_dict(),
             "extra": extra or {}}
    if optimizer is not None:
        state["optimizer"] = _inner_optimizer_state(optimizer)
    tmp = os.path.join(path, f".rank{L.local_rank:04d}.pt.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(path, f"rank{L.local_rank:04d}.pt"))
    return path


def load_island_checkpoint(directory: str, model: list, optimizer,
                           outer: IslandOuterStep) -> dict:
    """Inverse of ``save_island_checkpoint`` (same layout); returns the ``extra`` dict."""
    from megatron.core.utils import unwrap_model

    L = outer.layout
    path = os.path.join(_island_dir(directory, L), f"rank{L.local_rank:04d}.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no island checkpoint {path!r}")
    state = torch.load(path, weights_only=False)
    with torch.no_grad():
        for m, sd in zip(model, state["model"]):
            unwrap_model(m).load_state_dict(sd)
    if optimizer is not None:
        _load_inner_optimizer_state(optimizer, state["optimizer"])
    outer.load_state_dict(state["outer"])
    return state["extra"]


# ==========================================================================================
# Megatron-style command-line flags
# ==========================================================================================

class OuterArgumentError(ValueError):
    """A bad outer-optimizer / islands flag; the message names the flag."""


def add_outer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the DiLoCo / IsoLoCo flags (an argument group titled ``'outer optimizer'``)."""
    g = parser.add_argument_group("outer optimizer", "DiLoCo / IsoLoCo islands")
    g.add_argument("--outer-optimizer", choices=("diloco", "isoloco"), default=None,
                   help="Train in islands that synchronise every --diloco-inner-steps with "
                        "this outer optimizer (default: off, plain data parallelism).")
    g.add_argument("--diloco-islands", type=int, default=1,
                   help="Number of islands K; each island is a TP x PP x DP layout of "
                        "world / K contiguous ranks.")
    g.add_argument("--diloco-inner-steps", type=int, default=30,
                   help="Inner steps H between outer steps.")
    g.add_argument("--outer-lr", type=float, default=None,
                   help="Outer learning rate (default: diloco 0.7, isoloco 1.8).")
    g.add_argument("--outer-momentum", type=float, default=None,
                   help="Outer Nesterov momentum in [0, 1) (default: diloco 0.9, isoloco 0.8).")
    g.add_argument("--outer-no-nesterov", dest="outer_nesterov", action="store_false",
                   help="Plain momentum (u = m) instead of Nesterov (u = D + mu m).")
    g.add_argument("--isoloco-mode", choices=("svd", "ns"), default=None,
                   help="Iso-C by exact SVD or by the matmul-only Newton-Schulz polar factor "
                        "(default svd; isoloco only).")
    g.add_argument("--isoloco-order", choices=("iso_first", "momentum_first"), default=None,
                   help="Iso-C of mean D before momentum (default) or of the momentum update.")
    g.add_argument("--diloco-fault-tolerant", action="store_true",
                   help="Leave out of an outer round the islands that have not reported "
                        "within --diloco-island-timeout; they rejoin at the next round.")
    g.add_argument("--diloco-island-timeout", type=float, default=300.0,
                   help="Seconds an outer round waits for late islands (fault mode).")
    return parser


def validate_outer_args(args, world_size: Optional[int] = None,
                        model_parallel_size: int = 1) -> None:
    """Check the outer flags; raises ``OuterArgumentError`` naming the flag."""
    method = getattr(args, "outer_optimizer", None)
    K = args.diloco_islands
    if not isinstance(K, int) or K < 1:
        raise OuterArgumentError(f"--diloco-islands must be >= 1, got {K!r}")
    if method is None:
        for flag, value, default in (("--diloco-islands", K, 1),
                                     ("--outer-lr", args.outer_lr, None),
                                     ("--outer-momentum", args.outer_momentum, None),
                                     ("--isoloco-mode", args.isoloco_mode, None),
                                     ("--isoloco-order", args.isoloco_order, None)):
            if value != default:
                raise OuterArgumentError(f"{flag} needs --outer-optimizer diloco|isoloco")
        if args.diloco_fault_tolerant:
            raise OuterArgumentError("--diloco-fault-tolerant needs --outer-optimizer")
        return
    if method not in OUTER_DEFAULTS:
        raise OuterArgumentError(f"--outer-optimizer must be diloco or isoloco, got {method!r}")
    if world_size is not None:
        if world_size % K:
            raise OuterArgumentError(f"--diloco-islands {K} does not divide the world size "
                                     f"{world_size}")
        if (world_size // K) % model_parallel_size:
            raise OuterArgumentError(
                f"each island has {world_size // K} ranks, not a multiple of TP x PP = "
                f"{model_parallel_size} (--diloco-islands {K}, world {world_size})")
    if not isinstance(args.diloco_inner_steps, int) or args.diloco_inner_steps < 1:
        raise OuterArgumentError(f"--diloco-inner-steps must be >= 1, got "
                                 f"{args.diloco_inner_steps!r}")
    if args.outer_lr is not None and not (math.isfinite(args.outer_lr) and args.outer_lr >= 0):
        raise OuterArgumentError(f"--outer-lr must be a finite number >= 0, got {args.outer_lr}")
    if args.outer_momentum is not None and not 0.0 <= args.outer_momentum < 1.0:
        raise OuterArgumentError(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    if method == "diloco":
        if args.isoloco_mode is not None:
            raise OuterArgumentError("--isoloco-mode only applies to --outer-optimizer isoloco")
        if args.isoloco_order is not None:
            raise OuterArgumentError("--isoloco-order only applies to --outer-optimizer isoloco")
    if args.diloco_fault_tolerant:
        if K < 2:
            raise OuterArgumentError("--diloco-fault-tolerant needs --diloco-islands >= 2")
        if not (math.isfinite(args.diloco_island_timeout) and args.diloco_island_timeout > 0):
            raise OuterArgumentError(f"--diloco-island-timeout must be > 0 seconds, got "
                                     f"{args.diloco_island_timeout}")


def outer_kwargs_from_args(args) -> dict:
    """Keyword arguments for ``IslandOuterStep`` from validated flags."""
    if getattr(args, "outer_optimizer", None) is None:
        raise OuterArgumentError("outer_kwargs_from_args needs --outer-optimizer")
    kw = dict(method=args.outer_optimizer, lr=args.outer_lr, momentum=args.outer_momentum,
              nesterov=getattr(args, "outer_nesterov", True),
              fault_tolerant=bool(args.diloco_fault_tolerant),
              island_timeout=float(args.diloco_island_timeout))
    if args.outer_optimizer == "isoloco":
        kw.update(iso_mode=args.isoloco_mode or "svd", order=args.isoloco_order or "iso_first")
    return kw
