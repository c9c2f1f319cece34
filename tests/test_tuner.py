"""NSTuner: validation against the reference, choice, JSON persistence, cost-model lookups."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_muon.kernels import NSTuner, batched_newton_schulz
from megatron_muon.kernels.backends import torch_batched, torch_gram, torch_loop
from megatron_muon.kernels.tuner import CACHE_ENV, default_candidates
from megatron_muon.core.newton_schulz import resolve_coefficients


class Counting:
    """Wraps a backend and counts calls, to prove what was (not) timed."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, x, coeffs, eps, dtype):
        self.calls += 1
        return self.fn(x, coeffs, eps, dtype)


def _identity(x, coeffs, eps, dtype):
    """Fastest possible and wrong: returns the input."""
    return x.clone()


def _wrong_coefficients(x, coeffs, eps, dtype):
    """Plausible but wrong: classic cubic NS instead of the requested set."""
    return torch_batched(x, resolve_coefficients("cubic", len(coeffs)), eps, dtype)


def _raises(x, coeffs, eps, dtype):
    raise RuntimeError("no kernel image for this device")


@pytest.mark.timeout(60)
def test_drops_wrong_candidates_and_keeps_a_correct_one():
    tuner = NSTuner(candidates={"identity": _identity, "wrong_coeffs": _wrong_coefficients,
                                "broken": _raises, "torch_batched": torch_batched,
                                "torch_loop": torch_loop},
                    warmup=0, iters=1)
    choice = tuner.choose(24, 40, 3, torch.float32, "cpu")
    assert choice in ("torch_batched", "torch_loop")
    (row,) = tuner.table()
    assert set(row["rejected"]) == {"identity", "wrong_coeffs", "broken"}
    assert "relative Frobenius error" in row["rejected"]["wrong_coeffs"]
    assert "no kernel image" in row["rejected"]["broken"]
    assert set(row["timings"]) == {"torch_batched", "torch_loop"}
    assert row["seconds"] == min(row["timings"].values()) == tuner.time(24, 40, 3, torch.float32, "cpu")


@pytest.mark.timeout(60)
def test_bf16_tolerance_accepts_correct_rejects_wrong():
    tuner = NSTuner(candidates={"torch_loop": torch_loop, "wrong_coeffs": _wrong_coefficients},
                    warmup=0, iters=1)
    assert tuner.choose(32, 16, 2, torch.bfloat16, "cpu") == "torch_loop"
    assert "wrong_coeffs" in tuner.table()[0]["rejected"]


@pytest.mark.timeout(60)
def test_persists_and_reloads_without_retiming(tmp_path):
    path = tmp_path / "sub" / "ns_tuner.json"
    first = NSTuner(cache_path=path, candidates=["torch_batched", "torch_loop"], warmup=0, iters=1)
    keys = [(16, 32, 1, torch.float32), (48, 24, 3, torch.float32), (16, 16, 2, torch.bfloat16)]
    chosen = {k: first.choose(*k, "cpu") for k in keys}
    seconds = {k: first.time(*k, "cpu") for k in keys}
    assert first.tune_count == 3
    data = json.loads(path.read_text())
    assert len(data["entries"]) == 3
    for entry in data["entries"].values():  # choices AND all timings persisted
        assert set(entry["timings"]) == {"torch_batched", "torch_loop"}
        assert entry["choice"] in entry["timings"] and entry["seconds"] > 0

    counters = {"torch_batched": Counting(torch_batched), "torch_loop": Counting(torch_loop)}
    second = NSTuner(cache_path=path, candidates=counters, warmup=0, iters=1)
    for k in keys:
        assert second.choose(*k, "cpu") == chosen[k]
        assert second.time(*k, "cpu") == seconds[k]
    assert second.tune_count == 0
    assert all(c.calls == 0 for c in counters.values())
    assert len(second.table()) == 3


@pytest.mark.timeout(60)
def test_time_is_a_lookup_after_the_first_call():
    counter = Counting(torch_batched)
    tuner = NSTuner(candidates={"torch_batched": counter}, warmup=1, iters=2)
    t1 = tuner.time(20, 30, 2, torch.float32, torch.device("cpu"))
    calls = counter.calls
    assert calls == 1 + 1 + 2  # validation run, warmup, timed iterations
    for _ in range(100):
        assert tuner.time(20, 30, 2, torch.float32, "cpu") == t1
    assert counter.calls == calls


@pytest.mark.timeout(60)
def test_env_var_names_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "env_cache.json"
    monkeypatch.setenv(CACHE_ENV, str(path))
    tuner = NSTuner(candidates=["torch_batched"], warmup=0, iters=1)
    tuner.choose(8, 16, 1, torch.float32, "cpu")
    assert tuner.cache_path == str(path) and path.exists()
    monkeypatch.delenv(CACHE_ENV)
    assert NSTuner(candidates=["torch_batched"]).cache_path is None  # memory only


