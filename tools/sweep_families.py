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
                                            patched_megatron)

COMMON = F.COMMON
TOLERANCE = F.RESHARD_TOLERANCE  # fp32 reshards (its derivation: families.py)


def _first_error(out: Path, name: str) -> str:
    for log in sorted(out.glob(f"{name}.rank*.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines()
                 if "Error" in line and not line.startswith(" ")]
        if lines:
            return lines[-1].strip()[:160]
    return "no result"


def run_case(case: F.Case, root: Path, out: Path) -> dict:
    runs = F.case_runs(case, str(out))
    _, results, _ = launch_mlm_runs(root, out, runs, COMMON, timeout=900)
    n, other = case.name, F.reshard_layout(case)
    row = {"case": n, "train": "ok" if n in results else _first_error(out, n)}
    if n in results:
        row["losses"] = results[n]["losses"]
    res = results.get(f"{n}.resume")
    if res is None:
        row["resume"] = _first_error(out, f"{n}.resume") if n in results else "-"
    else:
        last = f"iter_{F.STEPS:07d}"
        whole = checkpoint_tensors(out / f"ck_{n}" / last)
        again = checkpoint_tensors(out / f"ck_{n}.resume" / last)
        same = res["losses"] == results[n]["losses"][F.SAVE_AT:] and set(whole) == set(again) \
            and all(whole[k].equal(again[k]) for k in whole)
        row["resume"] = "bitwise" if same else "differs"
    at = results.get(f"{n}.at_{other}")
    if at is None:
        row["reshard"] = _first_error(out, f"{n}.at_{other}") if n in results else "-"
    else:
        worst = max(abs(a - b) for a, b in zip(at["losses"], results[n]["losses"][F.SAVE_AT:]))
        ok = worst < TOLERANCE or case.precision != "fp32"
        row["reshard"] = f"{other}: {worst:.1e}" + ("" if ok else " (over 3e-4)")
    for kind, run in (("warm", f"{n}.from_adam"), ("lora", f"{n}.lora")):
        got = results.get(run)
        row[kind] = (_first_error(out, run) if n in results else "-") if got is None else \
            f"{got['losses'][0]:.4f} -> {got['losses'][-1]:.4f}"
    return row


def markdown(rows: list, command: str) -> str:
    lines = ["# Model families through Megatron-LM's loop", "",
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
    good = sum(r["train"] == "ok" and r["resume"] == "bitwise" and "over" not in r["reshard"]
               and ":" in r["reshard"] and "->" in r["warm"] and "->" in r["lora"]
               for r in rows)
    lines += ["", f"{good} of {len(rows)} cases complete the whole chain.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairwise", action="store_true", help="only the all-pairs cover (CI's)")
    ap.add_argument("--cases", default="*", help="glob over case names")
    ap.add_argument("--out-dir", default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--markdown", default=None, help="write the table here")
    args = ap.parse_args(argv)
    cases = [c for c in (F.pairwise_cases() if args.pairwise else F.all_cases())
             if fnmatch.fnmatch(c.name, args.cases)]
    if not cases:
        ap.error(f"no case matches {args.cases!r}")
    work = Path(args.out_dir or tempfile.mkdtemp(prefix="sweep_families_"))
    work.mkdir(parents=True, exist_ok=True)
    root = work / "megatron_lm"
    if not (root / "megatron").exists():
        root.mkdir()
        patched_megatron(root)
    rows, start = [], time.time()
    for i, case in enumerate(cases):
        out = work / case.name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        rows.append(run_case(case, root, out))
        r = rows[-1]
        print(f"[{i + 1}/{len(cases)} {time.time() - start:.0f}s] {case.name}: train "
              f"{r['train']}, resume {r['resume']}, reshard {r['reshard']}, warm {r['warm']}, "
              f"lora {r['lora']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    command = "python tools/sweep_families.py " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, command.strip()))
    if args.out_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r["case"] for r in rows if r["train"] != "ok" or r["resume"] != "bitwise"]
    print(f"{len(rows) - len(failed)} of {len(rows)} cases train and resume bitwise "
          f"(the table: every lifecycle step)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
