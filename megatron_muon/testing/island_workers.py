"""Per-rank entry points for the islands tests (``tests/test_islands.py``), run by ``run_ranks``.

``islands_suite`` runs several island layouts one after the other in the same processes (a
launch costs more than a layout on a small CPU machine); ``islands_fault`` runs the fault
mode with one island made to stall.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_muon.testing.gpt import TinyGPTConfig, build_gpt, full_named_params, init_parallel, train_step
from megatron_muon.testing.workers import constant_scheduler, make_optimizer_config

__all__ = ["islands_suite", "islands_fault"]

TINY = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
            num_query_groups=2, vocab_size=64, seq_length=8, micro_batch_size=2,
            num_microbatches=1)
INNER = dict(lr=3e-3, weight_decay=0.0)
# dmuon inner optimizer ("DiLoCo with a Muon inner optimizer"), as tests/test_dmuon.py: fp32
# Newton-Schulz, and adam_eps 1e-3 so that the AdamW part (embedding, output layer, norms) is
# not ill-conditioned by gradient elements near zero (the bound in tests/test_islands.py)
INNER_DMUON = dict(lr=2e-3, weight_decay=0.0, adam_eps=1e-3, muon_fp32_matmul_prec="highest",
                   muon_nesterov=True)
DMUON_OUTER = dict(method="diloco")  # published defaults: lr 0.7, Nesterov momentum 0.9


def _build(gcfg, opt_kind: str = "adam"):
    from megatron_muon.megatron.factory import get_megatron_optimizer

    model = build_gpt(gcfg)
    ocfg = make_optimizer_config(opt_kind, bf16=False,
                                 **(INNER_DMUON if opt_kind == "dmuon" else INNER))
    optim = get_megatron_optimizer(ocfg, model)
    return model, optim, constant_scheduler(optim, ocfg)


def _coords() -> dict:
    from megatron.core import parallel_state as ps

    return dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                dp=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size())


def _inner_steps(model, optim, sched, gcfg, island: int, first: int, H: int) -> list:
    c = _coords()
    losses = []
    for s in range(first, first + H):
        sched.step(1)
        out = train_step(model, optim, gcfg, 1000 * island + s, c["dp"], c["dp_size"])
        losses.append(out.get("loss"))
    return losses


def _island_run(gcfg, K: int, tp: int, pp: int, outer_kw: dict, rounds: int, H: int,
                checkpoint: Optional[str] = None, opt_kind: str = "adam") -> dict:
    """Train ``rounds`` x (H inner steps + outer step); record what the reference needs."""
    from megatron_muon.islands.runtime import (IslandOuterStep, destroy_islands,
                                                initialize_islands, load_island_checkpoint,
                                                save_island_checkpoint)

    layout = initialize_islands(K, tp=tp, pp=pp, seed=gcfg.seed)
    model, optim, sched = _build(gcfg, opt_kind)
    outer = IslandOuterStep(model, layout, inner_optimizer=optim, **outer_kw)
    rec = dict(island=layout.island, local=layout.local_rank, **_coords(),
               theta0=full_named_params(model), rounds=[], losses=[])
    for _ in range(rounds):
        rec["losses"] += _inner_steps(model, optim, sched, gcfg, layout.island,
                                      outer.round * H, H)
        before = full_named_params(model)
        if checkpoint and outer.round == rounds - 1:
            save_island_checkpoint(checkpoint, model, optim, outer)
        report = outer.step()
        rec["rounds"].append(dict(report=report, before=before,
                                  after=full_named_params(model)))
    rec["stats"] = outer.comm_stats.as_dict()
    rec["iso_computed"] = outer.iso_computed
    if checkpoint:
        # a fresh model, optimizer and outer step resume from the file and redo the last round
        model2, optim2, sched2 = _build(gcfg)
        outer2 = IslandOuterStep(model2, layout, inner_optimizer=optim2, **outer_kw)
        load_island_checkpoint(checkpoint, model2, optim2, outer2)
        rec["resumed_before"] = full_named_params(model2)
        outer2.step()
        rec["resumed_after"] = full_named_params(model2)
        rec["resumed_losses"] = _inner_steps(model2, optim2, sched2, gcfg, layout.island,
                                             outer2.round * H, H)
        rec["continued_losses"] = _inner_steps(model, optim, sched, gcfg, layout.island,
                                               outer.round * H, H)
        # the resumed run saves again, and a third model resumes from that: the lifecycle
        # save -> resume -> save -> resume, against the uninterrupted run's next round
        again = checkpoint + "_again"
        save_island_checkpoint(again, model2, optim2, outer2)
        model3, optim3, sched3 = _build(gcfg)
        outer3 = IslandOuterStep(model3, layout, inner_optimizer=optim3, **outer_kw)
        load_island_checkpoint(again, model3, optim3, outer3)
        sched3.load_state_dict(sched2.state_dict())
        for m, o, out_, sch, key in ((model3, optim3, outer3, sched3, "resumed_again"),
                                     (model, optim, outer, sched, "continued_again")):
            out_.step()
            rec[f"{key}_losses"] = _inner_steps(m, o, sch, gcfg, layout.island,
                                                out_.round * H, H)
            rec[f"{key}_params"] = full_named_params(m)
    destroy_islands()
    return rec


def _emulated_run(gcfg, K: int, outer_kw: dict, rounds: int, H: int,
                  opt_kind: str = "dmuon") -> dict:
    """K islands of one rank each, emulated in this process: K models with their own inner
    optimizers (Megatron TP1 x PP1 x DP1: every rank of the world is an island of its own
    here, so Megatron's groups are this rank alone) trained on the data the real island k
    reads, merged by the library's ``OuterOptimizer`` on ``mean_pseudo_gradient`` -- the
    1-rank-island result the TP2 / PP2 islands are compared with at equal tokens."""
    from megatron_muon.islands.isoloco import OuterOptimizer, mean_pseudo_gradient
    from megatron_muon.islands.runtime import (destroy_islands, initialize_islands,
                                                island_param_names)
    from megatron_muon.megatron.params import is_muon_matrix

    initialize_islands(dist.get_world_size(), seed=gcfg.seed)
    islands = [_build(gcfg, opt_kind) for _ in range(K)]  # every rank builds K (collectives)
    theta0 = full_named_params(islands[0][0])
    outer = OuterOptimizer(theta0, **outer_kw)
    rec = dict(theta0=theta0, rounds=[], adam_grad_max=0.0)
    for r in range(rounds):
        before = []
        for k, (model, optim, sched) in enumerate(islands):
            for s in range(r * H, (r + 1) * H):
                _inner_steps(model, optim, sched, gcfg, k, s, 1)
                # largest gradient element of an AdamW parameter (the tests' tolerance)
                rec["adam_grad_max"] = max([rec["adam_grad_max"]] + [
                    p.main_grad.abs().max().item() for n, p in island_param_names(model)
                    if not is_muon_matrix(n, p) and getattr(p, "main_grad", None) is not None])
            before.append(full_named_params(model))
        outer.step(mean_pseudo_gradient(outer.params, before))
        with torch.no_grad():
            for model, optim, _ in islands:
                for name, p in island_param_names(model):
                    p.data.copy_(outer.params[name].to(p.dtype))
                optim.reload_model_params()
        rec["rounds"].append(dict(before=before,
                                  after={n: t.clone() for n, t in outer.params.items()}))
    destroy_islands()
    return rec


def _plain_run(gcfg, tp: int, steps: int) -> dict:
    """The same training without islands: Megatron's own initialisation, no outer step."""
    init_parallel(tp=tp, seed=gcfg.seed)
    model, optim, sched = _build(gcfg)
    losses = _inner_steps(model, optim, sched, gcfg, 0, 0, steps)
    return dict(losses=losses, params=full_named_params(model))


def islands_suite(workdir: str, parts: Optional[list] = None) -> dict:
    """Runs on 4 ranks. Parts: k1 (K=1, TP2 x DP2 vs plain), k4 (4 x 1: diloco, isoloco svd with
    checkpoint resume, isoloco ns momentum_first), tp2 (2 x TP2), pp2 (2 x PP2), dp2 (2 x DP2),
    all with an AdamW inner optimizer; dmuon (2 x TP2 and 2 x PP2 with a dmuon inner
    optimizer and the DiLoCo outer step, and the same 2 islands emulated as 1-rank islands)."""
    from megatron.core import parallel_state as ps

    gcfg = TinyGPTConfig(**TINY)
    parts = parts or ["k1", "k4", "tp2", "pp2", "dp2", "dmuon"]
    out = {}
    timings = {}
    for part in parts:
        t0 = time.perf_counter()
        if part == "k1":
            out["k1"] = _island_run(gcfg, 1, 2, 1, dict(method="diloco", lr=1.0, momentum=0.0,
                                                        delta_dtype=torch.float64), 2, 2)
            out["k1_plain"] = _plain_run(gcfg, 2, 4)
            ps.destroy_model_parallel()
        elif part == "k4":
            out["k4_diloco"] = _island_run(gcfg, 4, 1, 1, dict(method="diloco"), 2, 2)
            out["k4_isoloco_svd"] = _island_run(
                gcfg, 4, 1, 1, dict(method="isoloco", iso_mode="svd", delta_dtype=torch.float64),
                2, 2,
                checkpoint=os.path.join(workdir, "ckpt_k4"))
            out["k4_isoloco_ns_mf"] = _island_run(
                gcfg, 4, 1, 1, dict(method="isoloco", iso_mode="ns", order="momentum_first",
                                    delta_dtype=torch.float64), 2, 2)
        elif part == "tp2":
            out["tp2"] = _island_run(gcfg, 2, 2, 1, dict(method="isoloco", iso_mode="svd"), 2, 2)
        elif part == "pp2":
            out["pp2"] = _island_run(gcfg, 2, 1, 2, dict(method="isoloco", iso_mode="ns"), 2, 2)
        elif part == "dp2":
            out["dp2"] = _island_run(gcfg, 2, 1, 1, dict(method="isoloco", iso_mode="svd",
                                                         order="momentum_first"), 2, 2)
        elif part == "dmuon":
            out["tp2_dmuon"] = _island_run(gcfg, 2, 2, 1, DMUON_OUTER, 2, 2, opt_kind="dmuon")
            out["pp2_dmuon"] = _island_run(gcfg, 2, 1, 2, DMUON_OUTER, 2, 2, opt_kind="dmuon")
            out["ref1_dmuon"] = _emulated_run(gcfg, 2, DMUON_OUTER, 2, 2, opt_kind="dmuon")
        else:
            raise ValueError(part)
        timings[part] = time.perf_counter() - t0
    out["timings"] = timings
    out["rank"] = dist.get_rank()
    return out


def islands_fault(rounds: int = 6, H: int = 1, stall_island: int = 3, stall_round: int = 1,
                  stall_s: float = 2.5, island_timeout: float = 1.0) -> dict:
    """K = world islands of 1 rank, fault mode; island ``stall_island`` sleeps ``stall_s``
    before its outer step of round ``stall_round``."""
    from megatron_muon.islands.runtime import (IslandOuterStep, destroy_islands,
                                                initialize_islands)

    gcfg = TinyGPTConfig(**TINY)
    K = dist.get_world_size()
    layout = initialize_islands(K, seed=gcfg.seed)
    model, optim, sched = _build(gcfg)
    messages = []
    outer = IslandOuterStep(model, layout, method="isoloco", iso_mode="svd",
                            inner_optimizer=optim, delta_dtype=torch.float64,
                            fault_tolerant=True, island_timeout=island_timeout,
                            rejoin_timeout=60.0, max_rounds=rounds, log=messages.append)
    rec = dict(island=layout.island, theta0=full_named_params(model), rounds=[], stalled=False)
    t_start = time.perf_counter()
    while outer.round < rounds:
        _inner_steps(model, optim, sched, gcfg, layout.island, outer.round * H, H)
        if layout.island == stall_island and outer.round == stall_round and not rec["stalled"]:
            rec["stalled"] = True
            time.sleep(stall_s)
        before = full_named_params(model)
        report = outer.step()
        if report["finished"]:
            break
        rec["rounds"].append(dict(report=report, before=before, after=full_named_params(model)))
    rec["final"] = full_named_params(model)
    rec["messages"] = messages
    rec["seconds"] = time.perf_counter() - t_start
    destroy_islands()
    return rec
