"""Megatron's production settings under ``--optimizer dmuon`` (issue #30).

* the features dmuon does not run with are refused at setup with one line naming the
  setting and the fix: in the config (``DMuonOptimizerConfig``), in the factory's
  ``compat.check_supported`` (a field set after construction; what only the model and the
  groups show) and on the command line (``validate_dmuon_args``, Megatron-LM's names);
* Megatron-Core 0.19's ``adaptive_muon_moment2_method`` maps onto ``dmuon_moment2``;
* TF32 for ``muon_fp32_matmul_prec='high'`` uses torch's new precision API where it exists
  and restores a user's setting exactly;
* docs/megatron_flags.md lists every optimizer flag of Megatron-LM's real parser (needs
  ``megatron/training``: the megatron-core 0.19 lane);
* examples/pretrain_gpt.py gives GPU runs Megatron's settings and keeps the CPU ones in
  one branch; its NS precision is the config's default on both.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_muon.testing.flag_table import flag_table, parser_facts, table_gaps

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def cfg(**kw):
    from megatron_muon import DMuonOptimizerConfig

    return DMuonOptimizerConfig(**{"use_distributed_optimizer": True, **kw})


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


# --------------------------------------------------------------------------- config
# (field, the reason the message gives); the fix is "turn it off (<field>=False)"
SWITCHES = [
    ("use_precision_aware_optimizer", "param.decoupled_grad, which DMuon does not read"),
    ("optimizer_cpu_offload", "the device that holds the gradient buffers"),
    ("overlap_param_gather_with_optimizer_step",
     "ChainedOptimizer starts the param all-gather right after its first sub-optimizer"),
    ("optimizer_cuda_graph", "would replay the host-side decisions of one step"),
]


@pytest.mark.parametrize("optimizer", ["dmuon", "muon_naive"])
@pytest.mark.parametrize("field,why", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_config_refuses_unsupported_megatron_switches(optimizer, field, why):
    """One ValueError line naming the field and the fix; Megatron's own checks (an
    AssertionError "--use-precision-aware-optimizer only supported with adam") come later.
    Fields this megatron-core lacks (optimizer_cuda_graph before 0.19) go through the
    validator itself."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_muon.megatron.config import check_muon_setup

    want = f"optimizer={optimizer!r} does not support {field}=True: "
    fix = f"turn it off ({field}=False)"
    if field in {f.name for f in fields(OptimizerConfig)}:
        with pytest.raises(ValueError) as err:
            cfg(optimizer=optimizer, **{field: True})
    else:
        values = dict(optimizer=optimizer, use_distributed_optimizer=True, **{field: True})
        with pytest.raises(ValueError) as err:
            check_muon_setup(values.get, cli=False)
    msg = _one_line(err)
    assert msg.startswith(want) and why in msg and msg.endswith(fix), msg


def test_precision_aware_dtypes_are_refused_and_adam_keeps_them():
    with pytest.raises(ValueError) as err:
        cfg(main_grads_dtype=torch.bfloat16)
    assert _one_line(err).startswith("optimizer='dmuon' keeps main grads, main params and Adam "
                                     "moments in fp32: main_grads_dtype=torch.bfloat16 needs "
                                     "use_precision_aware_optimizer=True")
    assert cfg(optimizer="adam").optimizer == "adam"  # adam's own settings are Megatron's


# --------------------------------------------------------------------------- the factory
def _chunk(cls_name="DistributedDataParallel", experts=False, model=None, params=(), **ddp):
    """What ``check_supported`` reads of a model chunk: its class, ddp_config, buffers,
    model config (``model``: TransformerConfig fields) and ``params`` (name, parameter)."""
    chunk = type(cls_name, (), {"named_parameters": lambda self: iter(params)})()
    chunk.ddp_config = SimpleNamespace(**{"use_distributed_optimizer": True, **ddp})
    chunk.expert_parallel_buffers = [object()] if experts else []
    chunk.config = SimpleNamespace(**(model or {}))
    return chunk


