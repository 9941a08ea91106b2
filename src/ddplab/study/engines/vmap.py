"""The vectorized engine: every run of one global batch trained together, as stacked parameters.

A global batch B trains the same on W DDP ranks as in one process with B (DDP averages the
ranks' mean gradients), so each batch size's runs live in one process: a slice of stacked
parameters per run, one forward and backward for all of them through ``torch.func.vmap`` over
``functional_call`` — never a loop over runs. Each run's data order is DistributedSampler's
(seed + epoch permutation, full batches only), so :mod:`ddplab.study.grid.verify` can replay any grid
point on real DDP ranks and compare.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.func import functional_call, vmap

from ddplab.adapt.gain import Smoothed, default_smoothing
from ddplab.errors import UsageError
from ddplab.noise import estimators
from ddplab.runtime import capacity
from ddplab.study import optim
from ddplab.study.config import StudyConfig
from ddplab.study.engines.base import Progress
from ddplab.study.optim import torch_dtype
from ddplab.study.orders import Batches
from ddplab.study.runs import DIVERGED_LOSS, RunGroup, RunResult, loser_bound, settle, settled_best
from ddplab.study.workloads import Workload


def seeded_params(workload: Workload, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's parameters as built under ``seed`` (as every DDP rank builds them)."""
    return seeded_state(workload, seed, dtype)[0]