@pytest.mark.timeout(60)
def test_new_candidate_triggers_retune_and_merges(tmp_path):
    path = tmp_path / "c.json"
    NSTuner(cache_path=path, candidates=["torch_batched"], warmup=0, iters=1).choose(8, 24, 2, torch.float32, "cpu")
    counter = Counting(torch_loop)
    wider = NSTuner(cache_path=path, candidates={"torch_batched": torch_batched, "torch_loop": counter},
                    warmup=0, iters=1)
    wider.choose(8, 24, 2, torch.float32, "cpu")
    assert counter.calls > 0 and wider.tune_count == 1
    wider.choose(8, 8, 1, torch.float32, "cpu")
    assert len(json.loads(path.read_text())["entries"]) == 2


@pytest.mark.timeout(60)
def test_auto_backend_uses_the_tuner():
    counter = Counting(torch_batched)
    tuner = NSTuner(candidates={"mine": counter}, warmup=0, iters=1)
    x = torch.randn(3, 16, 24)
    out = batched_newton_schulz(x, steps=5, coefficients="simple", backend="auto", tuner=tuner)
    assert counter.calls == 3  # validation, timing, and the real call
    assert torch.allclose(out, batched_newton_schulz(x, backend="torch_batched"))
    assert tuner.choose(16, 24, 3, torch.float32, "cpu") == "mine"


@pytest.mark.timeout(30)
def test_bad_tuner_arguments_and_corrupt_cache(tmp_path):
    with pytest.raises(ValueError, match="unknown NS backend"):
        NSTuner(candidates=["torch_batched", "fastest_ever"])
    with pytest.raises(ValueError, match="ns_steps must be an integer >= 1"):
        NSTuner(steps=0)
    with pytest.raises(ValueError, match="m, n, batch >= 1"):
        NSTuner().choose(0, 4, 1, torch.float32, "cpu")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring unreadable cache"):
        tuner = NSTuner(cache_path=bad, candidates=["torch_batched"], warmup=0, iters=1)
    assert tuner.table() == []
    tuner.choose(4, 8, 1, torch.float32, "cpu")  # rewrites a valid file
    assert json.loads(bad.read_text())["version"] == 1


@pytest.mark.timeout(30)
def test_default_candidates_on_cpu_skip_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert default_candidates("cpu") == ["torch_batched", "torch_loop", "torch_gram"]


def _noisy(x, coeffs, eps, dtype):
    """Within the bf16 tolerance of the reference (5e-2) but 3e-2 off: less accurate than
    bf16 standard NS (~1.5e-2 from the exact result) by more than one bf16 unit roundoff."""
    out = torch_batched(x, coeffs, eps, dtype)
    noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return out + 3e-2 * noise * out.norm() / noise.norm()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gram_is_a_validated_default_candidate(dtype):
    """The default candidates include Gram NS; it passes both accuracy checks (within
    tolerance of the reference, and no further from fp64 than the reference + slack) and
    is timed like the others, so the tuner can choose it where it is faster."""
    tuner = NSTuner(warmup=0, iters=1, coefficients="quintic")
    tuner.choose(32, 128, 2, dtype, "cpu")
    (row,) = tuner.table()
    assert set(row["timings"]) == {"torch_batched", "torch_loop", "torch_gram"}, row["rejected"]
    assert row["rejected"] == {}


@pytest.mark.timeout(60)
def test_rejects_a_candidate_less_accurate_than_the_reference():
    tuner = NSTuner(candidates={"noisy": _noisy, "torch_gram": torch_gram, "torch_batched": torch_batched},
                    warmup=0, iters=1)
    tuner.choose(32, 64, 2, torch.bfloat16, "cpu")
    (row,) = tuner.table()
    assert set(row["rejected"]) == {"noisy"}
    assert "less accurate than the reference" in row["rejected"]["noisy"]
    assert set(row["timings"]) == {"torch_gram", "torch_batched"}


