"""How ranks are started (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from ddplab.errors import UsageError
from ddplab.validation import at_least, positive

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
    """How long a collective waits for the other ranks before the run fails, naming the rank that stopped answering
    (the process-group timeout)."""
    deadline_s: float | None = None
    """Wall-clock limit for the whole run; ranks still running are stopped and what they measured so far is reported
    where the command can (default: none; SIGTERM/Ctrl-C cancel cleanly). Not applied under torchrun."""
    start_method: StartMethod = "auto"
    """'auto' forks CPU ranks and spawns GPU ranks; 'spawn' starts fresh interpreters on CPU too."""

    def __post_init__(self):
        at_least("world_size", self.world_size)
        if self.backend not in (None, "gloo", "nccl"):
            raise UsageError(f"{{backend}} must be gloo or nccl, got {self.backend!r}")
        positive("pg_timeout_s", self.pg_timeout_s)
        positive("deadline_s", self.deadline_s)
        if self.start_method not in ("auto", "fork", "spawn"):
            raise UsageError(f"{{start_method}} must be auto, fork or spawn, got {self.start_method!r}")

    def for_ranks(self, world_size: int) -> LaunchConfig:
        """This configuration for ``world_size`` ranks (a command's choice when none was given)."""
        return dataclasses.replace(self, world_size=self.world_size or world_size)


def under_torchrun() -> bool:
    """True when a launcher (torchrun, elastic) already assigned this process a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