def _expert_weight(allreduce: bool):
    """An expert's fc1 as Megatron marks it: ``allreduce=False`` when it is in the expert
    buffers, True when in the dense ones."""
    p = torch.nn.Parameter(torch.zeros(4, 4))
    p.allreduce = allreduce
    return ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", p)


def _groups(cp=1, expt_tp=1):
    return SimpleNamespace(cp_size=cp, expt_tp_size=expt_tp)


@pytest.mark.parametrize("field", ["use_precision_aware_optimizer", "optimizer_cpu_offload",
                                   "overlap_param_gather_with_optimizer_step"])
def test_factory_refuses_a_field_set_after_construction(field):
    """``build_dmuon_optimizer`` calls ``check_supported`` first: a config changed after
    its own validation is refused there, before any optimizer is built."""
    from megatron_muon.megatron import compat

    c = cfg()
    setattr(c, field, True)
    with pytest.raises(ValueError) as err:
        compat.check_supported(c, [_chunk()], _groups())
    assert _one_line(err).startswith(f"optimizer='dmuon' does not support {field}=True: ")


@pytest.mark.parametrize("chunk,groups,message", [
    (_chunk(use_megatron_fsdp=True), _groups(),
     "optimizer='dmuon' does not run on Megatron-FSDP yet; use the distributed optimizer "
     "(ZeRO-1) with Megatron DDP"),
    # Megatron's torch-FSDP2 wrapper: its config has use_distributed_optimizer=False
    (_chunk("TorchFullyShardedDataParallel", use_distributed_optimizer=False), _groups(),
     "optimizer='dmuon' does not support torch FSDP2; wrap the model in Megatron DDP"),
    (_chunk(), _groups(cp=2),
     "optimizer='dmuon' does not support context parallelism yet (context parallel size 2)"),
    (_chunk(experts=True), _groups(expt_tp=2),
     "optimizer='dmuon': dmuon_tp_mode='blockwise' treats dense TP shards only; with expert "
     "tensor parallel size 2 use dmuon_tp_mode='exact'"),
    # megatron-core 0.16 at EP 1: expert-TP shards in the dense buffers
    (_chunk(model=dict(expert_tensor_parallel_size=2, tensor_model_parallel_size=1),
            params=[_expert_weight(allreduce=True)]), _groups(),
     "optimizer='dmuon': this Megatron-Core keeps MoE experts sharded by expert TP 2 in the "
     "dense buffers"),
], ids=["megatron_fsdp", "torch_fsdp2", "context_parallel", "expert_tp_blockwise",
        "expert_tp_without_ep"])
def test_factory_refuses_unsupported_layouts(chunk, groups, message):
    from megatron_muon.megatron import compat

    blockwise = "blockwise" in message
    with pytest.raises(ValueError) as err:
        compat.check_supported(cfg(dmuon_tp_mode="blockwise") if blockwise else cfg(),
                               [chunk], groups)
    assert _one_line(err).startswith(message), str(err.value)


def test_factory_accepts_expert_tp_groups_of_a_dense_model():
    """Megatron makes an expert-TP group of the TP size even for dense models."""
    from megatron_muon.megatron import compat

    compat.check_supported(cfg(), [_chunk()], _groups(expt_tp=2))


