"""Peak memory per rank: AdamW vs Megatron-Core's Muon vs dmuon (default, matrix, ZeRO-3).

One command; every variant runs in its own launch (its own processes), so peaks never mix:

    python tools/bench_memory.py --nproc 4 --tp 1      # DP4, GPT of ~353M parameters
    python tools/bench_memory.py --nproc 4 --tp 2      # TP2 x DP2

(On a 24 GiB machine the DP4 run at this size fits only with ``--malloc-mmap-threshold
1048576``: with glibc's default heap 4 ranks of AdamW are killed by the OOM killer.)

Per rank it measures, in phases: ``build`` (model + DDP buffers + optimizer), ``steady``
(``--steps`` training steps after the first) and ``save`` (one ``save_checkpoint``).  On CPU
a phase's peak is Linux's high-water mark of the process's resident set (``VmHWM``), reset
at the start of the phase (``/proc/self/clear_refs``); on CUDA it is
``torch.cuda.max_memory_allocated`` (reset likewise).  ``above imports`` subtracts the
resident set after importing torch and Megatron (the same for every variant), and
``B/param`` is that divided by the parameters of the rank's model replica (the model over
TP).  ``held`` is what stays allocated between steps (``held_bytes``: live tensors, so on
CPU free of what glibc keeps in its heap after a free).  ``--malloc-mmap-threshold`` fixes
glibc's mmap threshold in every rank (e.g. 1048576), so that freed large blocks go back to
the OS and CPU peaks follow live tensors more closely, as CUDA's max allocated does.  The
table prints the max over ranks and each variant's ratio to AdamW.  AdamW's state is saved
in Megatron-LM's default format (``dp_reshardable``; ``--adam-sharding-type``), DMuon's in
its own.  Each rank records its phases as it finishes them, so a variant whose save is
killed (out of memory) still reports its build and steady rows.  Megatron-Core's
own Muon (``optimizer='muon'``, layer-wise distributed) runs where the installed
megatron-core has it and ``emerging_optimizers`` imports; otherwise the row says why.

Activations are kept small (sequence 64, micro-batch 1) so that the optimizer's memory is
what differs; fp32 parameters and gradients, as Megatron's fp32 runs.  CPU numbers are from
one run, side by side; each variant in its own job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# Megatron-Core's Muon row: emerging_optimizers needs Python 3.12's typing.override; alias it
# before Megatron is imported.
from megatron_muon.megatron.cpu_run import alias_typing_override  # noqa: E402

alias_typing_override()

from megatron_muon.megatron.checkpoint import SHARDING_TYPES  # noqa: E402

VARIANTS = ("adam", "mcore_muon", "dmuon", "dmuon_matrix", "dmuon_zero3", "dmuon_zero3_sync",
            "recon_zero3", "recon_zero3_sync")


# -- per-process memory ---------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the peak RSS (VmHWM)
            fh.write("5")


def peak_bytes() -> int:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return 1024 * _status_kib("VmHWM")


def held_bytes() -> int:
    """Bytes of live tensors now: CUDA's allocated bytes, or on CPU the storages of every
    tensor the garbage collector can reach (each storage once).  Between steps that is what
    the variant holds (parameters, gradient buffers, optimizer state), free of whatever the
    C heap keeps after tensors are freed."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    import gc

    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            try:
                st = o.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without a storage
                continue
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def current_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    return 1024 * _status_kib("VmRSS")


