#!/usr/bin/env bash
# Launch examples/pretrain_gpt.py on GPUs with torchrun (NCCL), one node or many.
#
# Single node, all GPUs:
#   bash examples/launch_torchrun.sh --optimizer dmuon
# Several nodes: run the same command on every node (or use launch_slurm.sbatch):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node001 bash examples/launch_torchrun.sh --optimizer dmuon
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node001 bash examples/launch_torchrun.sh --optimizer dmuon
#
# Every argument is passed to pretrain_gpt.py after the defaults below, so it overrides them
# (argparse keeps the last value): e.g. --tensor-model-parallel-size 4 --train-iters 2000.
# Environment knobs: GPUS_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, PYTHON,
# DATA_CACHE_DIR (must be on a filesystem all nodes share: Megatron's GPTDataset caches its
# sample indices there, written by global rank 0), NCCL_* as usual.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"

if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        GPUS_PER_NODE="$(nvidia-smi -L | grep -c '^GPU')"
    else
        GPUS_PER_NODE="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
    fi
fi
if [[ "$GPUS_PER_NODE" -lt 1 ]]; then
    echo "error: no GPUs found; on a CPU machine run: python $SCRIPT_DIR/pretrain_gpt.py" >&2
    exit 2
fi
NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"
DATA_CACHE_DIR="${DATA_CACHE_DIR:-$HOME/.cache/megatron_muon}"

# Megatron-Core: one CUDA connection keeps TP/PP communication kernels in issue order.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# Fail fast (instead of hanging) when a rank dies inside a collective.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONUNBUFFERED=1

# A GPT-2-small-sized byte-level model; everything here can be overridden on the command line.
DEFAULT_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1
    --num-layers 12 --hidden-size 768 --num-attention-heads 12
    --seq-length 1024 --micro-batch-size 4 --global-batch-size 256
    --train-iters 2000 --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 100 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0 --bf16
    --optimizer dmuon --muon-fp32-matmul-prec medium
    --log-interval 10
    --data-cache-dir "$DATA_CACHE_DIR"
)

echo "torchrun: $NNODES node(s) x $GPUS_PER_NODE GPU(s), node rank $NODE_RANK, master $MASTER_ADDR:$MASTER_PORT" >&2
exec "$PYTHON" -m torch.distributed.run \
    --nproc-per-node "$GPUS_PER_NODE" \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" \
    --master-port "$MASTER_PORT" \
    "$SCRIPT_DIR/pretrain_gpt.py" "${DEFAULT_ARGS[@]}" "$@"
