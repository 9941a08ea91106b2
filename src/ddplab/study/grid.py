"""The study's grid: which runs each global batch needs, trained once and cached per batch size.

The cache lives under ``DIR/runs/``, one JSON per batch size, each written atomically, and is
tied to a fingerprint of the workload (a spec's content included) and every training setting:
a changed setting or spec never silently reuses old runs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

from ddplab.errors import UsageError, literal
from ddplab.serialize import write_json_atomic
from ddplab.study import analysis, ramp
from ddplab.study.config import StudyConfig, round_lr
from ddplab.study.engine import RunResult, train_group
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


class RankZeroCache:
    """A study under torchrun: rank 0 alone reads and writes the cache, and every rank takes its answer."""

    def __init__(self, cache: Cache | None, rank: int):
        self.cache, self.rank = cache, rank

    def load(self, global_batch: int, runs: list[tuple[float, int]], kind: str = "") -> list[RunResult] | None:
        import torch.distributed as dist

        found = [self.cache.load(global_batch, runs, kind) if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def load_any(self, global_batch: int, kind: str) -> dict[tuple[float, int], RunResult]:
        import torch.distributed as dist

        found = [self.cache.load_any(global_batch, kind) if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def save(self, global_batch: int, results: list[RunResult], kind: str = "") -> None:
        if self.rank == 0:
            self.cache.save(global_batch, results, kind)


class Cache:
    """Finished groups under ``DIR/runs/``, one JSON per batch size, written atomically."""

    def __init__(self, directory: str, fingerprint: str, *, fresh: bool):
        self.directory, self.fingerprint = directory, fingerprint
        self.runs_dir = os.path.join(directory, "runs")
        self.stamp = os.path.join(directory, "config.json")
        if fresh and os.path.isdir(self.runs_dir):
            shutil.rmtree(self.runs_dir)
        # Only runs count: a study that failed before its first group left nothing to protect.
        if self._holds_runs() and self._stamped() not in (None, fingerprint):
            raise UsageError(f"{{out}} {literal(repr(directory))} holds runs of a study with other settings or another "
                             "spec; pass {fresh} to start over or choose another {out}")
        os.makedirs(self.runs_dir, exist_ok=True)

    def _holds_runs(self) -> bool:
        return os.path.isdir(self.runs_dir) and any(name.endswith(".json") for name in os.listdir(self.runs_dir))

    def _stamped(self) -> str | None:
        if not os.path.exists(self.stamp):
            return None
        return self._read(self.stamp).get("fingerprint")

    def _read(self, path: str):
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            raise UsageError(f"the study cache file {literal(path)} cannot be read (cut short or edited?): pass "
                             "{fresh} to start over") from None

    def _path(self, global_batch: int, kind: str) -> str:
        return os.path.join(self.runs_dir, f"batch-{global_batch}{kind}.json")

    def load(self, global_batch: int, runs: list[tuple[float, int]], kind: str = "") -> list[RunResult] | None:
        """The cached runs of one group (``kind`` "-adascale" for the AdaScale runs), or None."""
        cached = self.load_any(global_batch, kind)
        # A cached group serves when it holds every run asked for (a grid may shrink, not grow).
        if not cached or not all(key in cached for key in runs):
            return None
        return [cached[key] for key in runs]

    def load_any(self, global_batch: int, kind: str) -> dict[tuple[float, int], RunResult]:
        """Every cached run of one file, by (lr, seed)."""
        path = self._path(global_batch, kind)
        if not os.path.exists(path):
            return {}
        try:
            return {(r["lr"], r["seed"]): RunResult(**r) for r in self._read(path)}
        except (TypeError, KeyError):
            raise UsageError(f"the study cache file {literal(path)} holds no runs ddplab wrote: pass {{fresh}} to "
                             "start over") from None

    def save(self, global_batch: int, results: list[RunResult], kind: str = "") -> None:
        write_json_atomic(self.stamp, {"fingerprint": self.fingerprint})
        write_json_atomic(self._path(global_batch, kind), [r.to_json() for r in results], standard=False)


Trainer = Callable[..., list[RunResult]]
"""train(workload, config, global_batch, runs, advance, *, sweep_only, adascale, adam_sqrt) → the group's results."""