# -- DMuon's planner: one measuring rank, the run's NS problem, a cache shared by processes ----
@pytest.mark.timeout(300)
def test_ranks_with_different_local_timings_build_the_same_plan():
    """``dmuon_plan_cost='tuner'``: each rank's kernels time differently (here: rank r sees
    the costs in reversed order, scaled by 1000^r; on GPUs it is noise, clocks and
    neighbours).  Rank 0 measures alone and every rank plans from its numbers: one plan, and
    no other rank touches the kernels or the cache."""
    from megatron_muon.testing.launch import run_ranks

    res = run_ranks("megatron_muon.testing.workers:tuner_plans", 2,
                    dict(opt=dict(muon_num_ns_steps=5)), timeout=120)
    assert [r["error"] for r in res] == [None, None], [r["error"] for r in res]
    assert res[0]["digest"] == res[1]["digest"] and res[0]["owners"] == res[1]["owners"]
    assert sorted(set(res[0]["measured"])) == [(8, 8), (8, 16), (16, 16), (16, 32)]
    assert res[1]["measured"] == []


def _tiny_matrices():
    from megatron_muon.core.units import whole_units
    from megatron_muon.distributed.owner_centric import Piece, ShardedMatrix

    return [ShardedMatrix("w0", (16, 32), tuple(whole_units((16, 32))), None, 1,
                          (Piece(0, 0, 0, 16 * 32, 0),))]


@pytest.mark.timeout(60)
def test_planner_tuner_validates_and_times_the_runs_ns_problem(tmp_path):
    """The planner's tuner validates and times the candidates with the run's step count and
    coefficient set (here 3 steps of 'quintic'), not the tuner's defaults (5 of 'simple'):
    the cache key it writes says which problem was measured."""
    from megatron_muon.megatron.dmuon import build_engine
    from megatron_muon.testing.workers import make_optimizer_config

    path = tmp_path / "plan.json"
    cfg = make_optimizer_config("dmuon", dmuon_plan_cost="tuner", dmuon_tuner_cache=str(path),
                                dmuon_ns_backend="torch", muon_num_ns_steps=3,
                                muon_coefficient_type="quintic", dmuon_log_plan=False)
    build_engine(_tiny_matrices(), None, cfg)
    (key, entry), = json.loads(path.read_text())["entries"].items()
    assert key.startswith("16x32|b1|") and key.endswith("|cpu|k3|quintic"), key
    assert (entry["steps"], entry["coefficients"]) == (3, "quintic")


@pytest.mark.timeout(60)
def test_concurrent_cache_writers_keep_each_others_keys(tmp_path):
    """Two processes tuning their first keys at once: both re-read the file before they
    replace it, so without a lock the second replace drops the first one's key.  Here the
    second writer starts (in a thread) right after the first has read the file and gets 0.5 s
    to finish before the first replaces it; the lock makes it wait instead."""
    import threading

    path = tmp_path / "shared.json"
    a = NSTuner(cache_path=path, candidates=["torch_batched"], warmup=0, iters=1)
    b = NSTuner(cache_path=path, candidates=["torch_batched"], warmup=0, iters=1)
    entry = {"choice": "torch_batched", "seconds": 1.0, "timings": {"torch_batched": 1.0}}
    read = a._read_cache
    other = threading.Thread(target=b._write_cache, args=("key-b", dict(entry)))

    def read_then_let_the_other_write(warn=True):
        data = read(warn)
        if not other.is_alive() and other.ident is None:
            other.start()
            other.join(0.5)
        return data

    a._read_cache = read_then_let_the_other_write
    a._write_cache("key-a", dict(entry))
    other.join(10)
    assert not other.is_alive()
    assert sorted(json.loads(path.read_text())["entries"]) == ["key-a", "key-b"]
    assert (tmp_path / "shared.json.lock").exists()  # the lock file lives next to the cache


@pytest.mark.timeout(60)
def test_cache_is_replaced_atomically(tmp_path, monkeypatch):
    """The cache is written to a temporary file in its own folder and ``os.replace``d over
    the old one; a write that fails half-way leaves the old file whole and no temp file."""
    import os

    path = tmp_path / "c.json"
    tuner = NSTuner(cache_path=path, candidates=["torch_batched"], warmup=0, iters=1)
    tuner.choose(8, 16, 1, torch.float32, "cpu")
    before = path.read_text()
    replaced = []
    real_replace = os.replace

    def recording_replace(src, dst):
        replaced.append((os.path.dirname(os.path.abspath(src)), os.path.basename(src), dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    tuner.choose(8, 24, 1, torch.float32, "cpu")
    ((folder, name, dst),) = replaced
    assert folder == str(tmp_path) and name.startswith(".ns_tuner.") and dst == str(path)
    assert len(json.loads(path.read_text())["entries"]) == 2

    def half_written(obj, f, **kwargs):
        f.write('{"version": 1, "entr')
        raise OSError("disk full")

    before = path.read_text()
    monkeypatch.setattr(json, "dump", half_written)
    with pytest.raises(OSError, match="disk full"):
        tuner.tune(4, 8, 1, torch.float32, "cpu")
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "c.json.lock"]
