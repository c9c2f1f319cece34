"""The span recorder: Chrome-trace events on the host clock and torch.profiler ranges."""

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_muon.distributed import trace


def test_span_records_an_event_and_a_profiler_range():
    tl = trace.start(rank=3)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with trace.span("dmuon.ns", bucket_group=1):
                torch.randn(32, 32) @ torch.randn(32, 32)
        with trace.span("dmuon.scatter"):  # no profiler: the timeline only
            pass
    finally:
        trace.stop()
    assert "dmuon.ns" in {e.name for e in prof.events()}
    (ns,) = tl.events("dmuon.ns")
    assert ns["pid"] == 3 and ns["args"] == {"bucket_group": 1} and ns["dur"] >= 0
    assert [e["name"] for e in tl.events()] == ["dmuon.ns", "dmuon.scatter"]


def test_span_without_timeline_still_opens_the_profiler_range():
    assert trace.active() is None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with trace.span("lora.exchange", "lora"):
            torch.ones(4).sum()
    assert "lora.exchange" in {e.name for e in prof.events()}
    with trace.span("nothing recording"):
        pass


def test_a_long_run_keeps_a_bounded_timeline(tmp_path):
    """``--dmuon-trace-dir`` on a long run: the timeline keeps its last ``max_events``
    events and says how many it dropped (it kept every event in host memory before)."""
    import json

    from megatron_muon.distributed.trace import Timeline

    tl = Timeline(rank=3, max_events=4)
    for i in range(10):
        tl.add(f"e{i}", "dmuon", i, i + 1)
    assert [e["name"] for e in tl.events()] == ["e6", "e7", "e8", "e9"] and tl.dropped == 6
    meta = json.loads(open(tl.save(str(tmp_path / "t.json"))).read())["traceEvents"][0]
    assert meta["args"]["name"] == "rank 3 (the first 6 events dropped: max_events)"
