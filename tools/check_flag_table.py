"""Check docs/megatron_flags.md's table of every Megatron-LM optimizer flag against the
parsers of Megatron-LM checkouts (main, release branches): every optimizer flag of each
parser has a row (works / maps / refused), every row names a flag each parser has, and
each row marked ``(some versions)`` names a flag that at least one of them has.  CI checks
the installed megatron-core's parser (tests/test_production_flags.py); this covers the
versions CI does not install.

    git clone https://github.com/NVIDIA/Megatron-LM mlm_main
    git -C mlm_main worktree add ../mlm_019 core_v0.19.0
    python tools/check_flag_table.py mlm_main mlm_019

Exit 0 when the table covers every checkout, 1 otherwise (the gaps are printed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_muon.testing.flag_table import flag_table, parser_facts, table_gaps  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkouts", nargs="+", type=Path, help="Megatron-LM checkouts")
    args = ap.parse_args(argv)
    table, bad, seen = flag_table(), 0, set()
    for checkout in args.checkouts:
        facts = parser_facts(checkout=checkout.expanduser().resolve())
        missing, unknown = table_gaps(table, facts)
        flags = {o for a in facts["actions"] for o in a["options"]}
        seen |= flags
        lacks = sorted(f for f, (_, some) in table.items() if some and f not in flags)
        print(f"{checkout}: {len(flags)} flags, {len(table)} rows; missing rows: "
              f"{missing or 'none'}; rows it lacks: {unknown or 'none'}"
              f"{'; (some versions) rows it lacks: ' + ', '.join(lacks) if lacks else ''}")
        bad += bool(missing or unknown)
    nowhere = sorted(f for f, (_, some) in table.items() if some and f not in seen)
    if nowhere:
        print(f"(some versions) rows no checkout has: {nowhere}")
    return 1 if bad or nowhere else 0


if __name__ == "__main__":
    sys.exit(main())
