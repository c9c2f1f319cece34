"""``get_megatron_optimizer``: Megatron-Core's factory, plus ``'dmuon'`` and ``'muon_naive'``."""

from __future__ import annotations

from megatron.core.optimizer import get_megatron_optimizer as _mcore_get_megatron_optimizer

__all__ = ["get_megatron_optimizer"]


def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
    """Same signature and return type as ``megatron.core.optimizer.get_megatron_optimizer``."""
    name = getattr(config, "optimizer", None)
    if name in ("dmuon", "muon_naive"):
        from .dmuon import build_dmuon_optimizer

        return build_dmuon_optimizer(config, model_chunks, *args, **kwargs)
    return _mcore_get_megatron_optimizer(config, model_chunks, *args, **kwargs)
