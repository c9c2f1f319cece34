#!/usr/bin/env python3
"""IsoLoCo vs DiLoCo vs data-parallel AdamW at equal tokens, 4 CPU ranks.

    python examples/isoloco_islands.py                    # default: ~3-4 min on 2-4 CPU cores
    python examples/isoloco_islands.py --train-iters 600 --diloco-inner-steps 30
    python examples/isoloco_islands.py --methods adam,isoloco --isoloco-mode ns

Three runs of the same byte-level GPT on the same data, one after the other in the same 4
ranks (gloo on CPU; NCCL on GPUs):

* ``adam``: plain data parallelism, Megatron DDP + the distributed AdamW, DP = 4: every step
  reduce-scatters the gradients and all-gathers the parameters over the 4 ranks.
* ``diloco`` / ``isoloco``: 4 islands x 1 rank (``megatron_muon.islands.runtime``); every
  island trains alone with the same AdamW and schedule, and every ``--diloco-inner-steps``
  steps the islands merge with the outer step (DiLoCo: Nesterov SGD on mean D, lr 0.7 / mu
  0.9; IsoLoCo: Iso-C of mean D, lr 1.8 / mu 0.8 -- the published defaults).

Equal tokens: at inner step s, island k reads exactly the samples that DP rank k reads at
step s, so all runs see the same tokens in the same order. The data is the Python standard
library's own sources as bytes (``examples/pretrain_gpt.py``'s built-in corpus, tokenized once
into a Megatron ``.bin/.idx`` and read by ``GPTDataset``); 1 % of the documents are held out.

Reported per method: held-out loss (mean over ``--eval-samples`` held-out sequences,
evaluated every outer round on the global parameters), and the bytes each rank sends per
inner step: for AdamW 2 (n-1)/n x 4 bytes x parameters (ring reduce-scatter of fp32
gradients + all-gather of fp32 parameters), for the islands what ``IslandOuterStep`` counted
(ring all-reduce of fp32 mean D, Iso-C result broadcasts) divided by the inner steps.
Prints a table and writes ``<--out-dir>/isoloco_islands.{png,json}`` (default ``runs/``).
The numbers are what this small model on this small budget gives; at this scale IsoLoCo
need not beat DiLoCo or data parallelism.

Deterministic: data order, initialisation and every collective's reduction order are fixed,
so two runs on one machine agree bitwise. What used to change between machines (and
between the README's run and a re-run: up to 0.016 in held-out loss) was the number of
torch threads per rank, which defaulted to the core count / ranks: fp32 kernels sum in
thread-sized blocks, the last bits differ, and 300 steps of training with an outer step
that multiplies by lr (1 + mu) ~ 1.3 (DiLoCo) turn them into visible differences.
``--threads`` (default 1) fixes it; a different torch build or CPU instruction set can still
change the last bits (docs/isoloco.md#determinism).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

T_LAUNCH = time.perf_counter()

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

METHODS = ("adam", "diloco", "isoloco")
LABELS = {"adam": "data-parallel AdamW", "diloco": "DiLoCo", "isoloco": "IsoLoCo"}


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--methods", default="adam,diloco,isoloco",
                   help="comma-separated runs to compare: adam, diloco, isoloco")
    p.add_argument("--nproc", type=int, default=4, help="ranks = islands of 1 rank")
    p.add_argument("--train-iters", type=int, default=300, help="inner steps per run")
    p.add_argument("--diloco-inner-steps", type=int, default=30,
                   help="H: inner steps between two outer synchronizations")
    p.add_argument("--isoloco-mode", choices=("svd", "ns"), default="svd",
                   help="Iso-C by SVD (exact) or by Newton-Schulz (matmuls only)")
    p.add_argument("--isoloco-order", choices=("iso_first", "momentum_first"),
                   default="iso_first", help="iso_first: Iso-C of the mean delta, then "
                   "momentum; momentum_first: momentum on the mean delta, then Iso-C")
    p.add_argument("--diloco-outer-lr", type=float, default=None, help="default 0.7")
    p.add_argument("--diloco-outer-momentum", type=float, default=None, help="default 0.9")
    p.add_argument("--isoloco-outer-lr", type=float, default=None, help="default 1.8")
    p.add_argument("--isoloco-outer-momentum", type=float, default=None, help="default 0.8")
    p.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    p.add_argument("--hidden-size", type=int, default=128, help="model width")
    p.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq-length", type=int, default=64, help="tokens per sample")
    p.add_argument("--micro-batch-size", type=int, default=4, help="per rank / island")
    p.add_argument("--lr", type=float, default=2e-3, help="peak inner learning rate")
    p.add_argument("--min-lr", type=float, default=2e-4,
                   help="inner learning rate at the end of the decay")
    p.add_argument("--lr-warmup-iters", type=int, default=20, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    p.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the gradient norm to this (0: off)")
    p.add_argument("--eval-samples", type=int, default=128, help="held-out samples per evaluation")
    p.add_argument("--seed", type=int, default=1234, help="random seed")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per rank. The result depends on it (matmul and "
                   "reduction kernels block their sums by thread), so it is fixed rather than "
                   "taken from the core count: the same command gives the same numbers on any "
                   "machine with the same torch build")
    p.add_argument("--data-path", default=None, help="default: the Python stdlib sources")
    p.add_argument("--data-cache-dir", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_muon"),
        help="where the tokenized corpus and dataset indices are cached")
    p.add_argument("--out-dir", default=str(REPO / "runs"), help="where the results go")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        p.error(f"--methods: unknown {bad or '(none)'}; choose from {', '.join(METHODS)}")
    for name in ("train_iters", "diloco_inner_steps", "micro_batch_size", "eval_samples",
                 "nproc", "seq_length", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.train_iters % args.diloco_inner_steps:
        p.error("--train-iters must be a multiple of --diloco-inner-steps (whole outer rounds)")
    if args.hidden_size % args.num_attention_heads:
        p.error("--hidden-size must be a multiple of --num-attention-heads")
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        p.error("--lr-warmup-iters must be in [0, --train-iters)")
    return args


# ============================================================================ per rank
def _pretrain():
    import pretrain_gpt  # examples/pretrain_gpt.py: the corpus, tokenizer and batches

    return pretrain_gpt


def build_datasets(args):
    """Train and held-out ``GPTDataset`` over the byte corpus (99 % / 1 % of the documents)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    pre = _pretrain()
    pre.resolve_data(args)
    prefix = pre.build_indexed_dataset(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=([prefix], None),
        split="99,1,0", path_to_cache=os.path.join(args.data_cache_dir, "gpt_dataset_index"),
        tokenizer=pre.ByteTokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, mmap_bin_files=True)
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [args.train_iters * args.global_batch_size, args.eval_samples, None],
        lambda: True, config).build()
    return train, valid