# --------------------------------------------------------------------------- command line
CLI = [  # (case, Megatron-LM's argument names, the one line validate_dmuon_args gives)
    ("precision_aware", dict(use_precision_aware_optimizer=True),
     "--optimizer dmuon does not support --use-precision-aware-optimizer: with it Megatron puts "
     "the gradients in param.decoupled_grad, which DMuon does not read (its Muon matrices "
     "would only decay); drop --use-precision-aware-optimizer"),
    ("megatron_fsdp", dict(use_megatron_fsdp=True),
     "--optimizer dmuon does not support --use-megatron-fsdp: it runs on Megatron DDP with the "
     "distributed optimizer (ZeRO-1), not on Megatron-FSDP; drop --use-megatron-fsdp"),
    ("torch_fsdp2", dict(use_torch_fsdp2=True),
     "--optimizer dmuon does not support --use-torch-fsdp2: it runs on Megatron DDP with the "
     "distributed optimizer (ZeRO-1), not on torch FSDP2; drop --use-torch-fsdp2"),
    ("cpu_offload", dict(optimizer_cpu_offload=True),
     "--optimizer dmuon does not support --optimizer-cpu-offload: DMuon's step and its exchange "
     "run on the device that holds the gradient buffers; drop --optimizer-cpu-offload"),
    ("context_parallel", dict(context_parallel_size=2),
     "--optimizer dmuon does not support --context-parallel-size > 1 yet (got 2); use "
     "--context-parallel-size 1"),
    ("overlap_with_step",
     dict(overlap_param_gather=True, overlap_param_gather_with_optimizer_step=True),
     "--optimizer dmuon does not support --overlap-param-gather-with-optimizer-step: Megatron's "
     "ChainedOptimizer starts the param all-gather right after its first sub-optimizer, and "
     "dmuon chains a DMuon and an AdamW over the same buffers; drop "
     "--overlap-param-gather-with-optimizer-step"),
    ("cuda_graph", dict(optimizer_cuda_graph=True),
     "--optimizer dmuon does not support --optimizer-cuda-graph: "),
    ("main_grads_dtype", dict(main_grads_dtype=torch.bfloat16),  # Megatron-LM maps 'bf16'
     "--optimizer dmuon keeps main grads, main params and Adam moments in fp32: "
     "--main-grads-dtype bf16 needs --use-precision-aware-optimizer"),
    ("instances", dict(num_distributed_optimizer_instances=2),
     "--optimizer dmuon does not support --num-distributed-optimizer-instances > 1 (got 2)"),
    ("param_group_map", dict(dump_param_to_param_group_map="groups.json"),
     "--optimizer dmuon does not support --dump-param-to-param-group-map"),
]


@pytest.mark.parametrize("optimizer", ["dmuon", "muon_naive"])
@pytest.mark.parametrize("values,message", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_command_line_refuses_unsupported_megatron_flags(optimizer, values, message):
    from megatron_muon.megatron.arguments import DMuonArgumentError, validate_dmuon_args

    args = SimpleNamespace(optimizer=optimizer, use_distributed_optimizer=True, **values)
    with pytest.raises(DMuonArgumentError) as err:
        validate_dmuon_args(args)
    msg = _one_line(err)
    assert msg.startswith(message.replace("--optimizer dmuon", f"--optimizer {optimizer}")), msg
    adam = SimpleNamespace(optimizer="adam", use_distributed_optimizer=True, **values)
    assert validate_dmuon_args(adam) is adam  # Megatron's own optimizers: Megatron decides


@pytest.mark.parametrize("values", [
    dict(num_experts=None, expert_tensor_parallel_size=2),  # a dense model: means nothing
    dict(num_experts=4, expert_tensor_parallel_size=2, expert_model_parallel_size=2),
    dict(num_experts=4, expert_tensor_parallel_size=2, tensor_model_parallel_size=2),
    # megatron-core 0.19 gives these experts expert groups; 0.16 does not, which the factory
    # refuses where it sees the parameters (test_factory_refuses_unsupported_layouts)
    dict(num_experts=4, expert_tensor_parallel_size=1, tensor_model_parallel_size=2),
], ids=["dense", "etp2_ep2", "etp2_tp2", "etp1_tp2"])
def test_command_line_accepts_expert_tp(values):
    """Expert TP > 1 runs (tests/test_dmuon.py's expert TP test); Megatron-LM sets
    --expert-tensor-parallel-size to the TP size when not given."""
    from megatron_muon.megatron.arguments import validate_dmuon_args

    args = SimpleNamespace(optimizer="dmuon", use_distributed_optimizer=True,
                           main_grads_dtype=torch.float32, **values)
    assert validate_dmuon_args(args) is args


# --------------------------------------------------------------------------- adaptive_muon
def _parser(*megatron_flags):
    from megatron_muon.megatron.arguments import add_dmuon_args

    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="adam", choices=["adam", "muon", "adaptive_muon"])
    p.add_argument("--use-distributed-optimizer", action="store_true")
    for flag, kwargs in megatron_flags:
        p.add_argument(flag, **kwargs)
    return add_dmuon_args(p)


