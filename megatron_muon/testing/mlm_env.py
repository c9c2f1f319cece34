"""Where the installed megatron-core keeps Megatron-LM's ``megatron/training`` (the wheels of
0.17+ ship it; 0.16.x does not): the tests that drive Megatron-LM's own code look here."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

__all__ = ["installed_training_dir"]


def installed_training_dir() -> Optional[Path]:
    """The installed ``megatron/training`` folder, or None."""
    spec = importlib.util.find_spec("megatron")
    for base in (spec.submodule_search_locations or []) if spec else []:
        if (Path(base) / "training" / "arguments.py").is_file():
            return Path(base) / "training"
    return None


SCRIPT = Path(__file__).resolve().parent / "mlm_gpt.py"
REPO = Path(__file__).resolve().parents[2]


def patched_megatron(root: Path, checkout: Optional[Path] = None) -> Path:
    """Copy the installed ``megatron/`` tree (with ``training``), or that of a Megatron-LM
    ``checkout`` together with its top-level scripts (``pretrain_gpt.py`` and the modules it
    imports), into ``root`` and apply ``patches/megatron-lm-dmuon.patch`` there (neither the
    environment nor the checkout is touched); ``root``."""
    if checkout is not None:
        if not (checkout / "pretrain_gpt.py").is_file():
            raise RuntimeError(f"{checkout} is not a Megatron-LM checkout (no pretrain_gpt.py)")
        source = checkout / "megatron"
        root.mkdir(parents=True, exist_ok=True)
        for script in checkout.glob("*.py"):
            shutil.copy2(script, root / script.name)
    else:
        training = installed_training_dir()
        if training is None:
            raise RuntimeError("this megatron-core ships no megatron/training (0.16.x)")
        source = training.parent
    shutil.copytree(source, root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, str(REPO / "patches" / "apply_patch.py"), str(root)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"apply_patch failed:\n{done.stdout}{done.stderr}")
    return root


def _cpu_run(root: Path, script: Path, args: list, timeout: int, nproc: int, cwd: Path,
             **env) -> subprocess.CompletedProcess:
    """``script`` with ``args`` on ``nproc`` CPU ranks through ``megatron_muon.megatron.cpu_run``,
    Megatron-LM from ``root`` first on the path, plus the environment variables ``env``;
    raises ``subprocess.TimeoutExpired`` a minute after cpu_run's own ``timeout``."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", **env,
               PYTHONPATH=os.pathsep.join([str(root), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "megatron_muon.megatron.cpu_run", "--nproc",
                           str(nproc), "--timeout", str(timeout), str(script), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout + 60)


def launch_mlm_runs(root: Path, out: Path, runs: list, argv: list, timeout: int,
                    nproc: int = 4, record_batches=()) -> tuple:
    """Run ``mlm_gpt.py``'s trainings ``runs`` (``[[name, extra args], ...]``) in one launch
    on ``nproc`` CPU ranks, with Megatron-LM from ``root`` (``patched_megatron``) and the
    common arguments ``argv``.  ``(returncode, {run name: its .json}, stderr)``."""
    spec = {"out": str(out), "runs": runs}
    if record_batches:
        spec["record_batches"] = list(record_batches)
    (out / "spec.json").write_text(json.dumps(spec))
    proc = _cpu_run(root, SCRIPT, argv, timeout, nproc, REPO,
                    MLM_GPT_RUNS=str(out / "spec.json"))
    results = {}
    for name, _ in runs:
        path = out / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
    return proc.returncode, results, proc.stderr


def failure_report(out: Path, runs: list, results: dict, code: int, stderr: str) -> str:
    """The first run without a result, its logs' tails and the launch's error lines."""
    failed = next((name for name, _ in runs if name not in results), None)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}"
                      for p in sorted(out.glob(f"{failed}.rank*.log")) +
                      sorted(out.glob(f"{failed}.log")))
    errors = list(dict.fromkeys(line for line in stderr.splitlines()
                                if "Error" in line or "error:" in line))
    return (f"cpu_run exited {code}; run {failed!r} failed; results for {sorted(results)}\n"
            f"error lines of the launch:\n" + "\n".join(errors[:20]) +
            f"\nthe failing run's logs:\n{tails}")


def checkpoint_tensors(path: Path) -> dict:
    """Every tensor of a torch_dist (PyTorch DCP) checkpoint folder, model and optimizer."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.with_suffix(".pt")
    dcp_to_torch_save(str(path), str(flat))
    return {k: v for k, v in torch.load(flat, weights_only=False).items() if torch.is_tensor(v)}


#: runs per launch of ``mlm_gpt.py``: a launch's fixed cost (imports, the first checkpoint
#: save) is ~30 s on 2 cores; its runs reuse their process groups (``mlm_gpt._ReusedGroups``),
#: so a long launch stays as fast as a short one (the 52 runs of CI's families plan: 218 s in
#: one launch, 591 s in launches of 12 before the reuse)
RUNS_PER_LAUNCH = 60


def launch_in_chunks(root: Path, out: Path, groups: list, argv: list, timeout: int) -> tuple:
    """``launch_mlm_runs`` over ``groups`` (lists of runs that must share a launch, e.g. a
    case and its resumes), packed into launches of at most ``RUNS_PER_LAUNCH`` runs.
    ``(returncode of the first failing launch or 0, results, its stderr, runs)``."""
    chunks, results, runs = [[]], {}, [r for g in groups for r in g]
    for g in groups:
        if chunks[-1] and len(chunks[-1]) + len(g) > RUNS_PER_LAUNCH:
            chunks.append([])
        chunks[-1] += g
    for chunk in chunks:  # one after another, logs and results in ``out``
        code, got, stderr = launch_mlm_runs(root, out, chunk, argv, timeout)
        results.update(got)
        if code != 0 or len(got) != len(chunk):
            return code or 1, results, stderr, chunk
    return 0, results, "", runs


def logged_losses(log: str) -> dict:
    """``{iteration: lm loss}`` from Megatron-LM's training log lines."""
    return {int(m.group(1)): float(m.group(2)) for m in
            re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log)}


def launch_stock_runs(root: Path, out: Path, runs: list, argv: list, timeout: int,
                      nproc: int = 4) -> tuple:
    """Run each of ``runs`` (``[[name, extra args], ...]``) as its own launch of the stock
    ``root/pretrain_gpt.py`` (``patched_megatron(root, checkout)``) on ``nproc`` CPU ranks
    with the common arguments ``argv``; each run's output goes to ``out/<name>.log``.
    ``(returncode of the first failing run or 0, {run name: {"losses": [...],
    "first_iteration": n}} for the runs that finished, "")``: the losses are those
    Megatron-LM logs (``logged_losses``), so ``--log-interval 1`` belongs in ``argv``."""
    def text(s) -> str:  # TimeoutExpired carries bytes even under text=True
        return s.decode(errors="replace") if isinstance(s, bytes) else (s or "")

    code, results = 0, {}
    for name, extra in runs:
        try:
            proc = _cpu_run(root, root / "pretrain_gpt.py", [*argv, *extra], timeout, nproc, root)
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = 124, f"{text(e.stdout)}{text(e.stderr)}\nTimeoutError: {timeout + 60} s"
        (out / f"{name}.log").write_text(log)
        losses = logged_losses(log) if rc == 0 else {}
        if losses:
            results[name] = {"losses": [losses[i] for i in sorted(losses)],
                             "first_iteration": min(losses)}
        else:
            code = code or rc or 1
    return code, results, ""
