"""The engine for runs whose global batch changes as they train (the ``ramp`` and ``schedule`` rules).

Such a run cannot share a vectorized group: each trains one model in this process, with the run's optimizer and
step (the spec's own where it has them, as on the DDP engine), from the same initial weights as the grid's runs of
its seed, on micro-batches that follow DistributedSampler's order for that seed (full micro-batches only). The
rule's adapter (BatchRamp, BatchSchedule) sets the accumulation steps and the lr factor. It is evaluated as the
grid's runs are, every ``eval_every`` optimizer steps, and each evaluation records the global batch and lr in force
from the next step on.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ddplab.study.engines.base import Progress
from ddplab.study.engines.vmap import evaluate_model, seeded_state
from ddplab.study.optim import torch_dtype
from ddplab.study.orders import Batches
from ddplab.study.rules import registry
from ddplab.study.runs import DIVERGED_LOSS, RunGroup, RunResult, settle
from ddplab.study.workloads import run_optimizer

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig
    from ddplab.study.rules.changing import ChangingRule
    from ddplab.study.workloads import Workload


class ChangingEngine:
    """Each run of a group whose rule changes the batch, one after the other, in this process."""

    name = "changing"
    overhead = 1.0
    per_run = True

    def claims(self, group: RunGroup) -> bool:
        """Whether this engine, and no other, trains ``group``: its rule's runs change their batch."""
        return bool(group.rule) and registry.get(group.rule).batch_changes

    def train(self, workload: Workload, config: StudyConfig, group: RunGroup,
              progress: Progress | None = None) -> list[RunResult]:
        rule = registry.get(group.rule)
        out = []
        for lr, seed in group.runs:
            out.append(train_changing(workload, config, rule, group.global_batch_size, lr, seed))
            if progress:
                progress(config.max_steps)
        return out

    def seconds_per_step(self, workload: Workload, config: StudyConfig, group: RunGroup) -> float:
        raise NotImplementedError("a run whose batch changes has no one step to time")


def train_changing(workload: Workload, config: StudyConfig, rule: ChangingRule, global_batch: int, lr: float,
                   seed: int) -> RunResult:
    """One run of ``rule`` from ``global_batch`` at ``lr`` until it reaches the target, diverges or runs out of
    steps."""
    dtype = torch_dtype(config)
    model = workload.model().to(dtype)
    params, buffers = seeded_state(workload, seed, dtype)
    model.load_state_dict({**params, **buffers}, strict=False)
    optimizer = run_optimizer(workload, config, model.parameters(), lr)
    batch, before_step = rule.adapter(workload, config, model, optimizer)
    micro = rule.micro_batch_size(config)
    result = RunResult(global_batch_size=global_batch, lr=lr, seed=seed, rule=rule.name)
    batches = Batches(workload.train_size, micro, [seed])
    read = workload.batches("cpu", dtype)
    drawn = samples = 0
    for step in range(config.max_steps):
        window, loss_sum = batch.accumulation_steps, 0.0
        for _ in range(window):
            index = batches.indices(drawn)[0]
            drawn, samples = drawn + 1, samples + micro
            loss = workload.step_fn(model, read(index), workload.loss)
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
            metric = evaluate_model(workload, config, model)
            result.history.append([step + 1, loss, metric])
            result.trajectory.append([step + 1, batch.global_batch_size, lr * batch.lr_factor()])
            if settle(config, result, step + 1, metric):
                if result.steps_to_target is not None:
                    result.samples_to_target = samples
                break
    batch.remove()
    return result
