#!/usr/bin/env bash
# GPU check of the batched Newton-Schulz kernels (megatron_muon.kernels).
#
# Run from the repository root with python3 on PATH (torch, triton; megatron-core for the
# end-to-end part, Transformer Engine optional).  Budget: the whole script stops within
# GPU_CHECK_BUDGET_S seconds (default 470, < 8 minutes): each part runs under the smaller
# of its own limit and the time left (its own limits add up to 580 s on one H200; most
# parts need far less), and a part with under 10 s left is skipped and reported.  On CUDA it
#   1. checks the Triton kernels against torch at realistic sizes in fp32 and bf16,
#   2. tunes the bench shapes with NSTuner and prints its table,
#   3. measures NS throughput (TFLOP/s, % of bf16 peak) batched vs per-matrix loop
#      with tools/bench_ns.py (the bf16 hidden-1024 row has the end-to-end model's shapes),
#   4. runs the main job briefly as a GPU user gets it (examples/pretrain_gpt.py with its
#      defaults: dmuon, Megatron's GPU settings, NS precision 'medium'; TP2 x DP2 on 4+
#      GPUs, else TP1 on one), 30 iterations,
#   4b. checks LoRA on Megatron-Core's Transformer Engine layers (TE layer spec, dense and
#      grouped-expert MoE GPTs; megatron_muon/testing/lora_te_check.py): the adapted
#      forward against the merged weights, and that a backward moves only the adapters;
#      skipped with a message where Transformer Engine is not installed,
#   5. runs it end to end on one GPU with a bigger model (CUDA, bf16, the Transformer
#      Engine layer spec when it imports, 8 layers hidden 1024): AdamW, then
#      dmuon with its default overlap policy ('auto', off at PP1) and the tuner choosing
#      the NS backend, dmuon with Gram NS, dmuon with the Triton backend; it prints each
#      run's step time against AdamW's and its max memory allocated.
# Without CUDA it runs the CPU-safe parts (a tiny interpreted Triton check and a small
# CPU bench), says it skipped the GPU parts, and exits 0.
# Results: ${OUT:-/tmp}/gpu_check.txt (and the tuner cache next to it).
# Env: PYTHON (default python3), PEAK_TFLOPS (bf16 dense peak: default 989, the H200 datasheet
# figure that tools/cost_model_lib.py uses; a plain bf16 matmul reaches about 790 on one H200).

set -u
OUT_DIR="${OUT:-/tmp}"
mkdir -p "$OUT_DIR"
REPORT="$OUT_DIR/gpu_check.txt"
: > "$REPORT"
PY="${PYTHON:-python3}"
PEAK="${PEAK_TFLOPS:-989}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MEGATRON_MUON_TUNER_CACHE="$OUT_DIR/ns_tuner.json"
FAILED=0
SKIPPED=0
BUDGET="${GPU_CHECK_BUDGET_S:-470}"  # seconds for the whole script (bash's SECONDS: since start)

log() { echo "$*" | tee -a "$REPORT"; }

# step NAME SECONDS CMD...: run with a time limit (capped by what is left of the budget),
# keep the output, record failure.
step() {
    local name=$1 limit=$2 rc left
    shift 2
    left=$((BUDGET - SECONDS - 5))  # 5 s for the summary at the end
    log ""
    if [ "$left" -lt 10 ]; then
        log "== $name: skipped, the ${BUDGET}s budget is spent (${SECONDS}s so far)"
        SKIPPED=$((SKIPPED + 1))
        return 0
    fi
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    log "== $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee -a "$REPORT"
    rc=${PIPESTATUS[0]}
    log "-- $name: rc=$rc"
    if [ "$rc" -ne 0 ]; then FAILED=1; fi
}

log "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $PWD"
"$PY" - <<'EOF' 2>&1 | tee -a "$REPORT"
import importlib.util, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"cuda {torch.version.cuda}, available {torch.cuda.is_available()}")
if importlib.util.find_spec("triton"):
    import triton
    print(f"triton {triton.__version__}")
else:
    print("triton: not installed")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name(0)}")
EOF

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    HAVE_CUDA=1
else
    HAVE_CUDA=0
fi

if [ "$HAVE_CUDA" -eq 1 ]; then
    step "triton vs torch on CUDA (realistic sizes, fp32 + bf16)" 100 "$PY" - <<'EOF'
import sys, time, torch
from megatron_muon.kernels import batched_newton_schulz
from megatron_muon.core.newton_schulz import newton_schulz

