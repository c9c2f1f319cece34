"""patches/megatron-lm-dmuon.patch and megatron_muon.megatron.arguments.

* the patch applies cleanly to the ``megatron/training`` that megatron-core 0.19.2 ships
  (the installed wheel's copy; identical to the sdist's), reverts, detects a tree that
  does not match, and refuses a folder without Megatron-LM;
* Megatron-LM's own (patched) argument parser accepts ``--optimizer dmuon`` with valid
  flags, keeps the distributed optimizer on, and rejects bad values with messages that
  name the flag (``megatron/training`` imports on Python 3.11 with a ``typing.override``
  shim; it runs in a subprocess so this test session's modules stay untouched);
* the patched ``setup_model_and_optimizer`` builds megatron_muon's DMuon optimizer;
* ``add_dmuon_args`` on a plain argparse parser (every env, 0.16 included).

Tests that need ``megatron/training`` skip where the installed megatron-core has none
(megatron-core 0.16.x ships ``megatron/core`` only).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "patches" / "apply_patch.py"
PATCH = REPO / "patches" / "megatron-lm-dmuon.patch"


def _installed_training_dir():
    from megatron_muon.testing.mlm_env import installed_training_dir

    return installed_training_dir()


def _mcore_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:
        return "unknown"


TRAINING = _installed_training_dir()
needs_training = pytest.mark.skipif(
    TRAINING is None,
    reason=f"megatron-core {_mcore_version()} ships no megatron/training (only 0.17+ wheels and "
           "sdists do); the patch targets 0.19.2 - run in the mc19 env")


def _apply(*args, cwd=None):
    return subprocess.run([sys.executable, str(APPLY), *map(str, args)], capture_output=True,
                          text=True, timeout=60, cwd=cwd)


def _copy_tree(dest: Path, files=None) -> Path:
    """dest/megatron/training with the installed files (all, or just ``files``)."""
    target = dest / "megatron" / "training"
    if files is None:
        shutil.copytree(TRAINING, target, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        target.mkdir(parents=True)
        for name in files:
            shutil.copy(TRAINING / name, target / name)
    return dest


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory):
    if TRAINING is None:
        pytest.skip("no megatron/training in this env")
    root = _copy_tree(tmp_path_factory.mktemp("mlm"))
    out = _apply(root)
    assert out.returncode == 0, out.stdout + out.stderr
    return root


# --------------------------------------------------------------------------- the patch file
@needs_training
@pytest.mark.timeout(120)
def test_patch_applies_cleanly_and_reverts(tmp_path):
    root = _copy_tree(tmp_path, ["arguments.py", "training.py"])
    original = {n: (root / "megatron/training" / n).read_text() for n in ("arguments.py", "training.py")}

    check = _apply("--check", root)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "applies cleanly" in check.stdout
    assert (root / "megatron/training/arguments.py").read_text() == original["arguments.py"]

    done = _apply(root / "megatron")  # the megatron/ folder itself is accepted too
    assert done.returncode == 0, done.stdout + done.stderr
    args_py = (root / "megatron/training/arguments.py").read_text()
    train_py = (root / "megatron/training/training.py").read_text()
    assert "'dmuon', 'muon_naive'" in args_py and "add_dmuon_args" in args_py
    assert "validate_dmuon_args(args)" in args_py
    assert "from megatron_muon.megatron.factory import get_megatron_optimizer" in train_py
    assert "add_peft_args" in args_py and "validate_peft_args(args)" in args_py
    assert "'smuon'" in args_py and "LoRAModelBuild(args, cfg_container)" in train_py
    assert "get_lora_optimizer as build_optimizer" in train_py
    for name in ("arguments.py", "training.py"):
        py_compile.compile(str(root / "megatron/training" / name), doraise=True,
                           cfile=str(tmp_path / f"{name}c"))
    assert not list(root.rglob("*.orig")) and not list(root.rglob("*.rej"))

    again = _apply(root)
    assert again.returncode == 0 and "already applied" in again.stdout

    back = _apply("--revert", root)
    assert back.returncode == 0, back.stdout + back.stderr
    for name, text in original.items():
        assert (root / "megatron/training" / name).read_text() == text


@needs_training
@pytest.mark.timeout(120)
def test_patch_reports_a_tree_that_does_not_match(tmp_path):
    root = _copy_tree(tmp_path, ["arguments.py", "training.py"])
    args_py = root / "megatron/training/arguments.py"
    changed = args_py.read_text().replace("if args.optimizer not in ('sgd', 'adam'):",
                                          "if args.optimizer not in ('sgd', 'adam', 'lion'):")
    args_py.write_text(changed)
    out = _apply(root)
    assert out.returncode == 1
    assert "does not apply cleanly" in out.stderr and "nothing was changed" in out.stderr
    assert "FAILED" in out.stderr  # which hunk did not fit
    assert args_py.read_text() == changed
    assert "_add_dmuon_args" not in (root / "megatron/training/arguments.py").read_text()


@pytest.mark.timeout(60)
def test_apply_script_refuses_a_folder_without_megatron_training(tmp_path):
    out = _apply(tmp_path)
    assert out.returncode != 0
    assert "does not contain megatron/training/arguments.py" in out.stderr + out.stdout


def test_patch_header_names_the_version():
    text = PATCH.read_text()
    assert "megatron-core 0.19.2" in text
    assert "+++ b/megatron/training/arguments.py" in text
    assert "+++ b/megatron/training/training.py" in text


# --------------------------------------------------------------------------- patched Megatron-LM
_SHIM = """
import typing
if not hasattr(typing, "override"):  # Megatron-LM 0.19 imports typing.override (3.12+)
    import typing_extensions
    typing.override = typing_extensions.override
