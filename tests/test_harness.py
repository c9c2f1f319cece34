"""The gloo harness runs real Megatron-Core training (AdamW distributed optimizer) on CPU."""

import pytest
import torch

from megatron_muon.testing.launch import RankFailure, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_adamw_distributed_optimizer_keeps_dp_replicas_identical(tp, pp):
    res = run_ranks("megatron_muon.testing.workers:train_megatron", 4,
                    dict(cfg={}, tp=tp, pp=pp, optimizer="adam", opt={"lr": 1e-3}, steps=3),
                    timeout=240)
    replicas = {}
    for r in res:
        replicas.setdefault((r["layout"]["tp"], r["layout"]["pp"]), []).append(r["params"])
    assert all(len(v) == 2 for v in replicas.values())  # DP = 2
    for first, second in replicas.values():
        for n in first:
            assert torch.equal(first[n], second[n]), n
    losses = [r["losses"] for r in res if r["losses"][0] is not None][0]
    assert all(l == l and 0 < l < 10 for l in losses)


def test_hanging_rank_times_out_instead_of_hanging():
    with pytest.raises(RankFailure, match="timed out"):
        run_ranks("megatron_muon.testing.workers:stall", 2, dict(seconds=60), timeout=8)


def test_failing_rank_reports_its_error():
    with pytest.raises(RankFailure, match="exited with code"):
        run_ranks("megatron_muon.testing.workers:train_megatron", 2,
                  dict(cfg={}, tp=3, optimizer="adam"), timeout=120)
