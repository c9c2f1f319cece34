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
    (dict(muon_coefficient_type="nope"), "muon_coefficient_type 'nope' is unknown"),
    (dict(muon_coefficient_type=[(1.0, 2.0)]), "explicit coefficients must be"),
    (dict(muon_scale_mode="nope"), "muon_scale_mode 'nope' is unknown"),
    (dict(muon_num_ns_steps=0), "ns_steps must be an integer >= 1"),
    (dict(muon_momentum=1.0), "momentum must be in"),
    (dict(muon_fp32_matmul_prec="low"), "muon_fp32_matmul_prec"),
    (dict(use_distributed_optimizer=False), "use_distributed_optimizer=True"),
    (dict(optimizer="lamb"), "optimizer must be one of"),
    (dict(dmuon_plan_cost="guess"), "dmuon_plan_cost"),
    (dict(dmuon_ns_backend="cuda"), "dmuon_ns_backend 'cuda' is unknown"),
    (dict(muon_ns_method="fast"), "muon_ns_method 'fast' is unknown; choose one of auto, "
                                  "standard, gram"),
    (dict(muon_ns_method="gram", dmuon_ns_backend="triton"), "no Triton Gram kernel"),
    (dict(muon_ns_method="gram", muon_use_syrk=True),
     "muon_ns_method='gram' and muon_use_syrk=True: there is no Triton Gram kernel"),
    (dict(dmuon_qkv_split="head", muon_split_qkv=False),
     "dmuon_qkv_split='head' and muon_split_qkv=False contradict each other"),
    (dict(dmuon_qkv_split="heads"), "dmuon_qkv_split 'heads' is unknown; choose one of qkv, head"),
    (dict(muon_use_syrk=True, dmuon_ns_backend="torch"),
     "muon_use_syrk=True and dmuon_ns_backend='torch' contradict each other"),
    (dict(dmuon_overlap="maybe"), "dmuon_overlap 'maybe' is unknown; choose one of auto, on, off"),
    (dict(dmuon_locality_slack=-0.5), "dmuon_locality_slack must be a finite number >= 0"),
    (dict(dmuon_adam_params="(unclosed"), "dmuon_adam_params '\\(unclosed' is not a valid"),
    (dict(dmuon_zero3=True, dmuon_placement="matrix", optimizer="muon_naive"),
     "dmuon_zero3=True needs optimizer='dmuon' and dmuon_placement='matrix' or "
     "optimizer='dmuon' and dmuon_placement='dmuon' or optimizer='muon_naive' and "
     "dmuon_placement='dmuon' \\(got optimizer='muon_naive' and dmuon_placement='matrix'\\)"),
    (dict(dmuon_split="sometimes"), "dmuon_split 'sometimes' is unknown; choose one of auto, off"),
    (dict(dmuon_split_parts=1), "dmuon_split_parts must be an integer >= 2, got 1"),
    (dict(muon_coefficient_type="cubic5", muon_num_ns_steps=4),
     "muon_coefficient_type with muon_num_ns_steps 4: the 'cubic5' coefficient set is a fixed "
     "5-step schedule"),
    (dict(dmuon_split_parts=2, dmuon_placement="matrix"),
     "dmuon_split_parts=2 does not work with dmuon_placement='matrix'"),
    (dict(dmuon_split_parts=2, dmuon_split="off"), "dmuon_split='off'"),
    (dict(dmuon_split_parts=2, muon_ns_method="gram"), "muon_ns_method='gram'"),
    (dict(dmuon_split_parts=2, dmuon_moment2="normuon"), "needs whole units"),
    (dict(dmuon_split_flops_per_byte=0.0), "dmuon_split_flops_per_byte must be a finite"),
])
def test_bad_config_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kwargs)


def test_scalar_optimizer_and_lion_settings():
    c = cfg(muon_scalar_optimizer="lion")
    assert (c.muon_scalar_optimizer, c.lion_beta1, c.lion_beta2) == ("lion", 0.95, 0.98)
    with pytest.raises(ValueError, match="muon_scalar_optimizer 'sgd' is unknown; choose one "
                                         "of adam, lion"):
        cfg(muon_scalar_optimizer="sgd")
    with pytest.raises(ValueError, match=r"lion_beta1 must be in \[0, 1\), got 1.0"):
        cfg(muon_scalar_optimizer="lion", lion_beta1=1.0)