"""

# What a parser registered for each destination, as JSON (the subprocess drivers print it).
_TABLE = r"""
def actions_table(parser):
    import argparse
    rows = []
    for a in parser._actions:
        if not a.option_strings:
            continue
        default = "SUPPRESS" if a.default is argparse.SUPPRESS else a.default
        rows.append({"dest": a.dest, "options": list(a.option_strings), "default": default,
                     "help": a.help, "choices": list(a.choices) if a.choices else None,
                     "const": getattr(a, "const", None), "kind": type(a).__name__})
    return rows
"""

_PARSER_DRIVER = _SHIM + _TABLE + r"""
import io, json, sys, contextlib
import megatron.training.arguments as A
import megatron.training.training as T
from megatron_muon.megatron.arguments import DMuonArgumentError, dmuon_config_from_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "5",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--mock-data"]
assert A.__file__.startswith(sys.argv[1]), A.__file__  # the patched copy, not site-packages
results = {}
for name, extra in json.loads(sys.argv[2]).items():
    sys.argv = ["pretrain_gpt.py"] + BASE + extra
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = A.parse_args()
            A.validate_args(args)
    except SystemExit as e:
        results[name] = {"status": "argparse", "message": err.getvalue().strip().splitlines()[-1]}
        continue
    except (DMuonArgumentError, AssertionError) as e:
        results[name] = {"status": "invalid", "message": str(e)}
        continue
    r = {"status": "ok", "optimizer": args.optimizer,
         "use_distributed_optimizer": args.use_distributed_optimizer,
         "layer_wise": args.use_layer_wise_distributed_optimizer}
    for k in ("muon_momentum", "muon_nesterov", "muon_coefficient_type", "muon_num_ns_steps",
              "muon_fp32_matmul_prec", "dmuon_plan_cost", "dmuon_split_fc1", "lora_rank",
              "lora_target_modules", "overlap_param_gather", "dist_ckpt_optim_fully_reshardable"):
        r[k] = getattr(args, k)
    if args.optimizer in ("dmuon", "muon_naive"):
        base, _ = T.get_megatron_optimizer_config(args)
        cfg = dmuon_config_from_args(args, base)
        r["config"] = {"type": type(cfg).__name__, "lr": cfg.lr, "optimizer": cfg.optimizer,
                       "muon_nesterov": cfg.muon_nesterov, "plan": cfg.dmuon_plan_cost,
                       "clip_grad": cfg.clip_grad, "tp_mode": cfg.dmuon_tp_mode,
                       "scalar": cfg.muon_scalar_optimizer,
                       "lion": [cfg.lion_beta1, cfg.lion_beta2]}
    results[name] = r
