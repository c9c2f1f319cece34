"""SpeculationGate ('auto' overlap measures itself), single process with an injected clock:
the plain step runs until a probe window measured speculation faster in every period, the
windows force both modes, transitions and found-inf periods are not counted, and ``reduce``
(the group maximum in DMuon) decides."""
import itertools
import math

import pytest

from megatron_muon.megatron.overlap import SpeculationGate


def drive(gate, cost, steps, backoff=lambda s: True, skip_step_at=(), reduce=None):
    """Run ``steps`` iterations; an iteration in mode m takes cost(m, s) seconds (plus 0.5 s
    for the first iteration after a switch: the deferred update it inherits)."""
    t = [0.0]
    gate.clock = lambda: t[0]
    cost_of = cost if callable(cost) else (lambda m, s: cost[m])
    modes, prev = [], None
    for s in range(steps):
        m = gate.begin_pass(backoff(s))
        t[0] += cost_of(m, s) + (0.5 if prev is not None and m != prev else 0.0)
        prev = m
        modes.append(m)
        if s in skip_step_at:  # found-inf: Megatron skips optimizer.step(), no end_step
            continue
        gate.end_step(reduce)
    return modes


@pytest.mark.parametrize("spec_cost,verdict", [(1.0, True), (3.0, False)])
def test_gate_keeps_the_faster_mode(spec_cost, verdict):
    gate = SpeculationGate(first=2, every=10, run=3)
    modes = drive(gate, {True: spec_cost, False: 2.0}, 22)
    # before the first window: the plain step
    assert modes[:2] == [False, False]
    # windows at steps 2..7 and 12..17 force 3 speculating, then 3 plain iterations
    assert modes[2:8] == [True] * 3 + [False] * 3 and modes[12:18] == modes[2:8]
    # between windows: the verdict; the transition's extra 0.5 s is not counted
    assert modes[8:12] == [verdict] * 4 and modes[18:] == [verdict] * 4
    assert gate.probes == 2
    step, spec, plain, v = gate.decisions[0]
    assert (step, spec, plain, v) == (7, [spec_cost] * 2, [2.0] * 2, verdict)


def test_gate_needs_every_speculating_period_faster():
    # speculation faster on average but one of its periods is slower than a plain one:
    # not separated from the noise, so the plain step stays (the mean rule would have
    # switched it on)
    spec_periods = iter([1.0, 1.0, 1.0, 2.5])
    gate = SpeculationGate(first=0, every=20, run=5)
    modes = drive(gate, lambda m, s: next(spec_periods) if m and s % 5 else (2.0 if not m else 1.0),
                  12)
    step, spec, plain, v = gate.decisions[0]
    assert sum(spec) / len(spec) < sum(plain) / len(plain) and v is False
    assert modes[10:] == [False, False]


def test_gate_false_positive_rate_is_the_rank_test_level():
    """Equal costs, every order of the 2 (run - 1) periods equally likely: the gate turns
    speculation on for exactly 1 / C(2 (run - 1), run - 1) of the orders."""
    run, n = 4, 3
    on = 0
    perms = list(itertools.permutations(range(2 * n)))
    for perm in perms:
        gate = SpeculationGate(first=0, every=2 * run, run=run)
        periods = {True: iter(perm[:n]), False: iter(perm[n:])}

        def cost(m, s):
            return 10.0 if s % run == 0 else 1.0 + next(periods[m])

        drive(gate, cost, 2 * run)
        on += gate.verdict
    assert on / len(perms) == pytest.approx(1 / math.comb(2 * n, n))


def test_gate_respects_the_backoff_and_skips_found_inf_periods():
    gate = SpeculationGate(first=0, every=8, run=2)
    # the back-off says no on steps 4, 5: outside the window the gate follows it, inside the
    # window (steps 0-3, 8-11) the gate forces its modes
    modes = drive(gate, {True: 1.0, False: 2.0}, 10, backoff=lambda s: s not in (4, 5, 8))
    assert modes == [True, True, False, False, False, False, True, True, True, True]
    # a backward pass whose step was skipped (found-inf): the next period spans two passes
    gate = SpeculationGate(first=0, every=8, run=2)
    drive(gate, {True: 1.0, False: 2.0}, 4, skip_step_at=(2,))
    # steps: pass0 -> step0, pass1 -> step1 (counted), pass2 skipped, pass3 -> step2 (plain,
    # first of its run: not counted), so the plain mode has no clean sample yet
    assert gate.samples[True] == [1.0] and gate.samples[False] == []