torch.manual_seed(0)
rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
# (batch, m, n): the bench's Muon shapes, a tall one, and sizes that are not tile multiples
shapes = [(8, 1024, 1024), (4, 4096, 1024), (4, 1024, 4096), (2, 1000, 1500), (1, 2048, 8192)]
cases = [("float32", "simple", 1e-4), ("float32", "cubic", 1e-4),
         ("bfloat16", "simple", 3e-2), ("bfloat16", "quintic", 3e-2)]
bad = 0
print(f"fp32 matmul precision: {torch.get_float32_matmul_precision()} (triton fp32 uses "
      f"{'ieee' if torch.get_float32_matmul_precision() == 'highest' else 'tf32'})")
for dt_name, coef, tol in cases:
    dtype = getattr(torch, dt_name)
    for b, m, n in shapes:
        x = torch.randn(b, m, n, device="cuda")
        ref = newton_schulz(x, 5, coef, dtype=dtype)
        t0 = time.perf_counter()
        out = batched_newton_schulz(x, 5, coef, dtype=dtype, backend="triton")
        torch.cuda.synchronize()
        err = rel(out, ref)
        ok = err < tol and torch.isfinite(out).all().item()
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {dt_name:8s} {coef:8s} {b}x{m}x{n}: rel err {err:.2e} "
              f"(tol {tol:.0e}), first call {time.perf_counter() - t0:.2f}s")
# symmetric kernel on its own: every (also mirrored) tile written
from megatron_muon.kernels import triton_ns
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(3, 1000, 3000, device="cuda", dtype=dtype)
    a = torch.full((3, 1000, 1000), float("nan"), device="cuda", dtype=dtype)
    triton_ns.sym_gram(x, a, triton_ns.default_config(dtype, False))
    err = rel(a, torch.bmm(x, x.transpose(1, 2)))
    ok = err < (1e-4 if dtype == torch.float32 else 1e-2)
    bad += not ok
    print(f"{'ok  ' if ok else 'FAIL'} sym_gram {dtype}: rel err {err:.2e}, nan left {torch.isnan(a).sum().item()}")
sys.exit(1 if bad else 0)
EOF

    step "tuner on the bench shapes (bf16)" 60 "$PY" - <<'EOF'
import torch
from megatron_muon.kernels import NSTuner
tuner = NSTuner(warmup=2, iters=5)
for m, n, b in [(1024, 1024, 32), (1024, 4096, 16), (1024, 1024, 1), (4096, 4096, 4)]:
    tuner.choose(m, n, b, torch.bfloat16, "cuda")
for row in tuner.table():
    t = ", ".join(f"{k} {v * 1e3:.2f}ms" for k, v in sorted(row["timings"].items(), key=lambda kv: kv[1]))
    print(f"{row['m']}x{row['n']} b{row['batch']} {row['dtype']}: choice {row['choice']} | {t}")
    for k, why in row["rejected"].items():
        print(f"    rejected {k}: {why}")
print(f"cache: {tuner.cache_path}")
EOF

    step "bench bf16, 8 layers hidden 1024" 45 "$PY" tools/bench_ns.py --device cuda --dtype bf16 \
        --backends torch_batched,torch_loop,triton --peak-tflops "$PEAK"
    step "bench bf16, 4 layers hidden 4096 (bigger matrices)" 45 "$PY" tools/bench_ns.py --device cuda \
        --dtype bf16 --hidden 4096 --layers 4 --repeat 5 --backends torch_batched,torch_loop,triton \
        --peak-tflops "$PEAK"
    step "bench fp32, 8 layers hidden 1024 (% of the bf16 peak)" 35 "$PY" tools/bench_ns.py --device cuda \
        --dtype fp32 --repeat 5 --backends torch_batched,torch_loop,triton --peak-tflops "$PEAK"

    E2E="$OUT_DIR/e2e"
    mkdir -p "$E2E"
    # 4. the main job with its defaults, briefly (limit 45 s, it also builds the data cache)
    NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
    if [ "$NGPU" -ge 4 ]; then MAIN=(); else MAIN=(--nproc 1 --tensor-model-parallel-size 1); fi
    step "main job: examples/pretrain_gpt.py defaults, 30 iterations ($NGPU GPUs)" 45 "$PY" \
        examples/pretrain_gpt.py ${MAIN[@]+"${MAIN[@]}"} --train-iters 30 --log-interval 10 \
        --log-json "$E2E/main.json"

    # 4b. LoRA on the real Transformer Engine layers (skips itself, one line, without TE)
    step "LoRA on Transformer Engine layers (TE spec: dense + grouped MoE, 1 GPU, fp32)" 60 \
        "$PY" -m megatron_muon.testing.lora_te_check

    # 5. the main job end to end on one GPU; limits 45+55+45+45 s (capped by the budget)
    MODEL=(--nproc 1 --tensor-model-parallel-size 1 --bf16 --transformer-impl auto
           --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
           --micro-batch-size 4 --global-batch-size 16 --train-iters 20 --log-interval 10)
    step "e2e: AdamW (1 GPU, bf16)" 45 "$PY" examples/pretrain_gpt.py "${MODEL[@]}" \
        --optimizer adam --log-json "$E2E/adam.json"
    step "e2e: dmuon (overlap policy auto, tuner picks the NS backend)" 55 "$PY" \
        examples/pretrain_gpt.py "${MODEL[@]}" --optimizer dmuon --dmuon-plan-cost tuner \
        --log-json "$E2E/dmuon.json"
    step "e2e: dmuon, Gram NS" 45 "$PY" examples/pretrain_gpt.py "${MODEL[@]}" \
        --optimizer dmuon --muon-ns-method gram --log-json "$E2E/dmuon_gram.json"
    step "e2e: dmuon, Triton NS backend" 45 "$PY" examples/pretrain_gpt.py "${MODEL[@]}" \
        --optimizer dmuon --muon-ns-method standard --dmuon-ns-backend triton \
        --log-json "$E2E/dmuon_triton.json"
    "$PY" - "$E2E" <<'EOF' 2>&1 | tee -a "$REPORT"