full = A.add_megatron_arguments(__import__("argparse").ArgumentParser())
results["_groups"] = [g.title for g in full._action_groups]
(peft,) = [g for g in full._action_groups if g.title == "peft"]
results["_peft"] = [a.option_strings for a in peft._group_actions]
results["_actions"] = [r for r in actions_table(full) if r["dest"].startswith(("muon_", "dmuon_"))]
# The 'dmuon' section of --help (full.format_help() itself fails on Megatron-LM 0.19.2's
# own help strings: one has an unescaped '%').
fmt = full._get_formatter()
(dmuon,) = [g for g in full._action_groups if g.title == "dmuon"]
fmt.start_section(dmuon.title)
fmt.add_arguments(dmuon._group_actions)
fmt.end_section()
results["_help"] = fmt.format_help()
print("RESULTS " + json.dumps(results))
"""

GOOD = ["--optimizer", "dmuon", "--use-distributed-optimizer", "--muon-nesterov",
        "--muon-coefficient-type", "polar_express", "--muon-num-ns-steps", "8",
        "--muon-fp32-matmul-prec", "highest", "--dmuon-plan-cost", "tuner", "--dmuon-split-fc1"]
CASES = {
    "good": GOOD,
    "naive": ["--optimizer", "muon_naive", "--use-distributed-optimizer"],
    "adam": ["--optimizer", "adam", "--use-distributed-optimizer"],
    "bad_coeff": GOOD + ["--muon-coefficient-type", "bogus"],
    "bad_steps": GOOD + ["--muon-num-ns-steps", "0"],
    "bad_momentum": GOOD + ["--muon-momentum", "1.0"],
    "no_distopt": ["--optimizer", "dmuon", "--muon-nesterov"],
    "bad_prec": GOOD + ["--muon-fp32-matmul-prec", "low"],
    "lion": GOOD + ["--muon-scalar-optimizer", "lion", "--lion-beta1", "0.9"],
    "bad_lion": GOOD + ["--muon-scalar-optimizer", "lion", "--lion-beta2", "1.0"],
    "tp_blockwise": GOOD + ["--muon-tp-mode", "blockwise"],
    "tp_duplicated": GOOD + ["--muon-tp-mode", "duplicated"],
    "tp_distributed": GOOD + ["--muon-tp-mode", "distributed"],
    "tp_conflict": GOOD + ["--muon-tp-mode", "distributed", "--dmuon-tp-mode", "blockwise"],
    "bad_plan_choice": GOOD + ["--dmuon-plan-cost", "magic"],
    "bad_optimizer": ["--optimizer", "dmuonn", "--use-distributed-optimizer"],
    "zero3_no_overlap": GOOD + ["--dmuon-placement", "matrix", "--dmuon-zero3"],
    "zero3_params_norm": GOOD + ["--dmuon-placement", "matrix", "--dmuon-zero3",
                                 "--overlap-grad-reduce", "--log-params-norm"],
    # PEFT (--lora-*, --optimizer smuon, --relora-*)
    "lora_smuon": ["--optimizer", "smuon", "--lora-rank", "8", "--use-distributed-optimizer",
                   "--overlap-grad-reduce", "--overlap-param-gather",
                   "--lora-target-modules", "linear_qkv,linear_proj", "linear_fc2"],
    "lora_adam": ["--optimizer", "adam", "--lora-rank", "8", "--use-distributed-optimizer"],
    "lora_dmuon": GOOD + ["--lora-rank", "8"],
    "lora_relora": ["--optimizer", "smuon", "--lora-rank", "8", "--relora-interval", "10",
                    "--relora-reset", "prune"],
    "smuon_no_lora": ["--optimizer", "smuon"],
    "relora_no_lora": ["--relora-interval", "5"],
    "lora_zero3": GOOD + ["--dmuon-placement", "matrix", "--dmuon-zero3",
                          "--overlap-grad-reduce", "--lora-rank", "8"],
    "smuon_dmuon_flag": ["--optimizer", "smuon", "--lora-rank", "8", "--dmuon-plan-cost",
                         "tuner"],
    "relora_dmuon": GOOD + ["--lora-rank", "8", "--relora-interval", "5"],
    "lora_dropout": ["--lora-rank", "8", "--lora-dropout", "0.1"],
    "lora_bad_target": ["--lora-rank", "8", "--lora-target-modules", "linear-qkv"],
    "lora_bad_rank": ["--lora-rank", "-2"],
    "smuon_fp16": ["--optimizer", "smuon", "--lora-rank", "8", "--fp16"],
    "smuon_flag_adam": ["--lora-rank", "8", "--smuon-damping", "1e-3"],
    "relora_bad_reset": ["--optimizer", "smuon", "--lora-rank", "8", "--relora-interval", "5",
                         "--relora-reset", "bogus"],
}


@pytest.fixture(scope="module")
def parsed(patched_tree):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(patched_tree), str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _PARSER_DRIVER, str(patched_tree),
                          json.dumps(CASES)], capture_output=True, text=True, timeout=240, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULTS ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


@needs_training
@pytest.mark.timeout(300)
def test_patched_parser_accepts_dmuon(parsed):
    good = parsed["good"]
    assert good["status"] == "ok", good
    assert good["optimizer"] == "dmuon"
    assert good["use_distributed_optimizer"] is True and good["layer_wise"] is False
    assert good["muon_nesterov"] is True and good["muon_coefficient_type"] == "polar_express"
    assert good["muon_num_ns_steps"] == 8 and good["muon_fp32_matmul_prec"] == "highest"
    assert good["dmuon_plan_cost"] == "tuner" and good["dmuon_split_fc1"] is True
    assert good["muon_momentum"] == 0.9  # Megatron-LM's own flag and default, not re-registered
    assert good["config"] == {"type": "DMuonOptimizerConfig", "lr": 1e-3, "optimizer": "dmuon",
                              "muon_nesterov": True, "plan": "tuner", "clip_grad": 1.0,
                              # Megatron-LM's --muon-tp-mode default (blockwise) is not a
                              # choice for dmuon: only a given --muon-tp-mode counts
                              "tp_mode": "exact", "scalar": "adam", "lion": [0.95, 0.98]}
    assert parsed["naive"]["status"] == "ok" and parsed["naive"]["layer_wise"] is False
    assert parsed["adam"]["status"] == "ok" and parsed["adam"]["use_distributed_optimizer"]
    assert "dmuon" in parsed["_groups"]


@needs_training
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,status,message", [
    ("bad_coeff", "invalid", "--muon-coefficient-type 'bogus' is unknown"),
    ("bad_steps", "invalid", "--muon-num-ns-steps must be an integer >= 1, got 0"),
    ("bad_momentum", "invalid", "--muon-momentum must be in [0, 1), got 1.0"),
    ("no_distopt", "invalid", "--optimizer dmuon needs --use-distributed-optimizer"),
    ("bad_prec", "invalid", "--muon-fp32-matmul-prec 'low' is not supported by dmuon"),
    ("bad_lion", "invalid", "--lion-beta2 must be in [0, 1), got 1.0"),
    ("tp_conflict", "invalid", "--muon-tp-mode distributed --dmuon-tp-mode blockwise "
                               "contradict each other"),
    ("bad_plan_choice", "argparse", "argument --dmuon-plan-cost: invalid choice: 'magic'"),
    ("bad_optimizer", "argparse", "argument --optimizer: invalid choice: 'dmuonn'"),
    ("zero3_no_overlap", "invalid", "--dmuon-zero3 reduces gradients bucket by bucket"),
    ("zero3_params_norm", "invalid", "--dmuon-zero3 does not support --log-params-norm"),
])
def test_patched_parser_rejects_bad_values(parsed, case, status, message):
    assert parsed[case]["status"] == status, parsed[case]
    assert message in parsed[case]["message"], parsed[case]["message"]


@needs_training
@pytest.mark.timeout(300)
def test_patched_parser_maps_megatron_muon_flags(parsed):
    """Megatron's --muon-scalar-optimizer / --lion-* and --muon-tp-mode carry over to dmuon:
    lion with Megatron's betas; duplicated and distributed are DMuon's exact mode,
    blockwise its (inexact) blockwise mode."""
    lion = parsed["lion"]
    assert lion["status"] == "ok", lion
    assert lion["config"]["scalar"] == "lion" and lion["config"]["lion"] == [0.9, 0.98]
    for case, mode in (("tp_blockwise", "blockwise"), ("tp_duplicated", "exact"),
                       ("tp_distributed", "exact")):
        assert parsed[case]["status"] == "ok", parsed[case]
        assert parsed[case]["config"]["tp_mode"] == mode, case


@needs_training
@pytest.mark.timeout(300)
def test_patched_parser_accepts_peft(parsed):
    """--lora-rank with smuon, adam and dmuon; sMuon switches the distributed optimizer (and
    its param gather) off, as Megatron-LM's --freeze-all-layers does; with the distributed
    optimizer the checkpoints are fully reshardable (adapters resume at another TP / PP)."""
    smuon = parsed["lora_smuon"]
    assert smuon["status"] == "ok", smuon
    assert (smuon["optimizer"], smuon["lora_rank"], smuon["use_distributed_optimizer"],
            smuon["overlap_param_gather"], smuon["layer_wise"]) == ("smuon", 8, False, False,
                                                                     False)
    assert smuon["lora_target_modules"] == ["linear_qkv", "linear_proj", "linear_fc2"]
    adam = parsed["lora_adam"]
    assert adam["status"] == "ok" and adam["use_distributed_optimizer"] is True, adam
    assert adam["dist_ckpt_optim_fully_reshardable"] is True
    assert adam["lora_target_modules"] == ["linear_qkv", "linear_proj", "linear_fc1",
                                           "linear_fc2"]  # Megatron-Bridge's default
    assert parsed["lora_dmuon"]["status"] == "ok" and parsed["lora_dmuon"]["config"]
    assert parsed["lora_relora"]["status"] == "ok", parsed["lora_relora"]
    assert "peft" in parsed["_groups"]


@needs_training
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,message", [
    ("smuon_no_lora", "--optimizer smuon trains LoRA adapters: add --lora-rank R"),
    ("relora_no_lora", "--relora-interval needs LoRA: add --lora-rank R"),
    ("lora_zero3", "--dmuon-placement matrix / --dmuon-zero3 place the full weights"),
    ("smuon_dmuon_flag", "--dmuon-plan-cost is a dmuon flag; --optimizer smuon does not read it"),
    ("relora_dmuon", "--relora-interval needs --optimizer smuon or adam"),
    ("lora_dropout", "--lora-dropout 0.1: dropout on the adapter input is not supported"),
    ("lora_bad_target", "--lora-target-modules 'linear-qkv' is not a module name"),
    ("lora_bad_rank", "--lora-rank must be an integer >= 1, got -2"),
    ("smuon_fp16", "--fp16 needs a loss scaler"),
    ("smuon_flag_adam", "--smuon-damping is read only by --optimizer smuon"),
])
def test_patched_parser_refuses_peft_combinations(parsed, case, message):
    got = parsed[case]
    assert got["status"] == "invalid", got
    assert message in got["message"] and "\n" not in got["message"], got["message"]


@needs_training
@pytest.mark.timeout(300)
def test_patched_parser_rejects_an_unknown_relora_reset(parsed):
    got = parsed["relora_bad_reset"]
    assert got["status"] == "argparse" and "--relora-reset: invalid choice" in got["message"]


@needs_training
@pytest.mark.timeout(300)
def test_megatron_flags_doc_lists_every_peft_flag(parsed):
    """docs/megatron_flags.md's PEFT table names exactly the flags of the patched parser's
    'peft' group (plus --optimizer smuon)."""
    import re

    text = (REPO / "docs" / "megatron_flags.md").read_text()
    heading = "## PEFT flags"
    assert heading in text
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in section.splitlines():
        if line.startswith("| `--"):
            documented.update(re.findall(r"`(--[a-z0-9][a-z0-9-]*)", line.split("|")[1]))
    flags = {o for options in parsed["_peft"] for o in options}
    assert flags and documented - {"--optimizer"} == flags, (documented ^ flags)


def _actions_table(parser):
    scope: dict = {}
    exec(_TABLE, scope)
    return scope["actions_table"](parser)


def _assert_flags_match_config(rows, *, prefixes=("muon_", "dmuon_"), defaults=None,
                               help_text=None):
    """Each config field's flag, as registered: name, default, help text, choices and
    aliases all come from the field (``defaults``: a script's own documented overrides)."""
    from megatron_muon.megatron.config import choices_of, cli_fields, flag_of

    checked = []
    for f in cli_fields():
        if not f.name.startswith(prefixes):
            continue
        mine = [r for r in rows if r["dest"] == f.name]
        main = [r for r in mine if r["options"][0] == flag_of(f.name)]
        assert len(main) == 1, (f.name, mine)
        row, meta = main[0], f.metadata
        expected_default = (defaults or {}).get(f.name, f.default)
        assert row["default"] == expected_default, (f.name, row["default"], expected_default)
        assert row["help"] == meta["help"], f.name
        aliases = meta.get("aliases") or {}
        if f.type is bool:
            assert row["kind"] == "_Switch"
            assert row["options"] == [flag_of(f.name), "--no-" + flag_of(f.name)[2:],
                                      *[a for a, v in aliases.items() if v is False]], row
        else:
            allowed = choices_of(f)
            want = list(allowed) if allowed and meta.get("cli_choices", True) else None
            assert row["choices"] == want, (f.name, row["choices"])
            for alias, value in aliases.items():
                (a,) = [r for r in mine if r["options"] == [alias]]
                assert a["const"] == value and a["default"] == "SUPPRESS", a
        assert len(mine) == 1 + (0 if f.type is bool else len(aliases)), mine
        if help_text is not None:  # shown in --help (argparse re-wraps the text)
            flat = "".join(help_text.split())
            assert flag_of(f.name) in help_text and "".join(meta["help"].split()) in flat, f.name
        checked.append(f.name)
    assert checked
    return checked


def test_plain_parser_flags_are_generated_from_the_config():
    p = _plain_parser()
    names = _assert_flags_match_config(_actions_table(p), help_text=p.format_help())
    assert "dmuon_overlap" in names and "muon_nesterov" in names
    a = p.parse_args(["--no-muon-nesterov", "--muon-no-split-qkv", "--no-dmuon-overlap",
                      "--dmuon-no-log-plan", "--no-dmuon-overlap-bucket-gather"])
    assert (a.muon_nesterov, a.muon_split_qkv, a.dmuon_overlap, a.dmuon_log_plan,
            a.dmuon_overlap_bucket_gather) == (False, False, "off", False, False)
    a = p.parse_args(["--muon-nesterov", "--dmuon-overlap", "on", "--no-muon-split-qkv"])
    assert (a.muon_nesterov, a.dmuon_overlap, a.muon_split_qkv) == (True, "on", False)


def test_example_flags_are_generated_from_the_config():
    """examples/pretrain_gpt.py: every --muon-* / --dmuon-* flag from the config (the
    example's own Muon defaults documented in MUON_DEFAULTS), every flag with help text."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt_flags", REPO / "examples" /
                                                  "pretrain_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    p = example.build_parser()
    rows = _actions_table(p)
    _assert_flags_match_config(rows, defaults=example.MUON_DEFAULTS, help_text=p.format_help())
    assert not [r["options"] for r in rows if not r["help"]]  # every flag says what it does
    args = p.parse_args(["--no-muon-nesterov"])
    assert args.muon_nesterov is False and p.parse_args([]).muon_nesterov is True


@needs_training
@pytest.mark.timeout(300)
def test_patched_megatron_lm_dmuon_flags_are_generated_from_the_config(parsed):
    """Megatron-LM's own parser, patched: the --dmuon-* flags come from the config, its own
    --muon-* flags stay Megatron-LM's (registered once, Megatron's defaults)."""
    rows = parsed["_actions"]
    _assert_flags_match_config(rows, prefixes=("dmuon_",), help_text=parsed["_help"])
    for dest in ("muon_momentum", "muon_nesterov", "muon_split_qkv", "muon_fp32_matmul_prec"):
        (row,) = [r for r in rows if r["dest"] == dest]
        assert row["kind"] != "_Switch", row  # Megatron-LM's, not re-registered
    (prec,) = [r for r in rows if r["dest"] == "muon_fp32_matmul_prec"]
    assert "highest" in prec["choices"]


_NO_PACKAGE_DRIVER = _SHIM + r"""
import contextlib, io, sys
sys.modules["megatron_muon"] = None  # as if megatron-muon were not installed
import megatron.training.arguments as A

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "5"]
for extra in ([], ["--dmuon-placement", "matrix"], ["--no-dmuon-overlap"], ["--lora-rank", "4"]):
    sys.argv = ["pretrain_gpt.py"] + BASE + extra
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = A.parse_args()
        print("PARSED", args.optimizer)
    except ImportError as err:
        print("IMPORTERROR", err)
