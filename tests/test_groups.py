"""Explicit process groups (``DMuonGroups``) and the island set-up, without launching ranks.

The distributed behaviour is covered by test_dmuon / test_overlap / test_islands; here: a
``pg_collection`` that lacks a group DMuon needs is refused by name, and the island set-up
changes only what it says (``parallel_state.create_group``, and on megatron-core 0.16 the
default world size and ``RankGenerator``'s offset) while Megatron builds its groups, leaves
``torch.distributed.get_rank`` alone and restores everything afterwards.
"""

import inspect

import pytest
import torch.distributed as dist


def test_pg_collection_without_the_groups_dmuon_needs_is_refused():
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_muon.megatron.groups import DMuonGroups

    with pytest.raises(ValueError, match="pg_collection has no tp, dp, tp_dp_cp, pp group"):
        DMuonGroups.from_pg_collection(ProcessGroupCollection())


def test_island_setup_patches_only_what_it_says_and_restores_it():
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron import compat

    before = (dist.get_rank, dist.get_world_size, ps.create_group, ps.RankGenerator)
    native = "rank_offset" in inspect.signature(ps.initialize_model_parallel).parameters
    # island 1 of 2 islands of 2 ranks: global ranks 2 and 3
    with compat._island_groups(2, 2, 1) as extra:
        assert dist.get_rank is before[0]
        assert ps.create_group is not before[2]
        gen = ps.RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=1, order="tp-cp-ep-dp-pp",
                               rank_offset=extra.get("rank_offset", 0))
        assert gen.get_ranks("tp") == [[2, 3]]  # global ranks of the caller's island
        if native:
            assert extra == dict(rank_offset=2, local_world_size=2)
            assert dist.get_world_size is before[1] and ps.RankGenerator is before[3]
        else:
            assert extra == {}
            assert dist.get_world_size() == 2
        with pytest.raises(RuntimeError, match=r"outside island 1 \(ranks 2\.\.3\)"):
            ps.create_group([0, 1])
    assert (dist.get_rank, dist.get_world_size, ps.create_group, ps.RankGenerator) == before