@pytest.mark.parametrize("megatron,dmuon,expected", [
    (None, "exact", "exact"), (None, "blockwise", "blockwise"),
    ("duplicated", "exact", "exact"), ("distributed", "exact", "exact"),
    ("blockwise", "exact", "blockwise"), ("blockwise", "blockwise", "blockwise"),
])
def test_megatron_tp_mode_maps_onto_dmuon_tp_mode(megatron, dmuon, expected):
    assert cfg(muon_tp_mode=megatron, dmuon_tp_mode=dmuon).dmuon_tp_mode == expected


@pytest.mark.parametrize("syrk,backend,expected", [
    (False, "auto", "auto"), (True, "auto", "triton"), (True, "triton", "triton"),
    (False, "torch", "torch")])
def test_megatron_syrk_flag_maps_onto_the_triton_backend(syrk, backend, expected):
    """Megatron-Core main's --muon-use-syrk (a Triton SYRK kernel for NS's Gram products)
    is dmuon's Triton backend, whose kernels compute one triangle of the symmetric
    products; with --dmuon-ns-backend torch it is refused (test_bad_config_values)."""
    assert cfg(muon_use_syrk=syrk, dmuon_ns_backend=backend).dmuon_ns_backend == expected


def test_megatron_tp_mode_errors():
    with pytest.raises(ValueError, match="muon_tp_mode='duplicated' and dmuon_tp_mode="
                                         "'blockwise' contradict each other"):
        cfg(muon_tp_mode="duplicated", dmuon_tp_mode="blockwise")
    with pytest.raises(ValueError, match="muon_tp_mode 'rowwise' is unknown"):
        cfg(muon_tp_mode="rowwise")


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


ZERO3 = dict(dmuon_zero3=True, dmuon_placement="matrix")


def test_overlap_auto_is_adaptive_with_pp_else_off():
    """'auto' resolves to the adaptive policy with pipeline parallelism and to off without it
    (DP/TP only: nothing to hide behind) or with ZeRO-3 (no data-parallel collective to
    hide); the field keeps what was asked for, the optimizer reads ``overlap_policy``."""
    from megatron_muon.megatron.config import resolve_overlap

    assert cfg().dmuon_overlap == "auto"
    assert cfg().overlap_policy(2) == "adaptive" and cfg().overlap_policy(1) == "off"
    c = cfg(**ZERO3)
    assert c.dmuon_overlap == "auto" and c.overlap_policy(2) == "off"
    assert cfg(**ZERO3, dmuon_overlap="off").overlap_policy(2) == "off"
    assert cfg(dmuon_overlap="off").overlap_policy(2) == "off"
    assert cfg(dmuon_overlap="on").overlap_policy(1) == "on"
    # the former bool field: True / False are stored as 'on' / 'off'
    assert cfg(dmuon_overlap=True).dmuon_overlap == "on"
    off = cfg(dmuon_overlap=False)
    assert off.dmuon_overlap == "off" and off.overlap_policy(2) == "off"
    # the refinements are kept as given (they only act while the overlap is on)
    assert c.dmuon_overlap_bucket_gather and c.dmuon_overlap_param_update
    assert [resolve_overlap(m, z, pp) for m in ("auto", "on", "off", True, False)
            for z in (False, True) for pp in (1, 2) if (m, z) not in (("on", True), (True, True))
            ] == ["off", "adaptive", "off", "off", "on", "on", "off", "off", "off", "off",
                  "on", "on", "off", "off", "off", "off"]


@pytest.mark.parametrize("overlap", ["on", True])
def test_overlap_on_with_zero3_is_an_error_not_a_silent_change(overlap):
    with pytest.raises(ValueError, match="dmuon_overlap='on' does not work with dmuon_zero3=True"):
        cfg(**ZERO3, dmuon_overlap=overlap)
    c = cfg(**ZERO3)
    c.dmuon_overlap = "on"  # changed after construction: the resolution still refuses it
    with pytest.raises(ValueError, match="use 'auto' or 'off'"):
        c.overlap_policy(2)