DMUON = ["--optimizer", "dmuon", "--use-distributed-optimizer"]


def test_adaptive_muon_moment2_method_maps_onto_dmuon_moment2():
    from megatron_muon.megatron.arguments import (DMuonArgumentError, dmuon_config_from_args,
                                                  validate_dmuon_args)

    assert cfg(adaptive_muon_moment2_method="normuon").dmuon_moment2 == "normuon"
    assert cfg(adaptive_muon_moment2_method="adamuon", dmuon_moment2="adamuon").dmuon_moment2 \
        == "adamuon"
    assert cfg().dmuon_moment2 is None  # not given: plain Muon (Megatron's default is adamuon)
    with pytest.raises(ValueError) as err:
        cfg(adaptive_muon_moment2_method="normuon", dmuon_moment2="adamuon")
    assert _one_line(err) == ("adaptive_muon_moment2_method='normuon' and dmuon_moment2="
                              "'adamuon' contradict each other (adaptive_muon_moment2_method "
                              "maps onto dmuon_moment2); drop one")
    with pytest.raises(ValueError, match="adaptive_muon_moment2_method 'rmsprop' is unknown; "
                                         "choose one of adamuon, normuon"):
        cfg(adaptive_muon_moment2_method="rmsprop")

    p = _parser()  # Megatron-LM 0.19.2: no flag of its own; add_dmuon_args adds it
    args = p.parse_args(DMUON + ["--adaptive-muon-moment2-method", "normuon"])
    assert dmuon_config_from_args(validate_dmuon_args(args)).dmuon_moment2 == "normuon"
    bad = p.parse_args(DMUON + ["--adaptive-muon-moment2-method", "normuon", "--dmuon-moment2",
                                "adamuon"])
    with pytest.raises(DMuonArgumentError) as err:
        validate_dmuon_args(bad)
    assert _one_line(err) == ("--adaptive-muon-moment2-method normuon --dmuon-moment2 adamuon "
                              "contradict each other (--adaptive-muon-moment2-method maps onto "
                              "--dmuon-moment2); drop one")


def test_megatron_lm_adaptive_muon_flag_counts_only_when_given():
    """Megatron-LM versions that define --adaptive-muon-moment2-method default it to
    adamuon; reused for dmuon it counts only when given (else plain Muon).  Megatron's
    OptimizerConfig default (adamuon, 0.19) as the base config counts neither."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_muon.megatron.arguments import dmuon_config_from_args, validate_dmuon_args

    p = _parser(("--adaptive-muon-moment2-method",
                 dict(type=str, default="adamuon", choices=["adamuon", "normuon"])))
    base = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
    for argv, moment2 in (([], None), (["--adaptive-muon-moment2-method", "normuon"], "normuon"),
                          (["--adaptive-muon-moment2-method", "adamuon"], "adamuon"),
                          (["--dmuon-moment2", "normuon"], "normuon")):
        args = validate_dmuon_args(p.parse_args(DMUON + argv))
        assert dmuon_config_from_args(args).dmuon_moment2 == moment2, argv
        assert dmuon_config_from_args(args, base).dmuon_moment2 == moment2, argv
    assert p.parse_args([]).adaptive_muon_moment2_method == "adamuon"  # Megatron's default kept


# --------------------------------------------------------------------------- TF32
@pytest.fixture
def matmul_flags():
    """torch's CUDA matmul flags, put back as they were (they work without a GPU)."""
    flags = torch.backends.cuda.matmul
    if not hasattr(flags, "fp32_precision"):  # torch < 2.9: only the legacy flag exists
        pytest.skip(f"torch {torch.__version__} has no torch.backends.cuda.matmul.fp32_precision")
    saved = flags.fp32_precision
    yield flags
    flags.fp32_precision = saved


