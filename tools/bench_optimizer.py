"""Optimizer-step benchmark: AdamW vs muon_naive vs dmuon (vs Megatron-Core's own Muon).

One command, one run, the same model for every optimizer:

    python tools/bench_optimizer.py --nproc 4 --tp 1          # DP4
    python tools/bench_optimizer.py --nproc 4 --tp 2          # TP2 x DP2

It builds every variant on the same GPT first, then runs their training steps interleaved
(step s of every variant, then step s+1), so that load changes hit all rows alike, and
prints per variant the total step (forward+backward+optimizer step) and the optimizer step
alone: the median over the timed steps of each rank, then the slowest rank (barriers before
and after each phase).  Variants:

* ``adam``: Megatron's AdamW distributed optimizer;
* ``mcore_muon_blockwise`` / ``mcore_muon_duplicated``: Megatron-Core's own Muon on its
  layer-wise distributed optimizer (``optimizer='muon'``, megatron-core >= 0.19 with
  ``emerging_optimizers``), in its default inexact ``blockwise`` TP mode and its exact
  ``duplicated`` mode; when it is not importable its rows are skipped with the reason;
* ``dmuon``: DMuon with its defaults (``dmuon_overlap='auto'``); ``dmuon_noov``: overlap
  off, so that all of its work is inside the step; ``muon_naive``: every rank gathers and
  orthogonalises every matrix;
* ``dmuon_matrix``: MatrixFSDP placement (``dmuon_placement='matrix'``, overlap off);
  ``dmuon_zero3`` the same placement under ZeRO-3 (``dmuon_zero3=True``: buckets of
  ``--zero3-bucket-size`` elements are gathered for forward and backward, so its cost shows
  in the total); ``recon_zero3``: the reconstruction baseline, ZeRO-3 on Megatron's even
  shards (every rank stores a 1/DP slice of every bucket, the same buckets) with
  ``muon_naive``'s step (every rank gathers every matrix, orthogonalises it, keeps its
  slice).  ZeRO-3 prefetches the next bucket's gather during forward and backward (the
  default); ``dmuon_zero3_sync`` / ``recon_zero3_sync`` turn that off
  (``dmuon_zero3_prefetch=False``).  For the ZeRO-3 rows ``fwd+bwd KiB/r`` is what a rank
  sends in their bucket gathers and gradient reduce-scatters per step (a ring collective
  over W ranks sends (W - 1) / W of the bucket).

A second table gives bytes sent/received per rank in the Muon exchange, Muon state bytes and
memory per rank (param and grad buffers with their padding, optimizer state incl. fp32 main
params).  ``--profile VARIANT`` prints torch.profiler's table of that variant's last
optimizer step on rank 0.  ``--clip-grad`` is Megatron's ``clip_grad`` (default 1.0: clips
in most early steps; 0: off).  CPU numbers are ratios from one run, not absolute claims.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Megatron-Core 0.19's Muon needs emerging_optimizers, whose code uses typing.override
# (Python 3.12); on 3.11 alias it before Megatron imports it (benchmark only).
import torch  # noqa: E402

from megatron_muon.megatron.cpu_run import alias_typing_override  # noqa: E402

alias_typing_override()


def _mcore_muon_config(base: dict, tp_mode: str):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="muon", use_layer_wise_distributed_optimizer=True,
                           use_distributed_optimizer=False, muon_tp_mode=tp_mode,
                           muon_momentum=0.95, muon_num_ns_steps=base["ns_steps"],
                           muon_fp32_matmul_prec=base["prec"], muon_coefficient_type="quintic",
                           lr=1e-3, weight_decay=0.01, bf16=False, adam_beta1=0.9,
                           adam_beta2=0.95, adam_eps=1e-8,
                           clip_grad=base["clip_grad"])


from megatron_muon.testing.workers import BENCH_VARIANTS  # noqa: E402

VARIANTS = (*BENCH_VARIANTS, "mcore_muon_duplicated", "mcore_muon_blockwise")


def _build(name: str, gcfg, prec: str, ns_steps: int, clip_grad: float, zero3_bucket_size: int):
    """(model, optimizer) of one variant; raises ImportError etc. when it cannot be built."""
    from megatron_muon.testing.workers import build_bench_variant

    torch.manual_seed(gcfg.seed)
    if name.startswith("mcore_muon"):
        from megatron_muon.testing.peers import build_mcore_muon

        ocfg = _mcore_muon_config(dict(ns_steps=ns_steps, prec=prec, clip_grad=clip_grad),
                                  "duplicated" if name.endswith("duplicated") else "blockwise")
        return build_mcore_muon(gcfg, ocfg)
    # 'dmuon' keeps the default overlap policy ('auto'); every other DMuon row has it off so
    # that all of its work is inside optimizer.step()
    overlap = {} if name == "dmuon" else dict(dmuon_overlap=False)
    return build_bench_variant(name, gcfg, zero3_bucket_size, lr=1e-3,
                               muon_fp32_matmul_prec=prec, muon_num_ns_steps=ns_steps,
                               clip_grad=clip_grad, **overlap)


def worker(cfg: dict, tp: int, optimizers: list, steps: int, warmup: int, prec: str,
           ns_steps: int, zero3_bucket_size: int = 1_000_000, clip_grad: float = 1.0,
           profile: str = "") -> dict:
    """Builds every variant first, then times their steps interleaved (step s of every
    variant before step s+1 of any), so that a change in the machine's load hits all rows."""
    import torch.distributed as dist

    from megatron_muon.testing.gpt import TinyGPTConfig, init_parallel, layout_ranks, train_step

    gcfg = TinyGPTConfig(**cfg)
    init_parallel(tp=tp, pp=1, seed=gcfg.seed)
    lr = layout_ranks()
    out, live = {}, {}
    for name in optimizers:
        try:
            live[name] = _build(name, gcfg, prec, ns_steps, clip_grad, zero3_bucket_size)
        except Exception as e:  # reported in the table, not hidden
            out[name] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"}
            if os.environ.get("BENCH_TRACEBACK"):  # debugging: where it failed
                import traceback

                out[name]["error"] += "\n" + traceback.format_exc()[-3000:]
    times = {n: ([], [], []) for n in live}
    from megatron_muon.megatron.zero3 import zero3s

    def zero3_sent(model) -> int:  # bytes this rank sent in ZeRO-3's gathers / reductions
        return sum(z.stats["gather_bytes"] + z.stats["reduce_bytes"] for z in zero3s(model))

    sent_before = {n: zero3_sent(m) for n, (m, _) in live.items()}
    for step in range(warmup + steps):
        for name in list(live):
            model, optim = live[name]
            prof = None
            if profile == name and step == warmup + steps - 1 and dist.get_rank() == 0:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                              record_shapes=False)
            try:
                dist.barrier()
                t0 = time.perf_counter()
                train_step(model, None, gcfg, step, lr["dp"], lr["dp_size"])  # grads only
                dist.barrier()
                t1 = time.perf_counter()
                c1 = time.process_time()
                if prof is not None:
                    with prof:
                        optim.step()
                else:
                    optim.step()
                c2 = time.process_time()  # this process's CPU (all threads) in the step
                dist.barrier()
                t2 = time.perf_counter()
            except RuntimeError as e:  # e.g. gloo has no uneven all_gather
                out[name] = {"error": f"step failed: {str(e).splitlines()[0][:120]}"}
                del live[name]
                continue
            if prof is not None:
                out["_profile"] = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                            row_limit=25)
            if step >= warmup:
                times[name][0].append(t2 - t1)
                times[name][1].append(t1 - t0)
                times[name][2].append(c2 - c1)
    for name, (model, optim) in live.items():
        st, fb, cpu = times[name]
        rec = {"step_s": statistics.median(st), "fwd_bwd_s": statistics.median(fb),
               "step_cpu_s": statistics.median(cpu),
               "total_s": statistics.median(a + b for a, b in zip(st, fb)),
               # every timed step, in order (tools/bench_scaling.py takes its own statistics)
               "step_list": st, "fwd_bwd_list": fb, "step_cpu_list": cpu,
               "memory": _memory_per_rank(model, optim),
               "fwd_bwd_sent": (zero3_sent(model) - sent_before[name]) / (warmup + steps)}
        for sub in getattr(optim, "chained_optimizers", [optim]):
            if hasattr(sub, "dmuon_stats"):
                s = sub.dmuon_stats()
                per = warmup + steps
                rec.update(sent=s["comm"]["bytes_sent"] / per,
                           received=s["comm"]["bytes_received"] / per,
                           state=s["state_bytes"], muon_bytes=4 * s["muon_numel"],
                           imbalance=s["plan_imbalance"], bookkeeping=s["index_bytes"],
                           overlap=s["overlap"])
        out[name] = rec
    return out


