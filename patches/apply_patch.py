#!/usr/bin/env python3
"""Apply (or revert) megatron-lm-dmuon.patch to a Megatron-LM tree, checking it first.

    python patches/apply_patch.py /path/to/Megatron-LM          # a git checkout
    python patches/apply_patch.py /path/to/site-packages        # pip-installed megatron-core
    python patches/apply_patch.py /path/to/site-packages/megatron
    python patches/apply_patch.py --check DIR                   # dry run only
    python patches/apply_patch.py --revert DIR

The target is the directory that contains ``megatron/training/arguments.py`` (a path
to the ``megatron`` or ``megatron/training`` folder itself is accepted too).  The patch is
made against megatron-core 0.19.2 (whose sdist and wheel ship ``megatron/training``);
nearby versions may apply with fuzz.  The script runs a dry run first (``git apply
--check`` in a git checkout, ``patch --dry-run`` elsewhere) and changes nothing when the
tree does not match, saying which files/hunks did not fit and which version it found.

Exit codes: 0 applied / reverted / check passed, 1 does not apply, 2 bad usage.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

PATCH = Path(__file__).resolve().with_name("megatron-lm-dmuon.patch")
TARGET_FILES = ("megatron/training/arguments.py", "megatron/training/training.py")
MADE_FOR = "0.19.2"


def find_root(path: Path) -> Path:
    """The directory holding ``megatron/training`` for any of the accepted spellings."""
    path = path.expanduser().resolve()
    for cand in (path, path.parent, path.parent.parent):
        if (cand / "megatron" / "training" / "arguments.py").is_file():
            return cand
    raise SystemExit(f"error: {path} does not contain megatron/training/arguments.py "
                     "(give a Megatron-LM checkout, a site-packages folder with megatron-core "
                     ">= 0.17 installed, or its megatron/ folder)")


def detect_version(root: Path) -> str:
    info = root / "megatron" / "core" / "package_info.py"
    try:
        text = info.read_text()
    except OSError:
        return "unknown"
    parts = {k: v for k, v in re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([\w.]*)",
                                         text, re.M)}
    if {"MAJOR", "MINOR", "PATCH"} <= parts.keys():
        return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE', '')}"
    return "unknown"


def _is_git_toplevel(root: Path) -> bool:
    if shutil.which("git") is None:
        return False
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True)
    return out.returncode == 0 and Path(out.stdout.strip()).resolve() == root


def _tool(root: Path, reverse: bool, dry_run: bool) -> list[str]:
    if _is_git_toplevel(root) or shutil.which("patch") is None:
        if shutil.which("git") is None:
            raise SystemExit("error: neither 'patch' nor 'git' is installed")
        cmd = ["git", "apply", "-p1", "--verbose"]
        if reverse:
            cmd.append("--reverse")
        if dry_run:
            cmd.append("--check")
        return cmd + [str(PATCH)]
    cmd = ["patch", "-p1", "--forward", "--no-backup-if-mismatch", "-f", "-r", "-", "-i", str(PATCH)]
    if reverse:
        cmd = ["patch", "-p1", "--reverse", "--no-backup-if-mismatch", "-f", "-r", "-", "-i", str(PATCH)]
    if dry_run:
        cmd.append("--dry-run")
    return cmd


def run(root: Path, reverse: bool, dry_run: bool) -> subprocess.CompletedProcess:
    return subprocess.run(_tool(root, reverse, dry_run), cwd=root, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="Megatron-LM checkout, site-packages, or its megatron/ folder")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="dry run only; change nothing")
    mode.add_argument("--revert", action="store_true", help="undo a previously applied patch")
    args = p.parse_args(argv)

    root = find_root(Path(args.target))
    version = detect_version(root)
    where = f"{root} (megatron-core {version}; patch made for {MADE_FOR})"

    if not args.revert and run(root, reverse=True, dry_run=True).returncode == 0:
        print(f"already applied: {where}")
        return 0
    check = run(root, reverse=args.revert, dry_run=True)
    if check.returncode != 0:
        what = "revert" if args.revert else "apply"
        print(f"error: the patch does not {what} cleanly to {where}; nothing was changed.",
              file=sys.stderr)
        for line in (check.stdout + check.stderr).splitlines():
            if line.strip():
                print(f"  {line.strip()}", file=sys.stderr)
        if version != "unknown" and not version.startswith(MADE_FOR.rsplit(".", 1)[0]):
            print(f"  (this tree is megatron-core {version}; the patch targets {MADE_FOR}: "
                  "port the three small hunks by hand, see the patch header)", file=sys.stderr)
        return 1
    if args.check:
        print(f"ok: the patch applies cleanly to {where}")
        return 0
    done = run(root, reverse=args.revert, dry_run=False)
    if done.returncode != 0:  # should not happen after a clean dry run
        print(done.stdout + done.stderr, file=sys.stderr)
        return 1
    print(f"{'reverted' if args.revert else 'patched'}: {', '.join(TARGET_FILES)} in {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