"""


@needs_training
@pytest.mark.timeout(300)
def test_patched_parser_without_the_package_names_it(patched_tree):
    """Without megatron-muon a --dmuon-* flag says the package is needed (it used to be
    'unrecognized arguments'); without such flags Megatron-LM parses as before."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(patched_tree),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _NO_PACKAGE_DRIVER],
                         capture_output=True, text=True, timeout=240, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith(("PARSED", "IMPORTERROR"))]
    assert lines == [
        "PARSED adam",
        "IMPORTERROR --dmuon-placement needs the megatron-muon package (pip install megatron-muon)",
        "IMPORTERROR --no-dmuon-overlap needs the megatron-muon package (pip install megatron-muon)",
        "IMPORTERROR --lora-rank needs the megatron-muon package (pip install megatron-muon)",
    ], out.stdout[-3000:] + out.stderr[-3000:]


_SETUP_DRIVER = _SHIM + r"""
import datetime, os, sys
import torch.distributed as dist
from megatron_muon.megatron.cpu_mode import default_backend, enable_cpu_mode
enable_cpu_mode()
dist.init_process_group(default_backend(), timeout=datetime.timedelta(seconds=120))
import megatron.training.arguments as A
import megatron.training.training as T
from megatron.core import parallel_state as ps
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.training.global_vars import get_args, set_global_variables

TINY_ARGV = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "5",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--mock-data",
    "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
    "--transformer-impl", "local", "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights"]

sys.argv = TINY_ARGV + [
    "--optimizer", "dmuon", "--use-distributed-optimizer", "--muon-nesterov",
    "--muon-coefficient-type", "simple", "--muon-fp32-matmul-prec", "highest"] + EXTRA
args = A.parse_args()
A.validate_args(args)
set_global_variables(args, build_tokenizer=False)
ps.initialize_model_parallel(1, 1)
model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)

def model_provider(pre_process=True, post_process=True, vp_stage=None, **kwargs):
    cfg = A.core_transformer_config_from_args(get_args())
    cfg.batch_p2p_sync = False
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256,
                    max_sequence_length=32, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope")

model, optimizer, scheduler = T.setup_model_and_optimizer(ModelType.encoder_or_decoder,
                                                          model_provider)
subs = [type(o).__name__ for o in optimizer.chained_optimizers]
cfg = optimizer.chained_optimizers[0].config
print("SETUP", type(optimizer).__name__, ",".join(subs), type(cfg).__name__, cfg.optimizer,
      cfg.muon_coefficient_type, type(scheduler).__name__, type(model[0].buffers[0]).__name__,
      cfg.dmuon_placement, "zero3" if hasattr(model[0], "matrix_zero3") else "zero1")
dist.destroy_process_group()
"""


