"""DMuonOptimizerConfig and get_megatron_optimizer reject bad configurations clearly."""

import pytest

from megatron_muon.testing.launch import run_ranks

pytestmark = pytest.mark.timeout(120)


def cfg(**kw):
    from megatron_muon import DMuonOptimizerConfig

    base = dict(use_distributed_optimizer=True)
    base.update(kw)
    return DMuonOptimizerConfig(**base)


@pytest.mark.parametrize("kwargs,match", [
    (dict(muon_coefficient_type="nope"), "unknown Newton-Schulz coefficient set"),
    (dict(muon_scale_mode="nope"), "unknown muon scale mode"),
    (dict(muon_num_ns_steps=0), "ns_steps must be an integer >= 1"),
    (dict(muon_momentum=1.0), "momentum must be in"),
    (dict(muon_fp32_matmul_prec="low"), "muon_fp32_matmul_prec"),
    (dict(use_distributed_optimizer=False), "use_distributed_optimizer=True"),
    (dict(optimizer="lamb"), "optimizer must be one of"),
    (dict(dmuon_plan_cost="guess"), "dmuon_plan_cost"),
    (dict(dmuon_zero3=True), "dmuon_zero3=True needs optimizer='dmuon' and dmuon_placement='matrix'"),
    (dict(dmuon_zero3=True, dmuon_placement="matrix", optimizer="muon_naive"), "dmuon_zero3"),
])
def test_bad_config_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kwargs)


def test_megatron_names_and_defaults():
    c = cfg()
    assert c.optimizer == "dmuon" and c.muon_momentum == 0.95 and c.muon_num_ns_steps == 5
    assert c.muon_coefficient_type == "quintic" and c.muon_scale_mode == "spectral"
    from dataclasses import fields

    if "muon_use_nesterov" in {f.name for f in fields(type(c))}:  # megatron-core 0.16 spelling
        assert cfg(muon_use_nesterov=True).muon_nesterov


def build_error(ddp_distopt: bool) -> str:
    """Per-rank: try to build dmuon on a model whose DDP config is wrong; return the error."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_muon import get_megatron_optimizer
    from megatron_muon.testing.gpt import TinyGPTConfig, build_gpt, init_parallel
    from megatron_muon.testing.workers import make_optimizer_config

    init_parallel(1, 1)
    model = build_gpt(TinyGPTConfig(num_layers=1), ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=ddp_distopt))
    try:
        get_megatron_optimizer(make_optimizer_config("dmuon"), model)
    except ValueError as e:
        return str(e)
    return ""


def test_dmuon_without_distributed_optimizer_buffers_is_a_clear_error():
    (msg,) = run_ranks("test_config:build_error", 1, dict(ddp_distopt=False), timeout=100,
                       env={"PYTHONPATH": __import__("os").path.dirname(__file__)})
    assert "use_distributed_optimizer must be True" in msg


def test_zero3_turns_the_overlap_off():
    c = cfg(dmuon_zero3=True, dmuon_placement="matrix")
    assert not (c.dmuon_overlap or c.dmuon_overlap_bucket_gather or c.dmuon_overlap_param_update)