@pytest.mark.parametrize("prior", ["ieee", "tf32", "none"])
def test_tf32_matmuls_restore_the_users_setting_exactly(matmul_flags, prior):
    """muon_fp32_matmul_prec='high' turns TF32 on around Newton-Schulz; torch >= 2.9 raises
    when the legacy allow_tf32 and the new fp32_precision are mixed (a user who set
    fp32_precision='ieee' got a RuntimeError), and restoring through the legacy setter
    turned 'none' (inherit) into 'ieee'."""
    from megatron_muon.megatron import compat

    matmul_flags.fp32_precision = prior
    with compat._tf32_matmuls(torch.device("cuda")):  # a device object needs no GPU
        assert matmul_flags.fp32_precision == "tf32"
    assert matmul_flags.fp32_precision == prior
    restore = compat._tf32_matmuls_on("cuda")
    assert matmul_flags.fp32_precision == "tf32"
    restore()
    assert matmul_flags.fp32_precision == prior
    with compat._tf32_matmuls("cpu"):  # nothing elsewhere
        assert matmul_flags.fp32_precision == prior


def test_tf32_matmuls_keep_the_legacy_flag_on_old_torch():
    from megatron_muon.megatron import compat

    legacy = SimpleNamespace(allow_tf32=False)  # torch < 2.9's flags
    restore = compat._tf32_matmuls_on("cuda", legacy)
    assert legacy.allow_tf32 is True
    restore()
    assert legacy.allow_tf32 is False
    compat._tf32_matmuls_on("cpu", legacy)()
    assert legacy.allow_tf32 is False


# --------------------------------------------------------------------------- the flag table
def _installed_training_dir():
    from megatron_muon.testing.mlm_env import installed_training_dir

    return installed_training_dir()


needs_training = pytest.mark.skipif(
    _installed_training_dir() is None,
    reason="this megatron-core ships no megatron/training (Megatron-LM's parser); the "
           "megatron-core 0.19 lane runs it")

REFUSED_ARGV = {  # Megatron-LM's own spellings, parsed by its parser -> in the message
    "precision_aware": (["--use-precision-aware-optimizer"],
                        "drop --use-precision-aware-optimizer"),
    "megatron_fsdp": (["--use-megatron-fsdp"], "drop --use-megatron-fsdp"),
    "torch_fsdp2": (["--use-torch-fsdp2"], "drop --use-torch-fsdp2"),
    "cpu_offload": (["--optimizer-cpu-offload"], "drop --optimizer-cpu-offload"),
    "context_parallel": (["--context-parallel-size", "2"], "use --context-parallel-size 1"),
    "overlap_with_step": (["--overlap-param-gather", "--overlap-param-gather-with-optimizer-step"],
                          "drop --overlap-param-gather-with-optimizer-step"),
    "cuda_graph": (["--optimizer-cuda-graph"], "drop --optimizer-cuda-graph"),
    "main_grads_dtype": (["--main-grads-dtype", "bf16"], "drop --main-grads-dtype"),
    "moment2_conflict": (["--adaptive-muon-moment2-method", "normuon", "--dmuon-moment2",
                          "adamuon"], "contradict each other"),
}
ACCEPTED_ARGV = {"plain": [], "dense_expert_tp": ["--expert-tensor-parallel-size", "2"],
                 "moe_expert_tp": ["--num-experts", "4", "--expert-tensor-parallel-size", "2",
                                   "--expert-model-parallel-size", "2"],
                 "normuon": ["--adaptive-muon-moment2-method", "normuon"]}

@pytest.fixture(scope="module")
def megatron_lm_parser():
    if _installed_training_dir() is None:
        pytest.skip("no megatron/training in this env")
    return parser_facts({**{name: a for name, (a, _) in REFUSED_ARGV.items()}, **ACCEPTED_ARGV})


