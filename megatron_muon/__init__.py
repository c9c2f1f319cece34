"""megatron-muon: Muon for Megatron-Core at cluster scale.

Maths (``Muon``, ``newton_schulz``) import without Megatron; the Megatron adapter
(``DMuonOptimizerConfig``, ``get_megatron_optimizer``) is imported on first use.
"""

from megatron_muon.core.muon import Muon
from megatron_muon.core.newton_schulz import COEFFICIENT_SETS, muon_scale, newton_schulz
from megatron_muon.core.units import Unit

__version__ = "0.1.0"

_LAZY = {
    "DMuonOptimizerConfig": "megatron_muon.megatron.config",
    "get_megatron_optimizer": "megatron_muon.megatron.factory",
    "DMuonDistributedOptimizer": "megatron_muon.megatron.dmuon",
    "smuon_direction": "megatron_muon.peft.smuon",
    "SMuon": "megatron_muon.peft.smuon",
    "riemannion_update": "megatron_muon.peft.riemannion",
    "Riemannion": "megatron_muon.peft.riemannion",
    "iso_c": "megatron_muon.islands.isoloco",
    "apply_lora": "megatron_muon.peft.lora",
    "LoRAConfig": "megatron_muon.peft.lora",
    "LoRAOptimizer": "megatron_muon.peft.lora_optimizer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_muon' has no attribute {name!r}")


__all__ = ["Muon", "newton_schulz", "muon_scale", "COEFFICIENT_SETS", "Unit", *_LAZY]
