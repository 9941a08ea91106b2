import os

import pytest

from ddplab.runtime.launch import TORCHRUN_VARS


@pytest.fixture(autouse=True)
def _clean_distributed_state():
    """Restore the launcher's environment variables and never leak a process group."""
    saved = {name: os.environ.get(name) for name in TORCHRUN_VARS}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
