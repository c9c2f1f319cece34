#!/usr/bin/env python3
"""Pretrain a GPT with Megatron-Core and DMuon (owner-centric distributed Muon).

A complete, small Megatron-Core pretraining script, meant to be read top to bottom:
arguments -> data -> model -> optimizer -> training loop -> summary.  Everything is real
Megatron-Core: ``GPTModel``, Megatron DDP with the distributed optimizer (ZeRO-1),
``get_forward_backward_func`` (1F1B when --pipeline-model-parallel-size > 1),
``OptimizerParamScheduler``, ``GPTDataset`` over an ``IndexedDataset`` built with
``IndexedDatasetBuilder`` and ``BlendedMegatronDatasetBuilder``, and checkpoints with
``megatron.core.dist_checkpointing``.  ``--optimizer dmuon`` plugs in through
``megatron_muon.get_megatron_optimizer`` (same signature as Megatron-Core's); ``adam`` is
Megatron-Core's own AdamW distributed optimizer.

Run it:

    python examples/pretrain_gpt.py                      # 4 CPU ranks (gloo), TP2 x DP2, dmuon
    python examples/pretrain_gpt.py --optimizer adam --train-iters 50
    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --bf16          # GPUs: NCCL, Transformer Engine spec

Launched without torchrun's environment, the script starts ``--nproc`` local ranks itself
(a small torchrun: same environment variables, output of rank 0 on your terminal).  On a
machine without CUDA, ``megatron_muon.megatron.cpu_mode`` runs Megatron-Core on CPU with
gloo; with CUDA nothing is patched.

The data.  By default the corpus is the Python standard library's own ``*.py`` files,
read as bytes: about 10 MB of real, structured text that every Python installation has,
so the example needs no download, no tokenizer files and no network (the machines this
project runs on have none).  The tokenizer is byte-level: token = byte value, vocabulary
256 (padded to a multiple of 128 x TP, as Megatron-LM pads), and the NUL byte, which never
occurs in Python source, is the end-of-document token.  Rank 0 of each node tokenizes the
files once into ``<--data-cache-dir>/<name>-<fingerprint>.{bin,idx}`` with Megatron-Core's
``IndexedDatasetBuilder``; the other ranks wait at a barrier and then memory-map it.
``--data-path`` takes your own text file or directory of text files instead (same byte
tokenizer), or the prefix of an existing Megatron ``.bin``/``.idx`` pair with byte tokens.
For multi-node runs put ``--data-cache-dir`` on a shared filesystem (Megatron-Core's
``GPTDataset`` caches its sample/shuffle indices there, built by global rank 0).

Output: rank 0 prints one line every --log-interval iterations (iteration, loss, lr,
grad norm, tokens/s, ms/step) and a summary at the end (first and last loss, total time,
step time split into forward-backward and optimizer step, taken as the max over ranks);
``--log-json`` writes the per-step losses and timings.  Bad input ends with a one-line
``error: ...`` and exit code 2.  As in Megatron-LM (``--check-for-nan-in-loss-and-grad``, on
by default), a NaN or Inf loss or gradient stops the run with one ``error: iteration N: ...``
line and exit code 1.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import time
import warnings
from functools import partial
from pathlib import Path

T_LAUNCH = time.perf_counter()  # before importing torch: the wall time reported includes it

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if (REPO / "megatron_muon").is_dir() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without `pip install -e .`

OPTIMIZERS = ("adam", "dmuon", "muon_naive")
BYTE_VOCAB = 256
EOD = 0  # the NUL byte: never part of Python source or of a text file


class UsageError(Exception):
    """Bad input: reported as one line, ``error: <message>``, exit code 2."""


class TrainingError(Exception):
    """The run cannot go on (a NaN/Inf loss or gradient): one line per job,
    ``error: <message>``, exit code 1."""


class NonFinite(Exception):
    """A NaN/Inf loss or gradient norm found by this script's checks; ``local``: seen by this
    rank alone (a microbatch's loss), else the same on every rank (reduced values)."""

    def __init__(self, message: str, local: bool = False):
        super().__init__(message)
        self.local = local


# =========================================================================== arguments
class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of the long usage block
        raise UsageError(f"{message} (see --help)")


# The example's Muon defaults (the rest are DMuonOptimizerConfig's, the same on CPU and GPU:
# Newton-Schulz precision 'medium', bf16, as Megatron's): Nesterov, and an update RMS
# matched to AdamW's (spectral scale x 0.2, as Moonlight), so one --lr serves both parts of
# the model.
MUON_DEFAULTS = dict(muon_nesterov=True, muon_extra_scale_factor=0.2)


def build_parser() -> argparse.ArgumentParser:
    """The command line; the --muon-* / --dmuon-* flags come from DMuonOptimizerConfig."""
    from megatron_muon.megatron.arguments import add_dmuon_args

    p = _ArgumentParser(description="Pretrain a small GPT with Megatron-Core + DMuon.",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                        allow_abbrev=False)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=2,
                   help="tensor-parallel ranks per model replica")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (1F1B schedule when > 1)")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to start when launched without torchrun "
                        "(default: 4 on CPU, the number of GPUs with CUDA)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce-scatter gradients bucket by bucket during the backward pass")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather updated parameters bucket by bucket under the next "
                        "forward pass")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="DDP bucket size in elements (Megatron's default without it); under "
                        "--dmuon-zero3 the bucket is the unit gathered for forward/backward")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=128, help="model width")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP width; default: 4 x hidden")
    g.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="grouped-query attention; default: one group per head")
    g.add_argument("--seq-length", type=int, default=64, help="tokens per sample")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="dropout after attention and MLP")
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="dropout on the attention probabilities")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="std of the normal weight initialization")
    g.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"),
                   default="auto", help="auto: Transformer Engine on CUDA when it imports")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and compute (fp32 main weights in the optimizer)")
    g.add_argument("--gradient-accumulation-fusion", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="GPU: fuse the weight-gradient accumulation into main_grad where "
                        "apex's fused_weight_gradient_mlp_cuda kernel imports, as Megatron-LM "
                        "does (--no-gradient-accumulation-fusion: Megatron-LM's flag to turn it "
                        "off); CPU: always off")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4,
                   help="samples per forward/backward on each data-parallel rank")
    g.add_argument("--global-batch-size", type=int, default=16,
                   help="samples per optimizer step, over all data-parallel ranks")
    g.add_argument("--train-iters", type=int, default=250, help="optimizer steps")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, with --save) once the iteration number is a "
                        "multiple of this; resume later with --load for the rest of the same "
                        "--train-iters schedule (Megatron-LM's flag)")
    g.add_argument("--seed", type=int, default=1234,
                   help="random seed (initialization, data order, dropout)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="dmuon",
                   help="dmuon: owner-centric Muon for hidden matrices + AdamW for the rest; "
                        "muon_naive: the same maths, every rank orthogonalizing every matrix; "
                        "adam: Megatron-Core's AdamW")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=3e-4,
                   help="learning rate at the end of the decay")
    g.add_argument("--lr-warmup-iters", type=int, default=10,
                   help="linear warmup steps from 0 to --lr")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="steps of the decay to --min-lr; default: --train-iters")
    g.add_argument("--lr-decay-style", default="cosine",
                   choices=("constant", "linear", "cosine", "inverse-square-root"),
                   help="learning-rate decay after the warmup")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: off)")
    g.add_argument("--qk-clip", action="store_true",
                   help="QK-clip (MuonClip) after each step: rescale the Q and K rows of "
                        "every head whose max attention logit passed --qk-clip-threshold, in "
                        "the weights and in the optimizer's fp32 main-param shards")
    g.add_argument("--qk-clip-threshold", type=float, default=100.0,
                   help="max attention logit that QK-clip enforces (Megatron's default)")
    g.add_argument("--qk-clip-alpha", type=float, default=0.5,
                   help="share of the rescale that goes to Q (the rest to K)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="AdamW beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction,
                   default=True, help="stop at a NaN/Inf loss (each microbatch), local "
                   "gradient (Megatron DDP's check_for_nan_in_grad, before the data-parallel "
                   "reduction) or gradient norm, as Megatron-LM does by default")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None,
                   help="a text file, a directory of text files, or the prefix of a Megatron "
                        ".bin/.idx pair (byte tokens); default: the Python stdlib sources")
    g.add_argument("--data-cache-dir", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_muon"),
        help="where the tokenized corpus and Megatron's dataset indices are cached "
             "(a shared filesystem for multi-node runs)")

    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--save-interval", type=int, default=None,
                   help="iterations between checkpoints (and one at the end)")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    sched = g.add_mutually_exclusive_group()
    sched.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true",
                       help="on resume, keep the checkpoint's LR / weight-decay schedule when "
                            "it differs from the command line's (Megatron-LM's flag; without "
                            "either flag a difference is an error)")
    sched.add_argument("--override-opt-param-scheduler", action="store_true",
                       help="on resume, use the command line's LR / weight-decay schedule "
                            "instead of the checkpoint's")
    g.add_argument("--log-interval", type=int, default=10,
                   help="iterations between log lines of rank 0")
    g.add_argument("--log-json", default=None, help="write per-step losses and timings here")

    add_dmuon_args(p)  # --muon-* and --dmuon-*, generated from DMuonOptimizerConfig
    p.set_defaults(**MUON_DEFAULTS)
    return p


