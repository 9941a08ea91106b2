"""The study's lr rules, registered by name: each one object that says how it trains and how it is read.

Adding a rule is a module with a :class:`~ddplab.study.rules.base.Rule` subclass that calls
:func:`~ddplab.study.rules.registry.register` on itself (see :mod:`ddplab.study.rules.fixed` for the simplest),
imported here. :mod:`~ddplab.study.rules.sweep` is the grid's view over the rules a study asks for.
"""

# ruff: noqa: I001
from __future__ import annotations

# Each built-in rule registers itself on import: the order here is the order --help and the report list them.
from ddplab.study.rules import fixed, adam_sqrt, adamw_tau, surge, tuned, adascale, ramp, schedule  # noqa: F401
from ddplab.study.rules.base import BatchRuns, Best, Rule
from ddplab.study.rules.registry import (
    REGISTRY,
    defaults,
    get,
    ground_truth,
    help_line,
    of,
    predicting,
    register,
    sweeping,
)
from ddplab.study.rules.sweep import (
    anchored,
    b_simple_at,
    grid_runs,
    lrs,
    rules_lr,
    sweep_lrs,
    sweep_only,
    sweep_points,
    tuned_best,
    variants,
    view,
)

__all__ = ["REGISTRY", "BatchRuns", "Best", "Rule", "anchored", "b_simple_at", "defaults", "get", "grid_runs",
           "ground_truth", "help_line", "lrs", "of", "predicting", "register", "rules_lr", "sweep_lrs", "sweep_only",
           "sweep_points", "sweeping", "tuned_best", "variants", "view"]
