"""Owner planner: balance, determinism, locality (pure, no torch.distributed)."""

import pytest

from megatron_muon.core.plan import UnitTask, flops_cost, plan_owners

pytestmark = pytest.mark.timeout(60)


def gpt_units(layers=12, hidden=768, ffn=3072, split_qkv=True):
    cost = flops_cost(5)
    shapes = []
    for l in range(layers):
        qkv = [(hidden, hidden)] * 3 if split_qkv else [(3 * hidden, hidden)]
        for i, s in enumerate(qkv + [(hidden, hidden), (ffn, hidden), (hidden, ffn)]):
            shapes.append(UnitTask(f"l{l}.{i}", s, cost(s), 4 * s[0] * s[1]))
    return shapes


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("hidden,ffn", [(768, 3072), (1024, 4096)])
def test_twelve_layer_gpt_imbalance_within_5_percent(ranks, hidden, ffn):
    plan = plan_owners(gpt_units(12, hidden, ffn), ranks)
    assert plan.imbalance <= 0.05, plan.summary()


def test_plan_is_deterministic_and_order_independent():
    tasks = gpt_units(4)
    a = plan_owners(tasks, 4)
    b = plan_owners(list(reversed(tasks)), 4)
    assert a.owners == b.owners and a.digest == b.digest


def test_locality_prefers_holder_without_breaking_balance():
    tasks = [UnitTask(f"u{i}", (64, 64), 1.0) for i in range(8)]
    holdings = {f"u{i}": [4096 if r == i % 4 else 0 for r in range(4)] for i in range(8)}
    plan = plan_owners(tasks, 4, holdings=holdings)
    assert all(plan.owners[f"u{i}"] == i % 4 for i in range(8))
    assert plan.imbalance == 0.0


def test_summary_and_errors():
    plan = plan_owners(gpt_units(2), 2)
    assert "imbalance" in plan.summary() and "rank 1" in plan.summary()
    with pytest.raises(ValueError, match="unique"):
        plan_owners([UnitTask("a", (2, 2), 1.0)] * 2, 2)
    with pytest.raises(ValueError, match="num_ranks"):
        plan_owners([], 0)
