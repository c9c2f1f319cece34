"""The Megatron-Core adapter: config, optimizer factory, DMuon DistributedOptimizer, CPU mode.

Dependencies point one way: this package composes ``megatron_muon.core.plan``,
``megatron_muon.distributed.comm``, ``megatron_muon.kernels`` and the maths; none of those import it.
"""
