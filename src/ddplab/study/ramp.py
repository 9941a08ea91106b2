"""The study's ``ramp`` rule: ``ddplab.BatchRamp`` itself, one run per seed, from the grid's smallest batch.

A ramp run's global batch changes as it trains, so it cannot share a vectorized group: it trains
one model in this process, on either engine, with the run's optimizer and step (the spec's own where
it has them, as on the DDP engine), the one-process noise scale (micro-batches of
half the starting batch, measured at every step) and the library's BatchRamp, growing up to the
grid's largest batch with the linear rule and a warmup of ``WARMUP_STEPS`` after each jump. Its
micro-batches follow DistributedSampler's order for the run's seed (full micro-batches only), it
starts from the same initial weights as the grid's runs of that seed, and it is evaluated as they
are, every ``eval_every`` optimizer steps.
"""

from __future__ import annotations

import math

from ddplab.adapt.ramp import BatchRamp
from ddplab.noise.scale import GradientNoiseScale
from ddplab.study.config import StudyConfig
from ddplab.study.ddp import default_step, run_optimizer
from ddplab.study.engine import (
    DIVERGED_LOSS,
    RunResult,
    _Batches,
    cast,
    evaluate_model,
    seeded_state,
    stalled,
    torch_dtype,
)
from ddplab.study.workloads import Workload

WARMUP_STEPS = 10


def start_batch(config: StudyConfig) -> int | None:
    """The global batch ramp runs start from (the grid's smallest), or None without the rule."""
    if "ramp" not in config.rules:
        return None
    return min(config.global_batch_sizes)


def train_ramp(workload: Workload, config: StudyConfig, lr: float, seed: int) -> RunResult:
    """One ramp run from :func:`start_batch` at ``lr`` until it reaches the target, diverges or runs out of steps."""
    start = start_batch(config)
    micro = start // 2
    dtype = torch_dtype(config)
    model = workload.model().to(dtype)
    params, buffers = seeded_state(workload, seed, dtype)
    model.load_state_dict({**params, **buffers}, strict=False)
    optimizer = run_optimizer(workload, config, model.parameters(), lr)
    step_fn = workload.step or default_step
    noise = GradientNoiseScale(model, per_device_batch_size=micro, accumulation_steps=2, every=1,
                               dataset_size=workload.train_size)
    largest = min(max(config.global_batch_sizes), workload.train_size)
    ramp = BatchRamp(model, optimizer, noise, max_accumulation_steps=max(2, largest // micro), rule="linear",
                     warmup_steps=WARMUP_STEPS)
    result = RunResult(global_batch_size=start, lr=lr, seed=seed, ramp=True)
    batches = _Batches(workload.train_size, micro, [seed])
    inputs, targets = cast(workload.train[0], dtype), cast(workload.train[1], dtype)
    drawn = samples = 0
    for step in range(config.max_steps):
        window, loss_sum = ramp.accumulation_steps, 0.0
        for _ in range(window):
            index = batches.indices(drawn)[0]
            drawn, samples = drawn + 1, samples + micro
            loss = step_fn(model, (inputs[index], targets[index]), workload.loss)
            (loss / window).backward()
            loss_sum += float(loss.detach())
        loss = loss_sum / window
        if not math.isfinite(loss) or abs(loss) > DIVERGED_LOSS:
            result.diverged = True
            break
        noise.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % config.eval_every == 0:
            metric = evaluate_model(workload, config, model)
            result.history.append([step + 1, loss, metric])
            result.trajectory.append([step + 1, ramp.global_batch_size, lr * ramp.lr_factor()])
            if not math.isfinite(metric):
                result.diverged = True
                break
            if config.target.reached(metric):
                result.steps_to_target, result.samples_to_target = step + 1, samples
                break
            if stalled(config, result.history):
                result.stalled = True
                break
    ramp.remove()
    return result