@needs_training
@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["dmuon", "matrix", "zero3"])
def test_patched_training_builds_dmuon_optimizer(patched_tree, placement):
    """Megatron-LM's own setup_model_and_optimizer, patched, on one CPU rank (gloo); with
    --dmuon-placement matrix its get_model builds MatrixFSDP-placed DDP buffers, and with
    --dmuon-zero3 the parameters are sharded whole (ZeRO-3)."""
    from megatron_muon.testing.launch import rank_env, rendezvous_store

    store = rendezvous_store()  # holds the port until the driver is done (no port race)
    env = dict(os.environ, **rank_env(0, 1, store), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(patched_tree), str(REPO),
                                           os.environ.get("PYTHONPATH", "")]))
    extra = ["--dmuon-placement", "dmuon" if placement == "dmuon" else "matrix"]
    if placement == "zero3":
        extra += ["--dmuon-zero3", "--overlap-grad-reduce"]
    driver = _SETUP_DRIVER.replace("+ EXTRA", f"+ {extra!r}")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", driver], capture_output=True,
                         text=True, timeout=240, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith("SETUP ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    assert lines[-1].split()[1:] == [
        "DMuonChainedOptimizer", "DMuonDistributedOptimizer,SubsetDistributedOptimizer",
        "DMuonOptimizerConfig", "dmuon", "simple", "OptimizerParamScheduler",
        "_ParamAndGradBuffer" if placement == "dmuon" else "MatrixPlacedBuffer", extra[1],
        "zero3" if placement == "zero3" else "zero1"]


