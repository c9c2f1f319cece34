"""Time and host memory to build the owner-centric exchange for one matrix.

    python tools/bench_exchange.py                       # the three matrices below, both builders
    python tools/bench_exchange.py --shapes 28672x8192 --tp 8 --pieces-per-shard 8

One process holds every piece of one matrix and owns its single unit (group of one: no
communication), as in the measurement that opened issue #29.  Each (matrix, builder) runs in
a fresh interpreter, so the peak resident memory it adds over its imports is its own:
``arithmetic`` is the library (``core.flat_blocks.piece_unit_blocks``), ``element-wise``
the construction it replaced (``testing.exchange_oracle``: an int64 index per element).
Prints one row per run and writes ``runs/bench_exchange.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_SHAPES = "4096x4096,14336x4096,28672x8192"


def _child(shape: tuple, tp: int, pieces: int, builder: str) -> dict:
    import torch

    from megatron_muon.core.plan import UnitTask, plan_owners
    from megatron_muon.core.units import whole_units
    from megatron_muon.distributed import owner_centric
    from megatron_muon.distributed.owner_centric import OwnerCentricNS, Piece, ShardedMatrix

    if builder == "element-wise":
        from megatron_muon.testing.exchange_oracle import oracle_blocks

        def blocks(shape, tp_dim, tp_size, tp_rank, start, end, local_offset, unit):
            piece = Piece(0, tp_rank, start, end, local_offset)
            return oracle_blocks(ShardedMatrix("m", shape, (unit,), tp_dim, tp_size, ()),
                                 piece, unit)
        owner_centric.piece_unit_blocks = blocks
    m, n = shape
    local = m * n // tp
    cuts = [local * i // pieces for i in range(pieces + 1)]
    plist, off = [], 0
    for t in range(tp):
        for lo, hi in zip(cuts, cuts[1:]):
            plist.append(Piece(0, t, lo, hi, off))
            off += hi - lo
    mat = ShardedMatrix("fc1", (m, n), tuple(whole_units((m, n))), 0 if tp > 1 else None, tp,
                        tuple(plist))
    plan = plan_owners([UnitTask(mat.unit_key(0), (m, n), 1.0)], 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    engine = OwnerCentricNS([mat], plan, None, ns_steps=5, coefficients="quintic",
                            scale_mode="spectral", extra_scale_factor=1.0,
                            ns_dtype=torch.bfloat16, device=torch.device("cpu"))
    seconds = time.perf_counter() - t0
    added = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB -> MiB
    blocks = sum(t.blocks() for t in engine.gather_tables.values()) + \
        sum(t.blocks() for t in engine.scatter_tables.values())
    return dict(shape=f"{m}x{n}", tp=tp, pieces=len(plist), builder=builder,
                seconds=seconds, peak_rss_added_mib=added, blocks=blocks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="MxN,... (default %(default)s)")
    p.add_argument("--tp", type=int, default=None,
                   help="TP shards (default: 1 for the first two shapes' 8 pieces, 8 for "
                        "70B's 64, as issue #29 measured)")
    p.add_argument("--pieces-per-shard", type=int, default=8)
    p.add_argument("--builders", default="arithmetic,element-wise")
    p.add_argument("--out", default="runs/bench_exchange.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        shape, tp, pieces, builder = json.loads(a.child)
        print(json.dumps(_child(tuple(shape), tp, pieces, builder)))
        return 0
    rows = []
    print(f"{'matrix':>12} {'TP':>3} {'pieces':>6} {'builder':>13} {'build ms':>9} "
          f"{'+peak RSS MiB':>14} {'blocks':>7}")
    for spec in a.shapes.split(","):
        m, n = (int(x) for x in spec.lower().split("x"))
        tp = a.tp if a.tp is not None else (8 if m * n >= 28672 * 8192 else 1)
        for builder in a.builders.split(","):
            arg = json.dumps([[m, n], tp, a.pieces_per_shard, builder])
            out = subprocess.run([sys.executable, __file__, "--child", arg], capture_output=True,
                                 text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(f"{r['shape']:>12} {r['tp']:>3} {r['pieces']:>6} {builder:>13} "
                  f"{1e3 * r['seconds']:>9.2f} {r['peak_rss_added_mib']:>14.1f} {r['blocks']:>7}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
