"""The study's lr rules, registered by name: each one object that says how it trains and how it is read.

Adding a rule is a module with a :class:`~ddplab.study.rules.base.Rule` subclass and one :func:`register` call
(see :mod:`ddplab.study.rules.fixed` for the simplest). The helpers below are the grid's view over the rules a
study asks for.
"""

from __future__ import annotations

from ddplab.study import fit
from ddplab.study.config import StudyConfig
from ddplab.study.rules.adam_sqrt import AdamSqrt
from ddplab.study.rules.adascale import AdaScale
from ddplab.study.rules.base import BatchRuns, Rule
from ddplab.study.rules.fixed import Constant, Linear, Sqrt
from ddplab.study.rules.ramp import Ramp
from ddplab.study.rules.tuned import Tuned
from ddplab.study.runs import RunResult, steps

REGISTRY: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    """Make ``rule`` known to studies by its name (``--rules``)."""
    REGISTRY[rule.name] = rule
    return rule


for _rule in (Constant(), Linear(), Sqrt(), AdamSqrt(), Tuned(), AdaScale(), Ramp()):
    register(_rule)


def get(name: str) -> Rule:
    return REGISTRY[name]


def of(config: StudyConfig) -> list[Rule]:
    """The rules a study runs, in its order."""
    return [REGISTRY[name] for name in config.rules]


def sweeping(config: StudyConfig) -> Rule | None:
    """The study's sweep (the ground truth), if it runs one."""
    return next((rule for rule in of(config) if rule.sweeps), None)


def lrs(config: StudyConfig, global_batch: int) -> dict[float, list[str]]:
    """Every lr the shared grid trains at ``global_batch`` and the rules it serves (one run serves several)."""
    out: dict[float, list[str]] = {}
    for rule in of(config):
        for lr in rule.grid_lrs(config, global_batch):
            out.setdefault(lr, []).append(rule.name)
    return out


def grid_runs(config: StudyConfig, global_batch: int) -> list[tuple[float, int]]:
    """Every (lr, seed) of the shared grid at ``global_batch``."""
    return [(lr, seed) for lr in lrs(config, global_batch) for seed in range(config.seeds)]


def sweep_only(config: StudyConfig, global_batch: int) -> frozenset[float]:
    """The grid's lrs that serve the sweep alone: their runs may stop once they cannot be the best."""
    sweep = sweeping(config)
    return frozenset(lr for lr, names in lrs(config, global_batch).items() if sweep and names == [sweep.name])


def sweep_lrs(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> dict[float, list[str]]:
    """Every fixed lr trained at ``global_batch`` and the rules it serves: the grid's, and the sweep's extensions
    past its edge."""
    out = {lr: list(names) for lr, names in lrs(config, global_batch).items()}
    sweep = sweeping(config)
    for run in runs:
        if run.extension and sweep is not None:
            out.setdefault(run.lr, [sweep.name])
    return out


def tuned_best(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> tuple[float, float] | None:
    """(lr, median steps) of the sweep's best lr at ``global_batch`` among ``runs``; None without a sweep or when
    no lr's median arrived."""
    sweep = sweeping(config)
    if sweep is None:
        return None
    fixed = {(r.lr, r.seed): r for r in runs if r.fixed}
    swept = [lr for lr, names in sweep_lrs(config, global_batch, runs).items() if sweep.name in names]
    return fit.best_lr({lr: [steps(fixed[(lr, s)]) for s in range(config.seeds)] for lr in swept})


def view(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> BatchRuns:
    """The runs of one batch as the rules read them."""
    own: dict[str, dict[int, RunResult]] = {}
    for run in runs:
        if run.rule:
            own.setdefault(run.rule, {})[run.seed] = run
    return BatchRuns(config=config, global_batch_size=global_batch, lrs=sweep_lrs(config, global_batch, runs),
                     fixed={(r.lr, r.seed): r for r in runs if r.fixed}, own=own,
                     best=tuned_best(config, global_batch, runs))


__all__ = ["REGISTRY", "BatchRuns", "Rule", "get", "grid_runs", "lrs", "of", "register", "sweep_lrs", "sweeping",
           "tuned_best", "view"]