def get_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_args(args, world_size: int) -> None:
    """Everything that can be wrong with the command line, as one clear message."""
    from megatron_muon.megatron.arguments import DMuonArgumentError, validate_dmuon_args

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise UsageError("--tensor-model-parallel-size and --pipeline-model-parallel-size "
                         "must be >= 1")
    if world_size % (tp * pp) != 0:
        raise UsageError(f"TP x PP = {tp} x {pp} = {tp * pp} does not divide the world size "
                         f"{world_size} (DP = world / (TP x PP) must be a whole number)")
    if args.qk_clip:
        from megatron_muon.core.qk_clip import check_qk_clip_settings

        try:
            check_qk_clip_settings(args.qk_clip_threshold, args.qk_clip_alpha)
        except ValueError as e:
            raise UsageError(str(e)) from None
    args.data_parallel_size = dp = world_size // (tp * pp)
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.num_query_groups = args.num_query_groups or args.num_attention_heads
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    for name, value, div, what in (
            ("--num-attention-heads", args.num_attention_heads, tp, "TP"),
            ("--num-query-groups", args.num_query_groups, tp, "TP"),
            ("--num-layers", args.num_layers, pp, "PP"),
            ("--ffn-hidden-size", args.ffn_hidden_size, tp, "TP"),
            ("--hidden-size", args.hidden_size, args.num_attention_heads, "the number of heads"),
            ("--num-attention-heads", args.num_attention_heads, args.num_query_groups,
             "--num-query-groups"),
            ("--global-batch-size", args.global_batch_size, args.micro_batch_size * dp,
             f"micro batch x DP = {args.micro_batch_size} x {dp}")):
        if value < 1 or value % div != 0:
            raise UsageError(f"{name} {value} must be a positive multiple of {what} ({div})")
    head_dim = args.hidden_size // args.num_attention_heads
    if head_dim % 2:  # RoPE rotates pairs of channels: an odd head dim fails deep in the model
        raise UsageError(f"--hidden-size {args.hidden_size} / --num-attention-heads "
                         f"{args.num_attention_heads} = head dim {head_dim}, but rotary position "
                         "embeddings need an even head dim")
    for name in ("train_iters", "seq_length", "micro_batch_size", "log_interval"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise UsageError(f"need 0 <= --min-lr <= --lr and --lr > 0 (got {args.min_lr}, {args.lr})")
    if not 0 <= args.lr_warmup_iters < args.lr_decay_iters:
        raise UsageError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be >= 0 and below "
                         f"--lr-decay-iters ({args.lr_decay_iters}, default --train-iters)")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise UsageError("--exit-interval must be >= 1")
    if args.save_interval is not None and (args.save is None or args.save_interval < 1):
        raise UsageError("--save-interval needs --save DIR and a value >= 1")
    if args.transformer_impl == "transformer_engine" and not torch.cuda.is_available():
        raise UsageError("--transformer-impl transformer_engine needs CUDA")
    args.use_distributed_optimizer = True  # this script always uses Megatron's ZeRO-1
    try:
        validate_dmuon_args(args)
    except DMuonArgumentError as err:
        raise UsageError(str(err)) from None
    resolve_data(args)


