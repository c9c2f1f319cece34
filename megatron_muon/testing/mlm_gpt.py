"""A small GPT pretraining script for Megatron-LM's training loop (tests, README).

It drives ``megatron.training.pretrain`` the way Megatron-LM's own ``pretrain_gpt.py``
does: arguments from ``parse_and_validate_args``, a ``GPTModelConfig`` in a config
container (``builder.build_distributed_models`` builds the model), mock data.  With
``--legacy-model-provider`` it passes a ``model_provider`` function instead (the
``get_model`` path).  Every rank reads its own batches (no TP broadcast), which keeps the
forward step independent of Megatron-LM's batch helpers.

With ``MLM_GPT_RUNS=spec.json`` it runs several trainings in one launch (tests: the
imports and process start dominate a tiny run on CPU): ``{"out": DIR, "runs": [[name,
[extra args]], ...]}``; each run gets the command line's arguments plus its own, its
stdout goes to ``DIR/<name>.rank<R>.log`` and its per-iteration loss (full precision,
reduced over data parallel like Megatron-LM's ``lm loss``) to ``DIR/<name>.json``; for the
runs named in ``"record_batches"`` each rank's training microbatches go to
``DIR/<name>.batches.rank<R>.pt`` (``lora_replay.py`` replays them).  A run
whose arguments are a dict is a step between trainings instead (``{"merge": {...}}``:
``python -m megatron_muon.peft.merge`` on rank 0, ``_run_step``).
Between runs Megatron-LM's global state is reset (``unset_global_variables``,
``destroy_rerun_state_machine``, ``destroy_model_parallel``, the MoE metrics tracker), and
the runs reuse each other's process groups (``_ReusedGroups``).

Needs ``megatron/training`` (megatron-core >= 0.17 or a Megatron-LM checkout), patched
for ``--optimizer dmuon``.  On CPU:

    python -m megatron_muon.megatron.cpu_run --nproc 4 megatron_muon/testing/mlm_gpt.py \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 \\
        --vocab-size 256 --lr 1e-3 --train-iters 10 --optimizer dmuon --use-distributed-optimizer
"""

import contextlib
import json
import os
import sys
import traceback
from functools import partial
from pathlib import Path

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args


def extra_args(parser):
    group = parser.add_argument_group(title="mlm_gpt")
    group.add_argument("--legacy-model-provider", action="store_true",
                       help="build the model with a model_provider function (get_model) "
                            "instead of a GPTModelConfig in the config container")
    return parser


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    pg_collection=pg_collection, vp_stage=vp_stage)


_RECORDED = []  # (loss sum, tokens) of every microbatch of this rank, for MLM_GPT_RUNS
_BATCHES = []  # this rank's training microbatches, for the runs in spec["record_batches"]
_RECORD_BATCHES = False  # set by run_many for exactly those runs


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    _RECORDED.append((loss.detach().double().item(), float(num_tokens.item())))
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                    num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in next(data_iterator).items()}
    if _RECORD_BATCHES and model.training:
        _BATCHES.append({k: v.detach().cpu().clone() for k, v in batch.items()
                         if torch.is_tensor(v)})
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, split=args.split,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        path_to_cache=args.data_cache_path)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples,
                                         lambda: True, config).build()


datasets_provider.is_distributed = True  # every rank builds its loader (see the docstring)


def main():
    args = parse_and_validate_args(extra_args_provider=extra_args)
    if args.legacy_model_provider:
        cfg = pretrain_cfg_container_from_args(args)
        pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 model_provider=model_provider)
    else:
        cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step)


def _iteration_losses() -> list:
    """This run's loss per iteration, as Megatron-LM reports ``lm loss`` (sum of the loss
    over the DP ranks' microbatches / their tokens), at full precision; None off the last
    pipeline stage."""
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    if not mpu.is_pipeline_last_stage(ignore_virtual=True):
        return None
    t = torch.tensor(_RECORDED, dtype=torch.float64).view(-1, 2)
    torch.distributed.all_reduce(t, group=mpu.get_data_parallel_group())
    per_iter = t.view(-1, get_num_microbatches(), 2).sum(dim=1)
    return (per_iter[:, 0] / per_iter[:, 1]).tolist()


def _reset_megatron() -> None:
    from megatron.core import mpu
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training.global_vars import unset_global_variables

    torch.distributed.barrier()
    unset_global_variables()
    destroy_rerun_state_machine()
    mpu.destroy_model_parallel()
    try:  # the MoE metrics, sized by the previous run's layers (megatron-core >= 0.19)
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
    except ImportError:
        pass
    # the data loaders' worker processes live until their iterators are collected
    import gc

    gc.collect()


