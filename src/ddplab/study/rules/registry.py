"""The study's lr rules by name: a table of the built-in rules' modules, each imported the first time a rule is
asked for (:func:`known`); each module registers its one object here when it is imported.

The registry knows a rule only by the little it reads of it (:class:`Registered`), so the study's config, which
checks the rules it is given, stands below the rules, which read that config.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

BUILT_IN = ("ddplab.study.rules.fixed", "ddplab.study.rules.adam_sqrt", "ddplab.study.rules.adamw_tau",
            "ddplab.study.rules.surge", "ddplab.study.rules.tuned", "ddplab.study.rules.adascale",
            "ddplab.study.rules.ramp", "ddplab.study.rules.schedule")
"""The built-in rules' modules: the order --help and the report list them in."""


class Registered(Protocol):
    """What the registry and the config read of a rule (:class:`~ddplab.study.rules.base.Rule` is the whole)."""

    name: str
    help: str
    default_for: tuple[str, ...]
    predicts: tuple[str, ...]
    sweeps: bool

    def check(self, config: Any) -> None: ...

    def measures_at_reference(self, config: Any) -> str | None: ...


_REGISTRY: dict[str, Any] = {}
_loaded = False


def known() -> dict[str, Any]:
    """Every rule by name (``--rules``), the built-in ones' modules imported the first time, in their order."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILT_IN:
            importlib.import_module(module)
        # The built-in order, whichever rule module a program imported first.
        order = sorted(_REGISTRY.values(), key=lambda rule: _rank(type(rule).__module__))
        _REGISTRY.clear()
        _REGISTRY.update((rule.name, rule) for rule in order)
    return _REGISTRY


def _rank(module: str) -> int:
    return BUILT_IN.index(module) if module in BUILT_IN else len(BUILT_IN)


def register(rule: Registered) -> Registered:
    """Make ``rule`` known to studies by its name (``--rules``)."""
    _REGISTRY[rule.name] = rule
    return rule


def get(name: str) -> Any:
    return known()[name]


def of(config: Any) -> list[Any]:
    """The rules a study runs, in its order."""
    return [known()[name] for name in config.rules]


def defaults(family: str) -> tuple[str, ...]:
    """The rules a study with the optimizer ``family`` runs when it is given none, in registry order."""
    return tuple(name for name, rule in known().items() if family in rule.default_for)


def help_line() -> str:
    """--rules' help, as a config field's docstring writes it: the defaults, then each rule's own clause."""
    clauses = [rule.help for rule in known().values() if rule.help]
    return (f"lr rules, comma-separated (default {','.join(defaults('sgd'))} for SGD, {','.join(defaults('adam'))} "
            "for Adam/AdamW); " + "; ".join(clauses) + ".")


def ground_truth() -> Any:
    """The registered rule whose sweep is the ground truth the others are judged against (tuned)."""
    return next(rule for rule in known().values() if rule.sweeps)


def predicting(family: str) -> Any:
    """The registered rule whose lr is the textbook prediction of the best for optimizer ``family``."""
    return next(rule for rule in known().values() if family in rule.predicts)


def sweeping(config: Any) -> Any | None:
    """The study's sweep (the ground truth), if it runs one."""
    return next((rule for rule in of(config) if rule.sweeps), None)
