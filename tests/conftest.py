import os

import pytest
import torch

from megatron_muon.megatron.cpu_run import alias_typing_override

torch.set_num_threads(1)
# emerging_optimizers 0.3 (Megatron-Core 0.19's Muon, AdaptiveMuon, Lion) imports
# typing.override, new in Python 3.12; megatron.core.optimizer imports it as soon as it is
# installed.  On 3.11 alias typing_extensions' here, for this process and the ranks it forks
# (CI's 0.19.2 lane does it for every process: .ci/typing_override.pth).
alias_typing_override()
# run_ranks forks test ranks from this process instead of starting interpreters that each
# import torch and Megatron again (megatron_muon/testing/launch.py); set it to 'spawn' to
# start every rank fresh
os.environ.setdefault("MEGATRON_MUON_RANK_START", "fork")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def mcore_version():
    import megatron.core
    from packaging.version import Version

    return Version(megatron.core.__version__)


# CI runs the whole suite on megatron-core 0.16.1 (the primary lane).  The secondary lane
# (megatron-core 0.19.x) runs what depends on the Megatron version: Megatron-LM's own training
# loop, the patch, the configuration, and one case of each path that touches Megatron's
# buffers, hooks and checkpoint formats (TP, PP, matrix placement, ZeRO-3, the overlap,
# checkpoints).  The rest repeats the same arithmetic on the other version; CI stays under
# 30 minutes on 2 cores.  Entries are a file (all of it) or (file, test name or test id).
SECONDARY_LANE = {
    "test_megatron_lm.py", "test_patch.py", "test_config.py", "test_groups.py", "test_hooks.py",
    "test_islands.py", "test_production_flags.py", "test_cpu_mode.py", "test_geometry.py",
    "test_families.py",  # the model families through Megatron-LM's loop (its megatron/training)
    ("test_dmuon.py", "test_model_families_equal_reference[mla-dp4]"),
    ("test_dmuon.py", "test_model_families_equal_reference[mla-tp2dp2]"),
    ("test_dmuon.py", "test_model_families_equal_reference[mla_qkln-dp4]"),
    ("test_dmuon.py", "test_model_families_equal_reference[mla_qkln-tp2dp2]"),
    ("test_dmuon.py", "test_head_wise_qkv_split_equals_reference[mla-dp4]"),
    ("test_dmuon.py", "test_dmuon_equals_reference[tp2dp2]"),
    ("test_dmuon.py", "test_dmuon_equals_reference[pp2dp2]"),
    ("test_dmuon.py", "test_resume_is_bitwise_identical"),
    ("test_dmuon.py", "test_checkpoint_reshards_to_another_dp_and_tp"),
    ("test_dmuon.py", "test_checkpoint_stores_each_ranks_own_range_once"),
    ("test_dmuon.py", "test_matrix_placement_equals_reference_with_no_dp_collective[tp2dp2]"),
    ("test_dmuon.py", "test_zero3_equals_reference_and_stores_each_parameter_once[dp4]"),
    ("test_overlap.py", "test_overlapped_dmuon_equals_plain_dmuon[pp2dp2]"),
    ("test_checkpoint_chain.py", "test_chain_that_changes_layout_between_segments"),
    ("test_faults.py", "test_nan_loss_stops_the_run_with_one_line"),
    # Megatron's attention / distributed-optimizer internals that QK-clip and Lion use
    ("test_scalars.py", "test_qk_clip_maths_is_megatrons"),
    ("test_scalars.py", "test_lion_matches_megatron_cores_lion"),
    ("test_scalars.py", "test_lion_subset_equals_reference_and_resumes_exactly"),
    ("test_scalars.py", "test_qk_clip_with_dmuon_equals_reference_and_stays_clipped"),
    # the peers, installed in this lane only (.ci/run): emerging_optimizers' AdaptiveMuon and
    # Lion, Megatron-Core's own Muon on its layer-wise distributed optimizer
    ("test_moment2.py", "test_reference_matches_emerging_optimizers"),
    ("test_kernels.py", "test_coefficient_sets_are_emerging_optimizers"),
    "test_peers.py",
}


def in_secondary_lane(item) -> bool:
    name = item.path.name
    return name in SECONDARY_LANE or (name, item.originalname) in SECONDARY_LANE or \
        (name, item.name) in SECONDARY_LANE


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MEGATRON_MUON_CI_LANE") != "secondary":
        return
    skip = pytest.mark.skip(reason="runs in the primary CI lane only (tests/conftest.py)")
    for item in items:
        if not in_secondary_lane(item):
            item.add_marker(skip)
    if not config.invocation_params.args:  # the whole suite: every entry must name a test
        seen = {item.path.name for item in items} | \
            {(item.path.name, n) for item in items for n in (item.originalname, item.name)}
        missing = sorted(map(str, SECONDARY_LANE - seen))
        if missing:
            raise pytest.UsageError(f"tests/conftest.py SECONDARY_LANE names no test: {missing}")
