"""Run a Megatron-LM training script on CPU with gloo (no GPU, no torchrun needed).

    python -m megatron_muon.megatron.cpu_run [--nproc N] [--timeout S] SCRIPT.py ARGS...

Without torchrun's environment it starts ``N`` local ranks (``megatron_muon.distributed.launch``)
that each run ``SCRIPT.py ARGS...``; under torchrun every process runs the script itself.
Each rank turns on ``megatron_muon.megatron.cpu_mode`` and the shims below, and adds the
CPU defaults (``CPU_DEFAULTS``) that ``ARGS`` does not already set.  On a machine with CUDA
it refuses to run (use torchrun there).

The shims only work around Megatron-LM's training loop assuming CUDA (and, for the
dataset helpers, a source checkout); none of them changes what is trained.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["CPU_DEFAULTS", "with_cpu_defaults", "install_shims", "build_dataset_helpers",
           "alias_typing_override", "main"]

# (flag, value or None, flags that mean the user already chose): added only if none is given
CPU_DEFAULTS = [
    ("--transformer-impl", "local", ()),
    ("--no-persist-layer-norm", None, ()),
    ("--inference-rng-tracker", None, ()),  # the CUDA RNG tracker needs CUDA generators
    ("--use-cpu-initialization", None, ()),
    ("--distributed-backend", "gloo", ()),
    ("--no-gradient-accumulation-fusion", None, ()),
    ("--no-masked-softmax-fusion", None, ()),
    ("--no-bias-gelu-fusion", None, ()),
    ("--no-bias-dropout-fusion", None, ()),
    ("--no-rope-fusion", None, ()),
    ("--eval-iters", "0", ()),
    ("--mock-data", None, ("--data-path", "--train-data-path", "--data-args-path",
                           "--per-split-data-args-path", "--sft")),
    ("--tokenizer-type", "NullTokenizer", ()),
    # the loader's worker processes (Megatron-LM's default 2 per rank) cost a tiny CPU run
    # more than they save: ~4 s of a 15 s run on 2 cores
    ("--num-workers", "0", ()),
]


def _given(argv: list, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def with_cpu_defaults(argv: list) -> list:
    """``argv`` plus every CPU default it does not set; ``--no-load-rng`` with ``--load``
    (the inference RNG tracker saves empty RNG states, whose load fails)."""
    out = list(argv)
    for flag, value, alternatives in CPU_DEFAULTS:
        if not any(_given(argv, f) for f in (flag, *alternatives)):
            out += [flag] if value is None else [flag, value]
    if _given(argv, "--load") and not _given(argv, "--no-load-rng"):
        out.append("--no-load-rng")
    tokenizer = out[out.index("--tokenizer-type") + 1] if "--tokenizer-type" in out else None
    if tokenizer == "NullTokenizer" and not _given(out, "--vocab-size"):
        raise SystemExit("cpu_run: --tokenizer-type NullTokenizer (the CPU default) needs "
                         "--vocab-size N")
    return out


# ----------------------------------------------------------------------------- shims
@contextlib.contextmanager
def _one_cuda_device():
    import torch

    saved = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = saved


def _shim_initialize_megatron(original):
    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        """CPU only: Megatron-LM's ``initialize_megatron`` with ``allow_no_cuda=True``, and
        ``torch.cuda.device_count()`` = 1 while it runs (with 0 it skips the model-parallel
        groups and the RNG-tracker seeding).  Works around Megatron-LM on CPU; nothing else."""
        if args:
            args = (True, *args[1:])
        else:
            kwargs["allow_no_cuda"] = True
        with _one_cuda_device():
            return original(*args, **kwargs)
    return initialize_megatron


def _device_arch_version():
    """CPU only: stand-in for Megatron-LM's ``get_device_arch_version`` (which asks
    ``torch.cuda.get_device_properties`` when TP > 1): 0, i.e. no Blackwell-only options.
    Works around Megatron-LM on CPU; nothing else."""
    return 0


def _skip_jit_warmup(*args, **kwargs):
    """CPU only: stand-in for Megatron-LM's ``_warmup_jit_function``, which runs its fused
    bias-GeLU / bias-dropout-add kernels (``torch.compile``) once before training: about 10 s
    of Inductor compilation per rank on CPU, for kernels the CPU defaults switch off (a
    kernel that is used still compiles on first use).  Works around Megatron-LM on CPU;
    nothing else."""


def _run_jit_fusers_eagerly() -> None:
    """CPU only: Megatron-Core's ``jit_fuser`` (``torch.compile``) wraps the MoE router's and
    token dispatcher's helpers, which Inductor compiles on their first calls in every
    training: on 2 CPU cores a tiny MoE run spent 26 s in its first 3 iterations and 4 s in
    the next 3.  The runner runs them eagerly (the same functions, unfused).  Works around
    Megatron-LM on CPU; nothing else."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def _no_te_inference_layers() -> None:
    """CPU only: Megatron-Core 0.20's multi-token-prediction layer asks
    ``is_inference_column_parallel_linear``, an ``isinstance`` against inference classes
    derived from Transformer Engine's, which without it are not classes (``TypeError`` while
    building an ``--mtp-num-layers`` model).  No module is one of them without Transformer
    Engine, so the answer is False.  Works around Megatron-LM on CPU; nothing else."""
    try:
        from megatron.core.tensor_parallel import inference_layers
    except ImportError:
        return
    original = getattr(inference_layers, "is_inference_column_parallel_linear", None)
    if original is None or getattr(inference_layers, "HAVE_TE", True):
        return
    from megatron_muon.megatron.compat import replace_everywhere

    replace_everywhere("megatron.core", original, lambda module: False)


