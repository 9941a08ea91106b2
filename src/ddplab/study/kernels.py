"""The CPU kernels a study computes with, fixed so the same command and seeds give the same numbers on any machine.

torch picks its CPU kernels by what the processor can do: ATen's vectorized kernels come in AVX-512, AVX2 and
plain builds, and MKL's matrix products take a code path per processor. Each rounds float32 in its own order, and a
run at an unstable lr grows that rounding into other steps to target: on the default digits study the constant
rule's B_crit moved from 33.6 to 39.4 (plain ATen kernels) or 42.8 (MKL's compatible path) on one machine, with the
same seeds, one thread and the same engine. Both choices are read from the environment once, when torch first
needs them, so they are fixed before torch is imported: ATen's plain kernels and MKL's compatible path, which every
x86-64 processor runs alike. A variable the user set stays as set. Torch-free.
"""

from __future__ import annotations

import os
import sys

PINNED = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
"""What fixes the kernels: ATen's plain (not runtime-dispatched) kernels, MKL's processor-independent code path."""


def pin_cpu_kernels() -> bool:
    """Fix the CPU kernels torch will use in this process and the processes it starts, unless torch is already
    imported (its kernels are then whatever it picked); whether the fixed kernels are the ones in effect (False
    too where the user chose others)."""
    if "torch" not in sys.modules:
        for name, value in PINNED.items():
            os.environ.setdefault(name, value)
    return all(os.environ.get(name) == value for name, value in PINNED.items())
