"""The study's grid: which runs each global batch needs, trained once and cached per batch size.

The cache lives under ``DIR/runs/``, one JSON per batch size, each written atomically, and is
tied to a fingerprint of the workload (a spec's content included) and every training setting:
a changed setting or spec never silently reuses old runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddplab.errors import UsageError
from ddplab.study import engines
from ddplab.study.config import StudyConfig
from ddplab.study.engines import Engine, Progress
from ddplab.study.grid.cache import Cache
from ddplab.study.rules import registry, sweep
from ddplab.study.rules.base import round_lr
from ddplab.study.runs import RunGroup, RunResult, grid_group

if TYPE_CHECKING:
    # Annotations only: the command study's driver trains nothing here and imports no torch.
    from ddplab.study.workloads import Workload


def check_grid(workload: Workload, config: StudyConfig) -> None:
    """Refuse what cannot run before training anything."""
    too_big = [b for b in config.global_batch_sizes if b > workload.train_size]
    if too_big:
        raise UsageError(f"global batch {too_big[0]} is larger than the {workload.train_size} training samples; "
                         f"use {{global_batch_sizes}} up to {workload.train_size}")
    if workload.val is None and workload.evaluate is None:
        raise UsageError("the workload has no validation split and no evaluate(): nothing tells when the target is "
                         "reached")


def run_grid(workload: Workload, config: StudyConfig, cache: Cache | None, engine: Engine,
             advance: Progress | None = None) -> dict[int, list[RunResult]]:
    """Every batch size's groups, from the cache when they are there, else trained and cached at once: at every
    batch, the reference batch first, the shared grid of fixed lrs (with the tuned sweep's Adam variants) and the
    sweep's extensions past its edge, the rules' lrs scaled from the sweep's best at the reference batch where
    ``rules_lr`` is not given; then each rule's group of its own, which may read the grid at any batch (the surge
    rule's B_simple at the reference).

    ``advance(steps)`` is told each stretch of the step budget as it is used (or skipped).
    """
    results = {}
    budget = _Budget(config)
    # The reference batch first: the rules scale from its sweep's best lr (sweep.anchored), unless told another.
    reference = config.reference_global_batch_size
    for global_batch in sorted(config.global_batch_sizes, key=lambda b: (b != reference, b)):
        if global_batch != reference:
            config = sweep.anchored(config, results)
        runs = sweep.grid_runs(config, global_batch)
        grid = grid_group(config, global_batch, runs, sweep.variants(config, global_batch),
                          sweep_only=sweep.sweep_only(config, global_batch))
        results[global_batch] = _trained(workload, config, cache, engine, grid, advance) if runs else []
        results[global_batch] += _extend_sweep(workload, config, cache, engine, global_batch, results[global_batch],
                                               budget)
    # Then the groups of rules with runs of their own (another update, an lr another rule may share).
    for global_batch in sorted(config.global_batch_sizes):
        for rule in registry.of(config):
            group = rule.group(config, global_batch, results)
            if group is not None:
                results[global_batch] += _trained(workload, config, cache, engine, group, advance)
    return {b: results[b] for b in sorted(results)}


def _trained(workload: Workload, config: StudyConfig, cache: Cache | None, engine: Engine, group: RunGroup,
             advance: Progress | None) -> list[RunResult]:
    """One group's runs: cached, or trained (by the engine that claims it, else the study's)."""
    engine = engines.for_group(engine, group)
    cached = cache.load_any(group.global_batch_size, group.cache_key) if cache else {}
    keys = group.keys()
    if all(key in cached for key in keys):
        if advance:
            advance(config.max_steps * (len(group.runs) if engine.per_run else 1))
        return [cached[key] for key in keys]
    # Seeds or lrs added to a finished study: its runs are kept and only the new ones train. A pruned run is
    # trained again, as the bound it was pruned at came from fewer runs than the group now holds.
    kept = {key: cached[key] for key in keys if key in cached and not cached[key].pruned}
    if kept and advance and engine.per_run:
        advance(config.max_steps * len(kept))
    trained = engine.train(workload, config, group.only(set(keys) - set(kept)) if kept else group, advance)
    by_key = {**kept, **{run.key: run for run in trained}}
    if cache:
        cache.save(group.global_batch_size, list({**cached, **by_key}.values()), group.cache_key)
    return [by_key[key] for key in keys]


class _Budget:
    """Fixed-lr runs the study may still add to extend its sweeps (``max_runs`` less the grid's own)."""

    def __init__(self, config: StudyConfig):
        self.left = config.max_runs - sum(len(sweep.grid_runs(config, b)) for b in config.global_batch_sizes)
        if self.left < 0:
            raise UsageError(f"the grid has {config.max_runs - self.left} fixed-lr runs, more than {{max_runs}} "
                             f"{config.max_runs}: raise it, or give fewer {{global_batch_sizes}}, seeds or a coarser "
                             "{sweep_factor}")


def _extend_sweep(workload: Workload, config: StudyConfig, cache: Cache | None, engine: Engine, global_batch: int,
                  runs: list[RunResult], budget: _Budget) -> list[RunResult]:
    """Runs past the sweep's edge, a factor at a time, until its best lr is interior (or the next lr diverged, or
    the budget is spent): the sweep's best is only a best when something on each side lost to it."""
    tuned = registry.sweeping(config)
    if tuned is None:
        return []
    cached = cache.load_any(global_batch, "-extension") if cache else {}
    variants = sweep.variants(config, global_batch)
    added: list[RunResult] = []
    while True:
        best = sweep.tuned_best(config, global_batch, runs + added)
        lrs = sorted(lr for lr, names in sweep.sweep_lrs(config, global_batch, runs + added).items()
                     if tuned.name in names)
        if best is None or best.lr not in (lrs[0], lrs[-1]):
            return added
        lr = round_lr(best.lr * config.sweep_factor if best.lr == lrs[-1] else best.lr / config.sweep_factor)
        # The new lr with every setting the sweep tries, as each of its lrs.
        new = [(lr, seed, variant) for _, variant in sweep.sweep_points(config, global_batch, [lr])
               for seed in range(config.seeds)]
        # As in a group of the grid: what an earlier driver trained is kept (a pruned run trains again beside a new
        # seed, whose runs move the bound it was pruned at).
        missing = [key for key in new if key not in cached]
        missing += [key for key in new if missing and key in cached and cached[key].pruned]
        if missing and budget.left < len(missing):
            return added
        budget.left -= len(missing)
        fresh = engine.train(workload, config, grid_group(config, global_batch, missing, variants,
                                                          extension=True)) if missing else []
        by_key = {**cached, **{run.key: run for run in fresh}}
        trained = [by_key[key] for key in new]
        added += trained
        if cache:
            cache.save(global_batch, added, "-extension")
        if all(r.diverged for r in trained):
            return added


def groups(config: StudyConfig) -> int:
    """Stretches of ``max_steps`` the grid trains: a group per batch size, and those of the rules' own groups."""
    return sum(bool(sweep.grid_runs(config, b)) for b in config.global_batch_sizes) + \
        sum(rule.stretches(config) for rule in registry.of(config))
