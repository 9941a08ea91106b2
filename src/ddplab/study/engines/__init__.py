"""The study's engines, for both products: what trains a grid's run groups and a checkpoint's branches.

- ``vmap`` (:mod:`~ddplab.study.engines.vmap`, its branches :mod:`~ddplab.study.engines.vmap_branches`): every run
  of a group in one process, vectorized;
- ``ddp`` (:mod:`~ddplab.study.engines.ddp`, :mod:`~ddplab.study.engines.ddp_branches`): each run on real DDP ranks;
- ``changing`` (:mod:`~ddplab.study.engines.changing`): runs whose batch changes, one model each, in this process;
  it claims their groups whatever the study's engine (:func:`for_group`);
- ``fastest`` (:mod:`~ddplab.study.engines.fastest`) times a step on each; :mod:`~ddplab.study.engines.choice` is the
  one chooser both products ask (``auto`` is a fixed choice there, never a timing).

Each engine registers itself (:mod:`~ddplab.study.engines.registry`) when its module is imported, here.
"""

# ruff: noqa: I001
from __future__ import annotations

from typing import TYPE_CHECKING

# Every built-in engine registers itself on import: the order here is fastest's order of preference.
from ddplab.study.engines import vmap_branches, ddp_branches  # noqa: F401
from ddplab.study.engines.fastest import Fastest, duration, fastest
from ddplab.study.engines.base import Engine, Progress
from ddplab.study.engines.changing import ChangingEngine
from ddplab.study.engines.registry import ENGINES, EngineKind, branch_trainer, register, vectorized

if TYPE_CHECKING:
    from ddplab.study.runs import RunGroup

CLAIMING: tuple[Engine, ...] = (ChangingEngine(),)
"""Engines that train every group they claim, whatever engine the study trains the rest on."""


def for_group(engine: Engine, group: RunGroup) -> Engine:
    """The engine that trains ``group``: the one that claims it, else the study's ``engine``."""
    return next((claiming for claiming in CLAIMING if claiming.claims(group)), engine)


__all__ = ["CLAIMING", "ENGINES", "Engine", "EngineKind", "Fastest", "Progress", "branch_trainer", "duration",
           "fastest", "for_group", "register", "vectorized"]
