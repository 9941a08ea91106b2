"""The one-neuron DDP sandbox: single-process vs multi-rank runs of the same toy problem.

One parameter tensor of shape ``(n_experiments,)`` holds every experiment, so 10,000
independent experiments train in one run through one real ``DistributedDataParallel``
wrapper; the data comes from :mod:`ddplab.sandbox.data`.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddplab.noise.report import adascale_gain
from ddplab.noise.scale import GradientNoiseScale
from ddplab.runtime import capacity, strategies
from ddplab.runtime.launch import LaunchConfig, RankContext, default_world_size, launch, world_size_for
from ddplab.runtime.sharding import rank_indices
from ddplab.sandbox import data
from ddplab.sandbox.config import DATASET_SIZE, SandboxConfig, SandboxResult

# --- the model and one training run ---

class Neuron(torch.nn.Module):
    """forward(x) = w·x with one weight per experiment, all initialised to 1.0."""

    def __init__(self, n_experiments: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n_experiments))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


def l1_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Mean over the batch, sum over experiments: a global mean would divide each lr by n_experiments.
    return (output - target).abs().mean(dim=0).sum()


class _UpdateStats:
    """Running power sums of the applied updates, for their pooled variance and its error."""

    def __init__(self, device):
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)  # n, Σu, Σu², Σu³, Σu⁴

    def add(self, update: torch.Tensor) -> None:
        u = update.double()
        self.sums[0] += u.numel()
        self.sums[1:] += torch.stack([u.sum(), u.pow(2).sum(), u.pow(3).sum(), u.pow(4).sum()])

    def variance_and_stderr(self) -> tuple[float, float]:
        n, s1, s2, s3, s4 = self.sums.tolist()
        if n < 2:
            return 0.0, 0.0
        mean = s1 / n
        variance = max(s2 / n - mean * mean, 0.0) * n / (n - 1)
        if variance == 0.0:
            return 0.0, 0.0
        m4 = s4 / n - 4 * mean * s3 / n + 6 * mean ** 2 * s2 / n - 3 * mean ** 4
        # Standard error of a sample variance: sqrt((μ₄ − σ⁴) / n).
        return variance, math.sqrt(max(m4 - variance ** 2, 0.0) / n)


def _count_allreduces(state: dict, bucket):
    state["allreduces"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def train(cfg: SandboxConfig, ctx: RankContext | None = None, *, keep_weights: bool = False) -> SandboxResult:
    """Train one configuration: in this process (single) or on this rank of a DDP group (multi)."""
    started = time.perf_counter()
    device = ctx.device if ctx else torch.device("cpu")
    rank, world_size = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    model = Neuron(cfg.n_experiments).to(device)
    forward, counter, gns = model, {"allreduces": 0}, None
    if cfg.mode == "multi":
        strategy = strategies.get("ddp")
        ddp = strategy.wrap(model, ctx)
        ddp.register_comm_hook(counter, _count_allreduces)
        # The classic bug calls the inner module: DDP never sees the forward, so never all-reduces.
        forward = strategy.module(ddp) if cfg.bypass_ddp else ddp
        if not cfg.bypass_ddp and world_size > 1:
            # Each epoch's 256 samples are drawn afresh and dealt without replacement: corrected for N = 256.
            gns = GradientNoiseScale(ddp, per_device_batch_size=cfg.per_device_batch_size, every=1,
                                     dataset_size=DATASET_SIZE)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    stats = _UpdateStats(device)
    for epoch in range(cfg.n_epochs):
        indices = rank_indices(DATASET_SIZE, world_size=world_size, rank=rank, seed=cfg.seed, epoch=epoch)
        for step in range(cfg.steps_per_epoch):
            chunk = indices[step * cfg.per_device_batch_size:(step + 1) * cfg.per_device_batch_size]
            x, y = data.batch(cfg, epoch, chunk, device)
            optimizer.zero_grad(set_to_none=True)
            l1_loss(forward(x), y).backward()
            if gns is not None:
                gns.step()
            stats.add(cfg.lr * model.w.grad)
            optimizer.step()
    w = model.w.detach()
    result = _summarize(cfg, w, stats, counter["allreduces"], ctx, time.perf_counter() - started)
    if gns is not None and gns.history:
        result = dataclasses.replace(result, adascale_gain=adascale_gain(gns.summary(), world_size,
                                                                          cfg.per_device_batch_size))
    return dataclasses.replace(result, weights=tuple(w.tolist())) if keep_weights else result


def _summarize(cfg, w, stats: _UpdateStats, allreduces: int, ctx, seconds: float) -> SandboxResult:
    spread = 0.0
    if ctx is not None and cfg.bypass_ddp:
        # Ranks that train alone disagree; gather every rank's w to show by how much.
        gathered = [torch.empty_like(w) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, w)
        spread = torch.stack(gathered).double().std(dim=0, unbiased=False).mean().item()
        # Each rank's updates are its own sample: pool them over ranks.
        dist.all_reduce(stats.sums)
        w_all = torch.stack(gathered).reshape(-1)
    else:
        w_all = w
    variance, variance_stderr = stats.variance_and_stderr()
    w64 = w_all.double()
    stderr = (w64.std().item() / math.sqrt(w64.numel())) if w64.numel() > 1 else 0.0
    return SandboxResult(config=cfg, w=w64.mean().item(), w_stderr=stderr, update_step_variance=variance,
                         update_step_variance_stderr=variance_stderr, allreduces=allreduces,
                         w_rank_spread=spread, seconds=seconds)


def train_looped(cfg: SandboxConfig, ctx: RankContext | None = None) -> list[float]:
    """The classic way: one experiment at a time, each with its own model and DDP wrapper.

    Returns each experiment's final w; used to show the vectorized run computes the same.
    """
    final = []
    for experiment in range(cfg.n_experiments):
        one = dataclasses.replace(cfg, n_experiments=1)
        final.append(_train_one_experiment(one, experiment, ctx))
    return final


def _train_one_experiment(cfg: SandboxConfig, experiment: int, ctx: RankContext | None) -> float:
    device = ctx.device if ctx else torch.device("cpu")
    rank, world_size = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    model = Neuron(1).to(device)
    forward = strategies.get("ddp").wrap(model, ctx) if cfg.mode == "multi" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for epoch in range(cfg.n_epochs):
        indices = rank_indices(DATASET_SIZE, world_size=world_size, rank=rank, seed=cfg.seed, epoch=epoch)
        for step in range(cfg.steps_per_epoch):
            chunk = torch.tensor(indices[step * cfg.per_device_batch_size:(step + 1) * cfg.per_device_batch_size])
            x, y = _experiment_samples(cfg, epoch, chunk, experiment)
            optimizer.zero_grad(set_to_none=True)
            l1_loss(forward(x.to(device)), y.to(device)).backward()
            optimizer.step()
    return model.w.item()


def _experiment_samples(cfg: SandboxConfig, epoch: int, indices: torch.Tensor, experiment: int):
    if cfg.deterministic:
        return torch.ones(len(indices), 1), torch.zeros(len(indices), 1)
    return data.noisy_samples(cfg.seed, epoch, indices, torch.tensor([experiment]))


# --- entry points ---

def _train_all_on_rank(ctx: RankContext, configs: list[SandboxConfig]) -> list[SandboxResult] | None:
    results = [train(cfg, ctx) for cfg in configs]
    return results if ctx.is_main else None


def resolve(cfg: SandboxConfig) -> SandboxConfig:
    """The configuration with its world size decided (torchrun's under torchrun), checked to fit in memory."""
    if cfg.mode == "multi":
        cfg = cfg.for_ranks(world_size_for(cfg.world_size, default=default_world_size()))
    capacity.check_memory(cfg.rank_bytes * cfg.world_size, f"{cfg.n_experiments:,} experiments on "
                          f"{cfg.world_size} process{'es' if cfg.world_size > 1 else ''}", "n_experiments")
    return cfg


def run_multi(configs: list[SandboxConfig], launch_config: LaunchConfig | None = None) -> list[SandboxResult] | None:
    """Run several multi-rank configurations (world sizes decided) in one launch of the ranks.

    Returns rank 0's results, or None on the other ranks under torchrun.
    """
    world_size = configs[0].world_size
    # Eight CPU ranks on fewer cores is the sandbox's design (its runs are tiny and exact): memory is the limit.
    per_rank = max(cfg.rank_bytes for cfg in configs) + capacity.RANK_OVERHEAD_BYTES
    capacity.check_memory(world_size * per_rank, f"{world_size} ranks", "world_size")
    launch_config = dataclasses.replace(launch_config or LaunchConfig(), world_size=world_size)
    return launch(_train_all_on_rank, launch_config, configs)[0]


def run(cfg: SandboxConfig, launch_config: LaunchConfig | None = None) -> SandboxResult | None:
    """Run one configuration; multi mode starts (or joins) the ranks. The result's seconds count the launch."""
    started = time.perf_counter()
    cfg = resolve(cfg)
    if cfg.mode == "single":
        result = train(cfg)
    else:
        results = run_multi([cfg], launch_config)
        if not results:  # a non-zero rank under torchrun: rank 0 reports
            return None
        result = results[0]
    return dataclasses.replace(result, seconds=time.perf_counter() - started)
