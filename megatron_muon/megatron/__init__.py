"""The Megatron-Core adapter: config, optimizer factory, DMuon DistributedOptimizer, CPU mode.

Dependencies point one way: this package composes ``megatron_muon.plan``,
``megatron_muon.comm``, ``megatron_muon.kernels`` and the maths; none of those import it.
"""
