"""The study's engines by name: each engine's module registers what it is when it is imported.

Nothing here imports an engine: :mod:`ddplab.study.engines` imports every built-in one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ddplab.runtime.launch import LaunchConfig
    from ddplab.study.branched.checkpoint import BranchTrainer
    from ddplab.study.config import StudyConfig, StudyOptions
    from ddplab.study.workloads import Workload


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineKind:
    """What an engine is, for both products: its name (``--engine``), where it trains, and how it trains branches."""

    name: str
    vectorized: bool
    """Every run at once in this process (else: each run on real ranks)."""
    branches: Callable[..., BranchTrainer]
    """``(workload, config, device, options, launch_config, advance)``: its trainer of one checkpoint's branches."""


ENGINES: dict[str, EngineKind] = {}
"""The engines ``--engine`` names (besides auto and fastest), in fastest's order of preference (a tie goes to the
first)."""


def register(kind: EngineKind) -> EngineKind:
    """Make the engine ``kind`` known by its name."""
    ENGINES[kind.name] = kind
    return kind


def vectorized(name: str) -> bool:
    """Whether the engine ``name`` trains every run at once in this process (fastest, or a mix, is not one engine)."""
    return name in ENGINES and ENGINES[name].vectorized


def branch_trainer(name: str, workload: Workload, config: StudyConfig, device: torch.device, options: StudyOptions,
                   launch_config: LaunchConfig | None, advance: Callable[[int], None]) -> BranchTrainer:
    """The engine ``name``'s trainer of one checkpoint's branches."""
    return ENGINES[name].branches(workload, config, device, options, launch_config, advance)