def test_fp16_is_a_supported_precision():
    """fp16 (with Megatron's loss scaler) trains with DMuon (tests/test_dmuon.py), so neither
    the config nor the command line rejects it."""
    import argparse

    from megatron_muon.megatron.arguments import add_dmuon_args, validate_dmuon_args

    assert cfg(fp16=True).fp16
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="dmuon")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--fp16", action="store_true")
    args = add_dmuon_args(p).parse_args(["--use-distributed-optimizer", "--fp16"])
    assert args.fp16
    assert validate_dmuon_args(args) is args


def test_every_flag_field_carries_type_default_help_and_flag():
    import dataclasses
    from typing import Literal, get_origin

    from megatron_muon.megatron.config import (DMuonOptimizerConfig, choices_of, cli_fields,
                                               flag_of)

    names = [f.name for f in cli_fields()]
    own = [n for n in DMuonOptimizerConfig.__annotations__
           if n.startswith(("muon_", "dmuon_", "adaptive_muon_", "lion_"))]
    assert names == own  # every Muon / DMuon field is a flag, in declaration order
    for f in cli_fields():
        assert f.default is not dataclasses.MISSING and f.metadata["help"].strip(), f.name
        assert flag_of(f.name) == "--" + f.name.replace("_", "-")
        assert "%" not in f.metadata["help"]  # argparse would try to format it
        if get_origin(f.type) is Literal:
            assert f.default in choices_of(f), f.name
    assert choices_of(next(f for f in cli_fields() if f.name == "dmuon_overlap")) == (
        "auto", "on", "off")


def test_megatron_flags_table_lists_every_megatron_muon_field():
    """docs/megatron_flags.md cannot go stale: every Muon field of the installed
    megatron-core (OptimizerConfig: muon_*, adaptive_muon_*, lion_*; TransformerConfig:
    qk_clip*, log_max_attention_logit) and every muon_* / lion_* field of
    DMuonOptimizerConfig has a row (its name in backticks in the first column)."""
    import re
    from dataclasses import fields
    from pathlib import Path

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_muon import DMuonOptimizerConfig

    text = (Path(__file__).resolve().parents[1] / "docs" / "megatron_flags.md").read_text()
    rows = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            rows.update(re.findall(r"`([a-z0-9_]+)`", line.split("|")[1]))
    wanted = {f.name for c in (OptimizerConfig, DMuonOptimizerConfig) for f in fields(c)
              if f.name.startswith(("muon_", "adaptive_muon_", "lion_"))}
    wanted |= {f.name for f in fields(TransformerConfig)
               if f.name.startswith("qk_clip") or f.name == "log_max_attention_logit"}
    assert wanted, "no Muon fields found: the prefixes are wrong"
    assert not wanted - rows, f"docs/megatron_flags.md lacks rows for {sorted(wanted - rows)}"


def test_documented_defaults_equal_the_configs():
    """docs/usage.md's table of config fields (``| `field` | default | meaning |``) says the
    default each field really has: every row's default is ``DMuonOptimizerConfig``'s, and
    every field the command line generates has a row."""
    import re
    from pathlib import Path

    from megatron_muon.megatron.config import cli_fields, config_defaults

    text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    defaults = config_defaults()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `([a-z0-9_]+)` \| ([^|]+) \|", line)
        if m and m.group(1) in defaults:
            rows[m.group(1)] = m.group(2).strip().strip("`")
    assert len(rows) >= 20, f"the config-field table of docs/usage.md was not found: {rows}"
    wrong = {name: (doc, defaults[name]) for name, doc in rows.items()
             if doc != str(defaults[name])}
    assert not wrong, f"docs/usage.md: documented default vs the config's: {wrong}"
    missing = sorted(f.name for f in cli_fields() if f.name not in rows)
    assert not missing, f"docs/usage.md's config-field table lacks {missing}"


def test_even_zero3_refuses_sequence_parallel_on_the_command_line():
    """The reconstruction baseline (ZeRO-3 on even shards) cannot reduce the layer norms'
    sequence-parallel gradients (no rank holds a whole one), so the flags are refused before
    training; with matrix placement the same flags pass."""
    import argparse

    from megatron_muon.megatron.arguments import (DMuonArgumentError, add_dmuon_args,
                                                  validate_dmuon_args)

    def parse(*argv):
        p = argparse.ArgumentParser()
        p.add_argument("--optimizer", default="dmuon")
        p.add_argument("--use-distributed-optimizer", action="store_true")
        p.add_argument("--overlap-grad-reduce", action="store_true")
        p.add_argument("--sequence-parallel", action="store_true")
        return add_dmuon_args(p).parse_args(
            ["--use-distributed-optimizer", "--overlap-grad-reduce", "--sequence-parallel",
             "--dmuon-zero3", *argv])

    for opt in ("dmuon", "muon_naive"):
        with pytest.raises(DMuonArgumentError, match="does not support --sequence-parallel"):
            validate_dmuon_args(parse("--optimizer", opt))
    args = parse("--dmuon-placement", "matrix")
    assert validate_dmuon_args(args) is args


