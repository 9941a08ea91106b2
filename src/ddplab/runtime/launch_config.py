"""How ranks are started (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from ddplab.errors import UsageError

Backend = Literal["gloo", "nccl"]
StartMethod = Literal["auto", "fork", "spawn"]
DEFAULT_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to start ranks."""

    world_size: int | None = None
    """Number of ranks to start; None lets the command choose (ignored under torchrun, whose WORLD_SIZE wins)."""
    backend: Backend | None = None
    """'gloo' or 'nccl'; None picks NCCL when every rank has its own GPU, else gloo."""
    pg_timeout_s: float = DEFAULT_TIMEOUT_S
    """Process-group timeout: a collective that does not complete raises after this, naming the rank that stopped."""
    deadline_s: float | None = None
    """Wall-clock limit for the whole launch; ranks still running after it are stopped. None: no limit."""
    start_method: StartMethod = "auto"
    """'auto' forks CPU ranks and spawns GPU ranks; 'spawn' starts fresh interpreters on CPU too."""

    def __post_init__(self):
        if self.world_size is not None and not self.world_size >= 1:
            raise UsageError(f"{{world_size}} must be at least 1, got {self.world_size}")
        if self.backend not in (None, "gloo", "nccl"):
            raise UsageError(f"{{backend}} must be gloo or nccl, got {self.backend!r}")
        if not 0 < self.pg_timeout_s < float("inf"):
            raise UsageError(f"{{pg_timeout_s}} must be a positive number, got {self.pg_timeout_s}")
        if self.deadline_s is not None and not 0 < self.deadline_s < float("inf"):
            raise UsageError(f"{{deadline_s}} must be a positive number, got {self.deadline_s}")
        if self.start_method not in ("auto", "fork", "spawn"):
            raise UsageError(f"{{start_method}} must be auto, fork or spawn, got {self.start_method!r}")

    def for_ranks(self, world_size: int) -> LaunchConfig:
        """This configuration for ``world_size`` ranks (a command's choice when none was given)."""
        return dataclasses.replace(self, world_size=self.world_size or world_size)


def under_torchrun() -> bool:
    """True when a launcher (torchrun, elastic) already assigned this process a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
