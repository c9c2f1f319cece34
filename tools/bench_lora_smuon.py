"""sMuon for TP-sharded LoRA adapters: replicate or distribute the direction work?

Two measurements, one command:

    python tools/bench_lora_smuon.py                       # both parts, CPU, TP2 (gloo)
    python tools/bench_lora_smuon.py --part direction      # part 1 only (one process)

Part 1 (one process, one thread): the time of ``smuon_direction`` for the LoRA layers of a
hidden-1024 transformer layer (qkv 3072 x 1024, proj 1024 x 1024, fc1 4096 x 1024, fc2
1024 x 4096) at ranks 8, 16, 64, next to the time of the TP all-gather that both schemes
need for the sharded factor's gradient, and of the extra all-gather of the packed
directions that distribution adds (both on 2 gloo ranks, per layer set, batched as
``LoRAOptimizer`` does).

Part 2 (a real Megatron GPT on ``--tp`` gloo ranks, hidden 1024, ffn 4096, ``--layers``
layers, LoRA on qkv/proj/fc1/fc2): per rank r, the forward-backward time of one step and
``LoRAOptimizer.step()`` for sMuon with ``smuon_work="distribute"`` and ``"replicate"`` and
for AdamW-LoRA (barriers around each phase, so the slowest rank counts), with the sMuon
step split into gradient gather, direction work and direction exchange, and the
optimizer's share of the step time.

Replicated work costs every rank the whole sum of direction times; distributed work costs
each rank 1/TP of it plus one all-gather of the directions (the gradient gather is needed by
both).  Measured on the 2-core development machine (one run, shared CPUs: ratios, not
absolute claims), per hidden-1024 layer set at r = 8 / 16 / 64:

    smuon_direction, all four layers        4.0 / 10.9 / 81.5 ms  (replicated: every rank)
    distributed at TP2: half of it          2.0 /  5.5 / 40.8 ms
      + direction all-gather (2 ranks)      1.2 /  0.8 /  3.6 ms
    gradient-shard all-gather (both)        3.9 /  1.0 /  4.0 ms  (latency-bound, noisy)

and end to end (2 layers, TP2, ``LoRAOptimizer.step``): distribute 16.0 / 22.4 / 104 ms vs
replicate 18.3 / 30.3 / 181 ms; AdamW-LoRA 7.0 / 6.4 / 18.1 ms.  The exchange is one
collective for all layers while the direction work grows with the number of layers, so
distribution wins at every LoRA size we measured and ``LoRAOptimizer`` distributes by default
(an earlier, noisier run had the r = 8 exchange at 2.8 ms, about break-even for a single layer
set; with two or more layers distribution still won).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

LAYER_SET = {  # hidden 1024, MHA, ffn 4096 (non-gated): (m, n) = (out, in)
    "qkv": (3072, 1024), "proj": (1024, 1024), "fc1": (4096, 1024), "fc2": (1024, 4096)}
SHARDED = {"qkv": "B", "proj": "A", "fc1": "B", "fc2": "A"}  # column: B rows, row: A cols


def _median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def direction_times(ranks, reps: int = 7) -> dict:
    from megatron_muon.peft.smuon import smuon_direction

    torch.set_num_threads(1)
    out = {}
    for r in ranks:
        row = {}
        for name, (m, n) in LAYER_SET.items():
            g = torch.Generator().manual_seed(m + n + r)
            A = torch.randn(r, n, generator=g) / n ** 0.5
            B = torch.randn(m, r, generator=g) * 1e-2
            gA, gB = torch.randn(r, n, generator=g), torch.randn(m, r, generator=g)
            row[name] = _median_time(lambda: smuon_direction(A, B, gA, gB, gamma=2.0), reps)
        row["layer_set"] = sum(row[k] for k in LAYER_SET)
        out[r] = row
    return out


def comm_worker(ranks, reps: int = 7) -> dict:
    """Per layer set: all-gather of the sharded-factor gradient shards (both schemes) and of
    the packed directions (distribution only), on this TP group (2 gloo ranks)."""
    import torch.distributed as dist

    tp = dist.get_world_size()
    out = {}
    for r in ranks:
        grad_numel = sum((m if SHARDED[k] == "B" else n) * r // tp
                         for k, (m, n) in LAYER_SET.items())
        dir_numel = sum(r * (m + n) for m, n in LAYER_SET.values())
        slot = (dir_numel + tp - 1) // tp  # balanced owners: each packs ~1/tp of them
        res = {}
        for key, numel in (("grad_gather", grad_numel), ("direction_exchange", slot)):
            buf = torch.randn(numel)
            parts = [torch.empty_like(buf) for _ in range(tp)]

            def go():
                dist.barrier()
                dist.all_gather(parts, buf)

            res[key] = _median_time(go, reps)
            res[key + "_MB"] = numel * 4 * tp / 1e6
        out[r] = res
    return out


def model_worker(ranks, tp: int, layers: int, seq: int, micro_batch: int, steps: int,
                 warmup: int, modes) -> dict:
    import torch.distributed as dist

    from megatron_muon.peft.lora import apply_lora
    from megatron_muon.peft.lora_optimizer import LoRAOptimizer
    from megatron_muon.testing.gpt import TinyGPTConfig, build_gpt, init_parallel, layout_ranks, \
        train_step
    from megatron_muon.testing.lora_workers import _wrap_ddp

    init_parallel(tp=tp)
    lay = layout_ranks()
    cfg = TinyGPTConfig(num_layers=layers, hidden_size=1024, ffn_hidden_size=4096,
                        num_attention_heads=8, num_query_groups=8, vocab_size=256,
                        seq_length=seq, micro_batch_size=micro_batch, num_microbatches=1)
    out = {}
    for r in ranks:
        chunks = build_gpt(cfg, wrap_ddp=False)
        apply_lora(chunks, rank=r, alpha=2.0 * r)
        model = _wrap_ddp(chunks, cfg)
        res = {}
        for mode in modes:
            kind, work = (mode.split("-") + ["distribute"])[:2]
            opt = LoRAOptimizer(model, kind, lr=1e-4, smuon_work=work, profile=True)
            fb, st, parts = [], [], []
            for s in range(warmup + steps):
                opt.zero_grad()
                dist.barrier()
                t0 = time.perf_counter()
                train_step(model, None, cfg, s, lay["dp"], lay["dp_size"])
                dist.barrier()
                t1 = time.perf_counter()
                opt.step()
                dist.barrier()
                t2 = time.perf_counter()
                if s >= warmup:
                    fb.append(t1 - t0)
                    st.append(t2 - t1)
                    parts.append(dict(opt.last_timing))
            keys = parts[0].keys()
            res[mode] = dict(fwd_bwd_s=statistics.median(fb), step_s=statistics.median(st),
                             **{k: statistics.median(p[k] for p in parts) for k in keys})
            res[mode]["share"] = res[mode]["step_s"] / (res[mode]["step_s"] + res[mode]["fwd_bwd_s"])
        out[r] = res
        del model, chunks
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "direction", "model"), default="all")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=os.path.join("runs", "bench_lora_smuon.json"))
    a = p.parse_args(argv)
    from megatron_muon.testing.launch import run_ranks

    report = {"args": vars(a)}
    if a.part in ("all", "direction"):
        report["direction"] = direction_times(a.ranks)
        report["comm"] = run_ranks("tools.bench_lora_smuon:comm_worker", a.tp,
                                   dict(ranks=a.ranks), timeout=300)[0]
        print(f"Part 1: one hidden-1024 layer set (qkv, proj, fc1, fc2), 1 thread; "
              f"comm on TP{a.tp} gloo")
        print(f"{'rank':>5} | {'smuon_direction (ms) qkv/proj/fc1/fc2':>40} | {'sum':>7} | "
              f"{'replicated':>10} | {'distributed':>11} | {'grad gather':>11} | "
              f"{'dir. exchange':>13}")
        for r in a.ranks:
            d, c = report["direction"][r], report["comm"][r]
            per = "/".join(f"{1e3 * d[k]:.2f}" for k in LAYER_SET)
            print(f"{r:>5} | {per:>40} | {1e3 * d['layer_set']:7.2f} | "
                  f"{1e3 * d['layer_set']:8.2f}ms | {1e3 * d['layer_set'] / a.tp:9.2f}ms | "
                  f"{1e3 * c['grad_gather']:8.2f}ms | {1e3 * c['direction_exchange']:10.2f}ms")
        print("  replicated = every rank computes all directions; distributed = 1/TP of them "
              "+ the exchange (the grad gather is needed by both)")
    if a.part in ("all", "model"):
        modes = ["smuon-distribute", "smuon-replicate", "adam"]
        report["model"] = run_ranks(
            "tools.bench_lora_smuon:model_worker", a.tp,
            dict(ranks=a.ranks, tp=a.tp, layers=a.layers, seq=a.seq,
                 micro_batch=a.micro_batch, steps=a.steps, warmup=a.warmup, modes=modes),
            timeout=900)[0]
        print(f"\nPart 2: Megatron GPT, {a.layers} layers, hidden 1024, ffn 4096, TP{a.tp} gloo, "
              f"LoRA on qkv/proj/fc1/fc2, micro batch {a.micro_batch} x seq {a.seq}")
        print(f"{'rank':>5} | {'optimizer':>16} | {'fwd-bwd':>8} | {'opt step':>8} | "
              f"{'share':>6} | {'gather':>7} | {'directions':>10} | {'exchange':>8}")
        for r in a.ranks:
            for mode, v in report["model"][r].items():
                g = lambda k: f"{1e3 * v[k]:6.1f}ms" if k in v else "      - "  # noqa: E731
                print(f"{r:>5} | {mode:>16} | {1e3 * v['fwd_bwd_s']:6.0f}ms | "
                      f"{1e3 * v['step_s']:6.1f}ms | {100 * v['share']:5.1f}% | "
                      f"{g('grad_gather_s')} | {g('direction_s'):>10} | {g('exchange_s')}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