def seeded_state(workload: Workload, seed: int, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's parameters and buffers (BatchNorm's running statistics) as built under ``seed``."""
    torch.manual_seed(seed)
    model = workload.model().to(dtype)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return params, {name: b.detach().clone() for name, b in model.named_buffers()}


class Group:
    """All runs of one global batch size, as stacked parameters trained together."""

    def __init__(self, workload: Workload, config: StudyConfig, group: RunGroup, *, device: torch.device | str = "cpu"):
        global_batch, runs = group.global_batch_size, list(group.runs)
        self.workload, self.config, self.global_batch = workload, config, global_batch
        self.device = torch.device(device)
        dtype = torch_dtype(config)
        self.model = workload.model().to(dtype).to(self.device)
        seeds = sorted({seed for _, seed in runs})
        init = {seed: seeded_state(workload, seed, dtype) for seed in seeds}
        self.params = {name: torch.stack([init[seed][0][name] for _, seed in runs]).to(self.device)
                       for name in init[seeds[0]][0]}
        # Buffers (BatchNorm's running statistics) are per run too: each run's forward updates its own slice.
        self.buffers = {name: torch.stack([init[seed][1][name] for _, seed in runs]).to(self.device)
                        for name in init[seeds[0]][1]}
        # Each run steps with its own optimizer settings (the tuned sweep's Adam variants share a group).
        self.optimizer = optim.stacked(group.run_optimizers(), self.params)
        # Dropout draws a different mask for every run (vmap's randomness="different"), the same for the same grid.
        torch.manual_seed(global_batch)
        # In Python's precision on the host, as torch.optim holds an lr: the optimizer rounds what it derives once.
        self.lr = torch.tensor([lr for lr, _ in runs], dtype=torch.float64)
        self.seed_row = torch.tensor([seeds.index(seed) for _, seed in runs])
        self.active = list(range(len(runs)))
        self.results = group.results()
        adascale = group.lr_scaling == "gain"
        # AdaScale (ddplab.adapt's gain and smoothing, per run): the lr of each update is lr × r_t.
        self.scale = global_batch / config.reference_global_batch_size if adascale else None
        if self.scale is not None and (self.scale < 1 or global_batch < 2):
            raise UsageError(f"AdaScale scales up from the reference global batch {config.reference_global_batch_size}"
                             f" and measures with two halves of the batch: global batch {global_batch} cannot")
        self.smoothed = [Smoothed(default_smoothing(self.scale)) for _ in runs] if adascale else []
        self.tau = [0.0] * len(runs)
        self.batches = Batches(workload.train_size, global_batch, seeds)
        self.inputs = cast(workload.train[0], dtype).to(self.device)
        self.targets = cast(workload.train[1], dtype).to(self.device)
        self._forward = vmap(lambda params, buffers, inputs: functional_call(self.model, (params, buffers), (inputs,)),
                             randomness="different")
        self._losses = vmap(workload.loss)

    def _grad_and_loss(self, params, inputs, targets, buffers=None):
        # Runs share no parameters, so one backward of the summed losses gives each run its own gradient
        # (cheaper than vmap over torch.func.grad, and bit-identical).
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        losses = self._losses(self._forward(leaves, self.buffers if buffers is None else buffers, inputs), targets)
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
        return dict(zip(leaves, grads)), losses.detach()

    def _grad(self, inputs, targets):
        # A measurement only: the running statistics it would update are a copy, thrown away.
        return self._grad_and_loss(self.params, inputs, targets, {n: b.clone() for n, b in self.buffers.items()})[0]

    def step(self, step: int, *, measure: bool) -> torch.Tensor:
        """One optimizer step of every active run (torch.optim's formula, ddplab.study.optim); returns losses."""
        indices = self.batches.indices(step)[self.seed_row].to(self.device)
        inputs, targets = self.inputs[indices], self.targets[indices]
        grads, losses = self._grad_and_loss(self.params, inputs, targets)
        # AdaScale needs the estimates at every step; the fixed-lr runs only where they are recorded.
        estimates = None
        if (measure or self.scale is not None) and self.global_batch >= 2:
            estimates = self._estimates(inputs, targets)
        if measure and estimates is not None:
            for row, run in enumerate(self.active):
                self.results[run].noise_g2.append(estimates[row][0])
                self.results[run].noise_trace.append(estimates[row][1])
        lr = self.lr if self.scale is None else self.lr * self._gains(estimates, step, record=measure)
        with torch.no_grad():
            self.optimizer.step(self.params, grads, lr)
        return losses

    def _estimates(self, inputs, targets) -> list[tuple[float, float]]:
        """Each active run's (|G|², tr Σ) as two DDP ranks of B/2 measure it (``ddplab noise --world-size 2``).

        The batch's two rank shares (DistributedSampler's even and odd positions) each get their own gradient:
        the small batch's |g|² is the mean of theirs, the big batch's the square of their mean. Using both halves,
        tr Σ ∝ |g₀ − g₁|² is never negative and far less noisy than one half against the whole batch; with
        BatchNorm each half normalizes over its own B/2, as on two ranks.
        """
        half = self.global_batch // 2
        # One rank's share after the other: the memory of one half-batch pass, as a single half needed before.
        shares = [self._grad(inputs[:, rank:2 * half:2], targets[:, rank:2 * half:2]) for rank in (0, 1)]
        pairs = list(zip(*(share.values() for share in shares)))
        small_sq = sum((_squared_norms(g0) + _squared_norms(g1)) / 2 for g0, g1 in pairs)
        big_sq = sum(_squared_norms((g0 + g1) / 2) for g0, g1 in pairs)
        # Both halves come from one pass without replacement over the training set: noise's finite-data correction.
        size = self.workload.train_size
        return [estimators.unbiased_estimates(s, b, half, 2 * half, dataset_size=size)
                for s, b in zip(small_sq.tolist(), big_sq.tolist())]

    def _gains(self, estimates: list[tuple[float, float]], step: int, *, record: bool) -> torch.Tensor:
        """AdaScale's gain for this update, per active run: σ² of one reference-batch gradient and μ² = |G|²."""
        gains = []
        for row, run in enumerate(self.active):
            g2, trace = estimates[row]
            smoothed = self.smoothed[run]
            # A step whose estimates are not finite is left out of the averages, as ddplab.AdaScale does.
            if math.isfinite(g2) and math.isfinite(trace):
                smoothed.update(trace / self.config.reference_global_batch_size, g2)
            gain = smoothed.gain(self.scale)
            self.tau[run] += gain
            gains.append(gain)
            if record:
                self.results[run].gains.append([step + 1, gain, self.tau[run]])
        return torch.tensor(gains, dtype=self.lr.dtype)

    def metrics(self) -> list[float]:
        """Each active run's evaluation: vectorized on the validation split, or the spec's evaluate per run."""
        if self.workload.evaluate is not None:
            return self._evaluate_each()
        inputs, targets = self.workload.val
        dtype = torch_dtype(self.config)
        inputs, targets = cast(inputs, dtype).to(self.device), cast(targets, dtype).to(self.device)
        with torch.no_grad(), _eval_mode(self.model):
            outputs = vmap(lambda p, b: functional_call(self.model, (p, b), (inputs,)))(self.params, self.buffers)
            if self.config.target.kind == "accuracy":
                values = (outputs.argmax(-1) == targets).to(torch.float64).mean(-1)
            else:
                values = vmap(lambda out: self.workload.loss(out, targets))(outputs)
        return values.tolist()

    def _evaluate_each(self) -> list[float]:
        out = []
        with torch.no_grad():
            for row in range(len(self.active)):
                state = {n: t[row] for tensors in (self.params, self.buffers) for n, t in tensors.items()}
                self.model.load_state_dict(state, strict=False)
                out.append(float(self.workload.evaluate(self.model, self.workload.eval_dataset)))
        return out

    def keep(self, rows: list[int]) -> None:
        """Drop finished runs: only the rows in ``rows`` go on training."""
        # The seed rows stay on the host: their index is made there, not copied back from the device.
        host = torch.tensor(rows, dtype=torch.long)
        index = host.to(self.device)
        self.params = {n: p[index] for n, p in self.params.items()}
        self.buffers = {n: b[index] for n, b in self.buffers.items()}
        self.optimizer.keep(index, rows)
        self.lr, self.seed_row = self.lr[host], self.seed_row[host]
        self.active = [self.active[r] for r in rows]


def run_footprint(workload: Workload, config: StudyConfig, global_batch: int,
                  device: torch.device | str = "cpu") -> int:
    """Bytes one run of a group holds at its peak, measured on one forward of the model at ``global_batch``: its
    parameters, gradients and optimizer state, its batch, and every tensor autograd saves for the backward."""
    dtype = torch_dtype(config)
    model = workload.model().to(dtype).to(device)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = params * (2 if config.optimizer.adam else 1 if config.optimizer.momentum else 0)
    index = torch.arange(min(global_batch, workload.train_size))
    inputs = cast(workload.train[0][index], dtype).to(device)
    targets = cast(workload.train[1][index], dtype).to(device)
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        workload.loss(model(inputs), targets)
    batch = sum(t.numel() * t.element_size() for t in (inputs, targets))
    return 2 * params + state + batch + saved


def runs_that_fit(workload: Workload, config: StudyConfig, global_batch: int, device: torch.device | str = "cpu"
                  ) -> int:
    """How many runs one group at ``global_batch`` can hold in the memory this machine has free (CPU; on a GPU,
    what the device has free); UsageError when not even one fits."""
    per_run = run_footprint(workload, config, global_batch, device)
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        free = capacity.available_bytes()
    if free is None:
        return 1 << 30
    # Twice the measured footprint: vmap's batched intermediates and the allocator's slack come on top.
    fit = int(capacity.SAFETY * free // (2 * per_run))
    if fit < 1:
        raise UsageError(f"one run at global batch {global_batch} needs about {capacity.size(2 * per_run)}, more "
                         f"than this machine has free ({capacity.size(free)}): lower {{global_batch_sizes}}")
    return fit


def seconds_per_step(workload: Workload, config: StudyConfig, group: RunGroup, device: torch.device | str = "cpu",
                     *, steps: int = 5) -> float:
    """Seconds for one optimizer step of every run in ``group`` trained as one vectorized group, after a step of
    warm-up."""
    import time

    trained = Group(workload, config, group, device=device)
    trained.step(0, measure=False)
    synchronize(trained.device)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        trained.step(step, measure=False)
    synchronize(trained.device)
    return (time.perf_counter() - start) / steps


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block (an in-process engine's share of the machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a GPU runs ahead of the host), so a clock read after it counts it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def evaluate_model(workload: Workload, config: StudyConfig, model: torch.nn.Module) -> float:
    """One model's evaluation, as a group evaluates each of its runs (eval mode, validation split or evaluate())."""
    with torch.no_grad(), _eval_mode(model):
        if workload.evaluate is not None:
            return float(workload.evaluate(model, workload.eval_dataset))
        device = next(model.parameters()).device
        inputs, targets = workload.val
        outputs = model(cast(inputs, torch_dtype(config)).to(device))
        targets = cast(targets, torch_dtype(config)).to(device)
        if config.target.kind == "accuracy":
            return float((outputs.argmax(-1) == targets).to(torch.float64).mean())
        return float(workload.loss(outputs, targets))


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    # Evaluation sees the model as inference would: eval() mode, training mode restored after.
    model.eval()
    try:
        yield
    finally:
        model.train()


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _squared_norms(stacked: torch.Tensor) -> torch.Tensor:
    """Each run's squared norm of its slice of a stacked tensor, in float64."""
    return stacked.flatten(1).double().pow(2).sum(1)


def train_group(workload: Workload, config: StudyConfig, group: RunGroup, progress: Progress | None = None, *,
                device: torch.device | str = "cpu") -> list[RunResult]:
    """Train every run of ``group`` until it reaches the target, diverges or runs out of steps.

    Runs of an (lr, variant) in ``group.sweep_only`` (serving the tuned sweep alone) stop once it can no longer
    have the fewest median steps: they only had to lose to the best. With AdaScale's lr scaling each run's
    updates use lr × the gain measured at every step.
    """
    size = runs_that_fit(workload, config, group.global_batch_size, device)
    if len(group.runs) > size:
        # Groups split to fit: each part trains as a group of its own (pruning sees its own part's runs).
        return [result for start in range(0, len(group.runs), size)
                for result in train_group(workload, config, group.part(start, start + size), progress, device=device)]
    trained = Group(workload, config, group, device=device)
    reported = 0
    for step in range(config.max_steps):
        evaluate = (step + 1) % config.eval_every == 0
        losses = trained.step(step, measure=evaluate)
        finished = _finish_diverged(trained, losses)
        if evaluate:
            finished |= _finish_reached(trained, losses, step + 1)
            finished |= _prune(trained, group.sweep_only, step + 1, finished)
            if progress:
                progress(step + 1 - reported)
                reported = step + 1
        rows = [row for row, run in enumerate(trained.active) if run not in finished]
        if not rows:
            break
        if finished:
            trained.keep(rows)
    if progress:
        progress(config.max_steps - reported)
    return trained.results


def _prune(group: Group, sweep_only: frozenset[tuple[float, str]], steps: int, finished: set[int]) -> set[int]:
    if not sweep_only:
        return set()
    best_setting, best = settled_best(group.results)
    if steps <= loser_bound(best, group.config.seeds):
        return set()
    pruned = set()
    for run in group.active:
        result = group.results[run]
        setting = (result.lr, result.variant)
        if run not in finished and setting in sweep_only and setting != best_setting:
            result.pruned = True
            pruned.add(run)
    return pruned


def _finish_diverged(group: Group, losses: torch.Tensor) -> set[int]:
    bad = ~torch.isfinite(losses) | (losses.abs() > DIVERGED_LOSS)
    finished = set()
    for row in torch.nonzero(bad).flatten().tolist():
        run = group.active[row]
        group.results[run].diverged = True
        finished.add(run)
    return finished


def _finish_reached(group: Group, losses: torch.Tensor, steps: int) -> set[int]:
    finished = set()
    for row, metric in enumerate(group.metrics()):
        run = group.active[row]
        result = group.results[run]
        if result.diverged:
            continue
        result.history.append([steps, float(losses[row]), metric])
        if settle(group.config, result, steps, metric):
            finished.add(run)
    return finished


class VmapEngine:
    """Every run of a group in one process, vectorized over stacked parameters."""

    name = "vmap"
    overhead = 1.0
    per_run = False

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def train(self, workload: Workload, config: StudyConfig, group: RunGroup,
              progress: Progress | None = None) -> list[RunResult]:
        return train_group(workload, config, group, progress, device=self.device)

    def seconds_per_step(self, workload: Workload, config: StudyConfig, group: RunGroup) -> float:
        return seconds_per_step(workload, config, group, self.device)
