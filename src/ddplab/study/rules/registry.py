"""The study's lr rules by name: each rule's module registers its one object here when it is imported.

Nothing here imports a rule: :mod:`ddplab.study.rules` imports every built-in one, and a rule of one's own is
registered by importing its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddplab.study.rules.base import Rule

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig

REGISTRY: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    """Make ``rule`` known to studies by its name (``--rules``)."""
    REGISTRY[rule.name] = rule
    return rule


def get(name: str) -> Rule:
    return REGISTRY[name]


def of(config: StudyConfig) -> list[Rule]:
    """The rules a study runs, in its order."""
    return [REGISTRY[name] for name in config.rules]


def sweeping(config: StudyConfig) -> Rule | None:
    """The study's sweep (the ground truth), if it runs one."""
    return next((rule for rule in of(config) if rule.sweeps), None)
