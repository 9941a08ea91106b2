"""The study's engines, for both products: what trains a grid's run groups and a checkpoint's branches.

- ``vmap`` (:mod:`~ddplab.study.engines.vmap`, its branches :mod:`~ddplab.study.engines.vmap_branches`): every run
  of a group in one process, vectorized;
- ``ddp`` (:mod:`~ddplab.study.engines.ddp`, :mod:`~ddplab.study.engines.ddp_branches`): each run on real DDP ranks;
- ``changing`` (:mod:`~ddplab.study.engines.changing`): runs whose batch changes, one model each, in this process;
  it claims their groups whatever the study's engine (:func:`for_group`);
- ``fastest`` (:mod:`~ddplab.study.engines.fastest`) times a step on each; :mod:`~ddplab.study.engines.choice` is the
  one chooser both products ask (``auto`` is a fixed choice there, never a timing).

The engines are a table (:mod:`~ddplab.study.engines.registry`): each module is imported when the table is first
asked, so a driver that only checks its flags (``study -- COMMAND``) stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddplab.study.engines.base import Engine, Progress
from ddplab.study.engines.fastest import Fastest, duration, fastest
from ddplab.study.engines.registry import EngineKind, branch_trainer, kinds, register, vectorized
from ddplab.study.rules import registry

if TYPE_CHECKING:
    from ddplab.study.runs import RunGroup


def claiming() -> tuple[Engine, ...]:
    """Engines that train every group they claim, whatever engine the study trains the rest on (loaded when asked:
    each imports torch)."""
    from ddplab.study.engines.changing import ChangingEngine

    return (ChangingEngine(),)


def for_group(engine: Engine, group: RunGroup) -> Engine:
    """The engine that trains ``group``: the one that claims it, else the study's ``engine``."""
    # A rule whose runs change their batch is the changing engine's (ChangingEngine.claims): said without torch.
    if not (group.rule and registry.get(group.rule).batch_changes):
        return engine
    return next((other for other in claiming() if other.claims(group)), engine)


def __getattr__(name: str):
    # The table of engines by name, its modules imported on first use (each imports torch).
    if name == "ENGINES":
        return kinds()
    if name == "CLAIMING":
        return claiming()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CLAIMING", "ENGINES", "Engine", "EngineKind", "Fastest", "Progress", "branch_trainer", "claiming",
           "duration", "fastest", "for_group", "kinds", "register", "vectorized"]
