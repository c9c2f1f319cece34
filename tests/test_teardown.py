"""Teardown: ``close_optimizer`` (the chained optimizer's ``close()``) takes back what a build
installed, so that a second optimizer built on the same DDP model runs alone and trains
exactly as a fresh build does (factory.py's docstring lists what a build changes)."""

import pytest
import torch

from megatron_muon.testing.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

OPT = dict(muon_fp32_matmul_prec="highest", lr=2e-3, adam_eps=1e-3)
QK = {"qk_clip": True, "qk_clip_threshold": 0.05, "qk_clip_alpha": 0.5}
VARIANTS = {
    # the overlap's hooks on the bucket groups and chunks, QK-clip's recorders, the trace
    "overlap-qkclip-trace": dict(opt=dict(OPT, dmuon_overlap=True),
                                 ddp=dict(overlap_grad_reduce=True, bucket_size=3000)),
    # ZeRO-3: the model's, kept and reused by the second build
    "zero3": dict(opt=dict(OPT, dmuon_placement="matrix", dmuon_zero3=True),
                  ddp=dict(overlap_grad_reduce=True, overlap_param_gather=True,
                           bucket_size=20000)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    trace_dir = str(tmp_path_factory.mktemp("traces"))
    res = run_ranks("megatron_muon.testing.workers:teardown_rebuild", 2,
                    dict(variants=list(VARIANTS.values()), cfg={"num_layers": 2, "extra": QK},
                         steps=2, trace_dir=trace_dir), timeout=420)
    return {name: [r[i] for r in res] for i, name in enumerate(VARIANTS)}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_close_removes_every_hook_the_build_installed(runs, name):
    for r in runs[name]:
        c = r["census"]
        assert c["built"]["recorders"] > c["before"]["recorders"]  # QK-clip recorders
        assert c["built"]["tracing"] > 0 and c["built"]["optimizer"] > 0  # the trace
        if name == "overlap-qkclip-trace":
            assert c["built"]["bucket_groups"] > c["before"]["bucket_groups"]
            assert c["built"]["chunks"] > c["before"]["chunks"]
        assert c["closed"] == c["before"], c
        assert r["trace_written"]  # close() wrote the trace instead of waiting for exit


def test_closed_optimizers_overlap_no_longer_fires(runs):
    """The first optimizer's overlap saw none of the second one's backward passes."""
    for r in runs["overlap-qkclip-trace"]:
        (stats,) = r["first_overlap_stats"]
        assert stats["speculated"] == stats["skipped"] == 0, stats


@pytest.mark.parametrize("name", list(VARIANTS))
def test_second_build_on_the_same_model_equals_a_fresh_build(runs, name):
    for r in runs[name]:
        assert set(r["rebuilt"]) == set(r["fresh"])
        for n, t in r["fresh"].items():
            assert torch.equal(r["rebuilt"][n], t), n


def test_zero3_close_removes_its_replacements_and_module_hooks(runs):
    """``MatrixZeRO3.close()`` (for a model that is discarded): its replacements of the
    bucket-group and buffer methods, the state-dict hooks and the modules' forward hooks
    are gone."""
    for r in runs["zero3"]:
        z = r["zero3_close"]
        assert {"register_grad_ready", "start_param_sync", "reset"} <= set(z["before"]["methods"])
        assert z["before"]["module_hooks"] > 0
        assert z["after"] == dict(methods=[], module_hooks=0), z
