"""Where the installed megatron-core keeps Megatron-LM's ``megatron/training`` (the wheels of
0.17+ ship it; 0.16.x does not): the tests that drive Megatron-LM's own code look here."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

__all__ = ["installed_training_dir"]


def installed_training_dir() -> Optional[Path]:
    """The installed ``megatron/training`` folder, or None."""
    spec = importlib.util.find_spec("megatron")
    for base in (spec.submodule_search_locations or []) if spec else []:
        if (Path(base) / "training" / "arguments.py").is_file():
            return Path(base) / "training"
    return None