def test_gate_verdict_comes_from_the_reduced_periods():
    seen = []

    def reduce(values):  # another rank of the group saw one speculating period slower
        seen.append(list(values))
        return [max(values[0], 5.0)] + values[1:]

    gate = SpeculationGate(first=0, every=6, run=3)
    drive(gate, {True: 1.0, False: 2.0}, 6, reduce=reduce)
    assert seen == [[1.0, 1.0, 2.0, 2.0]] and gate.verdict is False
    # a period not measured on this rank (-1) is filled by the group's maximum
    gate = SpeculationGate(first=0, every=6, run=3)
    drive(gate, {True: 1.0, False: 2.0}, 7, skip_step_at=(1,),
          reduce=lambda v: [max(x, 1.0) if i < 2 else x for i, x in enumerate(v)])
    assert gate.decisions[0][1] == [1.0, 1.0] and gate.verdict is True
    # no clean sample of one mode anywhere: the verdict stays
    gate = SpeculationGate(first=0, every=6, run=3)
    gate.verdict = True
    gate._decide(5, None)
    assert gate.verdict is True


@pytest.mark.parametrize("kw", [dict(run=1), dict(every=5, run=3), dict(first=-1)])
def test_gate_rejects_bad_schedules(kw):
    with pytest.raises(ValueError, match="SpeculationGate needs"):
        SpeculationGate(**kw)


@pytest.mark.parametrize("changed", [None, 0, 1, 2])
@pytest.mark.parametrize("numel_scale", [1, 8])  # chunks of one parameter / the whole group
def test_step_compares_with_the_speculated_u_in_place(changed, numel_scale):
    """ShardedMuonStep._momentum_into_speculated (the step with a pending speculation):
    the momentum is committed exactly as the plain step commits it, the result says
    whether U matched the speculated U bit for bit, and the speculated buffer ends holding
    this step's U whichever parameter (if any) differed first.  The speculation is the
    overlap's own (``overlap.speculated_u``), so an unchanged gradient must match: a
    speculation computed with another kernel than the step's (it once used a foreach add
    where the step uses ``torch.add(out=)``) would be redone on every step where the two
    round differently."""
    import functools
    from types import SimpleNamespace

    import torch

    from megatron_muon.core.muon import momentum_update_
    from megatron_muon.megatron.dmuon import ShardedMuonStep
    from megatron_muon.megatron.overlap import speculated_u

    g = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((4, 3), (5, 2), (3, 3))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    offsets, off = {}, 0
    for p in ps:
        offsets[p], off = off, off + p.numel()
    moms = [torch.randn(p.shape, generator=g) for p in ps]
    # (numel and owned_numel set the chunk limit, min of them // 8: here 4 or 35 elements)
    me = SimpleNamespace(param_groups=[{"params": ps}], numel=off * numel_scale, momentum=0.9,
                         nesterov=True, engine=SimpleNamespace(owned_numel=off * numel_scale),
                         offsets=offsets,
                         state={p: {"momentum_buffer": m.clone()} for p, m in zip(ps, moms)})
    me._slice = functools.partial(ShardedMuonStep._slice, me)
    me._grad = ShardedMuonStep._grad
    # the speculation, by the overlap's own function (from copies of the momentum)
    spec = torch.empty(off)
    for p in ps:
        speculated_u(me, p, p.grad.clone(), spec[offsets[p]: offsets[p] + p.numel()])
    assert all(torch.equal(me.state[p]["momentum_buffer"], m) for p, m in zip(ps, moms))
    if changed is not None:  # that parameter's gradient changed after the speculation
        ps[changed].grad.mul_(0.5)
    # the plain step's U and momentum, for reference
    ref_m = [m.clone() for m in moms]
    ref = torch.empty(off)
    momentum_update_(ref_m, [p.grad for p in ps], 0.9, True, [me._slice(ref, p) for p in ps])
    same = ShardedMuonStep._momentum_into_speculated(me, spec)
    assert same is (changed is None)
    assert torch.equal(spec, ref)
    assert all(torch.equal(me.state[p]["momentum_buffer"], m) for p, m in zip(ps, ref_m))
