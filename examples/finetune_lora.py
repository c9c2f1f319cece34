#!/usr/bin/env python3
"""Fine-tune a pretrained GPT with LoRA on a new text domain: sMuon vs AdamW-LoRA vs Muon.

The recipe, top to bottom:

1. a base model: ``--load DIR`` takes a checkpoint written by ``examples/pretrain_gpt.py
   --save DIR`` (any TP layout; ``dist_checkpointing`` reshards it).  Without ``--load`` the
   recipe runs a short pretraining itself (``--pretrain-iters``, on the stdlib ``*.py``
   corpus, TP1) and caches the checkpoint under ``--out-dir`` for the next run.  The
   architecture (layers, hidden, ffn, SwiGLU, vocabulary) is read from the checkpoint's
   metadata; only ``--num-attention-heads`` must match the pretraining (default 4, as there).
2. a new domain: by default the C headers of this Python (``sysconfig.get_paths()["include"]``:
   ``Python.h`` and friends, ~190 files / 0.9 MB on CPython 3.11).  Every CPython that can build
   extensions has them (pyenv, venvs, conda, the official installers, Debian's python3-dev),
   they are never part of the pretraining corpus (Python sources only), and C declarations,
   macros and comments are a clearly different distribution from Python code.  Where the
   headers are missing, ``pydoc_data/topics.py`` (the reference manual's English text, which
   ``pretrain_gpt.py`` also leaves out) is used instead; ``--data-path`` takes your own text
   file or directory.  Files are split into fine-tuning and held-out sets by a stable hash of
   their name (``--eval-fraction``); with fewer than 10 files every file's tail is held out.
   Bytes are tokens, as in the pretraining (NUL = end of document).
3. LoRA (``megatron_muon.peft.lora``) on ``--lora-targets`` with ``--lora-rank`` /
   ``--lora-alpha``; the base weights are frozen; Megatron DDP reduces the adapter gradients.
4. the optimizers, under the same budget (same iterations, batches, data order, schedule,
   warm-up, clipping): ``smuon`` (sMuon: the Muon direction of the whole layer, restricted to
   the LoRA tangent space), ``adam`` (AdamW on A and B) and ``muon_factors`` (Muon on A and
   B separately).  Each uses its own learning rate (``--lr`` overrides all); the defaults
   are the best final held-out loss of a sweep on the default setup (one seed): smuon and
   muon_factors over 0.003, 0.01, 0.03, 0.1; adam over 1e-3, 3e-3, 1e-2, 3e-2 -- 0.01 won
   for all three (sMuon 2.557 / 2.397 / 2.425 / 2.766, AdamW 2.703 / 2.519 / 2.380 / 3.599
   (diverged), Muon on factors 2.645 / 2.426 / 2.761 / 3.464).
5. held-out loss every ``--eval-interval`` iterations, a table, ``--out-dir``/results.json and
   a PNG plot (``--out-dir``/finetune_lora.png; needs matplotlib).

Run it:

    python examples/finetune_lora.py                            # CPU, ~3 min: all three
    python examples/finetune_lora.py --optimizer smuon --lora-rank 16
    python examples/pretrain_gpt.py --save ckpt/base && \\
        python examples/finetune_lora.py --load ckpt/base --tensor-model-parallel-size 2
    torchrun --nproc-per-node 2 examples/finetune_lora.py --load ckpt/base \\
        --tensor-model-parallel-size 2                          # GPUs (local layer spec)

Launched without torchrun's environment the script starts ``--nproc`` local ranks itself
(default: the TP size).  Bad input ends with ``error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig
import time
import zlib
from functools import partial
from pathlib import Path

T_LAUNCH = time.perf_counter()

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if (REPO / "megatron_muon").is_dir() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pretrain_gpt  # noqa: E402  (ByteTokenizer, EOD, warning filters: one byte vocabulary)

OPTIMIZERS = ("smuon", "adam", "muon_factors")  # --optimizer all
EXTRA_OPTIMIZERS = ("riemannion",)  # selectable, not in "all" (not swept on this setup)
DEFAULT_LR = {"smuon": 0.01, "adam": 0.01, "muon_factors": 0.01, "riemannion": 0.01}
UsageError = pretrain_gpt.UsageError


# =========================================================================== arguments
def get_args(argv=None) -> argparse.Namespace:
    from megatron_muon.peft.lora import DEFAULT_TARGETS

    p = pretrain_gpt._ArgumentParser(
        description="LoRA fine-tuning of a pretrained GPT: sMuon vs AdamW vs per-factor Muon.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("base model")
    g.add_argument("--load", default=None,
                   help="checkpoint directory of examples/pretrain_gpt.py --save (default: "
                        "pretrain one, cached in --out-dir)")
    g.add_argument("--pretrain-iters", type=int, default=200,
                   help="iterations of the base-model pretraining when no --load is given")
    g.add_argument("--num-attention-heads", type=int, default=4,
                   help="must match the pretraining (not recorded in the checkpoint)")
    g.add_argument("--seq-length", type=int, default=64, help="tokens per sample")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel ranks (the adapters are TP-sharded like their layer)")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to start without torchrun (default: the TP size)")

    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-rank", type=int, default=8, help="adapter rank r")
    g.add_argument("--lora-alpha", type=float, default=16.0,
                   help="the adapter output is scaled by alpha / r")
    g.add_argument("--lora-targets", nargs="+", default=list(DEFAULT_TARGETS),
                   help="qkv proj fc1 fc2 experts, or module names (comma or space separated)")
    g.add_argument("--lora-init", choices=("kaiming", "normal"), default="kaiming",
                   help="init of A (B starts at 0): kaiming = U(-1/sqrt(n), 1/sqrt(n)) as "
                        "nn.Linear and PEFT, normal = N(0, 1/r^2)")
    g.add_argument("--save-adapters", action="store_true",
                   help="write <out-dir>/adapter-<optimizer>.pt (TP-independent)")

    g = p.add_argument_group("training")
    g.add_argument("--optimizer", choices=OPTIMIZERS + EXTRA_OPTIMIZERS + ("all",),
                   default="all",
                   help="optimizer of the adapters (riemannion: Muon on the rank-r manifold, "
                        "docs/relora.md#riemannion); all: one run each of "
                        + ", ".join(OPTIMIZERS) + ", compared")
    g.add_argument("--lr", type=float, default=None,
                   help="default per optimizer: " + ", ".join(f"{k} {v:g}"
                                                              for k, v in DEFAULT_LR.items()))
    g.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine decay ends at this x --lr")
    g.add_argument("--lr-warmup-iters", type=int, default=10, help="linear warmup steps")
    g.add_argument("--train-iters", type=int, default=150, help="fine-tuning steps")
    g.add_argument("--micro-batch-size", type=int, default=4,
                   help="samples per forward/backward on each data-parallel rank")
    g.add_argument("--global-batch-size", type=int, default=16,
                   help="samples per optimizer step, over all data-parallel ranks")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: off)")
    g.add_argument("--muon-momentum", type=float, default=0.95,
                   help="momentum of sMuon and per-factor Muon, in [0, 1)")
    g.add_argument("--muon-extra-scale-factor", type=float, default=0.2,
                   help="spectral scale x this (0.2 matches AdamW's update RMS, as Moonlight)")
    g.add_argument("--smuon-work", choices=("distribute", "replicate"), default="distribute",
                   help="distribute: each rank of the work group computes the sMuon "
                        "directions of some adapters, then they are shared; replicate: every "
                        "rank computes all of them")
    g.add_argument("--seed", type=int, default=1234,
                   help="fine-tuning seed: LoRA init and data order (the pretraining keeps "
                        "pretrain_gpt.py's default seed)")

    g = p.add_argument_group("data and output")
    g.add_argument("--data-path", default=None,
                   help="text file or directory (default: this Python's C headers)")
    g.add_argument("--eval-fraction", type=float, default=0.1,
                   help="share of the documents held out for evaluation")
    g.add_argument("--eval-samples", type=int, default=192,
                   help="held-out samples per evaluation")
    g.add_argument("--eval-interval", type=int, default=25,
                   help="iterations between held-out evaluations")
    g.add_argument("--data-cache-dir", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_muon"),
        help="where tokenized corpora and dataset indices are cached")
    g.add_argument("--out-dir", default=str(REPO / "runs" / "finetune_lora"),
                   help="results, plot, adapters and the cached base model")
    g.add_argument("--log-interval", type=int, default=25,
                   help="iterations between log lines")
    args = p.parse_args(argv)
    args.lora_targets = [t for item in args.lora_targets for t in item.split(",") if t]
    return args


def check_args(args, world: int) -> None:
    from megatron_muon.peft.lora import LoRAConfig

    tp = args.tensor_model_parallel_size
    if tp < 1 or world % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} must divide the world size {world}")
    args.data_parallel_size = dp = world // tp
    for name in ("train_iters", "seq_length", "micro_batch_size", "eval_samples",
                 "eval_interval", "log_interval", "pretrain_iters", "num_attention_heads"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise UsageError(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"micro batch x DP = {args.micro_batch_size} x {dp}")
    if args.num_attention_heads % tp:
        raise UsageError(f"--num-attention-heads {args.num_attention_heads} must be a multiple "
                         f"of TP ({tp})")
    if args.lr is not None and not args.lr > 0:
        raise UsageError("--lr must be > 0")
    if not 0 < args.eval_fraction < 1:
        raise UsageError("--eval-fraction must be between 0 and 1")
    if not 0 <= args.min_lr_ratio <= 1 or args.lr_warmup_iters < 0:
        raise UsageError("need 0 <= --min-lr-ratio <= 1 and --lr-warmup-iters >= 0")
    try:
        LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets,
                   init=args.lora_init)
    except ValueError as err:
        raise UsageError(str(err)) from None


# =========================================================================== data
def domain_documents(args) -> tuple[str, str, list[bytes], list[bytes]]:
    """(name, description, fine-tuning documents, held-out documents)."""
    if args.data_path:
        path = Path(args.data_path).expanduser()
        if not path.exists():
            raise UsageError(f"--data-path {args.data_path}: no such file or directory")
        files = [path] if path.is_file() else sorted(
            f for f in path.rglob("*") if f.is_file() and not f.name.startswith("."))
        root, what = (path.parent if path.is_file() else path), f"--data-path {path}"
    else:
        root = Path(sysconfig.get_paths()["include"])
        files = sorted(root.rglob("*.h")) if root.is_dir() else []
        what = f"C headers of Python {sys.version_info[0]}.{sys.version_info[1]} ({root})"
        if not files:
            topics = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
            files, root = ([topics] if topics.is_file() else []), topics.parent
            what = f"the reference manual text in {topics} (no C headers here)"
    docs = []
    for f in files:
        data = f.read_bytes()
        if data and b"\0" not in data[:65536]:
            docs.append((str(f.relative_to(root)) if f != root else f.name, data))
    if not docs or sum(len(d) for _, d in docs) < 4 * (args.seq_length + 1):
        raise UsageError(f"{what}: not enough text to fine-tune on")
    train, held = [], []
    if len(docs) >= 10:
        for name, data in docs:
            frac = zlib.crc32(name.encode()) / 2 ** 32
            (held if frac < args.eval_fraction else train).append(data)
        if not held or not train:
            raise UsageError(f"{what}: the {len(docs)} files do not split into fine-tuning and "
                             "held-out sets; change --eval-fraction")
    else:
        for _, data in docs:
            cut = int(len(data) * (1 - args.eval_fraction))
            train.append(data[:cut])
            held.append(data[cut:])
    name = "ft-" + hashlib.sha1(repr((what, [n for n, _ in docs], [len(d) for _, d in docs],
                                      args.eval_fraction)).encode()).hexdigest()[:12]
    desc = (f"{what}: {len(docs)} files, {sum(map(len, train)) / 1e6:.2f} MB fine-tuning / "
            f"{sum(map(len, held)) / 1e6:.2f} MB held out")
    return name, desc, train, held


def build_dataset(args, name: str, docs: list[bytes], num_samples: int, seed: int):
    """Megatron IndexedDataset (built once by local rank 0) + GPTDataset over it."""
    import numpy
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    cache = Path(args.data_cache_dir).expanduser()
    prefix = cache / name
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not Path(f"{prefix}.idx").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{prefix}.tmp{os.getpid()}")
        builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=numpy.uint16)
        for data in docs:
            data = data.replace(b"\0", b"") + bytes([pretrain_gpt.EOD])
            ids = numpy.frombuffer(data, dtype=numpy.uint8).astype(numpy.int64)
            builder.add_document(torch.from_numpy(ids), [len(ids)])
        builder.finalize(f"{tmp}.idx")
        os.replace(f"{tmp}.bin", f"{prefix}.bin")
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
    dist.barrier()
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=args.seq_length, blend=([str(prefix)], None),
        split="1,0,0", path_to_cache=str(cache / "gpt_dataset_index"),
        tokenizer=pretrain_gpt.ByteTokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        mmap_bin_files=True)
    ds, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None],
                                             lambda: True, config).build()
    return ds


def microbatches(dataset, args, start: int, count: int, dp_rank: int) -> list[dict]:
    """Samples [start, start + count) of ``dataset``; this DP rank's microbatches of them."""
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    out = []
    for j in range(count // (mbs * dp)):
        first = start + (j * dp + dp_rank) * mbs
        samples = [dataset[(first + b) % len(dataset)] for b in range(mbs)]
        out.append({k: torch.stack([s[k] for s in samples]).to(dev)
                    for k in ("tokens", "labels", "loss_mask", "position_ids")})
    return out


# =========================================================================== base model
def checkpoint_path(directory: str) -> str:
    latest = Path(directory) / "latest"
    if not latest.is_file():
        raise UsageError(f"--load {directory}: no checkpoint there (no 'latest' file; write one "
                         "with examples/pretrain_gpt.py --save DIR)")
    path = Path(directory) / f"iter_{int(latest.read_text().strip()):07d}"
    if not path.is_dir():
        raise UsageError(f"--load {directory}: {path} is missing")
    return str(path)


def architecture(args, path: str) -> dict:
    """Layers, hidden, ffn, SwiGLU, query groups and vocabulary from the checkpoint."""
    from megatron.core import dist_checkpointing

    try:
        md = dist_checkpointing.load_tensors_metadata(path)
    except Exception as err:
        raise UsageError(f"{path}: not a readable dist_checkpointing checkpoint "
                         f"({type(err).__name__})") from None
    shape = lambda key: tuple(md[key].global_shape)  # noqa: E731
    try:
        vocab, hidden = shape("embedding.word_embeddings.weight")
        layers, qkv_rows, _ = shape("decoder.layers.self_attention.linear_qkv.weight")
        fc1_rows = shape("decoder.layers.mlp.linear_fc1.weight")[1]
        ffn = shape("decoder.layers.mlp.linear_fc2.weight")[2]
    except KeyError as err:
        raise UsageError(f"{path}: not a GPT checkpoint of examples/pretrain_gpt.py "
                         f"(no {err})") from None
    heads = args.num_attention_heads
    if hidden % heads:
        raise UsageError(f"--num-attention-heads {heads} does not divide the checkpoint's "
                         f"hidden size {hidden}")
    head_dim = hidden // heads
    groups = (qkv_rows - hidden) // (2 * head_dim)
    if groups < 1 or hidden + 2 * groups * head_dim != qkv_rows or heads % groups:
        raise UsageError(f"--num-attention-heads {heads} does not fit the checkpoint's QKV "
                         f"weight ({qkv_rows} x {hidden}); use the value of the pretraining")
    tp = args.tensor_model_parallel_size
    if groups % tp or vocab % tp:
        raise UsageError(f"TP {tp} must divide the query groups ({groups}) and vocabulary "
                         f"({vocab}) of the checkpoint")
    return dict(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                swiglu=fc1_rows == 2 * ffn, num_query_groups=groups, vocab=vocab)


def build_base_model(args, arch: dict):
    """GPTModel as examples/pretrain_gpt.py builds it (local layer spec), fp32."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_muon.megatron.cpu_mode import cpu_transformer_config

    cpu_only = cpu_transformer_config()  # {} on GPUs
    config = TransformerConfig(
        num_layers=arch["num_layers"], hidden_size=arch["hidden_size"],
        ffn_hidden_size=arch["ffn_hidden_size"], num_attention_heads=args.num_attention_heads,
        num_query_groups=arch["num_query_groups"],
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=1, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, gated_linear_unit=arch["swiglu"],
        activation_func=torch.nn.functional.silu if arch["swiglu"] else torch.nn.functional.gelu,
        gradient_accumulation_fusion=False, **cpu_only)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=arch["vocab"], max_sequence_length=args.seq_length,
                     pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def load_base(model, path: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(state["model"])


def ensure_base_checkpoint(args) -> str:
    """--load, or a cached short pretraining with examples/pretrain_gpt.py (run here)."""
    if args.load:
        return args.load
    key = hashlib.sha1(repr((args.pretrain_iters, args.num_attention_heads,
                             sys.version_info[:2])).encode()).hexdigest()[:10]
    directory = Path(args.out_dir) / f"base-{key}"
    if (directory / "latest").is_file():
        print(f"base model: cached pretraining checkpoint {directory}", flush=True)
        return str(directory)
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "pretrain_gpt.py"),
           "--nproc", "1", "--tensor-model-parallel-size", "1",
           "--num-attention-heads", str(args.num_attention_heads),
           "--train-iters", str(args.pretrain_iters), "--log-interval", "50",
           "--save", str(directory)]
    print(f"base model: no --load given, pretraining one ({args.pretrain_iters} iterations on "
          f"the stdlib *.py corpus):\n  {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    code = subprocess.call(cmd)
    if code != 0 or not (directory / "latest").is_file():
        raise UsageError(f"the pretraining run failed (exit code {code})")
    print(f"base model: pretrained in {time.perf_counter() - t:.0f} s -> {directory}", flush=True)
    return str(directory)


# =========================================================================== training
def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(loss_mask, output_tensor):
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        return loss, {"lm loss": loss.detach().clone()}

    return output, partial(loss_func, batch["loss_mask"])


def run_batches(args, model, batches, forward_only: bool) -> float:
    """Mean loss over ``batches`` (and over DP ranks); backward unless ``forward_only``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=model[0],
        num_microbatches=len(batches), seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=forward_only)
    t = torch.stack([x["lm loss"] for x in losses]).double().mean().reshape(1)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t) / args.data_parallel_size