# =========================================================================== data
class ByteTokenizer:
    """Token = byte value; what Megatron's GPTDataset needs from a tokenizer."""

    vocab_size = BYTE_VOCAB
    eod = EOD
    unique_identifiers = {"class": "ByteTokenizer", "vocab_size": BYTE_VOCAB, "eod": EOD}

    @staticmethod
    def detokenize(ids) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")


def _is_text(path: Path) -> bool:
    with open(path, "rb") as fh:
        return b"\0" not in fh.read(1 << 16)


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's ``*.py`` files: code, docstrings and comments.

    Left out: tests, demos, site-packages, and generated tables (codec maps in encodings/,
    pydoc's topic dump) that are not representative text.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages",
            "__pycache__", "lib2to3", "turtledemo", "ensurepip", "encodings", "pydoc_data"}
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        files += [Path(d) / n for n in sorted(names) if n.endswith(".py")]
    return root, files


def resolve_data(args) -> None:
    """Decide what to train on; sets ``args.data`` (kind, name, files or prefix, fingerprint)."""
    if args.data_path is None:
        root, files = stdlib_files()
        if not files:
            raise UsageError(f"no Python sources found under {root}; pass --data-path")
        kind, name = "text", "stdlib-py%d%d" % sys.version_info[:2]
    else:
        path = Path(args.data_path).expanduser()
        if Path(str(path) + ".idx").is_file() and Path(str(path) + ".bin").is_file():
            args.data = dict(kind="indexed", prefix=str(path), name=path.name)
            check_indexed_dataset(str(path))
            return
        if not path.exists():
            raise UsageError(f"--data-path {args.data_path}: no such file or directory "
                             "(nor a .bin/.idx pair with that prefix)")
        if path.is_file():
            if path.suffix in (".bin", ".idx"):
                raise UsageError(f"--data-path {args.data_path}: give the prefix of a Megatron "
                                 f"dataset without .bin/.idx (and both files must exist)")
            if path.stat().st_size == 0:
                raise UsageError(f"--data-path {args.data_path}: the file is empty")
            if not _is_text(path):
                raise UsageError(f"--data-path {args.data_path}: not a text file (it contains "
                                 "NUL bytes); give text, or a Megatron .bin/.idx prefix")
            files = [path]
        else:
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                           and p.stat().st_size > 0 and _is_text(p))
            if not files:
                raise UsageError(f"--data-path {args.data_path}: no non-empty text files in "
                                 "this directory")
        kind, name = "text", path.name or "data"
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    size = sum(f.stat().st_size for f in files)
    if size < 2 * (args.seq_length + 1):
        raise UsageError(f"--data-path {args.data_path}: only {size} bytes of text; need at "
                         f"least {2 * (args.seq_length + 1)} for --seq-length {args.seq_length}")
    args.data = dict(kind=kind, name=name, files=[str(f) for f in files],
                     fingerprint=h.hexdigest()[:12], bytes=size)


