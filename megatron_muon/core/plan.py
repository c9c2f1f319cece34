"""Owner planning: which rank orthogonalises which unit (docs/design.md#owner-plan).

Pure and deterministic: the same inputs give the same plan on every rank, which the
adapter checks by exchanging ``OwnerPlan.digest``.  Knows nothing of Megatron or
torch.distributed.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from megatron_muon.core.newton_schulz import Coefficients, ns_flops

__all__ = ["UnitTask", "OwnerPlan", "plan_owners", "flops_cost"]


@dataclass(frozen=True)
class UnitTask:
    """One NS unit to place: ``key`` names it uniquely, ``shape`` is (m, n)."""

    key: str
    shape: tuple[int, int]
    cost: float  # seconds or flops; only ratios matter
    nbytes: int = 0


@dataclass
class OwnerPlan:
    num_ranks: int
    owners: dict[str, int]  # unit key -> owner rank
    load: list[float]  # summed cost per rank
    bytes_owned: list[int]
    tasks: list[UnitTask] = field(repr=False, default_factory=list)

    @property
    def imbalance(self) -> float:
        """max / mean - 1 of the per-rank cost (0 is perfect balance)."""
        mean = sum(self.load) / max(1, self.num_ranks)
        return max(self.load) / mean - 1.0 if mean > 0 else 0.0

    @property
    def digest(self) -> str:
        blob = json.dumps(sorted(self.owners.items())).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def units_of(self, rank: int) -> list[str]:
        return [k for k, r in self.owners.items() if r == rank]

    def summary(self) -> str:
        mean = sum(self.load) / max(1, self.num_ranks)
        lines = [f"owner plan: {len(self.owners)} units on {self.num_ranks} ranks, "
                 f"imbalance {100 * self.imbalance:.1f}% (max/mean - 1), digest {self.digest}"]
        for r in range(self.num_ranks):
            n = sum(1 for v in self.owners.values() if v == r)
            lines.append(f"  rank {r}: {n:4d} units, load {self.load[r]:.3e} "
                         f"({(self.load[r] / mean if mean else 0):.3f} x mean), "
                         f"{self.bytes_owned[r] / 2**20:.2f} MiB owned")
        return "\n".join(lines)


def flops_cost(steps: int, method: str = "standard",
               coefficients: Coefficients = "simple") -> Callable[[tuple[int, int], int], float]:
    """Cost of a unit (and of a batch of same-shape units) by the NS flop formula of
    ``method`` ('standard' or 'gram', ``newton_schulz.ns_flops``; Gram's restart period,
    and so its flops, depend on the coefficient set)."""
    ns_flops(1, 1, steps, method, coefficients=coefficients)  # ValueError for a bad method, now

    def cost(shape: tuple[int, int], batch: int = 1) -> float:
        return ns_flops(shape[0], shape[1], steps, method, coefficients=coefficients) * batch

    return cost


def plan_owners(tasks: Sequence[UnitTask], num_ranks: int,
                eligible: Optional[Callable[[UnitTask], Sequence[int]]] = None,
                holdings: Optional[dict[str, Sequence[int]]] = None,
                locality_slack: float = 0.03) -> OwnerPlan:
    """Longest-processing-time-first assignment of units to ranks.

    Units are taken in decreasing cost (ties broken by key, so every rank agrees) and each
    goes to the least-loaded eligible rank (ties to the lowest rank).  LPT's worst case is
    4/3 - 1/(3N) of optimal; with many units of similar size it is within a few percent.
    Same-shape units that land on one rank are batched by the executor.

    ``holdings[key][r]`` (elements of the unit already on rank r) makes the choice
    locality-aware: among the ranks that stay within ``(1 + locality_slack)`` of the mean
    load after taking the unit, the one holding most of it wins, which saves its bytes on
    both the gather and the scatter.  Under ZeRO-1 a DP shard holds whole matrices, so
    this removes most traffic at no balance cost.
    """
    if num_ranks < 1:
        raise ValueError("num_ranks must be >= 1")
    keys = [t.key for t in tasks]
    if len(set(keys)) != len(keys):
        raise ValueError("unit keys must be unique")
    load = [0.0] * num_ranks
    nbytes = [0] * num_ranks
    owners: dict[str, int] = {}
    order = sorted(tasks, key=lambda t: (-t.cost, t.key))
    if holdings is not None:
        target = (1.0 + locality_slack) * sum(t.cost for t in tasks) / num_ranks
        for t in order:
            ranks = list(eligible(t)) if eligible else list(range(num_ranks))
            least = min(ranks, key=lambda q: (load[q], q))
            ok = [q for q in ranks if load[q] + t.cost <= target] or [least]
            held = holdings.get(t.key, [0] * num_ranks)
            r = max(ok, key=lambda q: (held[q], -load[q], -q))
            owners[t.key] = r
            load[r] += t.cost
            nbytes[r] += t.nbytes
    elif eligible is None:
        heap = [(0.0, r) for r in range(num_ranks)]
        for t in order:
            l, r = heapq.heappop(heap)
            owners[t.key] = r
            load[r] = l + t.cost
            nbytes[r] += t.nbytes
            heapq.heappush(heap, (load[r], r))
    else:
        for t in order:
            ranks = list(eligible(t))
            if not ranks:
                raise ValueError(f"unit {t.key} has no eligible owner")
            r = min(ranks, key=lambda q: (load[q], q))
            owners[t.key] = r
            load[r] += t.cost
            nbytes[r] += t.nbytes
    return OwnerPlan(num_ranks=num_ranks, owners=owners, load=load, bytes_owned=nbytes,
                     tasks=list(tasks))
