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


def defaults(family: str) -> tuple[str, ...]:
    """The rules a study with the optimizer ``family`` runs when it is given none, in registry order."""
    return tuple(name for name, rule in REGISTRY.items() if family in rule.default_for)


def help_line() -> str:
    """--rules' help, as a config field's docstring writes it: the defaults, then each rule's own clause."""
    clauses = [rule.help for rule in REGISTRY.values() if rule.help]
    return (f"lr rules, comma-separated (default {','.join(defaults('sgd'))} for SGD, {','.join(defaults('adam'))} "
            "for Adam/AdamW); " + "; ".join(clauses) + ".")


def ground_truth() -> Rule:
    """The registered rule whose sweep is the ground truth the others are judged against (tuned)."""
    return next(rule for rule in REGISTRY.values() if rule.sweeps)


def predicting(family: str) -> Rule:
    """The registered rule whose lr is the textbook prediction of the best for optimizer ``family``."""
    return next(rule for rule in REGISTRY.values() if family in rule.predicts)


def sweeping(config: StudyConfig) -> Rule | None:
    """The study's sweep (the ground truth), if it runs one."""
    return next((rule for rule in of(config) if rule.sweeps), None)
