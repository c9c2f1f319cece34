"""``tools/bench_scale.py`` on small custom models, in this process, on torch's fake process
group (nothing is sent): every rank's executor is built and the totals must add up."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_scale  # noqa: E402
import cost_model_lib as cm  # noqa: E402

SMALL = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "512"]
CASES = {
    # TP shards, split QKV units, several DDP buckets
    "tp2dp3-buckets": ["--preset", "llama3-8b", *SMALL, "--tp", "2", "--dp", "3",
                       "--bucket-size", "150000"],
    # experts over their expert-DP group (EP2: 2 ranks) next to the dense DP x TP group
    "ep2dp4-experts": ["--preset", "qwen3-30b-a3b", *SMALL, "--kv-channels", "64",
                       "--num-experts", "4", "--moe-ffn-hidden-size", "128", "--ep", "2",
                       "--dp", "4"],
    # every unit's NS split over 3 ranks: parts are owned like units
    "tp2dp3-split3": ["--preset", "llama3-8b", *SMALL, "--tp", "2", "--dp", "3",
                      "--split-parts", "3"],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_bench_scale_totals_add_up(name, tmp_path, capsys):
    import torch.distributed as dist

    out = tmp_path / "scale.json"
    assert bench_scale.main([*CASES[name], "--all-ranks", "--progress", "0",
                             "--out", str(out)]) == 0
    assert not dist.is_initialized()  # every fake group it made is gone
    text = capsys.readouterr().out
    assert "owned NS flops over all" in text and "cost model" in text
    res = json.loads(out.read_text())
    kinds = [p["kind"] for p in res["parts"]]
    assert kinds == (["dense", "expert"] if "experts" in name else ["dense"])
    recv_max = 0
    for part in res["parts"]:
        rows = part["ranks"]
        assert part["all_ranks_measured"] and [r["rank"] for r in rows] == list(range(part["world"]))
        # every unit has exactly one owner, or one per part where the plan splits it, and
        # each rank's executor runs what the plan gives it
        extra = part["split_parts"] - part["split_units"]
        assert sum(r["owned_units"] for r in rows) == part["units"] + extra
        assert [r["owned_units"] for r in rows] == part["plan_owned_units"]
        if "split" in name:
            assert part["split_units"] == part["units"] and extra == 2 * part["units"]
            assert all(r["allreduce_bytes"] > 0 for r in rows)
        # what all ranks send is what all ranks receive, per exchange
        for kind in ("gather", "scatter"):
            assert sum(r[f"{kind}_send"] for r in rows) == sum(r[f"{kind}_recv"] for r in rows)
        assert sum(r["send_elems"] for r in rows) == sum(r["recv_elems"] for r in rows)
        # the cost model's exchange (cost_model_lib.matrix_exchange) is the executors' tables
        for key, per_rank in part["cost_model_exchange"].items():
            assert [r[key] for r in rows] == per_rank, key
        # the gather fills every owned unit: received + already local = owned elements
        assert all(r["gather_recv"] + r["gather_local"] == r["owned_numel"] for r in rows)
        assert all(r["index_bytes"] > 0 and r["build_s"] >= 0 for r in rows)
        # NS flops per rank: the planner's load less the split all-reduces' price
        assert part["plan_compute_imbalance"] == pytest.approx(
            part["summary"]["plan_owned_flops"]["max_over_mean"] - 1)
        recv_max += max(r["recv_bytes"] + r["allreduce_bytes"] for r in rows)
    if "buckets" in name:
        assert res["parts"][0]["buckets"] > 1
        # a unit's TP shards live on two ranks: at least one of them must move
        assert sum(r["send_elems"] for r in res["parts"][0]["ranks"]) > 0
    pred = res["cost_model"]
    if "split" in name:  # a forced split: the cost model plans with DMuon's defaults
        assert pred is None
        return
    # the cost model takes the same geometry and planner: its busiest rank is the measured one
    assert pred["muon_recv_bytes"] == pytest.approx(recv_max)
    assert pred["imbalance"] == pytest.approx(max(p["plan_imbalance"] for p in res["parts"]))


@pytest.mark.timeout(120)
def test_one_rank_of_a_later_stage():
    """A later pipeline stage (one bucket: Megatron buckets only the first stage) and one
    rank; the cost model, which models stage 0, is not compared."""
    assert bench_scale.main(["--preset", "llama3-8b", *SMALL, "--pp", "2", "--dp", "2",
                             "--stage", "1", "--rank", "1", "--progress", "0"]) == 0
    specs = cm.megatron_params(cm.MODELS["llama3-8b"], cm.Layout(pp=2, dp=2), pp_rank=1)
    assert specs[-1].name == "module.output_layer.weight"  # the last stage's output layer