def build_dataset_helpers(folder: Path) -> None:
    """Run ``make`` in Megatron's dataset folder for the interpreter that runs this: its own
    extension suffix and include paths on make's command line, which override the Makefile's
    ``python3-config`` / ``python3 -m pybind11``.  Those follow PATH, and under pyenv a
    Megatron-LM checkout's ``.python-version`` (3.12), to another interpreter, whose helper
    (``helpers_cpp.cpython-312-*.so``) this one cannot import."""
    import subprocess
    import sysconfig

    includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"],
                              capture_output=True, text=True)
    if includes.returncode != 0:
        raise SystemExit(f"cpu_run: Megatron-LM builds its dataset helpers with pybind11, which "
                         f"{sys.executable} cannot import: pip install pybind11")
    command = ["make", "-C", str(folder), f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}",
               f"CPPFLAGS={includes.stdout.strip()}"]
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"cpu_run: building Megatron's dataset helpers in {folder} failed "
                         "(make's output above says why)")


def _shim_compile_helpers(original):
    @functools.wraps(original)
    def compile_helpers():
        """Megatron-LM builds its dataset helpers with ``make`` at start.  A pip-installed
        megatron-core ships them built but has no Makefile: use those.  In a checkout, build
        them for the Python that runs the script (``build_dataset_helpers``).  Works around
        running Megatron-LM from a wheel, a venv or pyenv on CPU; nothing else."""
        here = Path(importlib.util.find_spec("megatron.core.datasets").origin).parent
        if (here / "Makefile").exists():
            return build_dataset_helpers(here)
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            return original()
        return None
    return compile_helpers


def alias_typing_override() -> None:
    """Megatron-LM 0.19+ and emerging_optimizers 0.3 (Megatron-Core 0.19's Muon) import
    ``typing.override`` (Python 3.12+); on 3.11 take typing_extensions'.  Works around their
    Python floor; nothing else.  This module imports nothing of Megatron, so it can run
    before Megatron is imported (the tests, the benchmarks)."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def install_shims() -> None:
    """Turn on CPU mode and the shims (idempotent); call before the script imports Megatron."""
    from megatron_muon.megatron.cpu_mode import enable_cpu_mode

    alias_typing_override()
    enable_cpu_mode()
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training  # noqa: F401  (imports initialize, arguments, training)
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize

    from megatron_muon.megatron.compat import replace_everywhere, set_megatron_attr

    if not getattr(initialize.initialize_megatron, "_megatron_muon_cpu", False):
        shim = _shim_initialize_megatron(initialize.initialize_megatron)
        shim._megatron_muon_cpu = True
        replace_everywhere("megatron.training", initialize.initialize_megatron, shim)
    if getattr(arguments, "get_device_arch_version", None) not in (None, _device_arch_version):
        replace_everywhere("megatron.training", arguments.get_device_arch_version,
                            _device_arch_version)
    if hasattr(initialize, "_warmup_jit_function"):
        set_megatron_attr(initialize, "_warmup_jit_function", _skip_jit_warmup)
    _run_jit_fusers_eagerly()
    _no_te_inference_layers()
    if not getattr(dataset_utils.compile_helpers, "_megatron_muon_cpu", False):
        shim = _shim_compile_helpers(dataset_utils.compile_helpers)
        shim._megatron_muon_cpu = True
        set_megatron_attr(dataset_utils, "compile_helpers", shim)


# ----------------------------------------------------------------------------- entry point
def _run_script(script: str, argv: list) -> None:
    import torch

    if torch.cuda.is_available():
        raise SystemExit("cpu_run runs Megatron-LM on CPU; this machine has CUDA: use torchrun "
                         "(or hide the GPUs with CUDA_VISIBLE_DEVICES=)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    install_shims()
    sys.argv = [script] + with_cpu_defaults(argv)
    sys.path.insert(0, str(Path(script).resolve().parent))
    _run_as_main(script)


def _run_as_main(script: str) -> None:
    """Run ``script`` as ``__main__``, with a module spec named ``__main__``: processes that
    Megatron-LM spawns (dist_checkpointing's write-results queue) then skip re-running the
    script (``multiprocessing.spawn`` re-imports a main module only by path or by a name
    other than ``__main__``), so they start quickly and without the shims."""
    spec = importlib.util.spec_from_file_location("__main__", script)
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules["__main__"] = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megatron_muon.megatron.cpu_run",
        description="Run a Megatron-LM training script on CPU with gloo (see the module doc).")
    p.add_argument("--nproc", type=int, default=1,
                   help="local ranks to start when not under torchrun (default 1)")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill every rank after this many seconds (exit code 124)")
    p.add_argument("script", help="a Megatron-LM training script, e.g. pretrain_gpt.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    a = p.parse_args(argv)
    if not Path(a.script).is_file():
        p.error(f"no such script: {a.script}")
    if "RANK" in os.environ:  # torchrun (or our own launcher) started this process
        _run_script(a.script, a.args)
        return 0
    from megatron_muon.distributed.launch import start_ranks, supervise

    procs = start_ranks([sys.executable, "-m", "megatron_muon.megatron.cpu_run", a.script,
                         *a.args], a.nproc)
    code, _ = supervise(procs, a.timeout)  # it reports a killed rank, a timeout, Ctrl-C
    return code


if __name__ == "__main__":
    sys.exit(main())