@needs_training
@pytest.mark.timeout(300)
def test_megatron_flags_table_lists_every_megatron_lm_optimizer_flag(megatron_lm_parser):
    """Every optimizer flag of Megatron-LM's parser (plus what add_dmuon_args adds under
    Megatron names) has a row with works / maps / refused, and every row names a flag that
    parser has: the table cannot go stale when Megatron-LM adds a flag."""
    table = flag_table()
    assert len(table) > 50, table  # the parse found the table's rows
    missing, unknown = table_gaps(table, megatron_lm_parser)
    assert not missing, f"docs/megatron_flags.md lacks rows for {missing}"
    assert not unknown, f"docs/megatron_flags.md names flags Megatron-LM's parser lacks: {unknown}"
    # rows for flags some Megatron-LM versions lack escape the check above; keep them few
    # (tools/check_flag_table.py checks them against checkouts)
    some = sorted(f for f, (_, only) in table.items() if only)
    assert len(some) <= 4, some
    refused = {f for f, (status, _) in table.items() if status == "refused"}
    assert {"--use-precision-aware-optimizer", "--use-megatron-fsdp", "--use-torch-fsdp2",
            "--optimizer-cpu-offload", "--context-parallel-size",
            "--overlap-param-gather-with-optimizer-step"} <= refused
    assert table["--adaptive-muon-moment2-method"][0] == "maps"
    assert table["--expert-tensor-parallel-size"][0] == "works"


@needs_training
@pytest.mark.timeout(300)
def test_megatron_lm_parser_flags_are_refused_for_dmuon(megatron_lm_parser):
    """The refusals read Megatron-LM's own argument names: each refused flag, parsed by its
    parser, gives one line naming it; the accepted ones pass."""
    got = megatron_lm_parser["validated"]
    for name, (_, fix) in REFUSED_ARGV.items():
        assert got[name] and "\n" not in got[name] and fix in got[name], (name, got[name])
        assert got[name].startswith(("--optimizer dmuon ", "--adaptive-muon-moment2-method ")), \
            got[name]
    assert {name: got[name] for name in ACCEPTED_ARGV} == dict.fromkeys(ACCEPTED_ARGV)


# --------------------------------------------------------------------------- the main job
@pytest.fixture(scope="module")
def pretrain():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_flags_example",
                                                  REPO / "examples" / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_job_ns_precision_is_the_configs_default(pretrain):
    """No CPU-only Newton-Schulz precision: 'medium' (the config's, Megatron's default)
    unless --muon-fp32-matmul-prec says otherwise."""
    from megatron_muon import DMuonOptimizerConfig

    p = pretrain.build_parser()
    assert p.parse_args([]).muon_fp32_matmul_prec == DMuonOptimizerConfig.muon_fp32_matmul_prec
    assert p.parse_args([]).muon_fp32_matmul_prec == "medium"
    assert p.parse_args(["--muon-fp32-matmul-prec", "highest"]).muon_fp32_matmul_prec == "highest"


def test_main_job_gpu_path_gets_megatrons_settings(pretrain, monkeypatch):
    """The GPU branch: gradient accumulation fusion as Megatron-LM (on, where its kernel
    imports; --no-gradient-accumulation-fusion); nothing CPU-only.  The CPU branch: the CPU
    mode's fields and no fusion."""
    from megatron_muon.megatron.cpu_mode import cpu_transformer_config

    args = pretrain.build_parser().parse_args([])
    monkeypatch.setattr(pretrain, "fused_wgrad_available", lambda: True)
    assert pretrain.device_transformer_fields(args, on_gpu=True) == dict(
        gradient_accumulation_fusion=True)
    off = pretrain.build_parser().parse_args(["--no-gradient-accumulation-fusion"])
    assert pretrain.device_transformer_fields(off, on_gpu=True) == dict(
        gradient_accumulation_fusion=False)
    monkeypatch.setattr(pretrain, "fused_wgrad_available", lambda: False)
    assert pretrain.device_transformer_fields(args, on_gpu=True) == dict(
        gradient_accumulation_fusion=False)  # no apex kernel: Megatron's layers would raise
    cpu = pretrain.device_transformer_fields(args, on_gpu=False)
    assert cpu == dict(cpu_transformer_config(), gradient_accumulation_fusion=False)
    if not torch.cuda.is_available():
        assert cpu["use_cpu_initialization"] is True
