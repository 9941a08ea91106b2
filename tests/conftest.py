import os
import signal

import pytest

from ddplab.runtime.launch import TORCHRUN_VARS


@pytest.fixture(autouse=True)
def _clean_distributed_state():
    """Restore the launcher's environment variables and signal handlers; never leak a process group."""
    saved = {name: os.environ.get(name) for name in TORCHRUN_VARS}
    # torch's elastic agent (elastic_launch in-process) leaves its own SIGINT/SIGTERM handlers behind.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
