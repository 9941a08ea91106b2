"""The study's engines by name: a table of the built-in engines' modules, each imported when the table is first
asked (:func:`kinds`); each module registers what it is when it is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
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
first); filled by :func:`kinds`."""
BUILT_IN = ("ddplab.study.engines.vmap_branches", "ddplab.study.engines.ddp_branches")
"""The built-in engines' modules, in fastest's order of preference."""
_loaded = False


def kinds() -> dict[str, EngineKind]:
    """Every engine by name, the built-in ones' modules imported the first time."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILT_IN:
            importlib.import_module(module)
        # Fastest's order, whichever module a program imported first.
        order = sorted(ENGINES.values(), key=lambda kind: _rank(kind.branches.__module__))
        ENGINES.clear()
        ENGINES.update((kind.name, kind) for kind in order)
    return ENGINES


def _rank(module: str) -> int:
    return BUILT_IN.index(module) if module in BUILT_IN else len(BUILT_IN)


def register(kind: EngineKind) -> EngineKind:
    """Make the engine ``kind`` known by its name."""
    ENGINES[kind.name] = kind
    return kind


def vectorized(name: str) -> bool:
    """Whether the engine ``name`` trains every run at once in this process (fastest, or a mix, is not one engine)."""
    return name in kinds() and ENGINES[name].vectorized


def branch_trainer(name: str, workload: Workload, config: StudyConfig, device: torch.device, options: StudyOptions,
                   launch_config: LaunchConfig | None, advance: Callable[[int], None]) -> BranchTrainer:
    """The engine ``name``'s trainer of one checkpoint's branches."""
    return kinds()[name].branches(workload, config, device, options, launch_config, advance)
