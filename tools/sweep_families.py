"""Model families x layouts x modes x precisions through Megatron-LM's own loop, with the
checkpoint lifecycle of every case: a table of what trains, resumes bitwise and reshards.

Each case (``megatron_muon/testing/families.py``) is its own launch of ``mlm_gpt.py`` on 4
CPU ranks (so one failure does not stop the sweep): train 6 iterations saving at 3, resume
from 3 (the losses and the final checkpoint must be the uninterrupted run's bit for bit),
resume the same checkpoint at another layout (fp32: losses within 3e-4 of the uninterrupted
run, tests/test_families.py), warm-start from Megatron's AdamW checkpoint of the same model,
and fine-tune the case's checkpoint with LoRA + sMuon.  Needs megatron-core >= 0.19 (its wheel ships
``megatron/training``); about a minute per case on 2 CPU cores.

    python tools/sweep_families.py --pairwise --markdown /tmp/pairwise.md   # 35 cases
    python tools/sweep_families.py --markdown docs/families_all.md          # all 240
    python tools/sweep_families.py --cases 'deepseek_v3-*'                  # a glob

With ``--megatron-lm CHECKOUT`` every run is instead its own launch of that Megatron-LM
checkout's stock ``pretrain_gpt.py`` (copied and patched in the work folder; the checkout is
not touched), and the losses are the ones it logs.  Megatron-LM logs, for the second
iteration after a resume, the mean of two iterations' losses (docs/checkpoints.md), so there
*resume* compares the logged losses of the other iterations and every tensor of the final
checkpoint:

    python tools/sweep_families.py --pairwise --megatron-lm ~/Megatron-LM \
        --lifecycle resume,reshard --markdown /tmp/stock_main.md            # ~1 hour
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_muon.testing import families as F  # noqa: E402
from megatron_muon.testing.mlm_env import (checkpoint_tensors, launch_mlm_runs,  # noqa: E402
                                            launch_stock_runs, patched_megatron)

COMMON = F.COMMON
TOLERANCE = F.RESHARD_TOLERANCE  # fp32 reshards (its derivation: families.py)


def _first_error(out: Path, name: str) -> str:
    for log in sorted(out.glob(f"{name}.rank*.log")) + sorted(out.glob(f"{name}.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines()
                 if "Error" in line and not line.startswith(" ")]
        if lines:
            return lines[-1].strip()[:160]
    return "no result"


LIFECYCLE = ("resume", "reshard", "warm", "lora")


def run_case(case: F.Case, root: Path, out: Path, stock: bool = False,
             lifecycle=LIFECYCLE) -> dict:
    runs = F.case_runs(case, str(out), lifecycle)
    launch = launch_stock_runs if stock else launch_mlm_runs
    _, results, _ = launch(root, out, runs, COMMON, timeout=900)
    n, other = case.name, F.reshard_layout(case)
    row = {"case": n, "train": "ok" if n in results else _first_error(out, n)}

    def resumed(run: dict) -> list:
        """(resumed, uninterrupted) loss pairs after SAVE_AT, without the stock log's mean
        of two iterations (module docstring)."""
        pairs = zip(run["losses"], results[n]["losses"][F.SAVE_AT:])
        return [ab for i, ab in enumerate(pairs) if not (stock and i == 1)]

    if n in results:
        row["losses"] = results[n]["losses"]
    res = results.get(f"{n}.resume")
    if "resume" not in lifecycle:
        row["resume"] = "not run"
    elif res is None:
        row["resume"] = _first_error(out, f"{n}.resume") if n in results else "-"
    else:
        last = f"iter_{F.STEPS:07d}"
        whole = checkpoint_tensors(out / f"ck_{n}" / last)
        again = checkpoint_tensors(out / f"ck_{n}.resume" / last)
        same = all(a == b for a, b in resumed(res)) and set(whole) == set(again) \
            and all(whole[k].equal(again[k]) for k in whole)
        row["resume"] = "bitwise" if same else "differs"
    at = results.get(f"{n}.at_{other}")
    if "reshard" not in lifecycle:
        row["reshard"] = "not run"
    elif at is None:
        row["reshard"] = _first_error(out, f"{n}.at_{other}") if n in results else "-"
    else:
        worst = max(abs(a - b) for a, b in resumed(at))
        ok = worst < TOLERANCE or case.precision != "fp32"
        row["reshard"] = f"{other}: {worst:.1e}" + ("" if ok else " (over 3e-4)")
    for kind, run in (("warm", f"{n}.from_adam"), ("lora", f"{n}.lora")):
        got = results.get(run)
        if kind not in lifecycle:
            row[kind] = "not run"
            continue
        row[kind] = (_first_error(out, run) if n in results else "-") if got is None else \
            f"{got['losses'][0]:.4f} -> {got['losses'][-1]:.4f}"
    return row


def complete(row: dict) -> bool:
    """Whether every lifecycle step that ran for ``row`` succeeded."""
    ran = lambda k: row[k] != "not run"  # noqa: E731
    return row["train"] == "ok" and (row["resume"] == "bitwise" or not ran("resume")) and \
        (":" in row["reshard"] and "over" not in row["reshard"] or not ran("reshard")) and \
        all("->" in row[k] or not ran(k) for k in ("warm", "lora"))


def markdown(rows: list, command: str, stock: bool = False) -> str:
    where = "a Megatron-LM checkout's stock `pretrain_gpt.py`" if stock else \
        "Megatron-LM's loop (`mlm_gpt.py`)"
    lines = [f"# Model families through {where}", "",
             f"Written by `{command}` (tools/sweep_families.py; the flags of each family, "
             "layout and mode are in `megatron_muon/testing/families.py`). Each case trains 6 "
             "iterations on 4 CPU ranks saving at 3; *resume* restarts from iteration 3 at the "
             "same layout (bitwise: the losses and every tensor of the final checkpoint); "
             "*reshard* restarts it at another layout (the largest difference from the "
             "uninterrupted run's losses; fp32 cases must stay within 3e-4, bf16 ones are "
             "listed as measured); *warm* trains the same model with Megatron's AdamW and "
             "starts the case's optimizer from that checkpoint (`--no-load-optim --finetune`); "
             "*lora* fine-tunes the case's checkpoint with LoRA + sMuon (`--finetune`).", "",
             "| case | train (loss 1 -> 6) | resume | reshard | warm from AdamW | LoRA + sMuon |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        train = r["train"] if r["train"] != "ok" else \
            f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        lines.append(f"| {r['case']} | {train} | {r['resume']} | {r['reshard']} | "
                     f"{r['warm']} | {r['lora']} |")
    lines += ["", f"{sum(map(complete, rows))} of {len(rows)} cases complete every step "
              "that ran.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairwise", action="store_true", help="only the all-pairs cover (CI's)")
    ap.add_argument("--cases", default="*", help="globs over case names, comma-separated")
    ap.add_argument("--out-dir", default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--markdown", default=None, help="write the table here")
    ap.add_argument("--megatron-lm", default=None, type=Path, metavar="CHECKOUT",
                    help="run the stock pretrain_gpt.py of this Megatron-LM checkout")
    ap.add_argument("--lifecycle", default=",".join(LIFECYCLE),
                    help="which of resume,reshard,warm,lora follow each case's training")
    args = ap.parse_args(argv)
    cases = [c for c in (F.pairwise_cases() if args.pairwise else F.all_cases())
             if any(fnmatch.fnmatch(c.name, g) for g in args.cases.split(","))]
    if not cases:
        ap.error(f"no case matches {args.cases!r}")
    lifecycle = tuple(x for x in args.lifecycle.split(",") if x)
    if not set(lifecycle) <= set(LIFECYCLE):
        ap.error(f"--lifecycle takes some of {','.join(LIFECYCLE)}, not {args.lifecycle!r}")
    work = Path(args.out_dir or tempfile.mkdtemp(prefix="sweep_families_"))
    work.mkdir(parents=True, exist_ok=True)
    root = work / "megatron_lm"
    if not (root / "megatron").exists():
        root.mkdir()
        patched_megatron(root, args.megatron_lm and args.megatron_lm.expanduser().resolve())
    rows, start = [], time.time()
    for i, case in enumerate(cases):
        out = work / case.name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        rows.append(run_case(case, root, out, args.megatron_lm is not None, lifecycle))
        r = rows[-1]
        print(f"[{i + 1}/{len(cases)} {time.time() - start:.0f}s] {case.name}: train "
              f"{r['train']}, resume {r['resume']}, reshard {r['reshard']}, warm {r['warm']}, "
              f"lora {r['lora']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    command = "python tools/sweep_families.py " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, command.strip(), args.megatron_lm is not None))
    if args.out_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r["case"] for r in rows if not complete(r)]
    print(f"{len(rows) - len(failed)} of {len(rows)} cases complete every lifecycle step "
          f"that ran{': not ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
