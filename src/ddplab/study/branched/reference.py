"""``branch_at``'s reference run: the reference batch and lr, seed 0, trained to the target (or the step
budget), then again to the largest fraction, keeping its state (model and torch.optim's) at each.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from ddplab.errors import UsageError
from ddplab.study.branched.checkpoint import Checkpoint
from ddplab.study.config import StudyConfig
from ddplab.study.engines.vmap import evaluate_model
from ddplab.study.optim import torch_dtype
from ddplab.study.orders import Stream
from ddplab.study.workloads import Workload, run_optimizer


def reference_checkpoints(workload: Workload, config: StudyConfig, fractions: tuple[float, ...],
                          device: torch.device, advance: Callable[[int], None]) -> tuple[list[Checkpoint], dict]:
    """The reference run's states at ``fractions`` of its steps to the target (or ``max_steps``), and the run."""
    steps, reached = _reference_run(workload, config, device, {}, advance)
    keep = sorted({round(f * steps) for f in fractions})
    snapshots: dict[int, Checkpoint] = {step: None for step in keep}
    _reference_run(workload, config, device, snapshots, advance)
    run = {"steps": steps, "reached": reached, "samples": steps * config.reference_global_batch_size,
           "global_batch_size": config.reference_global_batch_size, "lr": config.reference_lr}
    return [snapshots[step] for step in keep], run


def _on_host(value):
    """A copy of ``value`` with every tensor on the host: a checkpoint the same whatever device trained it, that
    ranks can be sent without touching a GPU."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_host(item) for item in value)
    return copy.deepcopy(value)


def _reference_run(workload: Workload, config: StudyConfig, device: torch.device, snapshots: dict[int, Checkpoint],
                   advance: Callable[[int], None]) -> tuple[int, bool]:
    """Train the reference run (seed 0, as the study builds it) to the target, filling ``snapshots`` (step: state
    after that many steps) and stopping after the last; (steps trained, reached)."""
    dtype = torch_dtype(config)
    torch.manual_seed(0)
    model = workload.model().to(dtype).to(device)
    optimizer = run_optimizer(workload, config, model.parameters(), config.reference_lr)
    batch = config.reference_global_batch_size
    stream = Stream(workload.train_size, batch, [0])
    read = workload.batches(device, dtype)
    last = max(snapshots, default=None)
    for step in range(config.max_steps + 1):
        if step in snapshots:
            snapshots[step] = Checkpoint(model={k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                                         optimizer=_on_host(optimizer.state_dict()), samples_seen=step * batch,
                                         source=f"step {step} of the reference run")
            if step == last:
                return step, False
        if step == config.max_steps:
            break
        index = stream.indices(step)[0].to(device)
        optimizer.zero_grad(set_to_none=True)
        workload.step_fn(model, read(index), workload.loss).backward()
        optimizer.step()
        advance(1)
        if (step + 1) % config.eval_every == 0:
            metric = evaluate_model(workload, config, model)
            if not math.isfinite(metric):
                raise UsageError(f"the reference run diverged by step {step + 1}: lower {{reference_lr}} "
                                 f"({config.reference_lr:g})")
            if config.target.reached(metric) and last is None:
                return step + 1, True
    return config.max_steps, False