def _batch(samples):
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    return {k: torch.stack([s[k] for s in samples]).to(dev)
            for k in ("tokens", "labels", "loss_mask", "position_ids")}


def held_out_loss(args, model, valid) -> float:
    """Mean loss over the first --eval-samples held-out sequences (split over the ranks)."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, args.eval_samples, world))
    mbs = args.micro_batch_size
    batches = [_batch([valid[i] for i in mine[j:j + mbs]]) for j in range(0, len(mine), mbs)]
    total = torch.zeros(2, dtype=torch.float64)
    if batches:
        for chunk in model:
            chunk.eval()
        with torch.no_grad():
            for b in batches:
                out = get_forward_backward_func()(
                    forward_step_func=_pretrain().forward_step, data_iterator=iter([b]),
                    model=model[0], num_microbatches=1, seq_length=args.seq_length,
                    micro_batch_size=b["tokens"].shape[0], forward_only=True)
                total += torch.tensor([float(out[0]["lm loss"]) * b["tokens"].shape[0],
                                       b["tokens"].shape[0]], dtype=torch.float64)
        for chunk in model:
            chunk.train()
    if torch.cuda.is_available():
        total = total.cuda()
    dist.all_reduce(total)
    return float(total[0] / total[1])


def run_method(args, method: str, train, valid) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_muon.islands.runtime import (IslandOuterStep, destroy_islands,
                                                initialize_islands)
    from megatron_muon.megatron.config import make_optimizer_config
    from megatron_muon.megatron.factory import get_megatron_optimizer
    from megatron_muon.megatron.models import TinyGPTConfig, build_gpt

    world = dist.get_world_size()
    K = 1 if method == "adam" else world  # adam: one island of DP = world
    layout = initialize_islands(K, seed=args.seed)
    gcfg = TinyGPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         ffn_hidden_size=4 * args.hidden_size,
                         num_attention_heads=args.num_attention_heads,
                         num_query_groups=args.num_attention_heads, vocab_size=256,
                         seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                         num_microbatches=1, seed=args.seed)
    model = build_gpt(gcfg)
    ocfg = make_optimizer_config("adam", lr=args.lr, min_lr=args.min_lr,
                                 weight_decay=args.weight_decay, clip_grad=args.clip_grad)
    optimizer = get_megatron_optimizer(ocfg, model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.train_iters,
        lr_decay_style="cosine", start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant")
    outer = None
    if method != "adam":
        lr = args.diloco_outer_lr if method == "diloco" else args.isoloco_outer_lr
        mu = args.diloco_outer_momentum if method == "diloco" else args.isoloco_outer_momentum
        kw = dict(iso_mode=args.isoloco_mode, order=args.isoloco_order) \
            if method == "isoloco" else {}
        outer = IslandOuterStep(model, layout, method=method, lr=lr, momentum=mu,
                                inner_optimizer=optimizer, **kw)
    n_params = sum(p.numel() for p in model[0].parameters())
    pre = _pretrain()
    data_args = argparse.Namespace(micro_batch_size=args.micro_batch_size,
                                   data_parallel_size=world,
                                   global_batch_size=args.global_batch_size,
                                   seq_length=args.seq_length,
                                   check_for_nan_in_loss_and_grad=False)
    H = args.diloco_inner_steps
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    curve = [dict(step=0, loss=held_out_loss(args, model, valid))]
    train_losses, outer_s = [], 0.0
    t0 = time.perf_counter()
    for step in range(args.train_iters):
        # island k / DP rank k: the same samples of the same global batch
        batches = pre.get_microbatches(train, data_args, step, dist.get_rank())
        loss, _, _, _ = pre.train_step(data_args, model, optimizer, batches)
        scheduler.step(increment=1)
        train_losses.append(loss)
        if (step + 1) % H == 0:
            if outer is not None:
                t = time.perf_counter()
                outer.step()
                outer_s += time.perf_counter() - t
            curve.append(dict(step=step + 1, loss=held_out_loss(args, model, valid)))
            say(f"  [{method}] step {step + 1:4d}/{args.train_iters}  held-out loss "
                f"{curve[-1]['loss']:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    seconds = time.perf_counter() - t0
    if outer is None:
        per_step = 2 * (world - 1) / world * 4 * n_params  # reduce-scatter + all-gather, fp32
        stats = {}
    else:
        per_step = outer.comm_stats.bytes_sent / args.train_iters
        stats = outer.comm_stats.as_dict()
    t = torch.tensor([train_losses[-1]], dtype=torch.float64)
    dist.all_reduce(t)
    destroy_islands()
    return dict(method=method, islands=K, curve=curve, final_loss=curve[-1]["loss"],
                last_train_loss=float(t) / world, bytes_per_inner_step=per_step,
                n_params=n_params, seconds=seconds, outer_seconds=outer_s, comm=stats)


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_muon.megatron.cpu_mode import default_backend, enable_cpu_mode

    enable_cpu_mode()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    else:
        torch.set_num_threads(args.threads)  # never from the environment: see --threads
    dist.init_process_group(backend=default_backend(), timeout=datetime.timedelta(minutes=10))
    world = dist.get_world_size()
    args.global_batch_size = args.micro_batch_size * world
    rank0 = dist.get_rank() == 0
    train, valid = build_datasets(args)
    if rank0:
        print(f"isoloco_islands: {world} ranks, GPT {args.num_layers} x {args.hidden_size}, seq "
              f"{args.seq_length}, {args.train_iters} steps x {args.global_batch_size} x "
              f"{args.seq_length} tokens, H = {args.diloco_inner_steps}, data "
              f"{args.data_path or 'Python stdlib sources'} ({len(valid)} held-out samples)",
              flush=True)
    results = [run_method(args, m, train, valid) for m in args.methods]
    if rank0:
        report(args, results, world)
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ report
def _mb(x: float) -> str:
    return f"{x / 2**20:.3f} MiB" if x >= 2**20 / 100 else f"{x / 1024:.2f} KiB"


def report(args, results: list, world: int) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = next((r for r in results if r["method"] == "adam"), None)
    tokens = args.train_iters * args.global_batch_size * args.seq_length
    lines = [f"equal tokens: {tokens:,} ({args.train_iters} inner steps x {world} x "
             f"{args.micro_batch_size} x {args.seq_length}); {results[0]['n_params']:,} "
             f"parameters; H = {args.diloco_inner_steps}",
             "| method | layout | held-out loss | bytes sent / rank / inner step | vs AdamW "
             "| train time |",
             "|---|---|---|---|---|---|"]
    for r in results:
        name = LABELS[r["method"]]
        if r["method"] == "isoloco":
            name += f" ({args.isoloco_mode}, {args.isoloco_order})"
        layout = f"DP {world}" if r["method"] == "adam" else f"{world} islands x 1"
        ratio = f"{r['bytes_per_inner_step'] / base['bytes_per_inner_step']:.4f}x" \
            if base else "-"
        lines.append(f"| {name} | {layout} | {r['final_loss']:.4f} | "
                     f"{_mb(r['bytes_per_inner_step'])} | {ratio} | {r['seconds']:.0f} s |")
    print("\n".join(lines), flush=True)
    (out / "isoloco_islands.json").write_text(json.dumps(
        dict(args={k: v for k, v in vars(args).items() if k != "data"}, results=results,
             table=lines), indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2),
                                 gridspec_kw=dict(width_ratios=[2, 1]))
    for r in results:
        xs = [c["step"] * args.global_batch_size * args.seq_length / 1e6 for c in r["curve"]]
        ax.plot(xs, [c["loss"] for c in r["curve"]], marker="o", ms=3, label=LABELS[r["method"]])
    ax.set_xlabel("tokens (millions, all ranks)")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"{world} ranks / islands, H = {args.diloco_inner_steps}")
    ax.grid(alpha=0.3)
    ax.legend()
    bx.bar([LABELS[r["method"]] for r in results],
           [r["bytes_per_inner_step"] for r in results], color=["C0", "C1", "C2"][:len(results)])
    bx.set_yscale("log")
    bx.set_ylabel("bytes sent per rank per inner step")
    bx.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(out / "isoloco_islands.png", dpi=120)
    print(f"wrote {out / 'isoloco_islands.png'} and {out / 'isoloco_islands.json'}", flush=True)


# ============================================================================ launching
def launch_local(args, argv) -> int:
    """Start --nproc ranks of this script (rank 0 prints to the terminal); never hangs."""
    from megatron_muon.distributed.launch import start_ranks, supervise

    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    logs = [None] + [Path(args.out_dir) / f"isoloco_islands.rank{r}.log"
                     for r in range(1, args.nproc)]
    procs = start_ranks([sys.executable, os.path.abspath(__file__), *argv], args.nproc,
                        threads=args.threads, env={"OMP_NUM_THREADS": str(args.threads)},
                        logs=logs)
    code, rank = supervise(procs, args.timeout)  # prints why it stopped early
    if code == 0:
        print(f"wall time {time.perf_counter() - T_LAUNCH:.0f} s", flush=True)
    elif rank is not None and logs[rank]:  # rank 0 prints to the terminal
        print(f"rank {rank}'s output: {logs[rank]}", file=sys.stderr)
    return code


def main(argv=None) -> int:
    import warnings

    argv = sys.argv[1:] if argv is None else argv
    args = get_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        warnings.filterwarnings("ignore")  # Megatron's CPU-mode notices (no TE / apex)
        rank_main(args)
        return 0
    return launch_local(args, argv)


if __name__ == "__main__":
    sys.exit(main())
