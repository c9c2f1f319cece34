"""Optimizer-step benchmark: AdamW vs muon_naive vs dmuon (vs Megatron-Core's own Muon).

One command, one run, the same model for every optimizer:

    python tools/bench_optimizer.py --nproc 4 --tp 1          # DP4
    python tools/bench_optimizer.py --nproc 4 --tp 2          # TP2 x DP2

For each optimizer it builds the tiny-but-not-trivial GPT, runs warm-up steps, then times
``optimizer.step()`` (barrier before and after, so the slowest rank counts; DMuon runs with
``dmuon_overlap=False`` so that all of its work is inside the step, see
``tools/bench_overlap.py`` for the overlap) and reports bytes sent/received per rank in the
Muon exchange, Muon state bytes per rank and memory per rank (param and grad buffers with
their padding, optimizer state incl. fp32 main params).  ``dmuon_matrix`` is DMuon with
MatrixFSDP placement (ZeRO-1: ``dmuon_placement='matrix'`` in matrix-placed DDP buffers);
``dmuon_zero3`` the same placement under ZeRO-3 (``dmuon_zero3=True``: a rank stores only
the parameters and gradients it owns; buckets of ``--zero3-bucket-size`` elements are
gathered for forward and backward, so its cost shows in the fwd+bwd column).
Megatron-Core's layer-wise distributed Muon (``optimizer='muon'``) is included when the
installed megatron-core has it and ``emerging_optimizers`` imports; otherwise the table
says why it is missing.  CPU numbers are ratios from one run, not absolute claims.
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
import typing  # noqa: E402

import torch  # noqa: E402

if not hasattr(typing, "override"):
    try:
        import typing_extensions

        typing.override = typing_extensions.override
    except ImportError:
        pass


def _mcore_muon_config(base: dict, tp_mode: str):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="muon", use_layer_wise_distributed_optimizer=True,
                           use_distributed_optimizer=False, muon_tp_mode=tp_mode,
                           muon_momentum=0.95, muon_num_ns_steps=base["ns_steps"],
                           muon_fp32_matmul_prec=base["prec"], muon_coefficient_type="quintic",
                           lr=1e-3, weight_decay=0.01, bf16=False)


def _fp32_layer_wise_workaround(optim, config):
    """megatron-core 0.19.2 wraps the layer-wise optimizer's torch optimizers only for bf16;
    in fp32 they stay raw and ``step()`` fails. Wrap them in FP32Optimizer."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    stack = [optim]
    while stack:
        o = stack.pop()
        subs = getattr(o, "chained_optimizers", None)
        if subs is None:
            continue
        if getattr(o, "config", None) is None:
            o.config = config
        for i, sub in enumerate(subs):
            if isinstance(sub, torch.optim.Optimizer) and not isinstance(sub, MegatronOptimizer):
                subs[i] = FP32Optimizer(sub, config, None)
            else:
                stack.append(sub)
    return optim


