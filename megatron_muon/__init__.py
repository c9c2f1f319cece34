"""megatron-muon: Muon for Megatron-Core at cluster scale.

Maths (``Muon``, ``newton_schulz``) import without Megatron; the Megatron adapter
(``DMuonOptimizerConfig``, ``get_megatron_optimizer``) is imported on first use.
"""

from .muon import Muon
from .newton_schulz import COEFFICIENT_SETS, muon_scale, newton_schulz
from .units import Unit

__version__ = "0.1.0"

_LAZY = {
    "DMuonOptimizerConfig": "megatron_muon.megatron.config",
    "get_megatron_optimizer": "megatron_muon.megatron.factory",
    "DMuonDistributedOptimizer": "megatron_muon.megatron.dmuon",
    "smuon_direction": "megatron_muon.smuon",
    "SMuon": "megatron_muon.smuon",
    "iso_c": "megatron_muon.isoloco",
    "apply_lora": "megatron_muon.megatron.lora",
    "LoRAConfig": "megatron_muon.megatron.lora",
    "LoRAOptimizer": "megatron_muon.megatron.lora_optimizer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_muon' has no attribute {name!r}")


__all__ = ["Muon", "newton_schulz", "muon_scale", "COEFFICIENT_SETS", "Unit", *_LAZY]
