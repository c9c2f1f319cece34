#!/usr/bin/env bash
# PEFT through Megatron-LM's own stock pretrain_gpt.py, on CPU (docs/usage.md#peft-in-megatron-lm):
#   1. pretrain a tiny GPT with --optimizer dmuon;
#   2. fine-tune it with LoRA + sMuon, and with LoRA + AdamW (Megatron's own Adam);
#   3. merge the sMuon adapters into an ordinary checkpoint (python -m megatron_muon.peft.merge);
#   4. evaluate the base, both fine-tuned models and the merged checkpoint (no LoRA flags).
#
#   examples/finetune_megatron_lm.sh /path/to/Megatron-LM [OUT_DIR]
#
# The checkout must be patched (python patches/apply_patch.py /path/to/Megatron-LM) and
# megatron-muon importable by the python on PATH (or $PYTHON).  Mock data (Megatron-LM's
# --mock-data: sequences 1, 2, 3, ... mod the vocabulary), 4 gloo ranks; about 2 minutes on
# 2 CPU cores.  Prints the held-out loss of each model.
set -euo pipefail

MLM=${1:?usage: $0 /path/to/Megatron-LM [OUT_DIR]}
OUT=${2:-runs/finetune_megatron_lm}
PYTHON=${PYTHON:-python}
MLM=$(cd "$MLM" && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
[ -f "$MLM/pretrain_gpt.py" ] || { echo "error: $MLM has no pretrain_gpt.py" >&2; exit 2; }
grep -q "peft_adapter" "$MLM/megatron/training/arguments.py" || {
  echo "error: $MLM is not patched: python patches/apply_patch.py $MLM" >&2; exit 2; }

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=ignore
export PYTHONPATH="$MLM${PYTHONPATH:+:$PYTHONPATH}"   # the checkout's megatron/ wins
cd "$MLM"
TINY=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32
      --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --vocab-size 256
      --eval-interval 1000 --log-interval 1 --seed 1234 --hidden-dropout 0 --attention-dropout 0
      --use-distributed-optimizer --ckpt-format torch_dist)
RUN=("$PYTHON" -m megatron_muon.megatron.cpu_run --nproc 4 --timeout 600 pretrain_gpt.py "${TINY[@]}")
LORA=(--lora-rank 4 --lora-alpha 8 --lr-decay-style constant)
EVAL=(--skip-train --eval-iters 4)

step() {  # step NAME ARGS...: run, log to OUT/NAME.log, fail loudly
  local name=$1; shift
  echo "== $name"
  if ! "${RUN[@]}" "$@" > "$OUT/$name.log" 2>&1; then
    echo "error: $name failed; the end of $OUT/$name.log:" >&2; tail -20 "$OUT/$name.log" >&2; exit 1
  fi
}
heldout() { grep -o 'validation set | lm loss value: [0-9.E+-]*' "$OUT/$1.log" | tail -1 | sed 's/.*: //'; }

rm -rf "$OUT"/ck_*
step pretrain     --train-iters 30 --optimizer dmuon --lr 1e-3 --save "$OUT/ck_base" --save-interval 30
step lora_smuon   --train-iters 20 --optimizer smuon "${LORA[@]}" --lr 1e-3 \
                  --load "$OUT/ck_base" --finetune --save "$OUT/ck_smuon" --save-interval 20
step lora_adam    --train-iters 20 --optimizer adam "${LORA[@]}" --lr 1e-2 \
                  --load "$OUT/ck_base" --finetune --save "$OUT/ck_adam" --save-interval 20
echo "== merge"
"$PYTHON" -m megatron_muon.peft.merge --adapters "$OUT/ck_smuon" --out "$OUT/ck_merged" \
  > "$OUT/merge.log" 2>&1 || { cat "$OUT/merge.log" >&2; exit 1; }
step eval_base    --train-iters 30 "${EVAL[@]}" --load "$OUT/ck_base"
step eval_smuon   --train-iters 20 "${EVAL[@]}" --lora-rank 4 --lora-alpha 8 --load "$OUT/ck_smuon"
step eval_adam    --train-iters 20 "${EVAL[@]}" --lora-rank 4 --lora-alpha 8 --load "$OUT/ck_adam"
step eval_merged  --train-iters 20 "${EVAL[@]}" --load "$OUT/ck_merged"

echo
echo "held-out loss (Megatron-LM $(git -C "$MLM" rev-parse --short HEAD 2>/dev/null || echo '?'), $OUT):"
printf '  %-34s %s\n' "base (dmuon, 30 iterations)" "$(heldout eval_base)" \
  "LoRA r4 + sMuon, 20 iterations" "$(heldout eval_smuon)" \
  "LoRA r4 + AdamW, 20 iterations" "$(heldout eval_adam)" \
  "merged sMuon adapters, no LoRA flag" "$(heldout eval_merged)"