def _memory_per_rank(model, optim) -> dict:
    """Bytes this rank holds between steps: param and grad buffers (incl. padding) or, under
    ZeRO-3, its owned shards (+ the largest gathered bucket, transient); optimizer state.
    ``even_*``: the model's param / grad bytes over the DP size (ideal even sharding)."""
    from megatron.core import parallel_state

    from megatron_muon.megatron.zero3 import zero3_memory

    state = 0
    for sub in getattr(optim, "chained_optimizers", [optim]):
        inner = getattr(sub, "optimizer", None)
        for st in getattr(inner, "state", {}).values():
            state += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
        for g in getattr(inner, "param_groups", []):  # fp32 main-param shards
            state += sum(p.numel() * 4 for p in g["params"])
    dp = parallel_state.get_data_parallel_world_size()
    z3 = zero3_memory(model)
    if z3 is not None:
        return dict(params=z3["params"], grads=z3["grads"], state=state,
                    transient=z3["largest_bucket"], even_params=z3["model_params"] / dp,
                    even_grads=z3["model_grads"] / dp)
    params = grads = 0
    for chunk in model:
        for buf in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            if buf.param_data is not None:
                params += buf.param_data.numel() * buf.param_data.element_size()
            grads += buf.grad_data.numel() * buf.grad_data.element_size()
    return dict(params=params, grads=grads, state=state, transient=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--ffn-hidden-size", type=int, default=1536)
    p.add_argument("--num-attention-heads", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--muon-fp32-matmul-prec", default="highest", choices=["highest", "high", "medium"])
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--clip-grad", type=float, default=1.0,
                   help="Megatron's clip_grad for every variant (0: no clipping)")
    p.add_argument("--optimizers", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--profile", default="",
                   help="torch.profiler table of this variant's last optimizer step (rank 0)")
    p.add_argument("--zero3-bucket-size", type=int, default=1_000_000,
                   help="DDP bucket size (elements) of the dmuon_zero3 row: its gather unit")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--plot", default=None,
                   help="also draw each variant's step (forward+backward, optimizer step; "
                        "slowest rank) as stacked bars into this PNG")
    a = p.parse_args(argv)

    from megatron_muon.testing.launch import run_ranks

    cfg = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
               num_attention_heads=a.num_attention_heads, num_query_groups=None, vocab_size=256,
               seq_length=a.seq_length, micro_batch_size=2, num_microbatches=1)
    opts = [o for o in a.optimizers.split(",") if o]
    t0 = time.time()
    res = run_ranks("tools.bench_optimizer:worker", a.nproc,
                    dict(cfg=cfg, tp=a.tp, optimizers=opts, steps=a.steps, warmup=a.warmup,
                         prec=a.muon_fp32_matmul_prec, ns_steps=a.ns_steps,
                         zero3_bucket_size=a.zero3_bucket_size, clip_grad=a.clip_grad,
                         profile=a.profile),
                    timeout=3000, env={"PYTHONPATH": os.getcwd()})
    dp = a.nproc // a.tp
    print(f"# optimizer-step benchmark: {a.nproc} ranks (TP{a.tp} x DP{dp}), {a.num_layers} layers, "
          f"hidden {a.hidden_size}, ffn {a.ffn_hidden_size}, NS {a.ns_steps} steps "
          f"({a.muon_fp32_matmul_prec}), seq {a.seq_length}, clip_grad {a.clip_grad}, median of "
          f"{a.steps} interleaved steps (max over ranks); wall {time.time() - t0:.0f}s")
    print(f"# command: python tools/bench_optimizer.py {' '.join(argv or sys.argv[1:])}")
    def slowest(name, key="step_s"):
        if name not in res[0] or "error" in res[0][name]:
            return None
        return max(r[name][key] for r in res)

    if "_profile" in res[0]:
        print(f"# torch.profiler, {a.profile}, rank 0, last optimizer.step():\n{res[0].pop('_profile')}")
    for name in opts:
        if "error" in res[0].get(name, {}):
            print(f"# {name}: skipped: {res[0][name]['error']}")

    base, naive = slowest("dmuon"), slowest("muon_naive")
    base_mem = None
    if base is not None:
        base_mem = max(sum(r["dmuon"]["memory"][k] for k in ("params", "grads", "state"))
                       for r in res)
    lw = slowest("mcore_muon_blockwise", "total_s"), slowest("mcore_muon_blockwise")
    adam = slowest("adam", "total_s"), slowest("adam")
    print(f"{'optimizer':24s} {'total ms':>9s} {'opt ms':>8s} {'tot/lw':>7s} {'opt/lw':>7s} "
          f"{'tot/adam':>8s} {'opt/adam':>8s} {'opt cpu ms':>10s} {'overlap (spec/used/redone/dropped/skipped)':>42s}")
    for name in opts:
        r0 = res[0].get(name, {})
        if "error" in r0:
            continue
        tot, st = slowest(name, "total_s"), slowest(name)
        ov = r0.get("overlap")
        ovs = "/".join(str(ov[k]) for k in ("speculated", "used", "redone", "dropped", "skipped")) \
            if ov else "-"
        ratio = lambda x, y: f"{x / y:.2f}" if y else "-"  # noqa: E731
        cpu = sum(r[name]["step_cpu_s"] for r in res)  # CPU of all ranks: work, not waiting
        print(f"{name:24s} {1e3 * tot:9.1f} {1e3 * st:8.1f} {ratio(tot, lw[0]):>7s} "
              f"{ratio(st, lw[1]):>7s} {ratio(tot, adam[0]):>8s} {ratio(st, adam[1]):>8s} {1e3 * cpu:10.1f} {ovs:>42s}")
    print()
    print(f"{'optimizer':24s} {'step ms':>9s} {'vs dmuon':>9s} {'naive/x':>8s} {'fwd+bwd ms':>11s} "
          f"{'sent KiB/r':>11s} {'recv KiB/r':>11s} {'fwd+bwd KiB/r':>14s} {'state KiB/r':>12s} "
          f"{'mem: params':>12s} {'grads':>8s} {'opt state':>10s} {'total':>8s} {'vs dmuon':>9s} "
          f"{'transient':>10s} KiB/rank (max)")
    for name in opts:
        r0 = res[0].get(name, {})
        if "error" in r0:
            continue
        step = max(r[name]["step_s"] for r in res)
        fb = max(r[name]["fwd_bwd_s"] for r in res)
        sent = max(r[name].get("sent", 0) for r in res) / 1024
        recv = max(r[name].get("received", 0) for r in res) / 1024
        fb_sent = max(r[name].get("fwd_bwd_sent", 0) for r in res) / 1024
        state = max(r[name].get("state", 0) for r in res) / 1024
        rel = f"{step / base:8.2f}x" if base else "      -"
        nv = f"{naive / step:7.2f}x" if naive else "     -"
        mem = {k: max(r[name]["memory"][k] for r in res) / 1024
               for k in ("params", "grads", "state", "transient")}
        total = max(sum(r[name]["memory"][k] for k in ("params", "grads", "state")) for r in res)
        mrel = f"{total / base_mem:8.2f}x" if base_mem else "      -"
        print(f"{name:24s} {1e3 * step:9.1f} {rel:>9s} {nv:>8s} {1e3 * fb:11.1f} {sent:11.1f} "
              f"{recv:11.1f} {fb_sent:14.1f} {state:12.1f} {mem['params']:12.0f} {mem['grads']:8.0f} "
              f"{mem['state']:10.0f} {total / 1024:8.0f} {mrel:>9s} {mem['transient']:10.0f}")
    if "dmuon_zero3" in res[0] and "error" not in res[0]["dmuon_zero3"]:
        rows = [r["dmuon_zero3"]["memory"] for r in res]
        held = max(m["params"] + m["grads"] for m in rows)
        even = max(m["even_params"] + m["even_grads"] for m in rows)
        print(f"# ZeRO-3: params + grads stored per rank (max) {held / 1024:.0f} KiB vs even "
              f"sharding (model / DP) {even / 1024:.0f} KiB: {100 * (held / even - 1):+.1f}%; "
              f"transient = largest gathered bucket (params + grads)")
    if "dmuon" in res[0] and "muon_bytes" in res[0]["dmuon"]:
        mb = res[0]["dmuon"]["muon_bytes"]
        n = a.nproc
        print(f"# Muon matrix bytes per stage {mb / 1024:.0f} KiB; bound 2(N-1)/N^2 x that = "
              f"{2 * (n - 1) / n**2 * mb / 1024:.0f} KiB per rank per step; "
              f"dmuon plan imbalance {100 * res[0]['dmuon']['imbalance']:.1f}%")
    for name in opts:
        if "bookkeeping" in res[0].get(name, {}):
            book = max(r[name]["bookkeeping"] for r in res)
            state = max(r[name]["state"] for r in res)
            print(f"# {name}: exchange bookkeeping per rank (max) {book / 1024:.1f} KiB = "
                  f"{100 * book / max(state, 1):.2f}% of its Muon momentum bytes")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    if a.plot:
        _plot(res, [o for o in opts if "error" not in res[0].get(o, {"error": 1})], a.plot,
              f"{a.nproc} ranks (TP{a.tp} x DP{dp}), {a.num_layers} x {a.hidden_size} GPT")
    return 0


def _plot(res, names, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fb = [1e3 * max(r[n]["fwd_bwd_s"] for r in res) for n in names]
    st = [1e3 * max(r[n]["step_s"] for r in res) for n in names]
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.5))
    ax.bar(names, fb, label="forward + backward")
    ax.bar(names, st, bottom=fb, label="optimizer step")
    ax.set_ylabel("ms (median step, slowest rank)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
