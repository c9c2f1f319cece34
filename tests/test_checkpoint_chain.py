"""The checkpoint lifecycle a user lives through: save -> resume -> save -> resume.

Each chain trains 6 steps in three segments (a checkpoint at steps 2 and 4, each segment a
freshly built model and optimizer that loads the previous checkpoint and saves the next
one) and compares with the same 6 steps uninterrupted.  All runs of one layout share one
launch (``train_variants``) to keep CI short; every segment still rebuilds everything from
the checkpoint.  Resuming on the same layout restores every tensor bit for bit and replays
the same arithmetic in the same order, so losses and parameters must be *equal*.  The
regression this pins: before the fix, every resumed run failed at its first save
(``AssertionError: steps: [9, 6]`` in Megatron's ``ChainedOptimizer._synchronize_steps``).
"""

import tempfile

import pytest
import torch

from megatron_muon.testing.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

OPT = dict(muon_fp32_matmul_prec="highest", muon_nesterov=True, lr=2e-3, adam_eps=1e-5)
MATRIX = dict(OPT, dmuon_placement="matrix")
ZERO3 = dict(MATRIX, dmuon_zero3=True)
ZERO3_DDP = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=20000)
CHAINS = {  # name: train_megatron arguments
    "adam": dict(optimizer="adam", opt=OPT),
    "dmuon": dict(optimizer="dmuon", opt=OPT),
    "matrix": dict(optimizer="dmuon", opt=MATRIX),
    "zero3": dict(optimizer="dmuon", opt=ZERO3, ddp=ZERO3_DDP),
    # Megatron-LM's default format for its distributed optimizer (no gather at save)
    "adam_dp_reshardable": dict(optimizer="adam", opt=OPT, sharding="dp_reshardable"),
}
# the same global batch (4 microbatches) in every layout, so that layouts can be compared
LAYOUTS = {"dp4": dict(tp=1, pp=1, cfg={"num_microbatches": 1}),
           "tp2dp2": dict(tp=2, pp=1, cfg={"num_microbatches": 2}),
           "pp2dp2": dict(tp=1, pp=2, cfg={"num_microbatches": 2})}
STEPS, SAVES = 6, (2, 4)


def segments(directory: str, layouts=None) -> list:
    """Three segments: [0, 2) saves; [2, 4) loads and saves; [4, 6) loads.  ``layouts``
    gives each segment its own parallel layout (the checkpoint reshards)."""
    a, b = SAVES
    segs = [dict(steps=a, checkpoint=dict(save=directory, save_at=a)),
            dict(steps=b, checkpoint=dict(load=directory, save=directory, save_at=b)),
            dict(steps=STEPS, checkpoint=dict(load=directory))]
    for seg, lay in zip(segs, layouts or [{}] * 3):
        seg.update(lay)
    return segs


def run_chains(names: list, layout: str, world: int = 4) -> dict:
    """{chain: (uninterrupted per-rank results, [segment per-rank results])}, one launch."""
    variants, index = [], {}
    with tempfile.TemporaryDirectory(prefix=f"chain_{layout}_") as root:
        for name in names:
            index[name] = len(variants)
            chain = dict(CHAINS[name])
            sharding = chain.pop("sharding", None)  # the checkpoints' optimizer format
            for v in [dict(steps=STEPS)] + segments(f"{root}/{name}"):
                if sharding and v.get("checkpoint", {}).get("save"):
                    v["checkpoint"]["sharding"] = sharding
                variants.append({**chain, **LAYOUTS[layout], **v})
        per_rank = run_ranks("megatron_muon.testing.workers:train_variants", world,
                             dict(variants=variants), timeout=840)
    out = {}
    for name, i in index.items():
        runs = [[r[j] for r in per_rank] for j in range(i, i + 4)]
        out[name] = (runs[0], runs[1:])
    return out


def merged(results) -> dict:
    full = {}
    for r in results:
        if r["layout"]["dp"] == 0 and r["layout"]["tp"] == 0:
            full.update(r["params"])
    return full