_LORA_SETUP_DRIVER = _SETUP_DRIVER.split("sys.argv = TINY_ARGV")[0] + r"""
sys.argv = TINY_ARGV + ["--use-distributed-optimizer",
    "--lora-rank", "4"] + EXTRA
args = A.parse_args()
A.validate_args(args)
set_global_variables(args, build_tokenizer=False)
ps.initialize_model_parallel(1, 1)
model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)

def model_provider(pre_process=True, post_process=True, vp_stage=None, **kwargs):
    cfg = A.core_transformer_config_from_args(get_args())
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256,
                    max_sequence_length=32, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope")

try:
    model, optimizer, scheduler = T.setup_model_and_optimizer(ModelType.encoder_or_decoder,
                                                              model_provider)
except ValueError as err:
    print("REFUSED " + str(err).replace("\n", " | "))
    raise SystemExit(0)
from megatron.core.utils import unwrap_model
from megatron_muon.peft.lora import lora_adapters
inner = unwrap_model(model[0])
trainable = sorted(n for n, p in inner.named_parameters() if p.requires_grad)
in_buffers = sum(len(b.params) for b in model[0].buffers)
subs = getattr(optimizer, "chained_optimizers", [optimizer])
params = sum(len(g["params"]) for o in subs for g in o.param_groups)
print("SETUP", type(optimizer).__name__, len(lora_adapters(model)), len(trainable),
      in_buffers, params, all(".lora." in n for n in trainable))
dist.destroy_process_group()
"""


@needs_training
@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer,expect", [
    ("smuon", "LoRAMegatronOptimizer"), ("adam", "ChainedOptimizer"),
    ("bogus_target", "REFUSED"), ("unknown_name", "REFUSED")])
def test_patched_training_builds_lora_models(patched_tree, optimizer, expect):
    """Megatron-LM's setup_model_and_optimizer (get_model path), patched, on one CPU rank:
    adapters on the 4 x 2 linear layers before DDP wraps the model, so DDP's buffers and the
    optimizer hold the 16 adapter factors only (the frozen base has no gradient buffer and no
    optimizer state); sMuon is LoRAMegatronOptimizer, Adam Megatron's own.  A target that
    names no module, or a module that is not a linear layer, is refused in one line."""
    from megatron_muon.testing.launch import rank_env, rendezvous_store

    store = rendezvous_store()
    env = dict(os.environ, **rank_env(0, 1, store), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(patched_tree), str(REPO),
                                           os.environ.get("PYTHONPATH", "")]))
    extra = {"smuon": ["--optimizer", "smuon"], "adam": ["--optimizer", "adam"],
             "bogus_target": ["--lora-target-modules", "linear_qkv,self_attention"],
             "unknown_name": ["--lora-target-modules", "linear_qkvv"]}[optimizer]
    driver = _LORA_SETUP_DRIVER.replace("+ EXTRA", f"+ {extra!r}")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", driver], capture_output=True,
                         text=True, timeout=240, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith(("SETUP ", "REFUSED "))]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    got = lines[-1].split()
    if expect == "REFUSED":
        assert got[0] == "REFUSED", lines
        assert "--lora-target-modules" in lines[-1]
        assert ("not a linear layer" if optimizer == "bogus_target"
                else "unknown LoRA target 'linear_qkvv'") in lines[-1], lines
        return
    assert got[1:] == [expect, "8", "16", "16", "16", "True"], lines


