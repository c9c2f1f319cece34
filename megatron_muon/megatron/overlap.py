"""DMuon overlap: speculative owner work during the backward pass (docs/design.md, "Overlap").

Megatron's optimizer step needs the global gradient norm (clipping) and found-inf (fp16),
known only once every pipeline stage has finished.  DMuon does not wait for them:

* each DDP bucket group's grad reduce-scatter is followed, as soon as the next bucket
  group starts its own (``bucket_gather``), by the momentum update of that bucket's shard
  (on a copy: nothing is committed) and an asynchronous all-to-all to the units' owners;
* at the end of the stage's backward (``finish_grad_sync``, which Megatron calls in
  ``finalize_model_grads`` *before* any cross-stage collective, so inside the 1F1B
  cool-down) the owners wait for their pieces and run batched NS; the results stay with
  the owners, so a speculation holds one buffer beyond the step's own (the owned units)
  and nothing of the shard's size;
* a used speculation's results are scattered to the holders in the step, into the step's
  flat buffer (the speculated U is no longer needed); with ``param_update`` each DDP
  bucket group's parameters are then updated and copied to the param buffer just before
  that bucket group's param all-gather (``start_param_sync``): under the next forward pass
  with Megatron's ``overlap_param_gather``, else at the end of the step;
* ``optimizer.step()`` recomputes the momentum update from the final (unscaled, maybe
  clipped) main grads exactly as the non-overlapped step does, compares it bit for bit
  with the speculative input, and all ranks of the stage agree (one MIN all-reduce) to use
  the speculative result or to redo the owner work.  A clipped or otherwise modified
  gradient therefore always gets the non-overlapped result; a skipped (found-inf) step
  simply drops the speculation.

Exactness does not rest on any assumption about Megatron: only the bitwise check decides.

Speculation costs (the momentum copy, the comparison, NS twice when the step redoes it) and
pays only where the owner work hides, so the policy (``dmuon_overlap``, resolved by
``config.resolve_overlap``) is: ``'on'`` speculates every step; ``'adaptive'`` (what
``'auto'`` gives with pipeline parallelism, where stages that finish early wait in the
cool-down) backs off: after a step that redid (or dropped) the speculation it skips the
next k backward passes (k = 1, 2, 4, ... up to ``MAX_BACKOFF`` while they keep failing,
back to 1 after a used speculation), and it is measured (``SpeculationGate``): every
100 steps (from step 4 on) a probe window times 5 speculating and 5 plain iterations and
the stage speculates only if every speculating iteration was faster than every plain one.  A skipped step runs exactly the
non-overlapped step: no hook does anything, ``take`` returns None without the agreement
all-reduce (every rank of the group takes the same decision: it depends only on agreed
outcomes and on timings maximised over the group), so its result is bitwise that of
``dmuon_overlap='off'``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_muon.core.muon import momentum_update
from megatron_muon.distributed.trace import span
from megatron_muon.megatron import hooks

logger = logging.getLogger(__name__)

__all__ = ["DMuonOverlap", "OverlapStats", "SpeculationGate"]


@dataclass
class OverlapStats:
    speculated: int = 0  # steps whose owner work ran during the backward pass
    used: int = 0  # optimizer steps that used the speculative result
    redone: int = 0  # optimizer steps whose gradients differed (clipping, ...): redo
    dropped: int = 0  # speculations never consumed (found-inf skipped the step, ...)
    skipped: int = 0  # backward passes the adaptive policy did not speculate in
    probes: int = 0  # probe windows the adaptive policy measured (``SpeculationGate``)

    def as_dict(self) -> dict:
        return dict(speculated=self.speculated, used=self.used, redone=self.redone,
                    dropped=self.dropped, skipped=self.skipped, probes=self.probes)


@dataclass
class _Entry:
    model_param: torch.Tensor
    main_param: torch.Tensor
    start: int
    end: int
    offset: int


@dataclass
class _Group:
    bucket_group: object
    engine_buckets: list
    entries: list


@dataclass
class _Speculation:
    flat: torch.Tensor  # U as speculated; the step's flat buffer once it is taken
    owned: Optional[torch.Tensor]  # the owners' units: gathered U, then NS results in place
    gathers: list = field(default_factory=list)
    out: Optional[torch.Tensor] = None  # the scattered results (over ``flat``), once used
    complete: bool = False

    def drain(self, engine) -> None:
        """Wait for every gather still in flight (results are thrown away)."""
        for h in self.gathers:
            engine.finish(h, self.owned)
        self.gathers = []


@dataclass
class _Deferred:
    """A used speculation whose scatters and updates finish bucket group by bucket group."""

    spec: _Speculation
    lr_wd: dict  # main param -> (lr, weight decay) of this step
    done: set = field(default_factory=set)


class SpeculationGate:
    """Whether ``dmuon_overlap='auto'`` speculates: only after it was measured faster, so
    that it never costs more than the plain step for long.

    Every ``every`` optimizer steps from step ``first`` on, a probe window of ``2 * run``
    steps runs ``run`` speculating iterations, then ``run`` plain ones, whatever the back-off
    says.  An iteration's period is the time between two consecutive ``optimizer.step()``
    calls (forward, backward, speculation, step, and any deferred update of the previous
    step); the first iteration of each run is a transition (it holds the previous mode's
    deferred update) and is not counted, nor is a period that spans a skipped (found-inf)
    step.  At the end of the window each period, maximised over the exchange group
    (``reduce``: the same numbers, hence the same verdict, on every rank), decides the steps
    until the next window: speculate (with the back-off) only if *every* speculating period
    was shorter than *every* plain one.  That is a one-sided exact rank test: if the two
    modes cost the same, all orders of the 2 (run - 1) periods are equally likely and this
    one has probability 1 / C(2 (run - 1), run - 1) (1/70 with the defaults), so noise
    alone rarely turns speculation on, and a gain larger than the spread of the periods
    always does.  Before the first window the plain step runs.  Outside the windows the cost
    over the better mode is therefore nothing; a window costs at most ``run`` iterations of
    the worse mode every ``every`` steps (``run / every`` of the difference, 5 % of it with
    the defaults).

    Pure bookkeeping (``clock`` and ``reduce`` are injected): every rank calls
    ``begin_pass`` once per backward pass and ``end_step`` once per optimizer step, in the
    same order, so every decision is identical on every rank of the group.
    """

    def __init__(self, first: int = 4, every: int = 100, run: int = 5, clock=time.perf_counter):
        if run < 2 or every < 2 * run or first < 0:
            raise ValueError(f"SpeculationGate needs run >= 2, every >= 2 * run and first >= 0; "
                             f"got first={first}, every={every}, run={run}")
        self.first, self.every, self.run, self.clock = first, every, run, clock
        self.steps = 0  # optimizer steps so far (end_step calls): the same on every rank
        self.passes = 0  # backward passes since the last optimizer step
        self.last: Optional[float] = None  # clock at the last end_step
        self.samples: dict = {True: [], False: []}
        self.verdict = False  # outside the windows: speculate (subject to the back-off)?
        self.probes = 0  # probe windows completed
        # (step, speculating periods, plain periods, verdict), periods group-maximised
        self.decisions: list = []

    def forced(self, step: int) -> Optional[bool]:
        """The mode a probe window forces on the iteration of optimizer step ``step``
        (True: speculate, False: plain), or None outside the windows."""
        if step < self.first:
            return None  # the verdict rules: plain until a window measured speculation faster
        pos = (step - self.first) % self.every
        return None if pos >= 2 * self.run else pos < self.run

    def begin_pass(self, backoff_allows: bool) -> bool:
        """Whether the backward pass that starts now speculates."""
        self.passes += 1
        forced = self.forced(self.steps)
        return forced if forced is not None else (self.verdict and backoff_allows)

    def end_step(self, reduce=None) -> None:
        """An optimizer step is taken: record its iteration's period; at the end of a probe
        window, decide (``reduce(list of floats) -> list``: the element-wise maximum over
        the group)."""
        now = self.clock()
        step = self.steps
        if step >= self.first:
            pos = (step - self.first) % self.every
            if pos < 2 * self.run:
                if pos % self.run != 0 and self.last is not None and self.passes == 1:
                    self.samples[pos < self.run].append(now - self.last)
                if pos == 2 * self.run - 1:
                    self._decide(step, reduce)
        self.steps, self.passes, self.last = step + 1, 0, now

    def _decide(self, step: int, reduce) -> None:
        n = self.run - 1  # counted periods per mode (the first of each run is a transition)
        # fixed length on every rank; -1 marks a period not measured (found-inf)
        values = [(self.samples[m] + [-1.0] * n)[:n] for m in (True, False)]
        flat = values[0] + values[1]
        if reduce is not None:
            flat = reduce(flat)
        spec = [v for v in flat[:n] if v > 0]
        plain = [v for v in flat[n:] if v > 0]
        if spec and plain:  # both modes measured; else the verdict stays
            self.verdict = max(spec) < min(plain)
        self.decisions.append((step, spec, plain, self.verdict))
        self.samples = {True: [], False: []}
        self.probes += 1


def speculated_u(step, main_param, grad: torch.Tensor, out: torch.Tensor) -> None:
    """The speculation's U of one main-param shard, written into ``out`` (a flat slice):
    from a copy of the momentum (the step commits the real one), with the very op the step
    uses for its own U (``momentum_update(..., out=)``: ``torch.add(..., out=)``).  The step
    compares the two bit for bit to decide whether the speculation stands, so they must not
    differ by how a kernel rounds (a foreach add and a plain add need not agree on a GPU)."""
    buf = step.state[main_param]["momentum_buffer"].clone()
    momentum_update(buf, grad.view_as(main_param), step.momentum, step.nesterov,
                    out=out.view_as(main_param))


class DMuonOverlap:
    """Hooks one ``DMuonDistributedOptimizer`` into its DDP chunks' grad-sync calls
    (through ``megatron_muon.megatron.hooks``; ``remove()`` takes the hooks back, ``close()``
    also finishes or drops the work in flight first).

    ``adaptive``: back off after a redone or dropped speculation (see the module docstring);
    False speculates in every backward pass (``dmuon_overlap='on'``).
    """

    MAX_BACKOFF = 16  # at most this many backward passes skipped in a row

    def __init__(self, view, step, bucket_gather: bool = True, param_update: bool = True,
                 adaptive: bool = False):
        self.view = view  # dmuon.DMuonView: what is read of the DMuon optimizer
        self.param_update = param_update
        self.deferred: Optional[_Deferred] = None
        self.step_opt = step  # ShardedMuonStep
        self.engine = self.step_opt.engine
        self.bucket_gather = bucket_gather
        self.stats = OverlapStats()
        self.spec: Optional[_Speculation] = None
        self.groups = self._bucket_groups()
        self.started: set = set()
        self.next = 0
        self.finished_chunks: set = set()
        self.adaptive = adaptive
        self.gate = SpeculationGate() if adaptive else None  # measured on/off ('auto')
        self.backoff = 1  # passes to skip after the next miss
        self.skip_left = 0  # passes still to skip
        self.active: Optional[bool] = None  # this backward pass speculates; None: undecided
        self.skipped_last = False  # the last backward pass was skipped (take: nothing to agree)
        self._install()

    # -- geometry -------------------------------------------------------------------
    def _bucket_groups(self) -> list:
        view, step = self.view, self.step_opt
        engine_bucket, shards = view.bucket_of, view.shards
        groups, covered = [], set()
        for chunk in view.model_chunks:
            for bg in list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups):
                params = [p for p in bg.params if p in shards]
                # (with matrix placement the engine has only the buckets this DP rank holds)
                keys = sorted({engine_bucket[p] for p in bg.params if p in engine_bucket}
                              & set(self.engine.gather_tables))
                if not keys:
                    continue
                entries = []
                for p in sorted(params, key=lambda q: step.offsets[shards[q][0]]):
                    main, start, end = shards[p]
                    entries.append(_Entry(p, main, start, end, step.offsets[main]))
                groups.append(_Group(bg, keys, entries))
                covered.update(keys)
        missing = set(self.engine.gather_tables) - covered
        if missing:
            raise RuntimeError(f"DMuon overlap: engine buckets {sorted(missing)} belong to no "
                               "DDP bucket group")
        return groups

    # -- hooks ----------------------------------------------------------------------
    def _install(self) -> None:
        self.registrations = []
        for i, g in enumerate(self.groups):
            self.registrations.append(
                hooks.on_grad_sync_started(g.bucket_group, lambda i=i: self._on_start(i)))
            if self.param_update:
                self.registrations.append(
                    hooks.before_param_sync(g.bucket_group, lambda i=i: self.flush(i)))
        chunks = list(self.view.model_chunks)
        for chunk in chunks:
            self.registrations.append(hooks.on_backward_done(
                chunk, lambda c=chunk, n=len(chunks): self._on_finish(c, n)))

    def remove(self) -> None:
        """Unhook from Megatron (the DDP chunks' methods are Megatron's again)."""
        for r in self.registrations:
            r.remove()
        self.registrations = []

    def close(self) -> None:
        """Teardown (``DMuonDistributedOptimizer.close``): land a deferred update, wait for
        the gathers of a speculation still in flight (an async all-to-all left unwaited
        would hold its buffers and its place in the group's collective order), drop the
        speculation and unhook.  Idempotent."""
        self.flush_all()
        if self.spec is not None:
            self.spec.drain(self.engine)
            self.spec = None
        self.remove()

    def _speculating(self) -> bool:
        """Decide, at the first hook of a backward pass, whether this pass speculates."""
        if self.active is None:
            if self.spec is not None:  # never consumed (found-inf skipped the step, ...)
                self.spec.drain(self.engine)
                self.spec = None
                self.stats.dropped += 1
                self._outcome(False)
            backoff_allows = not (self.adaptive and self.skip_left > 0)
            if self.skip_left > 0:
                self.skip_left -= 1  # the back-off counts backward passes
            self.active = self.gate.begin_pass(backoff_allows) if self.gate is not None \
                else backoff_allows
            self.skipped_last = not self.active
            if not self.active:
                self.stats.skipped += 1
        return self.active

    def _outcome(self, used: bool) -> None:
        """The adaptive back-off: a used speculation resets it, a miss skips and doubles."""
        if not self.adaptive:
            return
        if used:
            self.backoff = 1
        else:
            self.skip_left = self.backoff
            self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)

    def _on_start(self, i: int) -> None:
        if not self._speculating():
            return
        self.started.add(i)
        if not self.bucket_gather:
            return
        # Launch, in a fixed order, every earlier bucket group whose reduce-scatter was
        # started: the order of collectives is then identical on every rank.
        while self.next < len(self.groups) and self.next in self.started and self.next != i:
            self._process(self.next)
            self.next += 1

    def _on_finish(self, chunk, n_chunks: int) -> None:
        self.finished_chunks.add(id(chunk))
        if len(self.finished_chunks) < n_chunks:
            return
        if self._speculating():
            while self.next < len(self.groups):
                self._process(self.next)
                self.next += 1
            self._finish_backward()
        self.started, self.next, self.finished_chunks = set(), 0, set()
        self.active = None

    # -- speculative work -------------------------------------------------------------
    def _begin(self) -> _Speculation:
        if self.spec is not None:  # never consumed (skipped step, or no optimizer.step())
            self.spec.drain(self.engine)
            self.stats.dropped += 1
        self.step_opt.init_state()  # momentum buffers exist from the first step on
        dev = self.engine.device
        self.spec = _Speculation(
            flat=torch.zeros(self.step_opt.numel, dtype=torch.float32, device=dev),
            owned=torch.zeros(self.engine.owned_numel, dtype=torch.float32, device=dev))
        return self.spec

    @torch.no_grad()
    def _process(self, i: int) -> None:
        """Bucket group i's gradients are reduced: momentum on copies, gather to owners."""
        spec = self.spec if i > 0 and self.spec is not None and not self.spec.complete \
            else self._begin()
        g = self.groups[i]
        with span("dmuon.speculate", bucket_group=i):
            handle = g.bucket_group.grad_reduce_handle
            if handle is not None:
                handle.wait()  # Megatron waits again (a no-op) in finish_grad_sync
            step = self.step_opt
            scaler = self.view.grad_scaler
            found = torch.zeros(1, dtype=torch.float32, device=spec.flat.device)  # ignored
            for e in g.entries:
                grad = e.model_param.main_grad.view(-1)[e.start: e.end].float().clone()
                if scaler is not None:  # the unscale Megatron applies in prepare_grads
                    torch._amp_foreach_non_finite_check_and_unscale_([grad], found,
                                                                      scaler.inv_scale)
                speculated_u(step, e.main_param, grad,
                             spec.flat[e.offset: e.offset + e.main_param.numel()])
            for b in g.engine_buckets:
                spec.gathers.append(self.engine.gather(spec.flat, b, spec.owned, async_op=True))

    @torch.no_grad()
    def _finish_backward(self) -> None:
        eng = self.engine
        spec = self.spec if self.spec is not None and not self.spec.complete else self._begin()
        with span("dmuon.gather_wait"):
            for h in spec.gathers:
                eng.finish(h, spec.owned)
            spec.gathers = []
        with span("dmuon.ns"):
            eng.orthogonalize(spec.owned, out=spec.owned)  # gathered U not needed
        spec.complete = True  # the results wait on their owners for the step's agreement
        self.stats.speculated += 1

    def pending_flat(self) -> Optional[torch.Tensor]:
        """The speculated U (flat, like the step's buffer) of a complete speculation that
        waits for ``take``, else None.  The step compares its U with it in place and
        overwrites it with its own U (``take(lr_wd, matches)``): the speculation no longer
        needs it, so the step needs no flat buffer of its own."""
        spec = self.spec
        return spec.flat if spec is not None and spec.complete else None

    @torch.no_grad()
    def take(self, lr_wd: dict, matches: bool) -> Optional[torch.Tensor]:
        """The speculative NS output if it was computed from exactly this step's U on every
        rank.  ``matches``: whether this rank's U equalled the speculated one bit for bit
        (the step compares them in place, against ``pending_flat``; False when nothing was
        pending).

        With ``param_update`` a used speculation is kept as deferred work (``flush``):
        ``self.deferred`` is then set and the caller must not apply the update itself.
        """
        if self.gate is not None:
            self.gate.end_step(self._max_over_group)
            self.stats.probes = self.gate.probes
        spec, self.spec = self.spec, None
        if spec is None and self.skipped_last:
            self.skipped_last = False  # skipped by the policy on every rank: the plain step
            return None
        ok = spec is not None and spec.complete and matches
        agree = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.engine.device)
        if self.engine.group is not None and self.engine.world > 1:
            dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=self.engine.group)
        self._outcome(int(agree.item()) == 1)  # agreed: the same on every rank
        if spec is None:
            return None
        if int(agree.item()) == 1:
            self.stats.used += 1
            box, spec.owned = [spec.owned], None  # freed once packed (scatter_owned)
            spec.out = self.engine.scatter_owned(box, spec.flat)  # U is not needed any more
            if self.param_update and self.groups:
                self.deferred = _Deferred(spec, lr_wd)
            return spec.out
        spec.drain(self.engine)
        spec.owned = spec.out = None  # the plain step may run now: free what it does not use
        if spec.complete:
            self.stats.redone += 1
        else:
            self.stats.dropped += 1
        return None

    def _max_over_group(self, values: list) -> list:
        """The element-wise maximum of ``values`` over the exchange group (the gate's
        verdict is then the same on every rank)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        if self.engine.group is not None and self.engine.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.engine.group)
        return t.tolist()

    @torch.no_grad()
    def flush(self, i: int) -> None:
        """Apply bucket group i's deferred update (before its param all-gather)."""
        d = self.deferred
        if d is None or i in d.done:
            return
        g = self.groups[i]
        with span("dmuon.deferred_update", bucket_group=i):
            for e in g.entries:
                lr, wd = d.lr_wd[e.main_param]
                o = d.spec.out[e.offset: e.offset + e.main_param.numel()].view_as(e.main_param)
                self.step_opt.apply_update(e.main_param, o, lr, wd)
                self.view.publish(e.model_param, e.main_param)
        d.done.add(i)
        if len(d.done) == len(self.groups):
            self.deferred = None

    def flush_all(self) -> None:
        """Finish every deferred update (before a checkpoint, another step, ...)."""
        for i in range(len(self.groups)):
            self.flush(i)
