import os

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def mcore_version():
    import megatron.core
    from packaging.version import Version

    return Version(megatron.core.__version__)
