"""What every command that trains a spec on DDP ranks takes (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses

from ddplab.validation import at_least

DEFAULT_WORLD_SIZE = 2
"""Ranks a command starts when none are asked for (under torchrun: torchrun's WORLD_SIZE)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecRunConfig:
    """A spec trained on W DDP ranks of b samples each (``ddplab check``, ``ddplab noise``)."""

    spec_path: str
    """The training spec file (model(), dataset(), loss(), optionally optimizer() and step())."""
    per_device_batch_size: int
    """Per-device (per-rank) batch."""
    world_size: int | None = None
    """DDP ranks (default 2; under torchrun its WORLD_SIZE)."""
    steps: int
    """Optimizer steps."""
    seed: int = 0
    """Model init and data order seed."""

    def __post_init__(self):
        for field in ("world_size", "per_device_batch_size", "steps"):
            at_least(field, getattr(self, field))