def _run_step(name: str, step: dict, out: Path, rank: int) -> None:
    """``{"merge": {"base": ..., "adapters": ..., "out": ...}}``: global rank 0 runs
    ``python -m megatron_muon.peft.merge`` (a process of its own: one gloo rank), its output
    to ``DIR/<name>.log``; the other ranks wait for it."""
    import subprocess

    (kind, options), = step.items()
    if kind != "merge":
        raise ValueError(f"mlm_gpt: unknown step {kind!r}")
    code = torch.zeros(1)
    if rank == 0 or not torch.distributed.is_initialized():
        cmd = [sys.executable, "-m", "megatron_muon.peft.merge"]
        for key, value in options.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        with open(out / f"{name}.log", "w") as log:
            code[0] = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     timeout=600).returncode
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(code, src=0)
    if code.item() != 0:
        raise RuntimeError(f"mlm_gpt: step {name!r} failed (exit code {int(code.item())}), "
                           f"see {out / (name + '.log')}")
    if rank == 0:
        (out / f"{name}.json").write_text(json.dumps({"step": kind, "returncode": 0}))


class _ReusedGroups:
    """``torch.distributed.new_group`` for the runs of one launch: the n-th group a run asks
    for with given ranks and backend is the n-th one an earlier run made with them, when there
    is one.  Megatron-LM builds its process groups afresh in every run and forgets them without
    destroying them, and the models and optimizers holding them stay alive through their
    autograd hooks, so each run left ~40 gloo threads per rank behind; a launch of 50 runs
    reached 1500 and ran its last runs 10x slower.  Every rank makes the same calls in the same
    order, so all of them find (or make) the same groups; within a run the groups are as many
    and as distinct as without reuse."""

    def __init__(self):
        self.made, self.seen = {}, {}
        self.original = torch.distributed.new_group

    def new_run(self) -> None:
        self.seen = {}

    def __call__(self, ranks=None, timeout=None, backend=None, *args, **kwargs):
        base = (None if ranks is None else tuple(sorted(ranks)), str(backend),
                bool(kwargs.get("use_local_synchronization")))
        self.seen[base] = n = self.seen.get(base, 0) + 1
        key = base + (n,)
        if key not in self.made:
            self.made[key] = self.original(ranks, timeout, backend, *args, **kwargs)
        return self.made[key]


def run_many(spec_path: str) -> None:
    global _RECORD_BATCHES
    from megatron_muon.megatron.cpu_mode import cpu_mode_active
    from megatron_muon.megatron.cpu_run import with_cpu_defaults

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    rank = int(os.environ.get("RANK", "0"))
    common = sys.argv[1:]
    torch.distributed.new_group = groups = _ReusedGroups()
    for name, extra in spec["runs"]:
        groups.new_run()
        if isinstance(extra, dict):  # a step between trainings, e.g. {"merge": {...}}
            _run_step(name, extra, out, rank)
            continue
        argv = common + list(extra)
        sys.argv = [sys.argv[0]] + (with_cpu_defaults(argv) if cpu_mode_active() else argv)
        _RECORDED.clear()
        _BATCHES.clear()
        _RECORD_BATCHES = name in spec.get("record_batches", ())
        with open(out / f"{name}.rank{rank}.log", "w") as log, contextlib.redirect_stdout(log):
            try:
                main()
            except BaseException:  # the failing run's logs then say why, rank by rank
                print(f"mlm_gpt: run {name!r} failed on rank {rank}:\n{traceback.format_exc()}",
                      flush=True)
                raise
            from megatron.core import mpu
            from megatron.training import get_args

            losses = _iteration_losses()
            if losses is not None and mpu.get_data_parallel_rank() == 0 and \
                    mpu.get_tensor_model_parallel_rank() == 0:
                start = get_args().iteration  # the iteration it started from (resumed)
                (out / f"{name}.json").write_text(json.dumps(
                    {"losses": losses, "first_iteration": start + 1}))
            if _RECORD_BATCHES:
                torch.save(list(_BATCHES), out / f"{name}.batches.rank{rank}.pt")
            _reset_megatron()


if __name__ == "__main__":
    if os.environ.get("MLM_GPT_RUNS"):
        run_many(os.environ["MLM_GPT_RUNS"])
    else:
        main()
