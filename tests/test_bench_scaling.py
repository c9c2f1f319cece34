"""tools/bench_scaling.py at its smallest setting: one 2-rank point runs the calibration and
the interleaved bench in one job and writes well-formed JSON (measured cells, the cost
model's predictions, ratios) and a plot; --from-json predicts again from what it wrote."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(600)  # ~10-40 s; 3 minutes under a load average of 60
def test_smallest_point_writes_json_and_plot(tmp_path, capsys):
    import bench_scaling

    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert bench_scaling.main([
        "--points", "dp2", "--optimizers", "adam,muon_naive,dmuon", "--num-layers", "1",
        "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "16", "--steps", "1", "--reps", "2", "--warmup", "0", "--quick",
        "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["optimizers"] == ["adam", "muon_naive", "dmuon"]
    (pt,) = doc["points"]
    assert (pt["n"], pt["tp"], pt["dp"]) == (2, 1, 2)
    assert len(pt["profiles"]) == 2  # calibrated before and after the bench
    for prof in pt["profiles"]:
        assert prof["ns_rate_points"] and "all_to_all" in prof["collectives"]
    for name in ("adam", "muon_naive", "dmuon"):
        m, p = pt["results"][name]["measured"], pt["results"][name]["predicted"]
        raw = pt["raw"][name]
        assert len(raw["opt_s"]) == 2  # reps x steps timed steps
        for st, fb, tot in zip(raw["opt_s"], raw["fwd_bwd_s"], raw["total_s"]):
            assert max(st, fb) < tot <= st + fb + 1e-9  # the slowest rank's step + fwd/bwd
        assert 0 < m["opt_spread_ms"][0] <= m["opt_ms"] <= m["opt_spread_ms"][1]
        assert m["total_ms"] >= m["opt_ms"] > 0 and p["opt_ms"] > 0 and p["total_ms"] > 0
        assert p["opt_range_ms"][0] <= p["opt_ms"] <= p["opt_range_ms"][1]
    r = pt["ratios"]["muon_naive/dmuon opt"]
    assert r["measured"] > 0 and r["predicted"] > 0 and r["spread"][0] <= r["spread"][1]
    assert png.stat().st_size > 10_000
    capsys.readouterr()
    md = tmp_path / "s.md"
    assert bench_scaling.main(["--from-json", str(out), "--markdown", str(md)]) == 0
    assert "muon_naive/dmuon opt" in capsys.readouterr().out
    # the docs' tables: each cell is the measured median with the prediction beside it
    adam = pt["results"]["adam"]
    cell = f"{adam['measured']['opt_ms']:.0f} ({adam['predicted']['opt_ms']:.0f})"
    lines = md.read_text().splitlines()
    row = next(line for line in lines if line.startswith("| 2 | DP2 | "))
    assert row.split(" | ")[2] == cell, row
    assert sum(line.startswith("| 2 | DP2 |") for line in lines) == 3  # opt, total, ratios


def test_point_names():
    import bench_scaling

    assert bench_scaling.parse_point("dp8") == (1, 8)
    assert bench_scaling.parse_point("tp2dp4") == (2, 4)
    with pytest.raises(ValueError):
        bench_scaling.parse_point("pp2")
