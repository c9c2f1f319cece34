"""The process groups DMuon works over, named once and passed explicitly.

``DMuonGroups`` is built once by the factory (``build_dmuon_optimizer``) and handed to the
distributed optimizers, the owner planner and the exchange, so that nothing below the
factory reads Megatron's ``parallel_state`` globals. It comes from Megatron's
``ProcessGroupCollection`` (``pg_collection``) when the caller has one -- Megatron-LM
passes it to ``get_megatron_optimizer``, and islands build an island-local one -- and
otherwise from ``parallel_state`` (the groups ``initialize_model_parallel`` made).

Groups (``None`` where the layout does not have them):

* ``tp``, ``dp``, ``pp``, ``cp``: tensor, data (without context parallelism), pipeline and
  context parallel groups of this rank;
* ``tp_dp``: the joint TP x DP group of this pipeline stage, DMuon's exchange group;
* ``expt_tp``, ``expt_dp``: the expert tensor- and data-parallel groups (MoE);
* ``expt_tp_dp``: their product, every rank holding a piece of this rank's experts (expert
  TP x expert DP of one EP rank and stage): Megatron has no such group, so ``build`` makes it
  when both factors have more than one rank (``expt_exchange``: DMuon's exchange group for
  the experts, this product or the one factor that is more than one rank);
* ``optimizer``: what Megatron's ``setup_process_groups_for_optimizer`` returns for the
  distributed optimizers (model-parallel group, intra-instance DP groups and their gloo
  copies, the grad-stats group).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["DMuonGroups"]


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


@dataclass(frozen=True)
class DMuonGroups:
    """Explicit process groups of one rank (see the module docstring)."""

    tp: Optional[Any]
    dp: Optional[Any]
    tp_dp: Optional[Any]
    pp: Optional[Any]
    expt_tp: Optional[Any] = None
    expt_dp: Optional[Any] = None
    cp: Optional[Any] = None
    expt_tp_dp: Optional[Any] = None
    pg_collection: Optional[Any] = field(default=None, repr=False, compare=False)
    optimizer: dict = field(default_factory=dict, repr=False, compare=False)

    # -- sizes and ranks (1 and 0 for a group that is not there) ---------------------------
    tp_size = property(lambda self: _size(self.tp), doc="tensor-parallel size")
    tp_rank = property(lambda self: _rank(self.tp), doc="rank in the tensor-parallel group")
    dp_size = property(lambda self: _size(self.dp), doc="data-parallel size (no CP)")
    dp_rank = property(lambda self: _rank(self.dp), doc="rank in the data-parallel group")
    pp_size = property(lambda self: _size(self.pp), doc="pipeline-parallel size")
    cp_size = property(lambda self: _size(self.cp), doc="context-parallel size")
    expt_tp_size = property(lambda self: _size(self.expt_tp), doc="expert tensor-parallel size")
    expt_tp_rank = property(lambda self: _rank(self.expt_tp),
                            doc="rank in the expert tensor-parallel group")
    expt_dp_size = property(lambda self: _size(self.expt_dp), doc="expert data-parallel size")

    @property
    def expt_exchange(self):
        """Every rank holding a piece of this rank's experts: ``expt_tp_dp`` when both expert
        TP and expert DP have more than one rank (``build`` makes it), else the factor that
        has (expert DP when neither has)."""
        if self.expt_tp_dp is not None:
            return self.expt_tp_dp
        if self.expt_tp_size > 1 and self.expt_dp_size > 1:
            raise ValueError("DMuon with expert TP > 1 and expert DP > 1 exchanges over their "
                             "product group, which DMuonGroups.build makes")
        return self.expt_tp if self.expt_tp_size > 1 else self.expt_dp

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_pg_collection(cls, pg) -> "DMuonGroups":
        """From a Megatron ``ProcessGroupCollection`` (its ``dp`` excludes context parallelism;
        its TP x DP group ``tp_dp_cp`` includes it, which DMuon requires to be 1)."""
        def get(name):
            try:
                return getattr(pg, name, None)
            except (AttributeError, AssertionError):
                return None

        missing = [name for name in ("tp", "dp", "tp_dp_cp", "pp") if get(name) is None]
        if missing:
            raise ValueError(f"pg_collection has no {', '.join(missing)} group(s); DMuon needs "
                             "tp, dp, tp_dp_cp and pp (ProcessGroupCollection."
                             "use_mpu_process_groups() fills every field)")
        cp = get("cp")
        if _size(cp) > 1:
            raise ValueError("optimizer='dmuon' does not support context parallelism yet")
        return cls(tp=get("tp"), dp=get("dp"), tp_dp=get("tp_dp_cp"), pp=get("pp"),
                   expt_tp=get("expt_tp"), expt_dp=get("expt_dp"), cp=cp, pg_collection=pg)

    @classmethod
    def from_parallel_state(cls) -> "DMuonGroups":
        """From the groups Megatron's ``initialize_model_parallel`` made."""
        from megatron.core import parallel_state as ps

        def get(fn, **kw):
            try:
                return fn(**kw)
            except (AssertionError, RuntimeError):  # a group this layout does not have
                return None

        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            dp=ps.get_data_parallel_group(with_context_parallel=False),
            tp_dp=ps.get_tensor_and_data_parallel_group(with_context_parallel=False),
            pp=ps.get_pipeline_model_parallel_group(),
            expt_tp=get(ps.get_expert_tensor_parallel_group),
            expt_dp=get(ps.get_expert_data_parallel_group),
            cp=get(ps.get_context_parallel_group))

    @classmethod
    def build(cls, pg_collection=None, model_chunks=None,
              use_gloo_process_groups: bool = True) -> "DMuonGroups":
        """``from_pg_collection`` when one is given, else ``from_parallel_state``; with
        ``model_chunks`` also the distributed optimizers' groups (``optimizer``)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = cls.from_pg_collection(pg_collection) if pg_collection is not None \
            else cls.from_parallel_state()
        if groups.expt_tp_size > 1 and groups.expt_dp_size > 1:
            groups = dataclasses.replace(groups, expt_tp_dp=_product_group(groups.expt_tp,
                                                                           groups.expt_dp))
        if model_chunks is None:
            return groups
        opt = ProcessGroupCollection.setup_process_groups_for_optimizer(
            pg_collection, model_chunks, use_gloo_process_groups)
        return dataclasses.replace(groups, optimizer=dict(opt))


def _product_group(a, b):
    """The group of every rank that ``a`` x ``b`` reach from this rank (``a`` then ``b``
    hops; Megatron's groups tile the world so that the order does not matter).  Collective
    over the world, as ``new_group`` is: every rank learns every rank's members of both and
    makes each distinct product, in one order, keeping its own."""
    members = [None] * dist.get_world_size()
    dist.all_gather_object(members, (dist.get_process_group_ranks(a),
                                     dist.get_process_group_ranks(b)))
    products = [tuple(sorted({r for q in b_ranks for r in members[q][0]}))
                for _, b_ranks in members]
    mine = None
    for ranks in sorted(set(products)):
        group = dist.new_group(list(ranks))
        if ranks == products[dist.get_rank()]:
            mine = group
    return mine
