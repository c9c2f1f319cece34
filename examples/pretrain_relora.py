#!/usr/bin/env python3
"""ReLoRA low-rank pretraining of a Megatron-Core GPT: LoRA adapters merged and restarted.

The recipe (docs/relora.md):

1. the main job's data and model (``examples/pretrain_gpt.py``: the stdlib ``*.py`` corpus as
   bytes, Megatron's ``GPTDataset``, the same GPT sizes), randomly initialised -- or, with
   ``--load-base DIR``, the weights of a ``pretrain_gpt.py --save DIR`` checkpoint (a
   full-rank warm start, as the ReLoRA paper recommends);
2. LoRA adapters (``megatron_muon.peft.lora``) on the transformer's linears
   (``--lora-targets``); those base weights are frozen between merges, while embeddings,
   norms and the output layer are trained at full rank with AdamW (``--dense-lr``; off with
   ``--no-train-dense``);
3. the adapters' optimizer ``--optimizer smuon | adam | muon_factors | riemannion``
   (``megatron_muon.peft.lora_optimizer.LoRAOptimizer``: TP-aware, sMuon's direction work
   balanced over the TP ranks);
4. every ``--relora-every`` steps (``megatron_muon.peft.relora.ReLoRA``): merge the adapters
   into the base, re-initialise them, reset (``zero``) or prune (``prune``,
   ``--relora-prune-ratio``) their optimizer state;
5. the jagged schedule: warm-up, cosine decay, and a ``--restart-warmup-iters`` linear
   re-warm-up after every restart;
6. held-out loss on samples no step trains on (the end of the shuffled epoch), a log line
   every ``--log-interval`` steps, a summary; ``--save`` / ``--load`` / ``--exit-interval``
   resume bit for bit across merges (same layout).

Run it:

    python examples/pretrain_relora.py                         # 4 CPU ranks, TP2 x DP2, smuon
    python examples/pretrain_relora.py --optimizer adam --lr 3e-3 --relora-every 25
    python examples/pretrain_relora.py --save ck --exit-interval 120 && \\
        python examples/pretrain_relora.py --load ck --save ck    # stop at 120, resume

Bad input ends with one ``error: ...`` line and exit code 2; a non-finite loss or gradient
norm with ``error: iteration N: ...`` and exit code 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

T_LAUNCH = time.perf_counter()

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if (REPO / "megatron_muon").is_dir() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import finetune_lora  # noqa: E402  (base model build / load, batches, forward-backward)
import pretrain_gpt  # noqa: E402  (corpus, dataset, sampler order, launcher conventions)

OPTIMIZERS = ("smuon", "adam", "muon_factors", "riemannion")
DEFAULT_LR = {"smuon": 0.02, "adam": 3e-3, "muon_factors": 0.02, "riemannion": 0.02}
UsageError = pretrain_gpt.UsageError


TrainingError = pretrain_gpt.TrainingError


# =========================================================================== arguments
def get_args(argv=None) -> argparse.Namespace:
    from megatron_muon.peft.lora import DEFAULT_TARGETS
    from megatron_muon.peft.relora import RESETS

    p = pretrain_gpt._ArgumentParser(
        description="ReLoRA low-rank pretraining of a GPT (Megatron-Core) with sMuon / AdamW "
                    "/ per-factor Muon / Riemannion adapters.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=2)
    g.add_argument("--nproc", type=int, default=4,
                   help="ranks to start when launched without torchrun")
    g = p.add_argument_group("model (as examples/pretrain_gpt.py)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--load-base", default=None,
                   help="start from a pretrain_gpt.py --save checkpoint (its architecture); "
                        "with --train-iters 0 only evaluates it")
    g = p.add_argument_group("ReLoRA")
    g.add_argument("--lora-rank", type=int, default=32)
    g.add_argument("--lora-alpha", type=float, default=32.0, help="scale alpha / rank")
    g.add_argument("--lora-targets", nargs="+", default=list(DEFAULT_TARGETS))
    g.add_argument("--lora-init", choices=("kaiming", "normal"), default="kaiming")
    g.add_argument("--relora-every", type=int, default=50,
                   help="merge and restart the adapters after every this many steps")
    g.add_argument("--relora-reset", choices=RESETS, default="zero",
                   help="adapter optimizer state at a restart: zero (dropped), prune (all "
                        "but the largest entries zeroed), keep")
    g.add_argument("--relora-prune-ratio", type=float, default=0.99,
                   help="share of each state tensor zeroed by --relora-reset prune")
    g.add_argument("--restart-warmup-iters", type=int, default=10,
                   help="linear LR re-warm-up after each restart")
    g.add_argument("--train-dense", action=argparse.BooleanOptionalAction, default=True,
                   help="train embeddings, norms and the output layer at full rank (AdamW)")
    g = p.add_argument_group("training")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="smuon",
                   help="optimizer of the adapters")
    g.add_argument("--lr", type=float, default=None,
                   help="adapter peak LR; default " + ", ".join(
                       f"{k} {v:g}" for k, v in DEFAULT_LR.items()))
    g.add_argument("--dense-lr", type=float, default=3e-3,
                   help="peak LR of the full-rank AdamW part (same schedule shape)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--train-iters", type=int, default=250)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving) once the iteration is a multiple of this")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--muon-momentum", type=float, default=0.95)
    g.add_argument("--muon-extra-scale-factor", type=float, default=0.2,
                   help="spectral scale x this (sMuon, Riemannion and per-factor Muon)")
    g.add_argument("--smuon-work", choices=("distribute", "replicate"), default="distribute")
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("data, checkpoints, logging")
    g.add_argument("--data-path", default=None, help="as pretrain_gpt.py (default: stdlib)")
    g.add_argument("--data-cache-dir", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_muon"))
    g.add_argument("--eval-samples", type=int, default=128,
                   help="held-out samples (the end of the shuffled epoch: no step sees them)")
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None, help="resume a --save directory of this script")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--log-json", default=None, help="write losses, held-out curve, timings")
    args = p.parse_args(argv)
    args.lora_targets = [t for item in args.lora_targets for t in item.split(",") if t]
    return args


def check_args(args, world: int) -> None:
    from megatron_muon.peft.lora import LoRAConfig

    tp = args.tensor_model_parallel_size
    if tp < 1 or world % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} must divide the world size {world}")
    args.data_parallel_size = dp = world // tp
    args.pipeline_model_parallel_size = 1
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    args.lr_decay_iters = args.train_iters
    for name in ("seq_length", "micro_batch_size", "eval_samples", "eval_interval",
                 "log_interval", "relora_every", "num_layers", "num_attention_heads"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.train_iters < 0 or args.lr_warmup_iters < 0 or args.restart_warmup_iters < 0:
        raise UsageError("--train-iters, --lr-warmup-iters and --restart-warmup-iters must be "
                         ">= 0")
    if args.restart_warmup_iters >= args.relora_every:
        raise UsageError(f"--restart-warmup-iters ({args.restart_warmup_iters}) must be below "
                         f"--relora-every ({args.relora_every})")
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise UsageError(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"micro batch x DP = {args.micro_batch_size} x {dp}")
    for name, value, div in (("--num-attention-heads", args.num_attention_heads, tp),
                             ("--ffn-hidden-size", args.ffn_hidden_size, tp),
                             ("--hidden-size", args.hidden_size, args.num_attention_heads)):
        if value % div:
            raise UsageError(f"{name} {value} must be a multiple of {div}")
    if not (args.lr > 0 and args.dense_lr > 0 and 0 <= args.min_lr_ratio <= 1):
        raise UsageError("need --lr > 0, --dense-lr > 0 and 0 <= --min-lr-ratio <= 1")
    if not 0 <= args.relora_prune_ratio <= 1:
        raise UsageError("--relora-prune-ratio must be in [0, 1]")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise UsageError("--exit-interval must be >= 1")
    if args.save_interval is not None and (args.save is None or args.save_interval < 1):
        raise UsageError("--save-interval needs --save DIR and a value >= 1")
    if args.load and not (Path(args.load) / "latest").is_file():
        raise UsageError(f"--load {args.load}: no checkpoint of this script there")
    if args.load_base:
        try:
            finetune_lora.checkpoint_path(args.load_base)
        except UsageError as err:
            raise UsageError(str(err).replace("--load ", "--load-base ", 1)) from None
    try:
        LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets,
                   init=args.lora_init)
    except ValueError as err:
        raise UsageError(str(err)) from None
    pretrain_gpt.resolve_data(args)


# =========================================================================== model
def build(args):
    """GPT (fresh or --load-base) + LoRA + Megatron DDP, the optimizers, the ReLoRA scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_muon.megatron.models import wire_ddp_hooks
    from megatron_muon.peft.lora import LoRAConfig, apply_lora
    from megatron_muon.peft.lora_optimizer import LoRAOptimizer
    from megatron_muon.peft.relora import ReLoRA, TrainableAdamW

    if args.load_base:
        path = finetune_lora.checkpoint_path(args.load_base)
        arch = finetune_lora.architecture(args, path)
    else:
        arch = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                    ffn_hidden_size=args.ffn_hidden_size, swiglu=args.swiglu,
                    num_query_groups=args.num_attention_heads,
                    vocab=pretrain_gpt.padded_vocab_size(args))
    gpt = finetune_lora.build_base_model(args, arch)
    if args.load_base:
        finetune_lora.load_base(gpt, path)
    try:
        adapters = apply_lora(gpt, LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha,
                                              targets=args.lora_targets, init=args.lora_init,
                                              seed=args.seed))
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.train_dense:  # ReLoRA trains everything but the adapted linears at full rank
        adapted = {id(getattr(m, "weight", None)) for m in gpt.modules() if hasattr(m, "lora")}
        for p in gpt.parameters():
            if not getattr(p, "is_lora", False) and id(p) not in adapted:
                p.requires_grad_(True)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=False)
    model = [DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)]
    wire_ddp_hooks(gpt.config, model, ddp_config)
    opts = {"lora": LoRAOptimizer(model, args.optimizer, lr=args.lr,
                                  weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                                  momentum=args.muon_momentum,
                                  extra_scale_factor=args.muon_extra_scale_factor,
                                  adam_betas=(0.9, 0.95), smuon_work=args.smuon_work)}
    if args.train_dense:
        opts["dense"] = TrainableAdamW(model, lr=args.dense_lr, weight_decay=args.weight_decay,
                                       clip_grad=args.clip_grad, betas=(0.9, 0.95))
    relora = ReLoRA(model, opts["lora"], restart_every=args.relora_every,
                    reset=args.relora_reset, prune_ratio=args.relora_prune_ratio)
    return model, opts, relora, adapters, arch