# --------------------------------------------------------------------------- plain argparse
def _plain_parser():
    from megatron_muon.megatron.arguments import add_dmuon_args

    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    return add_dmuon_args(p)


def test_add_dmuon_args_on_a_plain_parser():
    from megatron_muon.megatron.arguments import (DMUON_ARGUMENTS, MUON_ARGUMENTS,
                                                  dmuon_config_from_args, validate_dmuon_args)
    from megatron_muon.megatron.config import DMuonOptimizerConfig

    p = _plain_parser()
    dests = {a.dest for a in p._actions}
    assert set(MUON_ARGUMENTS) | set(DMUON_ARGUMENTS) <= dests
    assert "dmuon" in [g.title for g in p._action_groups]
    args = p.parse_args(["--optimizer", "dmuon", "--use-distributed-optimizer", "--muon-nesterov",
                         "--muon-coefficient-type", "simple", "--muon-num-ns-steps", "7",
                         "--muon-no-split-qkv", "--dmuon-adam-params", "linear_proj"])
    assert validate_dmuon_args(args) is args
    cfg = dmuon_config_from_args(args)
    assert isinstance(cfg, DMuonOptimizerConfig)
    assert (cfg.optimizer, cfg.muon_nesterov, cfg.muon_coefficient_type, cfg.muon_num_ns_steps,
            cfg.muon_split_qkv, cfg.dmuon_adam_params, cfg.lr) == (
        "dmuon", True, "simple", 7, False, "linear_proj", 1e-3)
    defaults = p.parse_args([])
    assert defaults.muon_momentum == DMuonOptimizerConfig.muon_momentum
    assert defaults.dmuon_plan_cost == "flops" and defaults.dmuon_log_plan is True
    # Calling it twice (or on a parser that has the flags) registers nothing twice.
    from megatron_muon.megatron.arguments import add_dmuon_args

    add_dmuon_args(p)


def test_every_config_field_has_a_flag():
    """A new muon_*/dmuon_* field in DMuonOptimizerConfig needs its command-line flag here."""
    import dataclasses

    from megatron_muon.megatron.arguments import DMUON_ARGUMENTS, MUON_ARGUMENTS
    from megatron_muon.megatron.config import DMuonOptimizerConfig

    own = {f.name for f in dataclasses.fields(DMuonOptimizerConfig)
           if f.name.startswith(("muon_", "dmuon_")) and f.init}
    megatron_only = {"muon_tp_mode", "muon_use_nesterov", "muon_scalar_optimizer"}
    assert own - megatron_only <= set(MUON_ARGUMENTS) | set(DMUON_ARGUMENTS)
    assert {d for d in _plain_parser().parse_args([]).__dict__} >= set(DMUON_ARGUMENTS)


@pytest.mark.parametrize("argv,message", [
    (["--muon-coefficient-type", "bogus"], "--muon-coefficient-type 'bogus' is unknown"),
    (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps must be an integer >= 1"),
    (["--muon-momentum", "-0.1"], "--muon-momentum must be in [0, 1)"),
    (["--muon-extra-scale-factor", "0"], "--muon-extra-scale-factor must be a finite number > 0"),
    (["--dmuon-adam-params", "(unclosed"], "--dmuon-adam-params '(unclosed' is not a valid"),
    (["--dmuon-locality-slack", "-1"], "--dmuon-locality-slack must be a finite number >= 0"),
    (["--optimizer", "muon_naive", "--dmuon-placement", "matrix", "--dmuon-zero3"],
     "--dmuon-zero3 needs --optimizer dmuon --dmuon-placement matrix or --optimizer dmuon "
     "--dmuon-placement dmuon or --optimizer muon_naive --dmuon-placement dmuon (got "
     "--optimizer muon_naive --dmuon-placement matrix)"),
])
def test_validate_dmuon_args_messages(argv, message):
    from megatron_muon.megatron.arguments import DMuonArgumentError, validate_dmuon_args

    args = _plain_parser().parse_args(["--optimizer", "dmuon", "--use-distributed-optimizer", *argv])
    with pytest.raises(DMuonArgumentError) as err:
        validate_dmuon_args(args)
    assert message in str(err.value)


def test_validate_needs_distributed_optimizer_and_skips_adam():
    from megatron_muon.megatron.arguments import DMuonArgumentError, validate_dmuon_args

    p = _plain_parser()
    with pytest.raises(DMuonArgumentError, match="needs --use-distributed-optimizer"):
        validate_dmuon_args(p.parse_args(["--optimizer", "muon_naive"]))
    # adam: muon values are not this optimizer's business
    validate_dmuon_args(p.parse_args(["--optimizer", "adam", "--muon-num-ns-steps", "0"]))


def test_validate_with_parser_exits_cleanly(capsys):
    from megatron_muon.megatron.arguments import validate_dmuon_args

    p = _plain_parser()
    with pytest.raises(SystemExit) as exc:
        validate_dmuon_args(p.parse_args(["--optimizer", "dmuon", "--use-distributed-optimizer",
                                          "--muon-momentum", "1.5"]), parser=p)
    assert exc.value.code == 2
    assert "error: --muon-momentum must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_megatron_lm_flags_are_reused_not_duplicated():
    """On a parser that already has Megatron-LM's --muon-* flags, only --dmuon-* are added."""
    from megatron_muon.megatron.arguments import add_dmuon_args

    p = argparse.ArgumentParser()
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "muon"])
    g.add_argument("--muon-momentum", type=float, default=0.9)
    g.add_argument("--muon-nesterov", action="store_true")
    g.add_argument("--muon-fp32-matmul-prec", default="medium", choices=["low", "medium", "high"])
    g.add_argument("--muon-no-split-qkv", action="store_false", default=True, dest="muon_split_qkv")
    add_dmuon_args(p)  # would raise argparse.ArgumentError on a duplicate
    a = p.parse_args(["--optimizer", "dmuon", "--muon-fp32-matmul-prec", "highest",
                      "--dmuon-check-finite"])
    assert a.optimizer == "dmuon" and a.muon_momentum == 0.9 and a.dmuon_check_finite
    assert a.muon_fp32_matmul_prec == "highest"
    assert p.parse_args(["--optimizer", "muon_naive"]).optimizer == "muon_naive"


