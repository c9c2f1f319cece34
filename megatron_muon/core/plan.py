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

__all__ = ["UnitTask", "OwnerPlan", "SplitPolicy", "SplitUnit", "plan_owners", "flops_cost",
           "split_costs", "split_bytes", "equal_widths"]


@dataclass(frozen=True)
class UnitTask:
    """One NS unit to place: ``key`` names it uniquely, ``shape`` is (m, n)."""

    key: str
    shape: tuple[int, int]
    cost: float  # seconds or flops; only ratios matter
    nbytes: int = 0


@dataclass(frozen=True)
class SplitPolicy:
    """When the planner splits a unit's Newton-Schulz across ranks (docs/design.md#split-ns).

    Costs are flops.  ``flops_per_byte``: how many NS flops a rank does in the time its
    group moves one byte of the split's all-reduce (compute rate / all-reduce bandwidth per
    rank): the price of splitting.  ``parts``: split every unit whose long side allows it
    into exactly this many parts, whatever it costs (tests and experiments).  ``ay``: whether
    form 'ay' may be used (fp32 NS only: in bf16 its two rounded products, A X and A (A X),
    with the large cancelling quintic coefficients, were measured 3-5x further from fp32 NS
    than bf16 NS itself, where form 'b' matches bf16 NS)."""

    steps: int
    flops_per_byte: float = 2500.0
    max_parts: int = 64
    parts: Optional[int] = None
    ay: bool = True
    element_size: int = 4  # bytes per Gram element on the wire (the NS dtype's)


@dataclass(frozen=True)
class SplitUnit:
    """A unit whose NS runs on ``len(ranks)`` ranks: part j (``widths[j]`` of the long side,
    in order, ``core.units.split_unit``) on ``ranks[j]``.  ``form``: how a part applies
    B = b A + c A^2 (``'b'``: forms B, as the whole unit does; ``'ay'``: b A X_j + c A (A X_j),
    no s x s product, cheaper where a part is narrower than the short side)."""

    ranks: tuple[int, ...]
    widths: tuple[int, ...]
    form: str