def losses(results) -> list:
    """The loss of every step, from a rank of the last pipeline stage."""
    for r in results:
        if r["losses"] and r["losses"][0] is not None:
            return r["losses"]
    raise AssertionError("no rank reported a loss")


def assert_chain_equal(whole, segs) -> None:
    assert losses(segs[0]) + losses(segs[1]) + losses(segs[2]) == losses(whole)
    a, b = merged(whole), merged(segs[2])
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    moved = merged(segs[0])  # the parameters changed after the first segment
    assert any(not torch.equal(moved[n], a[n]) for n in a)


@pytest.mark.parametrize("layout", ["dp4", "tp2dp2"])
def test_save_resume_save_resume_equals_uninterrupted(layout):
    for name, (whole, segs) in run_chains(list(CHAINS), layout).items():
        try:
            assert_chain_equal(whole, segs)
        except AssertionError as err:
            raise AssertionError(f"{name} at {layout}: {err}") from None


def test_save_resume_save_resume_pipeline():
    (whole, segs), = run_chains(["dmuon"], "pp2dp2").values()
    assert_chain_equal(whole, segs)


def test_chain_that_changes_layout_between_segments(tmp_path):
    """DP4 -> TP2 x DP2 -> PP2 x DP2 for DMuon: the checkpoint reshards at each resume.

    Not bitwise: another layout sums the same gradients in another order (the DP
    reduce-scatter over 2 instead of 4 ranks, TP partial products of the row-parallel
    layers), so each fp32 gradient element differs from the DP4 one by a few units of
    fp32 rounding (eps = 2^-23 ~ 1.2e-7, relative), and the momentum, Newton-Schulz and
    AdamW carry that forward.  An update is at most lr x scale (x 1 for the orthogonal
    factor's entries, x 1/sqrt(v) for Adam) ~ 2e-3 per step, so the 4 resharded steps can
    move a parameter by at most 4 x 2e-3 x (relative error).  With a generous 1e-3
    relative error (NS amplifies small perturbations of nearly-degenerate singular
    values) that is 8e-6; the check is 1e-5, and that the runs did diverge from the
    initial parameters by far more.
    """
    d = str(tmp_path)
    layouts = [LAYOUTS["dp4"], LAYOUTS["tp2dp2"], LAYOUTS["pp2dp2"]]
    variants = [{**CHAINS["dmuon"], **LAYOUTS["dp4"], "steps": STEPS}]
    variants += [{**CHAINS["dmuon"], **v} for v in segments(d, layouts)]
    per_rank = run_ranks("megatron_muon.testing.workers:train_variants", 4,
                         dict(variants=variants), timeout=600)
    runs = [[r[j] for r in per_rank] for j in range(4)]
    a, b = merged(runs[0]), merged(runs[3])
    assert set(a) == set(b)
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst < 1e-5, worst
    first = merged(runs[1])
    assert max((first[n] - a[n]).abs().max().item() for n in a) > 1e-3
    # the first segment runs on the uninterrupted run's layout (the reported loss is that of
    # DP rank 0's microbatches, so other layouts report other numbers)
    assert losses(runs[1]) == losses(runs[0])[:SAVES[0]]


def test_a_checkpoint_with_another_number_of_optimizer_parts_is_refused_in_one_line():
    """An MoE checkpoint saved where the experts had optimizers of their own (EP2, or expert
    TP 1 under TP2) and resumed where they do not (EP1 with expert TP = TP): Megatron's
    ChainedOptimizer said only "Expected 2 entries in state dict, but got 3"."""
    from megatron_muon.megatron.factory import DMuonChainedOptimizer

    class Part:
        def __init__(self):
            self.loaded = None

        def load_state_dict(self, sd):
            self.loaded = sd

    chain = DMuonChainedOptimizer.__new__(DMuonChainedOptimizer)
    chain.chained_optimizers = [Part(), Part()]
    with pytest.raises(ValueError, match=r"checkpoint's optimizer has 3 parts and this run's 2: "
                                         r"MoE experts .*--no-load-optim"):
        chain.load_state_dict({0: {}, 1: {}, 2: {}})
    assert all(p.loaded is None for p in chain.chained_optimizers)