import json, os, sys
names = ("main", "adam", "dmuon", "dmuon_gram", "dmuon_triton")
runs = {}
for name in names:
    path = os.path.join(sys.argv[1], name + ".json")
    if os.path.exists(path):
        runs[name] = json.load(open(path))["summary"]
base = runs.get("adam", {}).get("step_ms")
print("e2e summary (mean step after warm-up, max over ranks; NS TFLOP/s: the bf16 bench above)")
for name, s in runs.items():
    rel = f"{s['step_ms'] / base:.2f}x AdamW" if base and name != "main" else "-"
    mem = s.get("max_memory_allocated_mib")
    mem = f"{mem:.0f} MiB" if mem is not None else "n/a"
    print(f"  {name:13s} step {s['step_ms']:8.1f} ms ({rel}), optimizer {s['optimizer_ms']:7.1f} "
          f"ms, loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}, max memory allocated {mem}")
missing = [n for n in names if n not in runs]
if missing:
    print(f"  missing runs: {', '.join(missing)}")
EOF
else
    log ""
    log "== no CUDA device: skipping the GPU parts (CUDA Triton check, tuner, GPU bench," \
        "LoRA on Transformer Engine layers, end-to-end GPU run of examples/pretrain_gpt.py)"
    if "$PY" -c 'import triton' 2>/dev/null; then
        CHECK="$(mktemp "${TMPDIR:-/tmp}/ns_interp_XXXXXX.py")"
        cat > "$CHECK" <<'EOF'
import sys, torch
from megatron_muon.kernels import batched_newton_schulz
from megatron_muon.core.newton_schulz import newton_schulz
bad = 0
for shape, dtype, tol in [((16, 32), torch.float32, 1e-5), ((32, 16), torch.float32, 1e-5),
                          ((2, 16, 32), torch.bfloat16, 2e-2)]:
    x = torch.randn(*shape)
    out = batched_newton_schulz(x, steps=2, dtype=dtype, backend="triton")
    ref = newton_schulz(x, steps=2, dtype=dtype)
    err = ((out - ref).norm() / ref.norm()).item()
    bad += not err < tol
    print(f"{'ok  ' if err < tol else 'FAIL'} interpreted triton {shape} {dtype}: rel err {err:.2e}")
sys.exit(1 if bad else 0)
EOF
        # TRITON_INTERPRET must be set before the kernels are decorated (first triton use)
        step "tiny interpreted Triton check (CPU)" 120 env TRITON_INTERPRET=1 "$PY" "$CHECK"
        rm -f "$CHECK"
    else
        log "triton not installed: interpreted check skipped"
    fi
    step "small CPU bench" 120 "$PY" tools/bench_ns.py --device cpu --hidden 256 --layers 1 --repeat 1
fi

log ""
if [ "$SKIPPED" -ne 0 ]; then
    log "# gpu_check: $SKIPPED part(s) skipped for the time budget (GPU_CHECK_BUDGET_S=$BUDGET)"
fi
if [ "$FAILED" -ne 0 ]; then
    log "# gpu_check: FAILED (see above); report in $REPORT"
    [ "$HAVE_CUDA" -eq 1 ] && exit 1
    exit 0
fi
log "# gpu_check: all run parts passed; report in $REPORT"
exit 0