@torch.no_grad()
def evaluate(args, model, eval_set, dp_rank: int) -> float:
    for m in model:
        m.eval()
    loss = run_batches(args, model, microbatches(eval_set, args, 0, args.eval_samples, dp_rank),
                       forward_only=True)
    for m in model:
        m.train()
    return loss


def lr_at(args, base_lr: float, it: int) -> float:
    if it < args.lr_warmup_iters:
        return base_lr * (it + 1) / (args.lr_warmup_iters + 1)
    span = max(1, args.train_iters - args.lr_warmup_iters)
    frac = min(1.0, (it - args.lr_warmup_iters) / span)
    low = base_lr * args.min_lr_ratio
    return low + 0.5 * (base_lr - low) * (1 + math.cos(math.pi * frac))


def finetune(args, name: str, arch: dict, ckpt: str, train_set, eval_set, say) -> dict:
    """One optimizer: fresh base + fresh adapters (same seed), train, evaluate."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_muon.peft.lora import LoRAConfig, apply_lora, save_lora
    from megatron_muon.peft.lora_optimizer import LoRAOptimizer
    from megatron_muon.megatron.models import wire_ddp_hooks

    gpt = build_base_model(args, arch)
    load_base(gpt, ckpt)
    try:
        adapters = apply_lora(gpt, LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha,
                                              targets=args.lora_targets, init=args.lora_init,
                                              seed=args.seed))
    except ValueError as err:  # unknown target, rank > min(m, n), ...
        raise UsageError(str(err)) from None
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=False)
    model = [DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)]
    wire_ddp_hooks(gpt.config, model, ddp_config)
    lr = args.lr or DEFAULT_LR[name]
    opt = LoRAOptimizer(model, name, lr=lr, weight_decay=args.weight_decay,
                        clip_grad=args.clip_grad, momentum=args.muon_momentum,
                        extra_scale_factor=args.muon_extra_scale_factor,
                        scale_mode="spectral", adam_betas=(0.9, 0.999),
                        smuon_work=args.smuon_work)
    n_lora = sum(a.A.numel() + a.B.numel() for a in adapters)
    dp_rank = ps.get_data_parallel_rank()
    curve = [(0, evaluate(args, model, eval_set, dp_rank))]
    say(f"[{name}] lr {lr:g}, {len(adapters)} adapters, {n_lora / 1e3:.1f} K trainable "
        f"parameters on this rank; held-out loss at start {curve[0][1]:.4f}")
    train_losses, t_fb, t_opt = [], [], []
    for it in range(args.train_iters):
        for group in opt.param_groups:
            group["lr"] = lr_at(args, lr, it)
        batches = microbatches(train_set, args, it * args.global_batch_size,
                               args.global_batch_size, dp_rank)
        model[0].zero_grad_buffer()
        opt.zero_grad()
        t0 = time.perf_counter()
        train_losses.append(run_batches(args, model, batches, forward_only=False))
        t1 = time.perf_counter()
        ok, grad_norm, _ = opt.step()
        t2 = time.perf_counter()
        t_fb.append(t1 - t0)
        t_opt.append(t2 - t1)
        if (it + 1) % args.eval_interval == 0 or it + 1 == args.train_iters:
            curve.append((it + 1, evaluate(args, model, eval_set, dp_rank)))
        if (it + 1) % args.log_interval == 0 or it + 1 == args.train_iters:
            recent = train_losses[-args.log_interval:]
            say(f"[{name}] iter {it + 1:4d}/{args.train_iters} | train loss "
                f"{sum(recent) / len(recent):.4f} | held-out {curve[-1][1]:.4f} (iter "
                f"{curve[-1][0]}) | grad norm {grad_norm:.3f} | "
                f"{1e3 * (t1 - t0):.0f} + {1e3 * (t2 - t1):.1f} ms")
    if args.save_adapters:
        path = Path(args.out_dir) / f"adapter-{name}.pt"
        save_lora(path, model, metadata={"optimizer": name, "lr": lr, "base": ckpt})
        say(f"[{name}] adapters -> {path}")
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731  (robust to a busy machine)
    return dict(optimizer=name, lr=lr, curve=curve, train_losses=train_losses,
                start=curve[0][1], final=curve[-1][1], best=min(v for _, v in curve),
                train_last10=sum(train_losses[-10:]) / len(train_losses[-10:]),
                fwd_bwd_ms=1e3 * median(t_fb), optimizer_ms=1e3 * median(t_opt),
                fwd_bwd_s=t_fb, opt_s=t_opt, lora_params=n_lora)


def train(args) -> None:
    import torch.distributed as dist

    from megatron_muon.megatron.cpu_mode import default_backend, enable_cpu_mode
    from megatron_muon.megatron.models import init_parallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    check_args(args, world)
    enable_cpu_mode()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend=default_backend(), timeout=datetime.timedelta(minutes=10))
    init_parallel(tp=args.tensor_model_parallel_size, seed=args.seed)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    ckpt = checkpoint_path(args.load)
    arch = architecture(args, ckpt)
    name, desc, train_docs, held_docs = domain_documents(args)
    train_set = build_dataset(args, name + "-train", train_docs,
                              args.train_iters * args.global_batch_size, args.seed)
    eval_set = build_dataset(args, name + "-heldout", held_docs, args.eval_samples, args.seed + 1)
    say(f"finetune_lora: {world} ranks = TP{args.tensor_model_parallel_size} x "
        f"DP{args.data_parallel_size} ({default_backend()}), base {ckpt}")
    say(f"  model: {arch['num_layers']} layers, hidden {arch['hidden_size']}, ffn "
        f"{arch['ffn_hidden_size']}{' (SwiGLU)' if arch['swiglu'] else ''}, "
        f"{args.num_attention_heads} heads / {arch['num_query_groups']} groups, vocab "
        f"{arch['vocab']}")
    say(f"  domain: {desc}")
    say(f"  a sample: {pretrain_gpt.ByteTokenizer.detokenize(train_set[0]['tokens'][:72])!r}")
    say(f"  LoRA rank {args.lora_rank}, alpha {args.lora_alpha:g}, targets "
        f"{','.join(args.lora_targets)}; {args.train_iters} iterations x "
        f"{args.global_batch_size} x {args.seq_length} tokens, warm-up {args.lr_warmup_iters}, "
        f"cosine to {args.min_lr_ratio:g} x lr, clip {args.clip_grad:g}, wd {args.weight_decay:g}")
    names = OPTIMIZERS if args.optimizer == "all" else (args.optimizer,)
    records = []
    for n in names:
        t = time.perf_counter()
        rec = finetune(args, n, arch, ckpt, train_set, eval_set, say)
        rec["wall_s"] = time.perf_counter() - t
        records.append(rec)
    if rank == 0:
        report(args, records, desc, ckpt)
    dist.barrier()
    dist.destroy_process_group()


# =========================================================================== report
def report(args, records: list[dict], desc: str, ckpt: str) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print("=" * 92)
    print(f"held-out loss (nats/byte) on {desc}")
    print(f"LoRA rank {args.lora_rank}, alpha {args.lora_alpha:g}, {args.train_iters} iterations, "
          f"TP{args.tensor_model_parallel_size} x DP{args.data_parallel_size}")
    print("| optimizer    | lr      | held-out: base -> final | best   | train (last 10) "
          "| fwd-bwd ms | opt ms |")
    print("|--------------|---------|-------------------------|--------|-----------------"
          "|------------|--------|")
    for r in records:
        print(f"| {r['optimizer']:<12} | {r['lr']:<7g} | {r['start']:.4f} -> {r['final']:.4f}"
              f"        | {r['best']:.4f} | {r['train_last10']:.4f}          "
              f"| {r['fwd_bwd_ms']:10.1f} | {r['optimizer_ms']:6.1f} |")
    print("(best: lowest held-out loss seen at an evaluation; ms: medians per iteration, rank 0)")
    print("=" * 92, flush=True)
    with open(out / "results.json", "w") as fh:
        json.dump(dict(args={k: v for k, v in vars(args).items()}, domain=desc, base=ckpt,
                       records=records), fh, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in records:
        its, vals = zip(*r["curve"])
        line, = ax.plot(its, vals, marker="o", label=f"{r['optimizer']} (lr {r['lr']:g})")
        k = 10
        tl = r["train_losses"]
        smooth = [sum(tl[max(0, i - k + 1): i + 1]) / len(tl[max(0, i - k + 1): i + 1])
                  for i in range(len(tl))]
        ax.plot(range(1, len(tl) + 1), smooth, color=line.get_color(), alpha=0.3, lw=1)
    ax.axhline(records[0]["start"], color="gray", ls="--", lw=1, label="base model")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(f"LoRA r={args.lora_rank} fine-tuning: held-out (markers), train (faint)",
                 fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "finetune_lora.png", dpi=120)
    print(f"wrote {out / 'finetune_lora.png'} and {out / 'results.json'}", flush=True)


# =========================================================================== launching
def launch_local(args, argv: list[str]) -> int:
    from megatron_muon.distributed.launch import start_ranks, supervise

    nproc = args.nproc or args.tensor_model_parallel_size
    check_args(args, nproc)
    load = ensure_base_checkpoint(args)
    checkpoint_path(load)  # fail here, not in every rank
    threads = max(1, (os.cpu_count() or 1) // nproc)
    procs = start_ranks([sys.executable, os.path.abspath(__file__), *argv, "--load", load], nproc,
                        threads=threads)
    code, _ = supervise(procs)
    if code == 0:
        print(f"wall time {time.perf_counter() - T_LAUNCH:.1f} s", flush=True)
    return code


def main(argv=None) -> int:
    return pretrain_gpt.run_cli(argv, get_args, train, launch_local, check=_check_load)


def _check_load(args, under_launcher: bool) -> None:
    if under_launcher and not args.load:
        raise UsageError("under torchrun, give --load (a pretrain_gpt.py checkpoint)")


if __name__ == "__main__":
    sys.exit(main())
