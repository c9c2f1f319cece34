"""Overlap benchmark: exposed optimizer time per pipeline stage and step time.

One command, one run:

    python tools/bench_overlap.py                      # PP2, DP2 and PP2xDP2
    python tools/bench_overlap.py --layouts pp2 --steps 8 --trace-dir /tmp/overlap_trace

For every layout it launches the ranks once per variant and trains the same GPT with AdamW,
DMuon with the overlap off (``dmuon_overlap='off'``), with the default policy (``'auto'``:
adaptive with PP, off without) and with it forced on (``'on'``: speculate every step);
Megatron's ``overlap_grad_reduce`` is on for all.  ``--clip-grad`` sets Megatron's
``clip_grad`` (0: no clipping; a small value clips in most steps, so the speculation is
redone and ``auto`` backs off).  Each rank records a timeline
(``megatron_muon.distributed.trace``); per step it reports

* exposed optimizer time of a stage: from the end of the stage's last backward
  microbatch to the end of its ``optimizer.step()`` (the slowest rank of the stage),
* DMuon work after the flush: per stage, the time its DMuon spans (gather, NS, scatter,
  speculative momentum, deferred update) run after the *whole pipeline's* last backward
  microbatch, i.e. the DMuon work the cool-down did not absorb,
* step time: from the barrier that starts the step to the end of the slowest rank's
  ``optimizer.step()``,

as medians over the timed steps, with ratios to AdamW and to DMuon without overlap.
The traces of the last layout (one JSON per rank and variant) open in Perfetto.

On CPU, compute cannot hide compute (all ranks share the cores); what the overlap can
hide here is idle time: the pipeline cool-down (a later stage finishes its backward while
earlier stages still run theirs) and gloo transfers, which run on gloo's own threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = {"pp2": (2, 2), "dp2": (1, 2), "pp2dp2": (2, 4)}  # pp, world
VARIANTS = {
    "adamw": ("adam", {}),
    "dmuon": ("dmuon", {"dmuon_overlap": "off"}),
    "dmuon+auto": ("dmuon", {"dmuon_overlap": "auto"}),
    "dmuon+overlap": ("dmuon", {"dmuon_overlap": "on"}),
}


def worker(cfg: dict, pp: int, variants: list, steps: int, warmup: int, bucket_size: int,
           trace_dir: str, clip_grad: float = 0.0) -> dict:
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_muon.distributed import trace
    from megatron_muon.megatron.factory import get_megatron_optimizer
    from megatron_muon.megatron.tracing import enable_tracing
    from megatron_muon.testing.gpt import TinyGPTConfig, build_gpt, init_parallel, layout_ranks, train_step
    from megatron_muon.testing.workers import make_optimizer_config

    gcfg = TinyGPTConfig(**cfg)
    out = {}
    for name in variants:
        opt_name, extra = VARIANTS[name]
        init_parallel(pp=pp, seed=gcfg.seed)
        model = build_gpt(gcfg, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=True,
            bucket_size=bucket_size))
        ocfg = make_optimizer_config(opt_name, lr=1e-3, muon_fp32_matmul_prec="highest",
                                     dmuon_log_plan=False, clip_grad=clip_grad, **extra)
        optim = get_megatron_optimizer(ocfg, model)
        trace.stop()
        tl = enable_tracing(model, optim, label=f"{name} rank {dist.get_rank()}")
        lr = layout_ranks()
        rows = []
        for step in range(warmup + steps):
            dist.barrier()
            tl.clear() if step == warmup else None
            t0 = tl.now_us()
            train_step(model, optim, gcfg, step, lr["dp"], lr["dp_size"])
            t1 = tl.now_us()
            if step < warmup:
                continue
            bwd = [e for e in tl.events("backward") if e["ts"] >= t0]
            last_bwd = max(e["ts"] + e["dur"] for e in bwd)
            opt_end = max(e["ts"] + e["dur"] for e in tl.events("optimizer.step") if e["ts"] >= t0)
            # DMuon spans that are not nested in another DMuon span (absolute microseconds)
            work = [(e["ts"], e["ts"] + e["dur"]) for e in tl.events()
                    if e["name"].startswith("dmuon.") and e["ts"] >= t0]
            work = [w for w in work if not any(o != w and o[0] <= w[0] and w[1] <= o[1]
                                                for o in work)]
            base = tl.t0 * 1e6  # perf_counter is one clock for every process on a machine
            rows.append(dict(step_us=t1 - t0, exposed_us=opt_end - last_bwd,
                             last_bwd_abs=base + last_bwd, end_abs=base + opt_end,
                             work_abs=[(base + a, base + b) for a, b in work]))
        tl.save(os.path.join(trace_dir, f"{name}_rank{dist.get_rank()}.json"))
        trace.stop()
        out[name] = dict(rows=rows, stage=lr["pp"], overlap=None)
        for sub in getattr(optim, "chained_optimizers", [optim]):
            if hasattr(sub, "dmuon_stats") and sub.dmuon_stats().get("overlap"):
                out[name]["overlap"] = sub.dmuon_stats()["overlap"]
        del optim, model
    return out


def summarize(res: list, variants: list, pp: int) -> dict:
    """Per variant: median over steps of (max over ranks) step time and per-stage exposed time."""
    n = len(res[0][variants[0]]["rows"])
    table = {}
    for v in variants:
        step = statistics.median(max(r[v]["rows"][i]["step_us"] for r in res) for i in range(n))
        exposed, after = [], []
        flush = [max(r[v]["rows"][i]["last_bwd_abs"] for r in res) for i in range(n)]
        for s in range(pp):
            ranks = [r for r in res if r[v]["stage"] == s]
            exposed.append(statistics.median(max(r[v]["rows"][i]["exposed_us"] for r in ranks)
                                             for i in range(n)))
            # DMuon work of this stage that runs after the whole pipeline's last backward
            after.append(statistics.median(
                max(sum(max(0.0, b - max(a, flush[i])) for a, b in r[v]["rows"][i]["work_abs"])
                    for r in ranks) for i in range(n)))
        table[v] = dict(step_ms=step / 1e3, exposed_ms=[e / 1e3 for e in exposed],
                        dmuon_after_flush_ms=[a / 1e3 for a in after],
                        overlap=res[0][v]["overlap"])
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="pp2,dp2,pp2dp2",
                   help=f"comma-separated subset of {','.join(LAYOUTS)}")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--bucket-size", type=int, default=200_000,
                   help="DDP bucket size (elements); several buckets per stage")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--trace-dir", default=os.path.join("runs", "overlap_trace"),
                   help="where the per-rank traces go (Perfetto JSON)")
    p.add_argument("--clip-grad", type=float, default=0.0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    from megatron_muon.testing.launch import run_ranks

    variants = [v for v in a.variants.split(",") if v]
    layouts = [x for x in a.layouts.split(",") if x]
    for kind, names, known in (("variants", variants, VARIANTS), ("layouts", layouts, LAYOUTS)):
        if set(names) - set(known):
            p.error(f"unknown {kind} {sorted(set(names) - set(known))}; choose from "
                    f"{','.join(known)}")
    cfg = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
               num_attention_heads=a.num_attention_heads, num_query_groups=None, vocab_size=256,
               seq_length=a.seq_length, micro_batch_size=a.micro_batch_size, num_microbatches=a.num_microbatches)
    print(f"# overlap benchmark: {a.num_layers} layers, hidden {a.hidden_size}, ffn "
          f"{a.ffn_hidden_size}, seq {a.seq_length}, {a.num_microbatches} microbatches per DP "
          f"rank, bucket {a.bucket_size}, clip_grad {a.clip_grad}; median of {a.steps} steps after {a.warmup} warm-up; "
          f"os.cpu_count()={os.cpu_count()}")
    print(f"# command: python tools/bench_overlap.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"{'layout':8s} {'optimizer':14s} {'step ms':>9s} {'vs adamw':>9s} "
          f"{'exposed ms per stage':>21s} {'vs dmuon':>13s} {'dmuon ms after flush':>21s}"
          f"  overlap stats")
    everything = {}
    for layout in layouts:
        pp, world = LAYOUTS[layout]
        tdir = os.path.join(a.trace_dir, layout)
        t0 = time.time()
        # one launch per variant: a variant that follows another in the same processes
        # ran measurably slower (leftover models, groups and hooks)
        per = [run_ranks("tools.bench_overlap:worker", world,
                         dict(cfg=cfg, pp=pp, variants=[v], steps=a.steps, warmup=a.warmup,
                              bucket_size=a.bucket_size, trace_dir=tdir,
                              clip_grad=a.clip_grad),
                         timeout=3000, env={"PYTHONPATH": os.getcwd()}) for v in variants]
        res = [{k: v for r in ranks for k, v in r.items()} for ranks in zip(*per)]
        table = summarize(res, variants, pp)
        everything[layout] = table
        base = table.get("adamw", {}).get("step_ms")
        plain = table.get("dmuon", {}).get("exposed_ms")
        for v in variants:
            t = table[v]
            exp = " ".join(f"{e:7.1f}" for e in t["exposed_ms"])
            rel = f"{t['step_ms'] / base:8.2f}x" if base else "-"
            vs = " ".join(f"{e / q:5.2f}x" for e, q in zip(t["exposed_ms"], plain)) if plain else "-"
            aft = " ".join(f"{e:7.1f}" for e in t["dmuon_after_flush_ms"])
            ov = t["overlap"] or ""
            print(f"{layout:8s} {v:14s} {t['step_ms']:9.1f} {rel:>9s} {exp:>21s} {vs:>13s} "
                  f"{aft:>21s}  {ov}")
        print(f"#   {layout}: {world} ranks, wall {time.time() - t0:.0f}s, traces in {tdir}/")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(everything, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
