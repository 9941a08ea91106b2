"""The noise scale at a checkpoint's weights: B_simple = tr Σ / |G|² from global batches each split into two
halves, as two DDP ranks would see them (``ddplab noise --world-size 2``'s estimator)."""

from __future__ import annotations

import math

import torch

from ddplab.noise import estimators
from ddplab.study.branched.checkpoint import Checkpoint
from ddplab.study.config import StudyConfig
from ddplab.study.engines.vmap import cast
from ddplab.study.optim import torch_dtype
from ddplab.study.orders import Stream
from ddplab.study.workloads import Workload

B_SIMPLE_BATCHES = 16
"""Batches the noise scale is measured on at each checkpoint (two halves each, as two DDP ranks would see them)."""


def b_simple_at_checkpoint(workload: Workload, config: StudyConfig, checkpoint: Checkpoint, global_batch: int,
                device: torch.device, batches: int = B_SIMPLE_BATCHES) -> float | None:
    """The noise scale B_simple = tr Σ / |G|² at the checkpoint's weights, from ``batches`` global batches each split
    into two halves (``ddplab noise --world-size 2``'s estimator with its finite-dataset correction); None when
    |G|² is not above 0."""
    dtype = torch_dtype(config)
    torch.manual_seed(0)
    model = workload.model().to(dtype).to(device)
    model.load_state_dict({k: cast(v, dtype) for k, v in checkpoint.model.items()})
    half = min(global_batch, workload.train_size) // 2
    stream = Stream(workload.train_size, 2 * half, [0], start=checkpoint.samples_seen)
    read = workload.batches(device, dtype)
    g2s, traces = [], []
    for step in range(batches):
        index = stream.indices(step)[0].to(device)
        grads = [_flat_grad(workload, model, read(index[rank::2])) for rank in (0, 1)]
        small = float((grads[0].pow(2).sum() + grads[1].pow(2).sum()) / 2)
        big = float(((grads[0] + grads[1]) / 2).pow(2).sum())
        g2, trace = estimators.unbiased_estimates(small, big, half, 2 * half, dataset_size=workload.train_size)
        g2s.append(g2)
        traces.append(trace)
    value = estimators.summarize(g2s, traces).b_simple
    return value if math.isfinite(value) else None


def _flat_grad(workload: Workload, model: torch.nn.Module, batch) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(workload.step_fn(model, batch, workload.loss), params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().double() for g, p in zip(grads, params)])