def _parse_megatron_lm(*argv, extra=()):
    """dmuon's flags on a parser with the Megatron-LM flags these refusals read."""
    import argparse

    from megatron_muon.megatron.arguments import add_dmuon_args

    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="dmuon")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--qk-layernorm", action="store_true")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--ckpt-format", default="torch_dist")
    p.add_argument("--enable-cuda-graph", action="store_true")
    p.add_argument("--external-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-impl", default="none")
    return add_dmuon_args(p).parse_args(["--use-distributed-optimizer", *argv])


def test_refusals_of_issue_42_name_the_flag_and_the_fix():
    """Each was a silent wrong result or a late crash before: even-shard ZeRO-3 with
    --qk-layernorm at TP > 1 (the q/k-norm gradients were never summed over TP), ZeRO-3 with
    CUDA graphs (a replay reads freed storage), --ckpt-format torch (owner-held state lost,
    one DP layout).  The configurations next to them that work still pass."""
    from megatron_muon.megatron.arguments import DMuonArgumentError, validate_dmuon_args

    zero3 = ("--dmuon-zero3", "--overlap-grad-reduce")
    cases = [
        (zero3 + ("--qk-layernorm", "--tensor-model-parallel-size", "2"),
         r"--dmuon-zero3 with even shards .* does not support --qk-layernorm at "
         r"--tensor-model-parallel-size > 1: use --dmuon-placement matrix"),
        (zero3 + ("--dmuon-placement", "matrix", "--enable-cuda-graph"),
         r"--dmuon-zero3 does not work with --enable-cuda-graph: a captured layer replays"),
        (zero3 + ("--dmuon-placement", "matrix", "--cuda-graph-impl", "local"),
         r"--dmuon-zero3 does not work with --cuda-graph-impl"),
        (("--ckpt-format", "torch"),
         r"--ckpt-format torch is not supported by dmuon: .* use --ckpt-format torch_dist"),
    ]
    for argv, message in cases:
        with pytest.raises(DMuonArgumentError, match=message):
            validate_dmuon_args(_parse_megatron_lm(*argv))
    for argv in (zero3 + ("--qk-layernorm", "--tensor-model-parallel-size", "2",
                          "--dmuon-placement", "matrix"),
                 zero3 + ("--qk-layernorm",),  # TP 1: nothing to all-reduce
                 ("--enable-cuda-graph",)):  # without ZeRO-3
        args = _parse_megatron_lm(*argv)
        assert validate_dmuon_args(args) is args


def test_triton_backend_is_refused_at_setup_where_it_cannot_run(monkeypatch):
    """--muon-use-syrk (and dmuon_ns_backend='triton') on parameters the Triton kernels
    cannot run on is refused when the optimizer is built, naming the flag, not at the first
    step deep inside the NS."""
    import torch

    from megatron_muon.kernels import backends
    from megatron_muon.megatron import compat

    monkeypatch.setattr(backends, "triton_usable", lambda device=None: False)
    chunks = [torch.nn.Linear(2, 2)]
    with pytest.raises(ValueError, match=r"muon_use_syrk=True \(Megatron-LM: --muon-use-syrk\) "
                                         r"runs dmuon's Triton .* \(these are on cpu\); drop it"):
        compat._check_triton_usable(cfg(muon_use_syrk=True), chunks)
    with pytest.raises(ValueError, match="dmuon_ns_backend='triton' runs dmuon's Triton"):
        compat._check_triton_usable(cfg(dmuon_ns_backend="triton"), chunks)
    monkeypatch.setattr(backends, "triton_usable", lambda device=None: True)
    compat._check_triton_usable(cfg(muon_use_syrk=True), chunks)  # where it runs: nothing
