"""What the adapt tests share: an example script run under torchrun on 2 CPU ranks."""

import os
import subprocess
import sys

import pytest

from ddplab.runtime.timescale import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def torchrun_example():
    """Run ``examples/NAME`` under torchrun (2 ranks, a free port); its stdout, after checking it exited 0."""

    def run(name: str) -> str:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               os.path.join(ROOT, "examples", name)], capture_output=True, text=True,
                              timeout=scaled(170))
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    return run
