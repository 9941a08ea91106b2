"""The study's lr rules, registered by name: each one object that says how it trains and how it is read.

Adding a rule is a module with a :class:`~ddplab.study.rules.base.Rule` subclass and one :func:`register` call
(see :mod:`ddplab.study.rules.fixed` for the simplest). The helpers below are the grid's view over the rules a
study asks for.
"""

from __future__ import annotations

from ddplab.study import fit
from ddplab.study.config import OptimizerConfig, StudyConfig
from ddplab.study.rules.adam_sqrt import AdamSqrt
from ddplab.study.rules.adamw_tau import AdamWTau
from ddplab.study.rules.adascale import AdaScale
from ddplab.study.rules.base import BatchRuns, Best, Rule
from ddplab.study.rules.fixed import Constant, Linear, Sqrt
from ddplab.study.rules.ramp import Ramp
from ddplab.study.rules.schedule import Schedule
from ddplab.study.rules.surge import Surge
from ddplab.study.rules.tuned import Tuned
from ddplab.study.runs import RunResult, steps

REGISTRY: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    """Make ``rule`` known to studies by its name (``--rules``)."""
    REGISTRY[rule.name] = rule
    return rule


for _rule in (Constant(), Linear(), Sqrt(), AdamSqrt(), AdamWTau(), Surge(), Tuned(), AdaScale(), Ramp(),
              Schedule()):
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


def variants(config: StudyConfig, global_batch: int) -> dict[str, OptimizerConfig]:
    """The optimizers the tuned sweep trains at ``global_batch`` beside the study's, by the rule they come from:
    each rule's :meth:`~Rule.variant`, once per distinct setting (none without a sweep)."""
    if sweeping(config) is None:
        return {}
    out: dict[str, OptimizerConfig] = {}
    for rule in of(config):
        optimizer = rule.variant(config, global_batch)
        if optimizer is not None and optimizer != config.optimizer and optimizer not in out.values():
            out[rule.name] = optimizer
    return out


def sweep_points(config: StudyConfig, global_batch: int, swept: list[float]) -> list[tuple[float, str]]:
    """(lr, variant) of every setting the sweep trains at its lrs ``swept``: each lr with the study's optimizer
    ("") and with each variant."""
    names = ["", *variants(config, global_batch)]
    return [(lr, variant) for lr in swept for variant in names]


def grid_runs(config: StudyConfig, global_batch: int) -> list[tuple[float, int, str]]:
    """Every (lr, seed, variant) of the shared grid at ``global_batch``."""
    sweep = sweeping(config)
    swept = [lr for lr, names in lrs(config, global_batch).items() if sweep and sweep.name in names]
    extra = [point for point in sweep_points(config, global_batch, swept) if point[1]]
    return [(lr, seed, "") for lr in lrs(config, global_batch) for seed in range(config.seeds)] + \
        [(lr, seed, variant) for lr, variant in extra for seed in range(config.seeds)]


def sweep_only(config: StudyConfig, global_batch: int) -> frozenset[tuple[float, str]]:
    """The grid's (lr, variant) that serve the sweep alone: their runs may stop once they cannot be the best."""
    sweep = sweeping(config)
    if sweep is None:
        return frozenset()
    alone = [lr for lr, names in lrs(config, global_batch).items() if names == [sweep.name]]
    swept = [lr for lr, names in lrs(config, global_batch).items() if sweep.name in names]
    return frozenset([(lr, "") for lr in alone] +
                     [point for point in sweep_points(config, global_batch, swept) if point[1]])


def sweep_lrs(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> dict[float, list[str]]:
    """Every fixed lr trained at ``global_batch`` and the rules it serves: the grid's, and the sweep's extensions
    past its edge."""
    out = {lr: list(names) for lr, names in lrs(config, global_batch).items()}
    sweep = sweeping(config)
    for run in runs:
        if run.extension and sweep is not None:
            out.setdefault(run.lr, [sweep.name])
    return out


def tuned_best(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> Best | None:
    """The sweep's best (lr, variant) at ``global_batch`` among ``runs``, with its median steps; None without a
    sweep or when no median arrived."""
    sweep = sweeping(config)
    if sweep is None:
        return None
    fixed = {r.key: r for r in runs if r.fixed}
    swept = [lr for lr, names in sweep_lrs(config, global_batch, runs).items() if sweep.name in names]
    points = {(lr, variant): [fixed.get((lr, s, variant)) for s in range(config.seeds)]
              for lr, variant in sweep_points(config, global_batch, swept)}
    # A setting whose runs are not all here (a cache from before the variants) is no candidate.
    best = fit.best_lr({point: [steps(r) for r in found] for point, found in points.items() if None not in found})
    return Best(lr=best[0][0], median_steps=best[1], variant=best[0][1]) if best else None


def view(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> BatchRuns:
    """The runs of one batch as the rules read them."""
    own: dict[str, dict[int, RunResult]] = {}
    for run in runs:
        if run.rule:
            own.setdefault(run.rule, {})[run.seed] = run
    return BatchRuns(config=config, global_batch_size=global_batch, lrs=sweep_lrs(config, global_batch, runs),
                     fixed={r.key: r for r in runs if r.fixed}, own=own,
                     best=tuned_best(config, global_batch, runs),
                     variants=tuple(variants(config, global_batch)))


__all__ = ["REGISTRY", "BatchRuns", "Best", "Rule", "get", "grid_runs", "lrs", "of", "register", "sweep_lrs",
           "sweep_points", "sweeping", "tuned_best", "variants", "view"]
