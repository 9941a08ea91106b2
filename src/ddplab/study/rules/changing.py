"""What the rules whose global batch changes as they train share (``ramp``, ``schedule``): one model trained in
this process, its loop, and how its runs are read against the tuned fixed runs at their starting batch.

The loop trains one model with the run's optimizer and step (the spec's own where it has them, as on the DDP
engine), from the same initial weights as the grid's runs of its seed, on micro-batches that follow
DistributedSampler's order for that seed (full micro-batches only); an :class:`~ddplab.adapt.accumulation.
AccumulatedBatch` (BatchRamp, BatchSchedule) sets the accumulation steps and the lr factor. It is evaluated as the
grid's runs are, every ``eval_every`` optimizer steps, and each evaluation records the global batch and lr in force
from the next step on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ddplab.study import fit
from ddplab.study.config import StudyConfig, round_lr
from ddplab.study.rules.base import BatchRuns, Rule, row
from ddplab.study.runs import DIVERGED_LOSS, RunGroup, RunResult, settle, steps


class ChangingRule(Rule):
    """A rule whose runs change their global batch as they train: one run per seed from its starting batch, at
    the lr a user would have tuned there, each trained in this process after the other."""

    fitted = False
    single_process = True
    trains_itself = True

    def start(self, config: StudyConfig) -> int | None:
        """The global batch its runs start from, or None without the rule."""
        raise NotImplementedError

    def cache_tag(self, config: StudyConfig) -> str:
        """What keeps its runs' cache apart from another setting's of the same rule."""
        return ""

    def train_one(self, workload, config: StudyConfig, lr: float, seed: int) -> RunResult:
        raise NotImplementedError

    def group(self, config: StudyConfig, global_batch: int, trained: dict[int, list[RunResult]]) -> RunGroup | None:
        if global_batch != self.start(config):
            return None
        lr = start_lr(config, global_batch, trained.get(global_batch, []))
        return RunGroup(global_batch_size=global_batch, runs=tuple((lr, seed) for seed in range(config.seeds)),
                        rule=self.name, optimizer=config.optimizer, cache_tag=self.cache_tag(config))

    def stretches(self, config: StudyConfig) -> int:
        return config.seeds if self.name in config.rules else 0

    def train(self, workload, config: StudyConfig, group: RunGroup, progress) -> list[RunResult]:
        out = []
        for lr, seed in group.runs:
            out.append(self.train_one(workload, config, lr, seed))
            if progress:
                progress(config.max_steps)
        return out

    def seeds_at(self, view: BatchRuns) -> list[RunResult] | None:
        return own_runs(view, self.name)

    def rows(self, view: BatchRuns) -> list[dict]:
        return [row(self.name, view.global_batch_size, run, trajectory=run.trajectory)
                for run in self.seeds_at(view) or []]


def start_lr(config: StudyConfig, start: int, trained: list[RunResult]) -> float:
    """The lr runs start at: what a user would have tuned at the starting batch (else the linear rule's)."""
    from ddplab.study import rules

    best = rules.tuned_best(config, start, trained)
    return best.lr if best else round_lr(config.reference_lr * start / config.reference_global_batch_size)


def train_changing(workload, config: StudyConfig, *, rule: str, global_batch: int, lr: float, seed: int,
                   micro: int, adapter: Callable) -> RunResult:
    """One run from ``global_batch`` at ``lr`` until it reaches the target, diverges or runs out of steps;
    ``adapter(model, optimizer)`` builds the batch's adapter and returns it with what to call before each step."""
    from ddplab.study.engines import vmap
    from ddplab.study.engines.ddp import run_optimizer

    dtype = vmap.torch_dtype(config)
    model = workload.model().to(dtype)
    params, buffers = vmap.seeded_state(workload, seed, dtype)
    model.load_state_dict({**params, **buffers}, strict=False)
    optimizer = run_optimizer(workload, config, model.parameters(), lr)
    batch, before_step = adapter(model, optimizer)
    result = RunResult(global_batch_size=global_batch, lr=lr, seed=seed, rule=rule)
    batches = vmap.Batches(workload.train_size, micro, [seed])
    inputs, targets = vmap.cast(workload.train[0], dtype), vmap.cast(workload.train[1], dtype)
    drawn = samples = 0
    for step in range(config.max_steps):
        window, loss_sum = batch.accumulation_steps, 0.0
        for _ in range(window):
            index = batches.indices(drawn)[0]
            drawn, samples = drawn + 1, samples + micro
            loss = workload.step_fn(model, (inputs[index], targets[index]), workload.loss)
            (loss / window).backward()
            loss_sum += float(loss.detach())
        loss = loss_sum / window
        if not math.isfinite(loss) or abs(loss) > DIVERGED_LOSS:
            result.diverged = True
            break
        before_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % config.eval_every == 0:
            metric = vmap.evaluate_model(workload, config, model)
            result.history.append([step + 1, loss, metric])
            result.trajectory.append([step + 1, batch.global_batch_size, lr * batch.lr_factor()])
            if settle(config, result, step + 1, metric):
                if result.steps_to_target is not None:
                    result.samples_to_target = samples
                break
    batch.remove()
    return result


def own_runs(view: BatchRuns, name: str) -> list[RunResult] | None:
    """The runs of rule ``name``'s group at the view's batch, by seed; None where it has none."""
    own = view.own.get(name, {})
    return [own[seed] for seed in sorted(own)] or None


def medians(runs: list[RunResult]) -> tuple[float, float]:
    """Median steps and median samples to the target (inf where the median run did not arrive)."""
    samples = [float(r.samples_to_target) if r.samples_to_target is not None else math.inf for r in runs]
    return fit.median([steps(r) for r in runs]), fit.median(samples)


def adaptive(start: int, runs: list[RunResult], tuned: list[dict]) -> dict:
    """The ``adaptive`` entry of a rule whose batch changes: its medians beside the tuned fixed runs' at ``start``
    (None where no tuned median arrived there)."""
    median_steps, median_samples = medians(runs)
    fixed = next((p["median_steps"] for p in tuned if p["global_batch_size"] == start), None)
    return {"median_steps": median_steps, "median_samples": median_samples, "start_global_batch_size": start,
            "fixed_median_steps": fixed, "fixed_median_samples": fixed * start if fixed is not None else None}
