"""docs/megatron_flags.md's table of every Megatron-LM optimizer flag, checked against a
Megatron-LM parser: the installed megatron-core's (tests/test_production_flags.py) or a
Megatron-LM checkout's (tools/check_flag_table.py).

A row names one or more flags in its first cell and has one status word (``STATUSES``) in
its second.  A row whose first cell says ``(some versions)`` is for flags that not every
Megatron-LM version has (e.g. one release branch lacks it): a parser may lack them, and
tools/check_flag_table.py requires one of the checkouts it reads to have each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

__all__ = ["OPTIMIZER_FLAG_PREFIXES", "STATUSES", "TABLE_HEADING", "SOME_VERSIONS", "PARSER_DRIVER",
           "flag_table", "parser_facts", "table_gaps"]

REPO = Path(__file__).resolve().parents[2]

# What the table must cover: every flag whose value Megatron-LM hands to the optimizer
# (its OptimizerConfig fields) and every flag with one of these names or prefixes.
OPTIMIZER_FLAG_PREFIXES = (
    "--optimizer", "--lr", "--min-lr", "--decoupled-lr", "--decoupled-min-lr", "--warmup",
    "--weight-decay", "--start-weight-decay", "--end-weight-decay", "--apply-wd-",
    "--no-weight-decay-", "--adam-", "--sgd-", "--muon-", "--no-muon-", "--lion-", "--soap-",
    "--adaptive-muon-", "--clip-grad", "--use-distributed-optimizer", "--overlap-param-gather",
    "--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype",
    "--exp-avg-dtype", "--exp-avg-sq-dtype", "--use-torch-optimizer-for-cpu-offload",
    "--overlap-cpu-optimizer-", "--no-pin-cpu-", "--dist-ckpt-optim-", "--distrib-optim-",
    "--num-distributed-optimizer-instances", "--override-opt", "--use-checkpoint-opt",
    "--no-save-optim", "--no-load-optim", "--dump-param-to-param-group-map", "--loss-scale",
    "--initial-loss-scale", "--min-loss-scale", "--hysteresis", "--qk-clip",
    "--log-max-attention-logit", "--use-megatron-fsdp", "--use-torch-fsdp2",
    "--megatron-fsdp-version", "--no-use-layer-wise-param-layout", "--layer-wise-param-layout",
    "--context-parallel-size", "--expert-tensor-parallel-size")
STATUSES = ("works", "maps", "refused")
TABLE_HEADING = "## Every Megatron-LM optimizer flag"
SOME_VERSIONS = "(some versions)"

# Megatron-LM's parser with add_dmuon_args (as the patch registers it), run in its own
# process: prints its flags, OptimizerConfig's fields and what validate_dmuon_args says
# about each argv of the JSON map in argv[1].
PARSER_DRIVER = r"""
import argparse, dataclasses, json, sys
from megatron_muon.megatron.cpu_run import alias_typing_override
alias_typing_override()  # Megatron-LM 0.19 imports typing.override (3.12+)
import megatron.training.arguments as A
from megatron.core.optimizer import OptimizerConfig
from megatron_muon.megatron.arguments import (DMuonArgumentError, add_dmuon_args,
                                              validate_dmuon_args)

parser = add_dmuon_args(A.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
out = {"actions": [{"options": a.option_strings, "dest": a.dest}
                   for a in parser._actions if a.option_strings],
       "optimizer_config_fields": [f.name for f in dataclasses.fields(OptimizerConfig)],
       "validated": {}}
for name, argv in json.loads(sys.argv[1]).items():
    args = parser.parse_args(["--optimizer", "dmuon", "--use-distributed-optimizer", *argv])
    try:
        validate_dmuon_args(args)
        out["validated"][name] = None
    except DMuonArgumentError as err:
        out["validated"][name] = str(err)
print("RESULTS " + json.dumps(out))
"""


def parser_facts(argvs: Optional[dict] = None, checkout: Optional[Path] = None,
                 timeout: int = 300) -> dict:
    """``PARSER_DRIVER``'s results for the installed Megatron-LM, or with ``checkout``'s
    ``megatron/`` first on the path.  RuntimeError with the output if it fails."""
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(REPO),
                                             env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", PARSER_DRIVER, json.dumps(argvs or {})],
                         capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULTS ")]
    if out.returncode != 0 or not line:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    return json.loads(line[0][len("RESULTS "):])


def flag_table(text: Optional[str] = None) -> dict:
    """docs/megatron_flags.md's flag table: ``{flag: (status, in some versions only)}``.  ValueError
    for a malformed row or a flag with two rows."""
    text = (REPO / "docs" / "megatron_flags.md").read_text() if text is None else text
    if TABLE_HEADING not in text:
        raise ValueError(f"docs/megatron_flags.md has no '{TABLE_HEADING}' section")
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        flags = re.findall(r"`(--[a-z0-9][a-z0-9_-]*)`", cells[0])
        status = cells[1].strip("*").lower()
        if not flags or status not in STATUSES:
            raise ValueError(f"a row without a flag or with a status other than "
                             f"{'/'.join(STATUSES)}: {line}")
        for flag in flags:
            if flag in table:
                raise ValueError(f"{flag} has two rows")
            table[flag] = (status, SOME_VERSIONS in cells[0])
    return table


def table_gaps(table: dict, facts: dict) -> tuple:
    """``(missing, unknown)``: the parser's optimizer flags (``OPTIMIZER_FLAG_PREFIXES`` or
    an ``OptimizerConfig`` field) without a row (each as its option strings), and the
    rows naming a flag the parser lacks (rows of ``SOME_VERSIONS`` flags excepted)."""
    fields_ = set(facts["optimizer_config_fields"])
    options = {o for a in facts["actions"] for o in a["options"]}
    wanted = [a["options"] for a in facts["actions"]
              if a["dest"] in fields_ or any(o.startswith(OPTIMIZER_FLAG_PREFIXES)
                                             for o in a["options"])]
    missing = [opts for opts in wanted if not any(o in table for o in opts)]
    unknown = sorted(f for f, (_, some) in table.items() if f not in options and not some)
    return missing, unknown
