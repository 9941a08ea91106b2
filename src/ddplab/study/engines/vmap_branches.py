"""The vmap engine's branches: from one checkpoint, each batch's runs vectorized as the engine trains a grid's
group (``torch.func.vmap`` over ``functional_call``, torch.optim's update as stacked foreach steps), in this process.

Each branch continues the data where the checkpoint left it: seed s draws DistributedSampler's epoch permutations
for s from the checkpoint's samples seen on (:class:`~ddplab.study.orders.Stream`), so at one seed every batch size
trains on the very same samples, only grouped differently.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.func import functional_call, vmap

from ddplab.runtime.launch import LaunchConfig
from ddplab.study import optim
from ddplab.study.branched.checkpoint import BranchTrainer, Checkpoint, Groups, Stop, Trained, held_out
from ddplab.study.branched.loading import _optimizer_state
from ddplab.study.config import StudyConfig, StudyOptions
from ddplab.study.engines.registry import EngineKind, register
from ddplab.study.engines.vmap import VmapEngine, cast, runs_that_fit
from ddplab.study.optim import torch_dtype
from ddplab.study.orders import Stream
from ddplab.study.workloads import Workload


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


def branch_trainer(workload: Workload, config: StudyConfig, device: torch.device, options: StudyOptions,
                   launch_config: LaunchConfig | None, advance: Callable[[int], None]) -> BranchTrainer:
    """How this engine trains one checkpoint's branches: batch after batch, in this process."""

    def vectorized(checkpoint: Checkpoint, groups: Groups, samples: int, stop: Stop | None) -> Trained:
        trained: Trained = {}
        for batch, (runs, record) in groups.items():
            trained[batch] = train_branches(workload, config, checkpoint, batch, runs, samples, device=device,
                                            record=record, advance=advance)
            if stop is not None and stop(trained):
                break
        # The steps of the batches the ladder left out: the progress bar counts them done.
        advance(sum(samples // batch for batch in groups if batch not in trained))
        return trained

    return vectorized


register(EngineKind(name=VmapEngine.name, vectorized=True, branches=branch_trainer))
