"""Branches from one checkpoint at one global batch, vectorized as the grid's vmap engine trains a group
(``torch.func.vmap`` over ``functional_call``, torch.optim's update as stacked foreach steps), and the noise scale
at a checkpoint's weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.func import functional_call, vmap

from ddplab.noise import estimators
from ddplab.study import optim
from ddplab.study.branched.checkpoint import Checkpoint, held_out
from ddplab.study.branched.loading import _optimizer_state
from ddplab.study.config import StudyConfig
from ddplab.study.engines.vmap import cast, runs_that_fit, torch_dtype
from ddplab.study.orders import Stream
from ddplab.study.workloads import Workload

B_SIMPLE_BATCHES = 16
"""Batches the noise scale is measured on at each checkpoint (two halves each, as two DDP ranks would see them)."""


def train_branches(workload: Workload, config: StudyConfig, checkpoint: Checkpoint, global_batch: int,
                   runs: list[tuple[float, int]], samples: int, *, device: torch.device, record: set[int] = frozenset(),
                   advance: Callable[[int], None] = lambda steps: None) -> dict[int, list[float]]:
    """Train ``runs`` (lr, seed) from ``checkpoint`` at ``global_batch`` for ``samples``: {steps: each run's held-out
    loss after them}, at the last step and at those in ``record``."""
    fit = runs_that_fit(workload, config, global_batch, device)
    if len(runs) > fit:
        # A group too large for memory trains in parts, each a group of its own.
        parts = [train_branches(workload, config, checkpoint, global_batch, runs[start:start + fit], samples,
                                device=device, record=record, advance=advance) for start in range(0, len(runs), fit)]
        return {step: [loss for part in parts for loss in part[step]] for step in parts[0]}
    return _Branches(workload, config, checkpoint, global_batch, runs, device).train(samples, record, advance)


class _Branches:
    """Runs from one checkpoint at one global batch, as stacked parameters trained together."""

    def __init__(self, workload: Workload, config: StudyConfig, checkpoint: Checkpoint, global_batch: int,
                 runs: list[tuple[float, int]], device: torch.device):
        dtype = torch_dtype(config)
        self.workload, self.global_batch, self.device = workload, global_batch, device
        self.model = workload.model().to(dtype).to(device)
        named = dict(self.model.named_parameters())
        state = {k: cast(v, dtype).to(device) for k, v in checkpoint.model.items()}
        self.params = {n: state[n].expand(len(runs), *state[n].shape).clone() for n in named}
        self.buffers = {n: state[n].expand(len(runs), *state[n].shape).clone() for n, _ in self.model.named_buffers()}
        self.optimizer = optim.stacked([config.optimizer] * len(runs), self.params)
        _load_optimizer(self.optimizer, _optimizer_state(workload, config, checkpoint), len(runs), self.params)
        # float64 on the host, as the stacked optimizers take it (torch.optim's lr is a Python float).
        self.lr = torch.tensor([lr for lr, _ in runs], dtype=torch.float64)
        seeds = sorted({seed for _, seed in runs})
        self.seed_row = torch.tensor([seeds.index(seed) for _, seed in runs])
        self.stream = Stream(workload.train_size, global_batch, seeds, start=checkpoint.samples_seen)
        self.inputs, self.targets = cast(workload.train[0], dtype).to(device), cast(workload.train[1], dtype).to(device)
        val_inputs, val_targets = held_out(workload)
        self.val = cast(val_inputs, dtype).to(device), cast(val_targets, dtype).to(device)
        self._forward = vmap(lambda p, b, x: functional_call(self.model, (p, b), (x,)), randomness="different")
        self._losses = vmap(workload.loss)

    def train(self, samples: int, record: set[int], advance: Callable[[int], None]) -> dict[int, list[float]]:
        steps = samples // self.global_batch
        # Dropout draws its own mask for every run, the same for the same checkpoint and batch.
        torch.manual_seed(self.global_batch)
        out = {0: self.held_out_losses()} if 0 in record else {}
        for step in range(steps):
            self.step(step)
            advance(1)
            if step + 1 in record or step + 1 == steps:
                out[step + 1] = self.held_out_losses()
        return out

    def step(self, step: int) -> None:
        index = self.stream.indices(step)[self.seed_row].to(self.device)
        leaves = {name: p.detach().requires_grad_() for name, p in self.params.items()}
        losses = self._losses(self._forward(leaves, self.buffers, self.inputs[index]), self.targets[index])
        # Runs share no parameters: one backward of the summed losses gives each run its own gradient.
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
        with torch.no_grad():
            self.optimizer.step(self.params, dict(zip(leaves, grads)), self.lr)

    def held_out_losses(self) -> list[float]:
        """Each run's training loss on the held-out split, in eval mode (a diverged run's is inf)."""
        inputs, targets = self.val
        self.model.eval()
        try:
            with torch.no_grad():
                outputs = vmap(lambda p, b: functional_call(self.model, (p, b), (inputs,)))(self.params, self.buffers)
                losses = vmap(lambda output: self.workload.loss(output, targets))(outputs)
        finally:
            self.model.train()
        return [x if math.isfinite(x) else math.inf for x in losses.double().tolist()]


def _load_optimizer(stacked: optim.StackedOptimizer, states: dict[str, dict] | None, runs: int,
                    like: dict[str, torch.Tensor]) -> None:
    """The checkpoint's torch.optim state, repeated for every run of a branch group."""
    if states is None:
        return

    def stack(key: str) -> dict[str, torch.Tensor]:
        return {name: states[name][key].to(like[name]).expand(runs, *like[name].shape[1:]).clone()
                for name in stacked.names}

    if isinstance(stacked, optim.StackedAdam):
        stacked.state = {"m": stack("exp_avg"), "v": stack("exp_avg_sq")}
        stacked.steps = int(states[stacked.names[0]]["step"])
    elif stacked.configs[0].momentum:
        # torch.optim.SGD starts its buffer from the first gradient; a saved buffer means that step was taken.
        stacked.state = {"buf": stack("momentum_buffer")}
        stacked.steps = 1


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
    inputs, targets = cast(workload.train[0], dtype).to(device), cast(workload.train[1], dtype).to(device)
    g2s, traces = [], []
    for step in range(batches):
        index = stream.indices(step)[0].to(device)
        grads = [_flat_grad(workload, model, inputs[index[rank::2]], targets[index[rank::2]]) for rank in (0, 1)]
        small = float((grads[0].pow(2).sum() + grads[1].pow(2).sum()) / 2)
        big = float(((grads[0] + grads[1]) / 2).pow(2).sum())
        g2, trace = estimators.unbiased_estimates(small, big, half, 2 * half, dataset_size=workload.train_size)
        g2s.append(g2)
        traces.append(trace)
    value = estimators.summarize(g2s, traces).b_simple
    return value if math.isfinite(value) else None


def _flat_grad(workload: Workload, model: torch.nn.Module, inputs, targets) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(workload.step_fn(model, (inputs, targets), workload.loss), params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().double() for g, p in zip(grads, params)])
