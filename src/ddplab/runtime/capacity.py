"""Refuse work that cannot fit, before any of it starts: ranks × memory against what the machine has.

One careless ``--world-size 2000`` once forked ranks until the machine ran out of memory; every
command that starts ranks or allocates by a user's number asks here first.
"""

from __future__ import annotations

import os
import warnings

from ddplab.errors import DdplabWarning, UsageError

# What a forked CPU rank costs beyond what it shares with its parent: gloo's buffers and threads, the
# interpreter's own pages once touched, allocator slack. Measured on torch 2.13 CPU: 60-120 MB.
RANK_OVERHEAD_BYTES = 128 * 2**20
# Headroom left to the rest of the machine.
SAFETY = 0.8


def available_bytes() -> int | None:
    """Memory the kernel says a new allocation can get (MemAvailable), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> int | None:
    """This process's resident memory, or None where it cannot say."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def check_memory(needed: int, what: str, field: str) -> None:
    """UsageError when ``needed`` bytes exceed what this machine has free; ``what`` says what needs them."""
    available = available_bytes()
    if available is not None and needed > SAFETY * available:
        raise UsageError(f"{what} needs about {size(needed)}, more than this machine has free "
                         f"({size(available)}): lower {{{field}}}")


def check_ranks(world_size: int, per_rank_bytes: int, *, on_cpu: bool) -> None:
    """Refuse ranks whose memory cannot fit; warn when CPU ranks outnumber the cores (they time-share)."""
    check_memory(world_size * (per_rank_bytes + RANK_OVERHEAD_BYTES),
                 f"{world_size} ranks of about {size(per_rank_bytes + RANK_OVERHEAD_BYTES)} each", "world_size")
    cores = os.cpu_count() or 1
    if on_cpu and world_size > cores:
        warnings.warn(f"{world_size} CPU ranks on {cores} cores time-share them: every step waits for the slowest, "
                      "so timings mean little (the results are still exact)", DdplabWarning, stacklevel=2)


def size(count: float) -> str:
    """Bytes as a person reads them: 12 KB, 1.5 GB."""
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit in ("B", "KB") else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TB"