def check_indexed_dataset(prefix: str) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    problem, hook = None, sys.unraisablehook
    sys.unraisablehook = lambda *_: None  # a half-built IndexedDataset complains in __del__
    try:
        try:
            ds = IndexedDataset(prefix)
            n = len(ds)
            top = max((int(ds[i].max()) for i in range(min(n, 64)) if len(ds[i])), default=-1)
        except Exception as err:  # a truncated or foreign file fails in many different ways
            detail = str(err).splitlines()[0] if str(err) else ""
            problem = f"{type(err).__name__}: {detail}" if detail else type(err).__name__
    finally:  # `err` (and the half-built dataset) is gone by now
        sys.unraisablehook = hook
    if problem is not None:
        raise UsageError(f"--data-path {prefix}: corrupt or unreadable Megatron dataset "
                         f"({problem})")
    if n == 0:
        raise UsageError(f"--data-path {prefix}: the dataset has no documents")
    if top >= BYTE_VOCAB:
        raise UsageError(f"--data-path {prefix}: token ids go up to {top}, but this script "
                         f"trains a byte-level model (ids < {BYTE_VOCAB})")


def build_indexed_dataset(args) -> str:
    """Tokenize the text files once into ``.bin``/``.idx`` (local rank 0), then barrier."""
    import numpy
    import torch.distributed as dist
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if args.data["kind"] == "indexed":
        return args.data["prefix"]
    cache = Path(args.data_cache_dir).expanduser()
    prefix = cache / f"{args.data['name']}-{args.data['fingerprint']}"
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not Path(f"{prefix}.idx").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{prefix}.tmp{os.getpid()}")
        builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=numpy.uint16)
        for f in args.data["files"]:
            data = Path(f).read_bytes().replace(b"\0", b"")
            if data:
                ids = numpy.frombuffer(data + bytes([EOD]), dtype=numpy.uint8).astype(numpy.int64)
                builder.add_document(torch.from_numpy(ids), [len(ids)])
        builder.finalize(f"{tmp}.idx")
        os.replace(f"{tmp}.bin", f"{prefix}.bin")  # .idx last: its presence means "complete"
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
    dist.barrier()
    return str(prefix)