# -- one variant, on every rank ---------------------------------------------------------------
def _record(phase_dir: str, out: dict) -> None:
    """This rank's phases so far, kept on disk: a rank killed in a later phase (the kernel's
    OOM killer, usually in the save) still reports the phases it finished."""
    import torch.distributed as dist

    path = os.path.join(phase_dir, f"rank{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(out, fh)
    os.replace(path + ".tmp", path)


def _recorded(phase_dir: str, nproc: int) -> Optional[list]:
    """Every rank's recorded phases, or None unless every rank got past the steady phase."""
    rows = []
    for r in range(nproc):
        try:
            with open(os.path.join(phase_dir, f"rank{r}.json")) as fh:
                rows.append(json.load(fh))
        except (OSError, ValueError):
            return None
    return rows if all("steady" in row for row in rows) else None


#: the ZeRO-3 variants' default DDP bucket size (elements), sized for the 353M default
ZERO3_BUCKET_SIZE = 20_000_000


def worker(cfg: dict, tp: int, variant: str, steps: int, save_dir: str,
           phase_dir: Optional[str] = None, adam_sharding: str = "dp_reshardable",
           ns_prec: Optional[str] = None, zero3_bucket_size: int = ZERO3_BUCKET_SIZE) -> dict:
    import torch.distributed as dist

    from megatron_muon.megatron.checkpoint import save_checkpoint
    from megatron_muon.testing.gpt import TinyGPTConfig, init_parallel, layout_ranks, \
        train_step
    from megatron_muon.testing.workers import build_bench_variant

    base = current_bytes()  # torch, Megatron and the package imported; nothing built yet
    gcfg = TinyGPTConfig(**cfg)
    init_parallel(tp=tp, pp=1, seed=gcfg.seed)
    reset_peak()
    if variant == "mcore_muon":
        from megatron.core.optimizer import OptimizerConfig

        from megatron_muon.testing.peers import build_mcore_muon

        ocfg = OptimizerConfig(optimizer="muon", use_layer_wise_distributed_optimizer=True,
                               use_distributed_optimizer=False, muon_tp_mode="duplicated",
                               muon_momentum=0.95, lr=1e-3, weight_decay=0.01, bf16=False)
        # the layer-wise optimizer's own DDP layout (every matrix whole in one DP shard),
        # fp32-usable, as tools/bench_optimizer.py builds it
        model, optim = build_mcore_muon(gcfg, ocfg)
    else:
        prec = {} if ns_prec is None or variant == "adam" else \
            dict(muon_fp32_matmul_prec=ns_prec)
        model, optim = build_bench_variant(variant, gcfg, zero3_bucket_size, lr=1e-3,
                                           dmuon_overlap=False, **prec)
    rank_params = sum(p.numel() for chunk in model for p in chunk.parameters())
    ranks = layout_ranks()
    # ZeRO-3 shards the parameters: count the replica's parameters, not the rank's views
    out = {"build": peak_bytes(), "base": base, "replica_params": rank_params}
    train_step(model, optim, gcfg, 0, ranks["dp"], ranks["dp_size"])  # allocates the state
    reset_peak()
    t0 = time.perf_counter()
    for step in range(1, 1 + steps):
        train_step(model, optim, gcfg, step, ranks["dp"], ranks["dp_size"])
    dist.barrier()
    out["steady"] = peak_bytes()
    out["step_s"] = (time.perf_counter() - t0) / steps
    out["held"] = held_bytes()
    if phase_dir is not None:
        _record(phase_dir, out)
    if variant == "mcore_muon":
        out["save"] = None  # saved through Megatron-LM's own checkpointing, not this path
    else:
        reset_peak()
        save_checkpoint(save_dir, model, optim, 1 + steps, optim_sharding_type=adam_sharding)
        dist.barrier()
        out["save"] = peak_bytes()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--ffn-hidden-size", type=int, default=4096)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="steady-state steps after the first")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--timeout", type=float, default=1800, help="per variant, seconds")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--adam-sharding-type", default="dp_reshardable",
                   choices=SHARDING_TYPES,
                   help="the checkpoint format of AdamW's state in the save phase (default: "
                        "Megatron-LM's, dp_reshardable; fully_reshardable gathers the state on "
                        "DP rank 0)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="CPU: set glibc's MALLOC_MMAP_THRESHOLD_ in every rank, so that blocks "
                        "of at least BYTES are mmapped and returned to the OS when freed "
                        "(glibc otherwise raises the threshold as large blocks are freed and "
                        "keeps later ones in its heap: peaks then include freed memory)")
    p.add_argument("--muon-fp32-matmul-prec", default=None,
                   choices=("highest", "high", "medium"),
                   help="the DMuon variants' Newton-Schulz precision (default: the config's, "
                        "medium = bf16; on the CPU bf16 matmuls run in oneDNN, which keeps "
                        "its kernels per problem shape, docs/memory.md)")
    p.add_argument("--zero3-bucket-size", type=int, default=ZERO3_BUCKET_SIZE, metavar="ELEMENTS",
                   help="the ZeRO-3 variants' DDP bucket size, their gather unit (default 20M "
                        "elements, sized for the 353M default; a model of a few buckets "
                        "gathers most of itself at once)")
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {','.join(VARIANTS)}")
    if a.nproc % a.tp:
        p.error(f"--tp {a.tp} does not divide --nproc {a.nproc}")

    from megatron_muon.testing.launch import RankFailure, run_ranks

    cfg = dict(num_layers=a.num_layers, hidden_size=a.hidden_size,
               ffn_hidden_size=a.ffn_hidden_size, num_attention_heads=a.num_attention_heads,
               num_query_groups=None, vocab_size=a.vocab_size, seq_length=a.seq_length,
               micro_batch_size=1, num_microbatches=1)
    env = {"PYTHONPATH": os.getcwd()}
    if a.malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.malloc_mmap_threshold)
    results, t0 = {}, time.time()
    for v in variants:
        print(f"[bench_memory] {v}: launching {a.nproc} ranks ...", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"bench_memory_{v}_") as tmp:
            phase_dir = os.path.join(tmp, "phases")
            os.makedirs(phase_dir)
            try:
                results[v] = run_ranks(
                    "tools.bench_memory:worker", a.nproc,
                    dict(cfg=cfg, tp=a.tp, variant=v, steps=a.steps,
                         save_dir=os.path.join(tmp, "ckpt"), phase_dir=phase_dir,
                         adam_sharding=a.adam_sharding_type,
                         ns_prec=a.muon_fp32_matmul_prec,
                         zero3_bucket_size=a.zero3_bucket_size),
                    timeout=a.timeout, env=env)
            except RankFailure as e:  # reported in the table, not hidden
                why = str(e).splitlines()[0][:160]
                rows = _recorded(phase_dir, a.nproc)
                if rows is None:
                    results[v] = why
                else:  # the save failed: the earlier phases stand, the save says why
                    results[v] = [dict(row, save_failed=why) for row in rows]
                    print(f"[bench_memory] {v}: the checkpoint save failed: {why}", flush=True)
        print(f"[bench_memory] {v}: done after {time.time() - t0:.0f}s", flush=True)

    dp = a.nproc // a.tp
    mib = 2.0 ** 20
    print(f"\n# peak memory per rank (max over ranks): {a.nproc} ranks (TP{a.tp} x DP{dp}), GPT "
          f"{a.num_layers} x {a.hidden_size} (ffn {a.ffn_hidden_size}, vocab {a.vocab_size}), "
          f"seq {a.seq_length}, micro-batch 1, fp32; each variant in its own job; "
          f"{'CUDA max allocated' if torch.cuda.is_available() else 'CPU peak RSS (VmHWM)'}")
    print(f"# command: python tools/bench_memory.py {' '.join(argv or sys.argv[1:])}")
    print(f"{'variant':18s} {'build MiB':>10s} {'steady MiB':>11s} {'vs AdamW':>9s} "
          f"{'above imports':>14s} {'B/param':>8s} {'save MiB':>9s} {'save/steady':>12s} "
          f"{'held MiB':>9s} {'held vs AdamW':>14s}")

    def worst(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return max(vals) if vals else None

    adam = results.get("adam")
    adam_steady = worst(adam, "steady") if isinstance(adam, list) else None
    adam_held = worst(adam, "held") if isinstance(adam, list) else None
    for v in variants:
        rows = results[v]
        if not isinstance(rows, list):
            print(f"{v:18s} unavailable: {rows}")
            continue
        steady, save, base = worst(rows, "steady"), worst(rows, "save"), worst(rows, "base")
        params = rows[0]["replica_params"]
        rel = f"{steady / adam_steady:8.3f}x" if adam_steady else "        -"
        above = steady - base
        per_param = above / params if params else float("nan")
        save_s = f"{save / mib:9.0f}" if save else "        -"
        ratio = f"{save / steady:11.3f}x" if save else "          -"
        if rows[0].get("save_failed"):
            killed = "SIGKILL" in rows[0]["save_failed"]
            save_s, ratio = f"{'killed' if killed else 'failed':>9s}", f"{'(OOM?)' if killed else '':>12s}"
        held = worst(rows, "held")
        held_rel = f"{held / adam_held:13.3f}x" if adam_held else "             -"
        print(f"{v:18s} {worst(rows, 'build') / mib:10.0f} {steady / mib:11.0f} {rel:>9s} "
              f"{above / mib:14.0f} {per_param:8.2f} {save_s} {ratio} {held / mib:9.0f} "
              f"{held_rel}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
