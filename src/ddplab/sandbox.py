"""The one-neuron DDP sandbox: single-process vs multi-rank runs of the same toy problem.

One parameter tensor of shape ``(n_experiments,)`` holds every experiment, so 10,000
independent experiments train in one run through one real ``DistributedDataParallel``
wrapper. Each experiment's data is a pure function of (seed, experiment, epoch, sample),
so every rank holds the same dataset and ``DistributedSampler`` shards it, as with real data.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddplab import sandbox_theory, training
from ddplab.launch import LaunchConfig, RankContext, launch

DATASET_SIZE = 256
MODES = ("single", "multi")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """One sandbox run."""

    mode: str
    """'single' (one process) or 'multi' (world_size DDP ranks)."""
    lr: float = 1e-3
    """SGD learning rate (no momentum)."""
    per_device_batch_size: int = 128
    """Loader batch per rank (per process in single mode)."""
    world_size: int = 1
    """Number of DDP ranks; always 1 in single mode."""
    deterministic: bool = True
    """x = 1, y = 0 when True; x = 1 + N(0,1), y = N(0,1) otherwise."""
    n_experiments: int = 1
    """Independent repetitions, vectorized into one parameter tensor."""
    n_epochs: int = 1
    """Passes over the 256 samples."""
    seed: int = 0
    """Seeds both the data and DistributedSampler's shuffle."""
    bypass_ddp: bool = False
    """Forward through the inner module (the classic bug): no all-reduce happens."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "single" and (self.world_size != 1 or self.bypass_ddp):
            raise ValueError("single mode runs one process: drop --world-size / --bypass-ddp")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        for flag, value in (("--batch-size", self.per_device_batch_size), ("--world-size", self.world_size),
                            ("--n-experiments", self.n_experiments), ("--n-epochs", self.n_epochs)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if DATASET_SIZE % self.global_batch_size:
            raise ValueError(
                f"--batch-size × world size = {self.global_batch_size} must divide the "
                f"{DATASET_SIZE} samples of an epoch; try a power of two")
        if self.bypass_ddp and self.deterministic:
            raise ValueError("--bypass-ddp needs noisy data (--noisy): with x = 1, y = 0 every rank "
                             "computes the same gradient and the damage is invisible")

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return DATASET_SIZE // self.global_batch_size

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.n_epochs

    def theory(self, *, batch_size: int | None = None) -> sandbox_theory.Prediction:
        return sandbox_theory.predict(
            lr=self.lr, batch_size=batch_size or self.global_batch_size,
            steps=self.steps, deterministic=self.deterministic)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """What one run measured, beside what theory predicts."""

    config: SandboxConfig
    w: float
    """Mean over experiments of w after training."""
    w_stderr: float
    """Standard error of that mean (0 for a single experiment)."""
    update_step_variance: float
    """Unbiased variance of lr × the applied gradient, pooled over steps and experiments."""
    update_step_variance_stderr: float
    allreduces: int
    """Gradient all-reduces DDP performed on rank 0 (0 in single mode)."""
    w_rank_spread: float
    """Mean over experiments of the std of w across ranks (0 when DDP keeps them in sync)."""
    seconds: float
    weights: tuple[float, ...] | None = None
    """Every experiment's final w, when asked for (rank 0's in bypass mode)."""

    def theory(self) -> sandbox_theory.Prediction:
        return self.config.theory()

    def to_json(self) -> dict[str, Any]:
        cfg, theory = self.config, self.theory()
        out = {
            "mode": cfg.mode, "world_size": cfg.world_size,
            "per_device_batch_size": cfg.per_device_batch_size,
            "global_batch_size": cfg.global_batch_size, "lr": cfg.lr,
            "deterministic": cfg.deterministic, "n_experiments": cfg.n_experiments,
            "n_epochs": cfg.n_epochs, "seed": cfg.seed, "steps": cfg.steps,
            "w": self.w, "w_stderr": self.w_stderr,
            "update_step_variance": self.update_step_variance,
            "update_step_variance_stderr": self.update_step_variance_stderr,
            "allreduces": self.allreduces,
            "theory": {"w": theory.w, "update_step_variance": theory.update_step_variance},
            "seconds": self.seconds,
        }
        if cfg.bypass_ddp:
            out["bypass_ddp"] = True
            out["w_rank_spread"] = self.w_rank_spread
            out["theory_if_ranks_train_alone"] = dataclasses.asdict(
                cfg.theory(batch_size=cfg.per_device_batch_size))
        return out


# --- data: a counter-based generator, so sample i of experiment e is the same everywhere ---

_MASK64 = (1 << 64) - 1


def _to_int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_GOLDEN, _MIX1, _MIX2 = (_to_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    # int64 >> is arithmetic; mask off the sign copies to get splitmix64's logical shift.
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(state: torch.Tensor) -> torch.Tensor:
    """splitmix64's output for each state, on int64 tensors (multiplication wraps mod 2**64)."""
    z = state + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _uniform_pair(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Two 32-bit halves → two float64 in (0, 1); the half-step offset keeps log() finite.
    scale = 2.0 ** -32
    return ((_shift_right(bits, 32).double() + 0.5) * scale, ((bits & 0xFFFFFFFF).double() + 0.5) * scale)


def _stream_key(seed: int, epoch: int) -> int:
    """An int64 key for one (seed, epoch), mixed so nearby seeds share no counters."""
    return int(splitmix64(torch.tensor([_to_int64(seed * 0x100000001B3 + epoch)]))[0])


def noisy_samples(seed: int, epoch: int, indices: torch.Tensor,
                  experiments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y of shape (len(indices), len(experiments)) for these samples of these experiments.

    A pure function of (seed, experiment, epoch, sample index): any subset of samples or
    experiments, computed anywhere, gives the same numbers.
    """
    counter = (experiments.long()[None, :] * DATASET_SIZE + indices.long()[:, None]) * 2
    # The n-th splitmix64 state is key + n·γ: counters index one stream per (seed, epoch).
    state = _stream_key(seed, epoch) + counter * _GOLDEN
    u1, u2 = _uniform_pair(splitmix64(state))
    u3, u4 = _uniform_pair(splitmix64(state + _GOLDEN))
    # Box–Muller: one standard normal each for x and y.
    x = 1.0 + torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    y = torch.sqrt(-2.0 * torch.log(u3)) * torch.cos(2.0 * math.pi * u4)
    return x.float(), y.float()


def batch(cfg: SandboxConfig, epoch: int, indices: list[int],
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The toy data for these sample indices, shape (batch, n_experiments)."""
    shape = (len(indices), cfg.n_experiments)
    if cfg.deterministic:
        return torch.ones(shape, device=device), torch.zeros(shape, device=device)
    x, y = noisy_samples(cfg.seed, epoch, torch.tensor(indices), torch.arange(cfg.n_experiments))
    return x.to(device), y.to(device)


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
    forward, counter = model, {"allreduces": 0}
    if cfg.mode == "multi":
        ddp = DistributedDataParallel(model, device_ids=ctx.device_ids)
        ddp.register_comm_hook(counter, _count_allreduces)
        # The classic bug calls the inner module: DDP never sees the forward, so never all-reduces.
        forward = ddp.module if cfg.bypass_ddp else ddp
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    stats = _UpdateStats(device)
    for epoch in range(cfg.n_epochs):
        indices = training.rank_indices(DATASET_SIZE, world_size=world_size, rank=rank, seed=cfg.seed, epoch=epoch)
        for step in range(cfg.steps_per_epoch):
            x, y = batch(cfg, epoch, indices[step * cfg.per_device_batch_size:(step + 1) * cfg.per_device_batch_size],
                         device)
            optimizer.zero_grad(set_to_none=True)
            l1_loss(forward(x), y).backward()
            stats.add(cfg.lr * model.w.grad)
            optimizer.step()
    w = model.w.detach()
    result = _summarize(cfg, w, stats, counter["allreduces"], ctx, time.perf_counter() - started)
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
    forward = DistributedDataParallel(model, device_ids=ctx.device_ids) if cfg.mode == "multi" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for epoch in range(cfg.n_epochs):
        indices = training.rank_indices(DATASET_SIZE, world_size=world_size, rank=rank, seed=cfg.seed, epoch=epoch)
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
    return noisy_samples(cfg.seed, epoch, indices, torch.tensor([experiment]))


# --- entry points ---

def _train_all_on_rank(ctx: RankContext, configs: list[SandboxConfig]) -> list[SandboxResult] | None:
    results = [train(dataclasses.replace(cfg, world_size=ctx.world_size), ctx) for cfg in configs]
    return results if ctx.is_main else None


def run_multi(configs: list[SandboxConfig], launch_config: LaunchConfig) -> list[SandboxResult] | None:
    """Run several multi-rank configurations in one launch of the ranks.

    Returns rank 0's results, or None on the other ranks under torchrun.
    """
    return launch(_train_all_on_rank, launch_config, configs)[0]


def run(cfg: SandboxConfig, launch_config: LaunchConfig | None = None) -> SandboxResult | None:
    """Run one configuration; multi mode starts (or joins) the ranks."""
    if cfg.mode == "single":
        return train(cfg)
    launch_config = launch_config or LaunchConfig(world_size=cfg.world_size)
    results = run_multi([cfg], launch_config)
    return results[0] if results else None