def meta_of(args) -> dict:
    """What a resumed run must share with the saved one."""
    keys = ("optimizer", "tensor_model_parallel_size", "num_layers", "hidden_size",
            "ffn_hidden_size", "num_attention_heads", "seq_length", "swiglu", "lora_rank",
            "lora_alpha", "lora_targets", "lora_init", "relora_every", "relora_reset",
            "relora_prune_ratio", "train_dense", "seed", "global_batch_size", "load_base")
    return {k: getattr(args, k) for k in keys}


# =========================================================================== training
def train(args) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.cpu_mode import default_backend, enable_cpu_mode
    from megatron_muon.megatron.models import init_parallel
    from megatron_muon.peft.relora import jagged_lr, load_training_state, save_training_state

    t_start = time.perf_counter()
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
    prefix = pretrain_gpt.build_indexed_dataset(args)
    args.train_iters_data = max(args.train_iters, 1)
    saved_iters = args.train_iters
    args.train_iters = args.train_iters_data  # the dataset needs >= 1 batch
    dataset = pretrain_gpt.build_train_dataset(args, prefix)
    args.train_iters = saved_iters
    eval_start = len(dataset) - args.eval_samples
    if eval_start < args.train_iters * args.global_batch_size:
        raise UsageError(f"the corpus has {len(dataset)} samples: too few for "
                         f"{args.train_iters} x {args.global_batch_size} training samples "
                         f"and {args.eval_samples} held out")
    model, opts, relora, adapters, arch = build(args)
    dp_rank = ps.get_data_parallel_rank()
    start = 0
    if args.load:
        directory = Path(args.load) / f"iter_{int((Path(args.load) / 'latest').read_text()):07d}"
        try:
            start = load_training_state(str(directory), model, opts, relora, meta=meta_of(args))
        except ValueError as err:
            raise UsageError(str(err)) from None
    n_lora = sum(a.A.numel() + a.B.numel() for a in adapters)
    n_dense = sum(p.numel() for _, p in opts["dense"].named) if "dense" in opts else 0
    n_frozen = sum(p.numel() for p in model[0].module.parameters() if not p.requires_grad)
    say(f"pretrain_relora: {world} ranks = TP{args.tensor_model_parallel_size} x "
        f"DP{args.data_parallel_size} ({default_backend()}), adapters: {args.optimizer} lr "
        f"{args.lr:g}; full-rank part: {'AdamW lr %g' % args.dense_lr if n_dense else 'none'}")
    say(f"  model: {arch['num_layers']} layers, hidden {arch['hidden_size']}, ffn "
        f"{arch['ffn_hidden_size']}, base {args.load_base or 'random init'}; LoRA rank "
        f"{args.lora_rank}, alpha {args.lora_alpha:g} on {','.join(args.lora_targets)}")
    say(f"  parameters on rank 0: {n_lora / 1e3:.1f} K adapters, {n_dense / 1e3:.1f} K full-rank "
        f"trained, {n_frozen / 1e3:.1f} K frozen between merges; merge every "
        f"{args.relora_every} steps, state reset {args.relora_reset}, re-warm-up "
        f"{args.restart_warmup_iters}")
    say(f"  data: {len(dataset)} samples x {args.seq_length} bytes; held out: the last "
        f"{args.eval_samples}" + (f"; resumed at iteration {start} ({relora.restarts} merges "
                                 f"done)" if start else ""))

    def evaluate() -> float:
        for m in model:
            m.eval()
        with torch.no_grad():
            loss = finetune_lora.run_batches(args, model, finetune_lora.microbatches(
                dataset, args, eval_start, args.eval_samples, dp_rank), forward_only=True)
        for m in model:
            m.train()
        return loss

    log = dict(losses=[], lr=[], fwd_bwd_s=[], opt_s=[], restart_s=[], heldout=[])
    if start == 0 or args.train_iters == 0:
        log["heldout"].append((start, evaluate()))
    stop = args.train_iters
    if args.exit_interval:
        stop = min(stop, (start // args.exit_interval + 1) * args.exit_interval)
    tokens = args.global_batch_size * args.seq_length
    t_train = time.perf_counter()
    for it in range(start, stop):
        lr = jagged_lr(it, lr=args.lr, min_lr=args.lr * args.min_lr_ratio,
                       warmup=args.lr_warmup_iters, total=args.train_iters,
                       restart_every=args.relora_every, restart_warmup=args.restart_warmup_iters)
        for key, opt in opts.items():
            for group in opt.param_groups:
                group["lr"] = lr if key == "lora" else lr * args.dense_lr / args.lr
        batches = pretrain_gpt.get_microbatches(dataset, args, it, dp_rank)
        model[0].zero_grad_buffer()
        for opt in opts.values():
            opt.zero_grad()
        t0 = time.perf_counter()
        loss = finetune_lora.run_batches(args, model, batches, forward_only=False)
        t1 = time.perf_counter()
        results = [opt.step() for opt in opts.values()]
        t2 = time.perf_counter()
        if not math.isfinite(loss) or not all(ok for ok, _, _ in results):
            raise TrainingError(f"iteration {it + 1}: non-finite loss or gradient norm "
                                f"(loss {loss}); lower --lr")
        restarted = relora.due(it + 1)
        if restarted:
            relora.restart()
        t3 = time.perf_counter()
        log["losses"].append(loss)
        log["lr"].append(lr)
        log["fwd_bwd_s"].append(t1 - t0)
        log["opt_s"].append(t2 - t1)
        log["restart_s"].append(t3 - t2)
        if (it + 1) % args.eval_interval == 0 or it + 1 == args.train_iters:
            log["heldout"].append((it + 1, evaluate()))
        if (it + 1) % args.log_interval == 0 or it + 1 == stop or restarted:
            k = min(args.log_interval, len(log["losses"]))
            ms = 1e3 * (t3 - t0)
            say(f" iteration {it + 1:5d}/{args.train_iters} | loss "
                f"{sum(log['losses'][-k:]) / k:.4f} | lr {lr:.3e} | adapter grad norm "
                f"{results[0][1]:.3f} | {tokens / (t3 - t0):7.0f} tokens/s | {ms:6.1f} ms"
                + (f" | merge #{relora.restarts} ({1e3 * (t3 - t2):.1f} ms)" if restarted else "")
                + (f" | held-out {log['heldout'][-1][1]:.4f}"
                   if log["heldout"] and log["heldout"][-1][0] == it + 1 else ""))
        if args.save and ((args.save_interval and (it + 1) % args.save_interval == 0)
                          or it + 1 == stop):
            directory = Path(args.save) / f"iter_{it + 1:07d}"
            save_training_state(str(directory), model, opts, relora, it + 1, meta=meta_of(args))
            if rank == 0:
                (Path(args.save) / "latest").write_text(str(it + 1))
            say(f" saved {directory}")
    t_end = time.perf_counter()
    if rank == 0:
        summary(args, log, start, stop, t_train, t_end, t_start, relora.restarts)
    dist.barrier()
    dist.destroy_process_group()


def summary(args, log, start, stop, t_train, t_end, t_start, restarts) -> None:
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    s = dict(optimizer=args.optimizer, lr=args.lr, dense_lr=args.dense_lr,
             lora_rank=args.lora_rank, relora_every=args.relora_every,
             reset=args.relora_reset, seed=args.seed, iterations=[start, stop],
             first_loss=log["losses"][0] if log["losses"] else None,
             last_loss=(sum(log["losses"][-10:]) / len(log["losses"][-10:])
                        if log["losses"] else None),
             heldout=log["heldout"], final_heldout=log["heldout"][-1][1] if log["heldout"]
             else None, merges=restarts, train_s=t_end - t_train, total_s=t_end - t_start,
             fwd_bwd_ms=1e3 * med(log["fwd_bwd_s"]), opt_ms=1e3 * med(log["opt_s"]),
             opt_total_s=sum(log["opt_s"]), restart_total_s=sum(log["restart_s"]))
    print("=" * 78)
    if log["losses"]:
        print(f"  loss           {s['first_loss']:.4f} -> {s['last_loss']:.4f} (mean of the last "
              f"10 steps), iterations {start} -> {stop}, {restarts} merges")
    if s["final_heldout"] is not None:
        print(f"  held-out loss  {s['final_heldout']:.4f} at iteration {log['heldout'][-1][0]}")
    print(f"  step time      forward-backward {s['fwd_bwd_ms']:.1f} ms + optimizer "
          f"{s['opt_ms']:.1f} ms (medians, rank 0); merges {1e3 * s['restart_total_s']:.0f} ms "
          f"in all")
    print(f"  total time     {s['total_s']:.1f} s (training {s['train_s']:.1f} s)")
    print("=" * 78, flush=True)
    if args.log_json:
        Path(args.log_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.log_json, "w") as fh:
            json.dump(dict(summary=s, **log), fh)


# =========================================================================== launching
def launch_local(args, argv: list[str]) -> int:
    from megatron_muon.distributed.launch import start_ranks, supervise

    check_args(args, args.nproc)  # fail fast, before any process starts
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    procs = start_ranks([sys.executable, os.path.abspath(__file__), *argv], args.nproc,
                        threads=threads)
    code, _ = supervise(procs)
    if code == 0:
        print(f"wall time {time.perf_counter() - T_LAUNCH:.1f} s ({args.nproc} ranks)",
              flush=True)
    return code


def main(argv=None) -> int:
    return pretrain_gpt.run_cli(argv, get_args, train, launch_local, check=_check_nproc)


def _check_nproc(args, under_launcher: bool) -> None:
    if args.nproc < 1:
        raise UsageError("--nproc must be >= 1")


if __name__ == "__main__":
    pretrain_gpt.exit_with(main())