@dataclass
class OwnerPlan:
    num_ranks: int
    owners: dict[str, int]  # unit key -> owner rank (units that are not split)
    load: list[float]  # summed cost per rank
    bytes_owned: list[int]
    tasks: list[UnitTask] = field(repr=False, default_factory=list)
    splits: dict[str, SplitUnit] = field(default_factory=dict)  # split unit key -> its parts
    comm: list[float] = field(default_factory=list)  # the split all-reduces' share of load

    @property
    def compute_imbalance(self) -> float:
        """max / mean - 1 of the per-rank NS cost without the split units' all-reduces."""
        work = [l - c for l, c in zip(self.load, self.comm or [0.0] * self.num_ranks)]
        mean = sum(work) / max(1, self.num_ranks)
        return max(work) / mean - 1.0 if mean > 0 else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean - 1 of the per-rank cost (0 is perfect balance)."""
        mean = sum(self.load) / max(1, self.num_ranks)
        return max(self.load) / mean - 1.0 if mean > 0 else 0.0

    @property
    def digest(self) -> str:
        splits = sorted((k, list(v.ranks), list(v.widths), v.form) for k, v in self.splits.items())
        blob = json.dumps([sorted(self.owners.items()), splits] if splits else
                          sorted(self.owners.items())).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def units_of(self, rank: int) -> list[str]:
        """The units ``rank`` orthogonalises whole, then those it has a part of."""
        return [k for k, r in self.owners.items() if r == rank] + \
            [k for k, v in self.splits.items() if rank in v.ranks]

    def summary(self) -> str:
        mean = sum(self.load) / max(1, self.num_ranks)
        parts = sum(len(v.ranks) for v in self.splits.values())
        split = (f", {len(self.splits)} of them split into {parts} parts" if self.splits else "")
        lines = [f"owner plan: {len(self.owners) + len(self.splits)} units{split} on "
                 f"{self.num_ranks} ranks, imbalance {100 * self.imbalance:.1f}% (max/mean - 1), "
                 f"digest {self.digest}"]
        for r in range(self.num_ranks):
            n = len(self.units_of(r))
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


def equal_widths(length: int, k: int) -> tuple[int, ...]:
    """``length`` in ``k`` consecutive widths differing by at most one (larger first)."""
    q, r = divmod(length, k)
    return tuple(q + (j < r) for j in range(k))


def split_bytes(shape: tuple[int, int], k: int, steps: int, element_size: int = 4) -> float:
    """Bytes each of the k ranks of a split unit sends per optimizer step: one all-reduce
    of the s x s Gram matrix's upper triangle, s (s + 1) / 2 elements, per NS step (in the
    NS dtype, ``element_size`` bytes) as a reduce-scatter plus an all-gather,
    2 (k - 1) / k x element_size x s (s + 1) / 2 (the norm's all-reduce, 4 bytes, is left
    out)."""
    s = min(shape)
    return steps * element_size * (k - 1) / k * s * (s + 1) if k > 1 else 0.0


def split_costs(shape: tuple[int, int], widths: Sequence[int], steps: int,
                flops_per_byte: float, ay: bool = True,
                element_size: int = 4) -> tuple[str, list[float], float]:
    """``(form, [flops of each part], all-reduce cost of a part)`` of NS on a unit of
    ``shape`` split into parts of ``widths`` along its long side; the all-reduce's bytes
    (``split_bytes``) are priced at ``flops_per_byte``.  Per step a part of width
    w computes X_j X_j^T (2 s^2 w), then either B = b A + c A^2 and B X_j (form 'b':
    2 s^3 + 2 s^2 w) or Y = A X_j and A Y (form 'ay': 4 s^2 w); the cheaper form for the
    widest part is used (``ns_flops`` is form 'b' with one part; ``ay=False``: always 'b')."""
    s = min(shape)
    wide = max(widths)
    form = "ay" if ay and 4 * s * s * wide < 2 * s**3 + 2 * s * s * wide else "b"
    flops = [steps * ((6.0 * s * s * w) if form == "ay" else (4.0 * s * s * w + 2.0 * s**3))
             for w in widths]
    return form, flops, split_bytes(shape, len(widths), steps, element_size) * flops_per_byte


def _items(tasks: Sequence[UnitTask], split: dict) -> list:
    """What the planner places: ``(key, part index or None, cost, bytes, all-reduce cost)``,
    units in decreasing cost (ties by key, so every rank agrees), a split unit's parts
    together; a part's cost includes its all-reduce's."""
    out = []
    for t in sorted(tasks, key=lambda t: (-t.cost, t.key)):
        widths = split.get(t.key)
        if widths is None:
            out.append((t.key, None, t.cost, t.nbytes, 0.0))
            continue
        _, flops, comm = split[t.key + "#costs"]
        length = max(t.shape)
        out.extend((t.key, j, c + comm, t.nbytes * w // length, comm)
                   for j, (w, c) in enumerate(zip(widths, flops)))
    return out


def _with_costs(tasks: Sequence[UnitTask], widths: dict, policy: SplitPolicy) -> dict:
    out = dict(widths)
    for t in tasks:
        if t.key in widths:
            out[t.key + "#costs"] = split_costs(t.shape, widths[t.key], policy.steps,
                                                policy.flops_per_byte, policy.ay,
                                                policy.element_size)
    return out


def _makespan(items: list, num_ranks: int) -> float:
    """The largest per-rank load of plain LPT on ``items`` (a unit's parts on distinct ranks)."""
    heap = [(0.0, r) for r in range(num_ranks)]
    used: dict = {}  # split unit key -> the ranks that have one of its parts
    for key, j, cost, _, _ in items:
        skipped = []
        while True:
            l, r = heapq.heappop(heap)
            if j is None or r not in used.get(key, ()):
                break
            skipped.append((l, r))
        if j is not None:
            used.setdefault(key, set()).add(r)
        heapq.heappush(heap, (l + cost, r))
        for x in skipped:
            heapq.heappush(heap, x)
    return max(l for l, _ in heap)


def _choose_splits(tasks: Sequence[UnitTask], num_ranks: int, policy: SplitPolicy) -> dict:
    """{unit key: part widths} for the units to split (with ``key + '#costs'``: the form and
    per-part costs).

    The step waits for the rank with the largest load; where a unit costs more than the
    mean, no placement can hide it.  Greedy: while the costliest item (a unit, or a part of
    a split unit) costs more than the mean load, cut its unit into one more part, if that
    makes its parts cheaper (the all-reduce's share grows with the part count: past some
    count more parts cost more).  After each cut, LPT places the items; the cut counts
    with the smallest largest load win (no split at all is a candidate).  The mean is
    re-taken after every cut, which adds the all-reduces and, in form 'ay', flops."""
    if policy.parts is not None:  # forced: every unit whose long side allows it
        k = policy.parts
        if not 2 <= k <= num_ranks:
            raise ValueError(f"split into {k} parts needs 2 <= parts <= the group's "
                             f"{num_ranks} ranks")
        widths = {t.key: equal_widths(max(t.shape), k) for t in tasks if max(t.shape) >= k}
        return _with_costs(tasks, widths, policy)

    def part_cost(t: UnitTask, k: int) -> float:
        if k == 1:
            return t.cost
        _, flops, comm = split_costs(t.shape, equal_widths(max(t.shape), k), policy.steps,
                                     policy.flops_per_byte, policy.ay, policy.element_size)
        return max(flops) + comm

    parts = {t.key: 1 for t in tasks}
    total = sum(t.cost for t in tasks)
    heap = [(-t.cost, t.key) for t in tasks]  # costliest item first
    heapq.heapify(heap)
    by_key = {t.key: t for t in tasks}
    best_span, best = _makespan(_items(tasks, {}), num_ranks), dict(parts)
    limit = min(num_ranks, policy.max_parts)
    while heap:
        c, key = heap[0]
        t, k = by_key[key], parts[key]
        if -c <= total / num_ranks or k + 1 > min(limit, max(t.shape)):
            break
        c1 = part_cost(t, k + 1)
        if c1 >= -c:  # one more part would cost more: this unit is as cheap as it gets
            break
        heapq.heapreplace(heap, (-c1, key))
        total += c1 * (k + 1) - (-c) * k
        parts[key] = k + 1
        widths = {u: equal_widths(max(by_key[u].shape), n) for u, n in parts.items() if n > 1}
        span = _makespan(_items(tasks, _with_costs(tasks, widths, policy)), num_ranks)
        if span < best_span * (1 - 1e-9):
            best_span, best = span, dict(parts)
    widths = {u: equal_widths(max(by_key[u].shape), n) for u, n in best.items() if n > 1}
    return _with_costs(tasks, widths, policy)


def plan_owners(tasks: Sequence[UnitTask], num_ranks: int,
                eligible: Optional[Callable[[UnitTask], Sequence[int]]] = None,
                holdings: Optional[dict[str, Sequence[int]]] = None,
                locality_slack: float = 0.03,
                split: Optional[SplitPolicy] = None) -> OwnerPlan:
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

    ``split``: units that cost more than the group can balance are cut into parts along
    their long side, each part placed like a unit on a rank of its own
    (``_choose_splits``; ``OwnerPlan.splits``); costs must then be flops.
    """
    if num_ranks < 1:
        raise ValueError("num_ranks must be >= 1")
    keys = [t.key for t in tasks]
    if len(set(keys)) != len(keys):
        raise ValueError("unit keys must be unique")
    chosen = _choose_splits(tasks, num_ranks, split) if split is not None and num_ranks > 1 \
        else {}
    items = _items(tasks, chosen)
    by_key = {t.key: t for t in tasks}
    load = [0.0] * num_ranks
    nbytes = [0] * num_ranks
    owners: dict[str, int] = {}
    part_ranks: dict[str, list] = {}

    comm = [0.0] * num_ranks

    def place(key: str, j, cost: float, size: int, r: int, c: float) -> None:
        if j is None:
            owners[key] = r
        else:
            part_ranks.setdefault(key, []).append(r)
        load[r] += cost
        nbytes[r] += size
        comm[r] += c

    def free(key: str, j, ranks: Sequence[int]) -> list:
        """Eligible ranks for an item: a split unit's parts on distinct ranks."""
        if j is None or key not in part_ranks:
            return list(ranks)
        used = set(part_ranks[key])
        return [q for q in ranks if q not in used]

    if holdings is not None:
        target = (1.0 + locality_slack) * sum(it[2] for it in items) / num_ranks
        for key, j, cost, size, c in items:
            t = by_key[key]
            ranks = free(key, j, eligible(t) if eligible else range(num_ranks))
            least = min(ranks, key=lambda q: (load[q], q))
            ok = [q for q in ranks if load[q] + cost <= target] or [least]
            held = holdings.get(key, [0] * num_ranks)
            place(key, j, cost, size, max(ok, key=lambda q: (held[q], -load[q], -q)), c)
    elif eligible is None:
        heap = [(0.0, r) for r in range(num_ranks)]
        for key, j, cost, size, c in items:
            skipped = []
            while True:
                l, r = heapq.heappop(heap)
                if j is None or r not in part_ranks.get(key, ()):
                    break
                skipped.append((l, r))
            place(key, j, cost, size, r, c)
            heapq.heappush(heap, (load[r], r))
            for x in skipped:
                heapq.heappush(heap, x)
    else:
        for key, j, cost, size, c in items:
            ranks = free(key, j, eligible(by_key[key]))
            if not ranks:
                raise ValueError(f"unit {key} has no eligible owner")
            place(key, j, cost, size, min(ranks, key=lambda q: (load[q], q)), c)
    splits = {k: SplitUnit(tuple(part_ranks[k]), tuple(chosen[k]), chosen[k + "#costs"][0])
              for k in part_ranks}
    return OwnerPlan(num_ranks=num_ranks, owners=owners, load=load, bytes_owned=nbytes,
                     tasks=list(tasks), splits=splits, comm=comm)
