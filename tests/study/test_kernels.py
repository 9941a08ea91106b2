"""The study's CPU kernels are fixed before torch loads, whatever processor runs it."""

import os
import subprocess
import sys

from ddplab.runtime.timescale import scaled
from ddplab.study.kernels import PINNED

PROGRAM = """
import os, sys
from ddplab.study.kernels import pin_cpu_kernels
print(pin_cpu_kernels(), os.environ.get("MKL_CBWR"))
import torch
print(torch.backends.cpu.get_cpu_capability(), pin_cpu_kernels())
"""


def _fresh(env: dict) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env,
                          timeout=scaled(120), check=True)
    return done.stdout.splitlines()


def test_the_kernels_are_fixed_before_torch_loads_unless_the_user_chose():
    plain = {name: value for name, value in os.environ.items() if name not in PINNED}
    assert _fresh(plain) == ["True COMPATIBLE", "DEFAULT True"]
    # A choice the user made stays; the answer says the kernels are not the fixed ones.
    chosen = {**plain, "MKL_CBWR": "AUTO"}
    assert _fresh(chosen) == ["False AUTO", "DEFAULT False"]
