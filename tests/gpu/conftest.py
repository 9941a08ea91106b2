"""The GPU checks: every test marked ``gpu`` is skipped where torch sees no CUDA device.

They keep CUDA out of the test process (each CUDA run is a command, a spawned rank or a script), so the CPU
tests that fork ranks after them in the same session still can.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cuda_stays_out_of_the_test_process():
    yield
    # A forked CPU rank crashes once its parent initialised CUDA: launch refuses to fork then.
    assert not torch.cuda.is_initialized(), "a GPU test initialised CUDA in the test process"