def test_megatron_lm_muon_tp_mode_counts_only_when_given():
    """Megatron-LM's --muon-tp-mode defaults to blockwise; reused for dmuon it maps onto
    --dmuon-tp-mode only when given (else dmuon stays exact)."""
    from megatron_muon.megatron.arguments import add_dmuon_args, dmuon_config_from_args

    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="adam", choices=["adam", "muon"])
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--muon-tp-mode", type=str, default="blockwise",
                   choices=["blockwise", "duplicated", "distributed"])
    add_dmuon_args(p)
    base = ["--optimizer", "dmuon", "--use-distributed-optimizer"]
    for argv, mode in (([], "exact"), (["--muon-tp-mode", "blockwise"], "blockwise"),
                       (["--muon-tp-mode", "distributed"], "exact"),
                       (["--dmuon-tp-mode", "blockwise"], "blockwise")):
        args = p.parse_args(base + argv)
        assert dmuon_config_from_args(args).dmuon_tp_mode == mode, argv
    assert p.parse_args([]).muon_tp_mode == "blockwise"  # Megatron's own default is kept


# --------------------------------------------------------------------------- PEFT, plain argparse
def _peft_parser():
    from megatron_muon.megatron.peft_adapter import add_peft_args

    p = _plain_parser()
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    return add_peft_args(add_peft_args(p))  # idempotent


def test_add_peft_args_on_a_plain_parser():
    from megatron_muon.megatron.peft_adapter import (DEFAULT_TARGET_MODULES, PEFT_ARGUMENTS,
                                                     validate_peft_args)

    p = _peft_parser()
    assert set(PEFT_ARGUMENTS) <= {a.dest for a in p._actions}
    assert "smuon" in p._option_string_actions["--optimizer"].choices
    a = p.parse_args(["--optimizer", "smuon", "--lora-rank", "8", "--use-distributed-optimizer",
                      "--lora-target-modules", "linear_qkv,linear_proj", "experts"])
    assert validate_peft_args(a) is a
    assert a.use_distributed_optimizer is False  # sMuon reads all-reduced gradients
    assert a.lora_target_modules == ["linear_qkv", "linear_proj", "experts"]
    d = p.parse_args([])
    assert (d.lora_rank, d.lora_alpha, d.lora_dropout, d.relora_interval) == (None, 32.0, 0.0, 0)
    assert d.lora_target_modules == list(DEFAULT_TARGET_MODULES)
    assert validate_peft_args(d) is d  # no LoRA: nothing to check


@pytest.mark.parametrize("argv,message", [
    (["--optimizer", "smuon"], "--optimizer smuon trains LoRA adapters: add --lora-rank R"),
    (["--lora-save-base"], "--lora-save-base needs LoRA: add --lora-rank R"),
    (["--lora-rank", "0", "--relora-interval", "3"], "--relora-interval needs LoRA"),
    (["--lora-rank", "4", "--lora-alpha", "nan"], "--lora-alpha must be a finite number > 0"),
    (["--lora-rank", "4", "--lora-target-modules", ""], "--lora-target-modules is empty"),
    (["--lora-rank", "4", "--optimizer", "dmuon", "--dmuon-zero3"],
     "--dmuon-placement matrix / --dmuon-zero3"),
    (["--lora-rank", "4", "--optimizer", "smuon", "--dmuon-locality-slack", "2"],
     "--dmuon-locality-slack is a dmuon flag"),
    (["--lora-rank", "4", "--smuon-work", "replicate"],
     "--smuon-work is read only by --optimizer smuon"),
    (["--lora-rank", "4", "--optimizer", "smuon", "--relora-interval", "5",
      "--relora-prune-ratio", "2"], "--relora-reset / --relora-prune-ratio"),
    (["--lora-rank", "4", "--optimizer", "smuon", "--fp16"], "--fp16 needs a loss scaler"),
])
def test_validate_peft_args_messages(argv, message):
    from megatron_muon.megatron.peft_adapter import PEFTArgumentError, validate_peft_args

    args = _peft_parser().parse_args(argv)
    with pytest.raises(PEFTArgumentError) as err:
        validate_peft_args(args)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_validate_peft_args_refuses_other_checkpoint_formats():
    from megatron_muon.megatron.peft_adapter import PEFTArgumentError, validate_peft_args

    args = _peft_parser().parse_args(["--lora-rank", "4"])
    args.ckpt_format, args.save = "torch", "ckpt"
    with pytest.raises(PEFTArgumentError, match="LoRA checkpoints need --ckpt-format torch_dist"):
        validate_peft_args(args)