def build_train_dataset(args, prefix: str):
    """Megatron's GPTDataset: fixed-length samples, shuffled, cached indices."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=([prefix], None),
        split="1,0,0", path_to_cache=os.path.join(args.data_cache_dir, "gpt_dataset_index"),
        tokenizer=ByteTokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, mmap_bin_files=True)
    num_samples = max(args.train_iters, args.lr_decay_iters) * args.global_batch_size
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, None, None], lambda: True, config).build()
    return train


def get_microbatches(dataset, args, step: int, dp_rank: int) -> list[dict]:
    """This DP rank's microbatches of iteration ``step`` (Megatron's pretraining sampler order).

    The global batch of step s is samples [s * GBS, (s + 1) * GBS); microbatch j of DP rank d
    is the slice starting at s * GBS + (j * DP + d) * micro_batch_size.  Every TP/PP rank of a
    DP replica reads the same samples; the position in the data follows from ``step`` alone,
    so a resumed run sees exactly the data an uninterrupted run would.
    """
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    batches = []
    for j in range(args.global_batch_size // (mbs * dp)):
        start = step * args.global_batch_size + (j * dp + dp_rank) * mbs
        samples = [dataset[(start + b) % len(dataset)] for b in range(mbs)]
        batches.append({k: torch.stack([s[k] for s in samples]).to(device)
                        for k in ("tokens", "labels", "loss_mask", "position_ids")})
    return batches


# =========================================================================== model
def padded_vocab_size(args) -> int:
    multiple = 128 * args.tensor_model_parallel_size
    return int(math.ceil(BYTE_VOCAB / multiple) * multiple)


def use_transformer_engine(args) -> bool:
    if args.transformer_impl == "local" or not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        if args.transformer_impl == "transformer_engine":
            raise UsageError("--transformer-impl transformer_engine: transformer_engine "
                             "does not import") from None
        return False
    return True


def fused_wgrad_available() -> bool:
    """Megatron's own test for gradient accumulation fusion: apex's CUDA extension (every
    ``ColumnParallelLinear``, the output layer included, needs it; TE's layers fuse too)."""
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def device_transformer_fields(args, on_gpu: bool) -> dict:
    """The ``TransformerConfig`` fields that depend on the device.

    GPU: what Megatron-LM gives a GPU run: gradient accumulation fused into ``main_grad``
    (its ``--no-gradient-accumulation-fusion`` default, here where the kernel imports); every
    other field keeps Megatron-Core's default.  CPU: the one CPU-only branch.
    """
    if on_gpu:
        return dict(gradient_accumulation_fusion=args.gradient_accumulation_fusion and
                    fused_wgrad_available())
    # ---- CPU only (gloo ranks, megatron_muon.megatron.cpu_mode): no fused CUDA kernels
    # (gradient accumulation fusion is one), no batched p2p, CPU initialisation
    from megatron_muon.megatron.cpu_mode import cpu_transformer_config

    return dict(cpu_transformer_config(), gradient_accumulation_fusion=False)


def build_model(args) -> list:
    """GPTModel for this rank's pipeline stage, wrapped in Megatron DDP (ZeRO-1 buffers)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_muon.megatron.models import wire_ddp_hooks

    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, add_bias_linear=False,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        qk_clip=args.qk_clip, qk_clip_threshold=args.qk_clip_threshold,
        qk_clip_alpha=args.qk_clip_alpha, **device_transformer_fields(args, on_gpu))
    if use_transformer_engine(args):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec)

        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = get_gpt_layer_local_spec()
    model = GPTModel(config=config, transformer_layer_spec=layer_spec,
                     vocab_size=padded_vocab_size(args), max_sequence_length=args.seq_length,
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    if args.bf16:
        model = Float16Module(config, model)  # bf16 weights, fp32 logits/loss
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,  # as Megatron-LM
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, bucket_size=args.ddp_bucket_size)
    build = DistributedDataParallel
    if getattr(args, "dmuon_placement", "dmuon") == "matrix":  # MatrixFSDP buffers
        from megatron_muon.megatron.matrix_placement import matrix_placement_for

        build = matrix_placement_for(args).ddp
    model = [build(config=config, ddp_config=ddp_config, module=model)]
    wire_ddp_hooks(config, model, ddp_config)  # what Megatron-LM's training loop sets up
    if args.qk_clip:  # local attention: record the max logits QK-clip needs (TE has its own)
        from megatron_muon.megatron.qk_clip import install_max_logit_recorders

        install_max_logit_recorders(model)
    return model


def build_optimizer(args, model):
    """Megatron's optimizer factory (adam) or megatron_muon's (dmuon, muon_naive) + LR schedule."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_muon.megatron.arguments import dmuon_config_from_args
    from megatron_muon.megatron.factory import get_megatron_optimizer

    config = dmuon_config_from_args(args)  # a Megatron OptimizerConfig + muon_*/dmuon_* fields
    optimizer = get_megatron_optimizer(config, model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.lr_decay_iters, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
    return optimizer, scheduler


# =========================================================================== training
def forward_step(data_iterator, model, check: bool = False):
    """Megatron's forward_step_func: run one microbatch, return (output, loss_func)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], check=check)


def _kind(x: float) -> str:
    return "NaN" if math.isnan(x) else "+Inf" if x > 0 else "-Inf"


def loss_func(loss_mask, output_tensor, check: bool = False):
    losses = output_tensor.float()
    loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    if check and not bool(torch.isfinite(loss)):  # Megatron-LM's pretrain_gpt checks here too
        raise NonFinite(f"loss is {_kind(float(loss.detach()))}", local=True)
    return loss, {"lm loss": loss.detach().clone()}  # clone: Megatron scales `loss` in place


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_step(args, model, optimizer, batches) -> tuple[float, float, float, float]:
    """One iteration: forward-backward over the microbatches, then the optimizer step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _sync()
    t0 = time.perf_counter()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    check = args.check_for_nan_in_loss_and_grad
    losses = get_forward_backward_func()(
        forward_step_func=partial(forward_step, check=check), data_iterator=iter(batches),
        model=model[0],
        num_microbatches=len(batches), seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    _sync()
    t1 = time.perf_counter()
    # DMuon: gather -> Newton-Schulz on owners -> scatter.  The grad norm is global (the same
    # on every rank); a step skipped by a loss scaler's found-inf (fp16) returns no norm.
    updated, grad_norm, _ = optimizer.step()
    if check and updated and grad_norm is not None and not math.isfinite(grad_norm):
        raise NonFinite(f"gradient norm is {_kind(grad_norm)}")
    if getattr(args, "qk_clip", False) and updated:  # Megatron-LM clips right after the step
        from megatron_muon.megatron.qk_clip import clip_qk

        args.max_attention_logit = clip_qk(model, optimizer)
    _sync()
    t2 = time.perf_counter()
    loss = float(torch.stack([x["lm loss"] for x in losses]).mean()) if losses else float("nan")
    return loss, float(grad_norm or 0.0), t1 - t0, t2 - t1


def global_mean_loss(loss: float) -> float:
    """Mean of the last pipeline stage's losses over DP (and TP copies), on every rank."""
    import torch.distributed as dist

    have = not math.isnan(loss)
    t = torch.tensor([loss if have else 0.0, 1.0 if have else 0.0], dtype=torch.float64,
                     device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    return float(t[0] / t[1])


# Megatron DDP's check_for_nan_in_grad (the rerun state machine's RuntimeError)
_MEGATRON_GRAD_CHECK = re.compile(r"found (NaN|Inf) in local grad norm for bucket #(\d+)")


def training_error(args, iteration: int, rank: int, err: Exception):
    """The one-line ``TrainingError`` for a known fault of iteration ``iteration``, else None.

    Known: this script's NaN/Inf checks (loss, gradient norm), Megatron DDP's local gradient
    check (``check_for_nan_in_grad``) and DMuon's ``--dmuon-check-finite``
    (``FloatingPointError``); anything else keeps its traceback.
    """
    hint = (f"the training diverged: lower --lr (now {args.lr:g}) or check the data "
            "(--no-check-for-nan-in-loss-and-grad trains on regardless)")
    if isinstance(err, NonFinite):
        where = f" on rank {rank}" if err.local else ""
        return TrainingError(f"iteration {iteration}: {err}{where}; {hint}")
    match = _MEGATRON_GRAD_CHECK.search(str(err))
    if match is not None:
        return TrainingError(f"iteration {iteration}: gradient is {match[1]} on rank {rank} "
                             f"(bucket #{match[2]}, before the data-parallel reduction); {hint}")
    if isinstance(err, FloatingPointError):  # --dmuon-check-finite, on the ranks that hold it
        return TrainingError(f"iteration {iteration}: rank {rank}: {err} (--lr {args.lr:g})")
    return None


def report_once(message: str) -> None:
    """Print ``message`` on one rank of the job: the first to get here.

    A NaN usually reaches every replica, so several ranks fail at once; the torch.distributed
    store (hosted by rank 0, or by torchrun's agent) counts them and the first prints.  Where
    the store is gone its host (rank 0) has exited, after reporting.  The first lingers a
    moment if it hosts the store, so that the others still reach it; they wait longer: the
    launcher (or torchrun) ends the job when the first failed rank exits.
    """
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", 0))
    first = rank == 0
    if dist.is_available() and dist.is_initialized():
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=10))
            first = store.add("pretrain_gpt/errors_reported", 1) == 1
        except Exception:
            first = False
    if first:
        print(message, file=sys.stderr, flush=True)
    time.sleep(0.5 if first and rank == 0 else 0.0 if first else 2.0)


# A collective whose peer has exited (gloo raises; NCCL ranks are stopped by the launcher):
# the consequence of another rank's failure, which that rank reported.
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker "
                        r"crash|remote process exited|communicator was aborted", re.IGNORECASE)


def init_rerun_state_machine() -> None:
    """Megatron DDP's NaN check (``check_for_nan_in_grad``) reports through Megatron's rerun
    state machine; build it here, disabled (no reruns), as Megatron-LM's initialisation does,
    instead of implicitly with a warning at the first check."""
    import logging

    from megatron.core import rerun_state_machine as rsm

    log = logging.getLogger(rsm.__name__)
    level = log.level
    log.setLevel(logging.ERROR)  # "RerunStateMachine initialized in mode disabled"
    try:
        rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    finally:
        log.setLevel(level)


def checkpoint_functions():
    try:
        from megatron_muon.megatron.checkpoint import load_checkpoint, save_checkpoint
    except ImportError as err:
        raise UsageError(f"--save/--load need megatron_muon.megatron.checkpoint ({err})") from None
    return save_checkpoint, load_checkpoint


def checkpoint_load_failed(err, rank: int):
    """One line ``error: cannot load checkpoint ...``, no traceback, exit code 1, and no rank
    trains on a partly loaded state.  When every rank raised it (they agreed), rank 0 prints
    and the others wait for that before they exit; otherwise this rank prints and exits, and
    the launcher (or torchrun) stops the others."""
    import torch.distributed as dist

    if rank == 0 or not err.all_ranks:
        print(f"error: {err}", file=sys.stderr, flush=True)
    if err.all_ranks:
        dist.barrier()
        dist.destroy_process_group()
        raise SystemExit(1)
    sys.stdout.flush()
    os._exit(1)  # the others may be inside a collective: no clean shutdown is possible


def train(args) -> None:
    """The per-rank program (under torchrun, or started by ``launch_local``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.cpu_mode import default_backend, enable_cpu_mode
    from megatron_muon.megatron.models import init_parallel

    t_start = time.perf_counter()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    check_args(args, world)  # every rank checks, so every rank stops on bad input
    enable_cpu_mode()  # no-op with CUDA
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend=default_backend(), timeout=datetime.timedelta(minutes=10))
    init_parallel(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                  seed=args.seed)  # Megatron's TP/PP/DP groups and RNG trackers
    init_rerun_state_machine()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    dp_rank = ps.get_data_parallel_rank()

    say(f"pretrain_gpt: {world} ranks ({default_backend()}, "
        f"{'cuda' if torch.cuda.is_available() else 'cpu'}) = "
        f"TP{args.tensor_model_parallel_size} x PP{args.pipeline_model_parallel_size} x "
        f"DP{args.data_parallel_size}, optimizer {args.optimizer}, megatron-core "
        f"{_mcore_version()}")
    t_data = time.perf_counter()
    prefix = build_indexed_dataset(args)
    dataset = build_train_dataset(args, prefix)
    t_data = time.perf_counter() - t_data
    what = args.data_path or "Python stdlib sources"
    n_tokens = int(dataset.dataset.sequence_lengths.sum())
    say(f"data: {what} -> {prefix}.bin ({n_tokens / 1e6:.1f} M byte tokens, {len(dataset)} "
        f"samples of {args.seq_length} tokens), {t_data:.1f} s")
    say(f"      a sample: {ByteTokenizer.detokenize(dataset[0]['tokens'][:72])!r}")

    model = build_model(args)
    optimizer, scheduler = build_optimizer(args, model)
    n_params = sum(p.numel() for p in model[0].parameters())
    counts = torch.tensor([n_params], dtype=torch.float64)
    if torch.cuda.is_available():
        counts = counts.cuda()
    dist.all_reduce(counts)  # sum over ranks / DP copies = model size
    say(f"model: GPT {args.num_layers} layers, hidden {args.hidden_size}, ffn "
        f"{args.ffn_hidden_size}, {args.num_attention_heads} heads ({args.num_query_groups} "
        f"query groups), seq {args.seq_length}, vocab {padded_vocab_size(args)}, "
        f"{counts.item() / args.data_parallel_size / 1e6:.2f} M parameters, "
        f"{'bf16' if args.bf16 else 'fp32'}, "
        f"{'Transformer Engine' if use_transformer_engine(args) else 'local'} layers")
    say(f"batch: global {args.global_batch_size} x {args.seq_length} tokens = micro "
        f"{args.micro_batch_size} x {args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)}"
        f" microbatches x DP {args.data_parallel_size}; lr {args.lr:g} ({args.lr_decay_style}, "
        f"warmup {args.lr_warmup_iters}, min {args.min_lr:g}), wd {args.weight_decay:g}, "
        f"clip {args.clip_grad:g}")
    if args.optimizer != "adam":
        say(f"muon: momentum {args.muon_momentum}, nesterov {args.muon_nesterov}, "
            f"{args.muon_num_ns_steps} x {args.muon_coefficient_type} NS steps, scale "
            f"{args.muon_scale_mode} x {args.muon_extra_scale_factor}, NS precision "
            f"{args.muon_fp32_matmul_prec}")

    start = 0
    if args.load:
        from megatron_muon.megatron.checkpoint import CheckpointLoadError, no_checkpoint_reason

        save_ckpt, load_ckpt = checkpoint_functions()
        missing = no_checkpoint_reason(args.load)  # Megatron-LM starts from scratch then
        if missing:
            say(f"WARNING: --load {args.load}: {missing}; starting from scratch")
        else:
            try:
                start = load_ckpt(args.load, model, optimizer, scheduler)
            except CheckpointLoadError as err:
                checkpoint_load_failed(err, rank)
            say(f"resumed from {args.load} at iteration {start}")
    if args.save:
        save_ckpt, _ = checkpoint_functions()
    t_setup = time.perf_counter() - t_start

    tokens_per_step = args.global_batch_size * args.seq_length
    log, last_logged = [], start
    t_train = time.perf_counter()
    for step in range(start, args.train_iters):
        batches = get_microbatches(dataset, args, step, dp_rank)
        try:
            loss, grad_norm, t_fb, t_opt = train_step(args, model, optimizer, batches)
        except Exception as err:
            known = training_error(args, step + 1, rank, err)
            if known is None:
                raise
            raise known from None
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step(increment=1)
        loss = global_mean_loss(loss)
        if args.check_for_nan_in_loss_and_grad and not math.isfinite(loss):  # the same everywhere
            raise training_error(args, step + 1, rank, NonFinite(
                f"loss (mean over data-parallel ranks) is {_kind(loss)}"))
        log.append(dict(iter=step + 1, loss=loss, lr=lr, grad_norm=grad_norm,
                        fwd_bwd_ms=1e3 * t_fb, optimizer_ms=1e3 * t_opt))
        if args.qk_clip:  # the max over the stage's heads before this step's clip
            log[-1]["max_attention_logit"] = getattr(args, "max_attention_logit", 0.0)
        if (step + 1) % args.log_interval == 0 or step + 1 in (start + 1, args.train_iters):
            # Like Megatron-LM: loss and times are averages over the iterations since the
            # last line (this rank's times; the summary takes the max over ranks).
            recent = log[last_logged - start:]
            avg = lambda key: sum(r[key] for r in recent) / len(recent)  # noqa: E731
            fb_ms, opt_ms = avg("fwd_bwd_ms"), avg("optimizer_ms")
            say(f" iter {step + 1:5d}/{args.train_iters} | loss {avg('loss'):7.4f} | "
                f"lr {lr:.3e} | grad norm {grad_norm:6.3f} | " + (
                    f"max logit {log[-1]['max_attention_logit']:6.2f} | " if args.qk_clip else "") +
                f"{1e3 * tokens_per_step / (fb_ms + opt_ms):7.0f} tok/s | {fb_ms + opt_ms:7.1f} "
                f"ms/step (fwd-bwd {fb_ms:.1f}, optimizer {opt_ms:.1f})")
            last_logged = step + 1
        exiting = bool(args.exit_interval) and (step + 1) % args.exit_interval == 0 and \
            step + 1 < args.train_iters
        if args.save and (step + 1 == args.train_iters or exiting or
                          (args.save_interval and (step + 1) % args.save_interval == 0)):
            path = save_ckpt(args.save, model, optimizer, step + 1, scheduler=scheduler)
            say(f"saved checkpoint {path}")
        if exiting:
            say(f"exiting at iteration {step + 1} (--exit-interval {args.exit_interval})")
            break
    t_train = time.perf_counter() - t_train

    summary = summarize(args, log, start, t_setup, t_train, time.perf_counter() - t_start)
    if rank == 0:
        print_summary(args, summary)
        if args.log_json:
            Path(args.log_json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.log_json, "w") as fh:
                json.dump(dict(args={k: v for k, v in vars(args).items() if k != "data"},
                               data={k: v for k, v in args.data.items() if k != "files"},
                               world_size=world, steps=log, summary=summary), fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _mcore_version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", "?")


def summarize(args, log, start, t_setup, t_train, t_total) -> dict:
    """Step times as the max over ranks (the slowest rank sets the pace), first/last loss."""
    import torch.distributed as dist

    n = len(log)
    times = torch.tensor([[r["fwd_bwd_ms"], r["optimizer_ms"]] for r in log] or [[0.0, 0.0]],
                         dtype=torch.float64)
    if torch.cuda.is_available():
        times = times.cuda()
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu()
    for r, (fb, opt) in zip(log, times.tolist()):
        r["fwd_bwd_ms"], r["optimizer_ms"], r["step_ms"] = fb, opt, fb + opt
    skip = min(3, n // 5)  # the first iterations include one-time warm-up
    steady = times[skip:] if n else times
    fb, opt = (float(steady[:, 0].mean()), float(steady[:, 1].mean())) if n else (0.0, 0.0)
    mem = None
    if torch.cuda.is_available():  # the largest max_memory_allocated over ranks
        peak = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        mem = peak.item() / 2**20
    last = [r["loss"] for r in log[-10:]]
    return dict(
        optimizer=args.optimizer, iterations=n, first_iteration=start + 1,
        first_loss=log[0]["loss"] if n else None, last_loss=log[-1]["loss"] if n else None,
        mean_loss_last_10=sum(last) / len(last) if last else None,
        fwd_bwd_ms=fb, optimizer_ms=opt, step_ms=fb + opt,
        optimizer_share=opt / (fb + opt) if fb + opt > 0 else 0.0,
        tokens_per_s=args.global_batch_size * args.seq_length / ((fb + opt) / 1e3)
        if fb + opt > 0 else 0.0,
        timing_skipped_iterations=skip, setup_s=t_setup, train_s=t_train, total_s=t_total,
        max_memory_allocated_mib=mem)


def print_summary(args, s: dict) -> None:
    print("=" * 78)
    print(f"summary: {args.optimizer}, TP{args.tensor_model_parallel_size} x "
          f"PP{args.pipeline_model_parallel_size} x DP{args.data_parallel_size}, "
          f"{s['iterations']} iterations ({s['first_iteration']}..{s['first_iteration'] + s['iterations'] - 1})")
    if s["iterations"]:
        print(f"  loss           first {s['first_loss']:.4f} -> last {s['last_loss']:.4f} "
              f"(mean of last 10: {s['mean_loss_last_10']:.4f})")
        print(f"  step time      {s['step_ms']:8.1f} ms  (mean over iterations after the first "
              f"{s['timing_skipped_iterations']}, max over ranks), {s['tokens_per_s']:.0f} tokens/s")
        print(f"    forward-backward {s['fwd_bwd_ms']:8.1f} ms  ({100 - 100 * s['optimizer_share']:5.1f} %)")
        print(f"    optimizer step   {s['optimizer_ms']:8.1f} ms  ({100 * s['optimizer_share']:5.1f} %)")
    if s.get("max_memory_allocated_mib") is not None:
        print(f"  max memory     {s['max_memory_allocated_mib']:.0f} MiB allocated (CUDA, max over ranks)")
    print(f"  total time     {s['total_s']:.1f} s (setup {s['setup_s']:.1f} s, "
          f"training {s['train_s']:.1f} s)")
    print("=" * 78, flush=True)


# =========================================================================== launching
def launch_local(args, argv: list[str]) -> int:
    """No torchrun environment: start ``--nproc`` ranks of this script (a tiny torchrun)."""
    from megatron_muon.distributed.launch import start_ranks, supervise

    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 4)
    check_args(args, nproc)  # fail fast, before any process starts
    threads = max(1, (os.cpu_count() or 1) // nproc)
    procs = start_ranks([sys.executable, os.path.abspath(__file__), *argv], nproc, threads=threads)
    code, _ = supervise(procs)  # a failed rank (or Ctrl-C) stops the others: they would hang
    if code == 0:
        print(f"wall time {time.perf_counter() - T_LAUNCH:.1f} s ({nproc} ranks, including "
              "process start-up and imports)", flush=True)
    return code


def _quiet_warnings(rank: int) -> None:
    if rank != 0:
        warnings.simplefilter("ignore")
    for msg in (".*Transformer Engine and Apex are not installed.*", ".*absl.logging.*",
                ".*Apex is not installed.*", ".*full scope is deprecated.*",
                ".*The .grad attribute of a Tensor that is not a leaf.*",
                ".*is deprecated. Please use.*", ".*Could not determine rank.*"):  # CPU noise
        warnings.filterwarnings("ignore", message=msg)


def main(argv=None) -> int:
    return run_cli(argv, get_args, train, launch_local)


def run_cli(argv, get_args, train, launch_local, check=None) -> int:
    """The examples' entry point: parse, then train (a rank under a launcher) or start the
    local ranks; one ``error:`` line and exit code 2 for bad input, 1 for a failed run.
    ``check(args, under_launcher)``: a script's own checks that need to know which it is."""
    argv = sys.argv[1:] if argv is None else argv
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    _quiet_warnings(int(os.environ.get("RANK", 0)) if under_launcher else 0)
    try:
        args = get_args(argv)
        if check is not None:
            check(args, under_launcher)
        if under_launcher:
            train(args)
            return 0
        return launch_local(args, argv)
    except UsageError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except TrainingError as err:  # a rank: the others may be blocked in a collective
        report_once(f"error: {err}")
        return 1
    except Exception as err:
        if under_launcher and _PEER_LOST.search(str(err)):
            return 1  # another rank failed first and said why: no second report
        raise


def exit_with(code: int) -> None:
    """``sys.exit(code)``; a failed rank leaves at once (``os._exit``): tearing down the
    process group would wait for peers that are blocked in a collective (the launcher, or
    torchrun, stops them)."""
    if code and "RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_with(main())