def run_grid(workload: Workload, config: StudyConfig, cache: Cache | None,
             advance: Callable[[int], None] | None = None, train: Trainer = train_group) -> dict[int, list[RunResult]]:
    """Every batch size's group, from the cache when it is there, else trained by ``train`` and cached at once.

    ``advance(steps)`` is told each stretch of the step budget as it is used (or skipped).
    """
    results = {}
    budget = _Budget(config)
    for global_batch in sorted(config.global_batch_sizes):
        results[global_batch] = []
        # The fixed-lr runs, then AdaScale's and adam-sqrt's (an lr another rule may share, but another update):
        # each a group and a cache file of their own.
        for runs, kind in ((config.grid_runs(global_batch), ""), (config.adascale_runs(global_batch), "-adascale"),
                           (config.adam_sqrt_runs(global_batch), "-adam-sqrt")):
            if not runs:
                continue
            cached = cache.load(global_batch, runs, kind) if cache else None
            if cached is None:
                sweep_only = {lr for lr, rules in config.lrs(global_batch).items() if rules == ["tuned"]} \
                    if not kind else set()
                cached = train(workload, config, global_batch, runs, advance, sweep_only=sweep_only,
                               adascale=kind == "-adascale", adam_sqrt=kind == "-adam-sqrt")
                if cache:
                    cache.save(global_batch, cached, kind)
            elif advance:
                advance(config.max_steps)
            results[global_batch] += cached
        results[global_batch] += _extend_sweep(workload, config, cache, global_batch, results[global_batch], train,
                                               budget)
    start = ramp.start_batch(config)
    if start is not None:
        results[start] += _ramp_runs(workload, config, cache, results[start], advance)
    return results


class _Budget:
    """Fixed-lr runs the study may still add to extend its sweeps (``max_runs`` less the grid's own)."""

    def __init__(self, config: StudyConfig):
        self.left = config.max_runs - sum(len(config.grid_runs(b)) for b in config.global_batch_sizes)
        if self.left < 0:
            raise UsageError(f"the grid has {config.max_runs - self.left} fixed-lr runs, more than {{max_runs}} "
                             f"{config.max_runs}: raise it, or give fewer {{global_batch_sizes}}, seeds or a coarser "
                             "{sweep_factor}")


def _extend_sweep(workload: Workload, config: StudyConfig, cache: Cache | None, global_batch: int,
                  runs: list[RunResult], train, budget: _Budget) -> list[RunResult]:
    """Runs past the tuned sweep's edge, a factor at a time, until its best lr is interior (or the next lr
    diverged, or the budget is spent): the sweep's best is only a best when something on each side lost to it."""
    if "tuned" not in config.rules:
        return []
    cached = cache.load_any(global_batch, "-extension") if cache else {}
    added: list[RunResult] = []
    while True:
        fixed = {(global_batch, r.lr, r.seed): r for r in runs + added if r.fixed}
        lrs = analysis.sweep_lrs(config, global_batch, runs + added)
        best = analysis.tuned_best(config, global_batch, lrs, fixed)
        sweep = sorted(lr for lr, rules in lrs.items() if "tuned" in rules)
        if best is None or best[0] not in (sweep[0], sweep[-1]):
            return added
        lr = round_lr(best[0] * config.sweep_factor if best[0] == sweep[-1] else best[0] / config.sweep_factor)
        new = [(lr, seed) for seed in range(config.seeds)]
        if all(key in cached for key in new):
            trained = [cached[key] for key in new]
        elif budget.left < len(new):
            return added
        else:
            budget.left -= len(new)
            trained = train(workload, config, global_batch, new, None)
            for run in trained:
                run.extension = True
        added += trained
        if cache:
            cache.save(global_batch, added, "-extension")
        if all(r.diverged for r in trained):
            return added


def _ramp_runs(workload: Workload, config: StudyConfig, cache: Cache | None, at_start: list[RunResult],
               advance: Callable[[int], None] | None) -> list[RunResult]:
    """One ramp run per seed, from the best tuned lr at the starting batch (else the linear rule's lr there)."""
    lr = ramp_lr(config, at_start)
    runs = [(lr, seed) for seed in range(config.seeds)]
    cached = cache.load(ramp.start_batch(config), runs, "-ramp") if cache else None
    if cached is None:
        cached = []
        for _, seed in runs:
            cached.append(ramp.train_ramp(workload, config, lr, seed))
            if advance:
                advance(config.max_steps)
        if cache:
            cache.save(ramp.start_batch(config), cached, "-ramp")
    elif advance:
        advance(config.max_steps * config.seeds)
    return cached


def ramp_lr(config: StudyConfig, at_start: list[RunResult]) -> float:
    """The lr ramp runs start at: what a user would have tuned at the starting batch."""
    start = ramp.start_batch(config)
    fixed = {(start, r.lr, r.seed): r for r in at_start if r.fixed}
    lrs = analysis.sweep_lrs(config, start, at_start)
    best = analysis.tuned_best(config, start, lrs, fixed) if "tuned" in config.rules else None
    return best[0] if best else round_lr(config.rule_lr("linear", start))


def groups(config: StudyConfig) -> int:
    """Stretches of ``max_steps`` the grid trains: a group per batch size, one more per batch size AdaScale runs
    at, and one per ramp run."""
    ramps = config.seeds if ramp.start_batch(config) is not None else 0
    return sum(bool(config.grid_runs(b)) + bool(config.adascale_runs(b)) + bool(config.adam_sqrt_runs(b))
               for b in config.global_batch_sizes) + ramps