def worker(cfg: dict, tp: int, optimizers: list, steps: int, warmup: int, prec: str,
           ns_steps: int, zero3_bucket_size: int = 1_000_000) -> dict:
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_muon.megatron.factory import get_megatron_optimizer
    from megatron_muon.testing.gpt import TinyGPTConfig, build_gpt, init_parallel, layout_ranks, train_step
    from megatron_muon.testing.workers import make_optimizer_config

    gcfg = TinyGPTConfig(**cfg)
    out = {}
    for name in optimizers:
        init_parallel(tp=tp, pp=1, seed=gcfg.seed)
        try:
            if name.startswith("mcore_muon"):
                from megatron.core.optimizer import get_megatron_optimizer as mcore_get

                ocfg = _mcore_muon_config(dict(ns_steps=ns_steps, prec=prec),
                                          "duplicated" if name.endswith("duplicated") else "blockwise")
                model = build_gpt(gcfg, ddp_config=DistributedDataParallelConfig(
                    use_distributed_optimizer=False))
                optim = _fp32_layer_wise_workaround(mcore_get(ocfg, model), ocfg)
            else:
                zero3 = name == "dmuon_zero3"
                matrix = zero3 or name == "dmuon_matrix"
                ocfg = make_optimizer_config("dmuon" if matrix else name, lr=1e-3,
                                             muon_fp32_matmul_prec=prec, muon_num_ns_steps=ns_steps,
                                             dmuon_log_plan=False, dmuon_overlap=False,
                                             dmuon_placement="matrix" if matrix else "dmuon",
                                             dmuon_zero3=zero3)
                placement = None
                if matrix:
                    from megatron_muon.megatron.matrix_placement import matrix_placement_for

                    placement = matrix_placement_for(ocfg, log=False)
                ddp = dict(overlap_grad_reduce=True, bucket_size=zero3_bucket_size) if zero3 else {}
                model = build_gpt(gcfg, ddp_config=DistributedDataParallelConfig(
                    use_distributed_optimizer=True, grad_reduce_in_fp32=True, **ddp),
                    placement=placement)
                optim = get_megatron_optimizer(ocfg, model)
        except Exception as e:  # reported in the table, not hidden
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
            continue
        lr = layout_ranks()
        times, fb_times = [], []
        try:
            for step in range(warmup + steps):
                dist.barrier()
                t0 = time.perf_counter()
                train_step(model, None, gcfg, step, lr["dp"], lr["dp_size"])  # grads only
                dist.barrier()
                t1 = time.perf_counter()
                optim.step()
                dist.barrier()
                if step >= warmup:
                    times.append(time.perf_counter() - t1)
                    fb_times.append(t1 - t0)
        except RuntimeError as e:  # e.g. gloo has no uneven all_gather
            out[name] = {"error": f"step failed: {str(e).splitlines()[0][:120]}"}
            continue
        rec = {"step_s": statistics.median(times), "fwd_bwd_s": statistics.median(fb_times),
               "memory": _memory_per_rank(model, optim)}
        for sub in getattr(optim, "chained_optimizers", [optim]):
            if hasattr(sub, "dmuon_stats"):
                st = sub.dmuon_stats()
                per = warmup + steps
                rec.update(sent=st["comm"]["bytes_sent"] / per,
                           received=st["comm"]["bytes_received"] / per,
                           state=st["state_bytes"], muon_bytes=4 * st["muon_numel"],
                           imbalance=st["plan_imbalance"], bookkeeping=st["index_bytes"])
        out[name] = rec
        del optim, model
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
    p.add_argument("--optimizers", default="adam,muon_naive,dmuon,dmuon_matrix,dmuon_zero3,"
                                            "mcore_muon_duplicated,mcore_muon_blockwise")
    p.add_argument("--zero3-bucket-size", type=int, default=1_000_000,
                   help="DDP bucket size (elements) of the dmuon_zero3 row: its gather unit")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)

    from megatron_muon.testing.launch import run_ranks

    cfg = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
               num_attention_heads=a.num_attention_heads, num_query_groups=None, vocab_size=256,
               seq_length=32, micro_batch_size=2, num_microbatches=1)
    opts = [o for o in a.optimizers.split(",") if o]
    t0 = time.time()
    res = run_ranks("tools.bench_optimizer:worker", a.nproc,
                    dict(cfg=cfg, tp=a.tp, optimizers=opts, steps=a.steps, warmup=a.warmup,
                         prec=a.muon_fp32_matmul_prec, ns_steps=a.ns_steps,
                         zero3_bucket_size=a.zero3_bucket_size),
                    timeout=3000, env={"PYTHONPATH": os.getcwd()})
    dp = a.nproc // a.tp
    print(f"# optimizer-step benchmark: {a.nproc} ranks (TP{a.tp} x DP{dp}), {a.num_layers} layers, "
          f"hidden {a.hidden_size}, ffn {a.ffn_hidden_size}, NS {a.ns_steps} steps "
          f"({a.muon_fp32_matmul_prec}), median of {a.steps} steps; wall {time.time() - t0:.0f}s")
    print(f"# command: python tools/bench_optimizer.py {' '.join(argv or sys.argv[1:])}")
    def slowest(name):
        if name not in res[0] or "error" in res[0][name]:
            return None
        return max(r[name]["step_s"] for r in res)

    base, naive = slowest("dmuon"), slowest("muon_naive")
    base_mem = None
    if base is not None:
        base_mem = max(sum(r["dmuon"]["memory"][k] for k in ("params", "grads", "state"))
                       for r in res)
    print(f"{'optimizer':24s} {'step ms':>9s} {'vs dmuon':>9s} {'naive/x':>8s} {'fwd+bwd ms':>11s} "
          f"{'sent KiB/r':>11s} {'recv KiB/r':>11s} {'state KiB/r':>12s} "
          f"{'mem: params':>12s} {'grads':>8s} {'opt state':>10s} {'total':>8s} {'vs dmuon':>9s} "
          f"{'transient':>10s} KiB/rank (max)")
    for name in opts:
        r0 = res[0].get(name, {})
        if "error" in r0:
            print(f"{name:24s} unavailable: {r0['error']}")
            continue
        step = max(r[name]["step_s"] for r in res)
        fb = max(r[name]["fwd_bwd_s"] for r in res)
        sent = max(r[name].get("sent", 0) for r in res) / 1024
        recv = max(r[name].get("received", 0) for r in res) / 1024
        state = max(r[name].get("state", 0) for r in res) / 1024
        rel = f"{step / base:8.2f}x" if base else "      -"
        nv = f"{naive / step:7.2f}x" if naive else "     -"
        mem = {k: max(r[name]["memory"][k] for r in res) / 1024
               for k in ("params", "grads", "state", "transient")}
        total = max(sum(r[name]["memory"][k] for k in ("params", "grads", "state")) for r in res)
        mrel = f"{total / base_mem:8.2f}x" if base_mem else "      -"
        print(f"{name:24s} {1e3 * step:9.1f} {rel:>9s} {nv:>8s} {1e3 * fb:11.1f} {sent:11.1f} "
              f"{recv:11.1f} {state:12.1f} {mem['params']:12.0f} {mem['grads']:8.0f} "
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
