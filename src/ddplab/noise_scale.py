"""Measure the gradient noise scale of a plain DDP run through DDP's communication hook.

Each rank's bucket holds its local gradient (batch b) before the all-reduce and the averaged
one (batch W·b) after it: the two squared norms give unbiased |G|² and tr(Σ) every step, for
one extra all-reduce of two scalars per measured step. Training is unchanged: without a user
hook the reduction reproduces DDP's own arithmetic bit for bit.

    gns = GradientNoiseScale(ddp_model, per_device_batch_size=64)
    for batch in loader:
        loss_fn(ddp_model(x), y).backward()
        gns.step()              # after backward, once per optimizer step
        optimizer.step(); optimizer.zero_grad()
    print(gns.summary().b_simple)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ddplab import noise_estimators as est


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """One measured step."""

    step: int
    g_small_sq: float
    g_big_sq: float
    g2: float
    trace_sigma: float
    b_simple_ema: float


class GradientNoiseScale:
    """Gradient noise scale (B_simple) of a DDP model, measured from its own all-reduce.

    Args:
        ddp_model: the ``DistributedDataParallel`` model; its one comm-hook slot is taken.
        per_device_batch_size: samples per rank per micro-step.
        accumulation_steps: micro-steps per optimizer step (the others run under ``no_sync``).
        comm_hook, state: your own DDP comm hook and its state, which this wraps (e.g. fp16/bf16
            compression); None reproduces DDP's built-in all-reduce exactly.
        every: measure every K-th step only (the others pay nothing but the hook call).
        ema_decay: decay of the running averages behind ``b_simple``.
    """

    def __init__(self, ddp_model, *, per_device_batch_size: int, accumulation_steps: int = 1, comm_hook=None,
                 state=None, every: int = 1, ema_decay: float = 0.95, process_group=None):
        self.group = process_group or dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.world_size < 2:
            raise ValueError("the gradient noise scale needs the local and the averaged gradient, so world size >= 2; "
                             "on one process, measure with 2 ranks instead")
        if per_device_batch_size < 1 or accumulation_steps < 1 or every < 1:
            raise ValueError("per_device_batch_size, accumulation_steps and every must be positive")
        # Accumulated micro-batches make the synchronising bucket a gradient over A·b samples.
        self.b_small = per_device_batch_size * accumulation_steps
        self.b_big = self.world_size * self.b_small
        self.every, self.comm_hook, self.user_state = every, comm_hook, state
        self.steps, self.history = 0, []
        self._ema_g2, self._ema_trace = est.Ema(ema_decay), est.Ema(ema_decay)
        device = next(ddp_model.parameters()).device
        self._sums = torch.zeros(2, dtype=torch.float64, device=device)  # local |g|², this rank's share of |G|²
        ddp_model.register_comm_hook(self, GradientNoiseScale._hook)

    @property
    def measuring(self) -> bool:
        return self.steps % self.every == 0

    @staticmethod
    def _hook(self: "GradientNoiseScale", bucket):
        measuring = self.measuring
        buffer = bucket.buffer()
        if measuring:
            self._sums[0] += _squared_norm(buffer)
        if self.comm_hook is None:
            # DDP's reducer multiplies by 1/W, then sums: the same order is bit-identical.
            buffer.mul_(1.0 / self.world_size)
            future = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
            future = future.then(lambda fut: fut.value()[0])
        else:
            future = self.comm_hook(self.user_state, bucket)
        return future.then(self._measure_reduced) if measuring else future

    def _measure_reduced(self, future):
        reduced = future.value()
        # The averaged gradient is identical on every rank: each squares a 1/W share.
        flat = reduced.view(-1)
        share = -(-flat.numel() // self.world_size)
        self._sums[1] += _squared_norm(flat[self.rank * share:(self.rank + 1) * share])
        return reduced

    def step(self) -> StepEstimate | None:
        """Close one optimizer step (call after backward): one small all-reduce when measured."""
        measured = self.measuring
        self.steps += 1
        if not measured:
            return None
        sums = self._sums.clone()
        self._sums.zero_()
        dist.all_reduce(sums, group=self.group)
        g_small_sq, g_big_sq = sums[0].item() / self.world_size, sums[1].item()
        g2, trace = est.unbiased_estimates(g_small_sq, g_big_sq, self.b_small, self.b_big)
        ema = self._ema_trace.update(trace) / self._ema_g2.update(g2)
        record = StepEstimate(self.steps - 1, g_small_sq, g_big_sq, g2, trace, ema)
        self.history.append(record)
        return record

    @property
    def b_simple(self) -> float:
        """Running B_simple = EMA(tr Σ) / EMA(|G|²)."""
        return self._ema_trace.get() / self._ema_g2.get()

    def summary(self, last: int | None = None) -> est.Summary:
        """B_simple over the measured steps (the last ``last`` of them), with a 95% interval."""
        window = self.history[-last:] if last else self.history
        return est.summarize([r.g2 for r in window], [r.trace_sigma for r in window])


def _squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    # Half-precision buckets accumulate in float32; float32 ones in place, with no float64 copy.
    upcast = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else None
    return torch.linalg.vector_norm(tensor, dtype=upcast).double().square()


# --- measuring a spec file on ranks we start (ddplab noise) ---

@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseConfig:
    """One ``ddplab noise`` run."""

    spec_path: str
    world_size: int
    per_device_batch_size: int
    steps: int
    """Optimizer steps to train."""
    seed: int = 0
    every: int = 1
    """Measure every K-th step."""
    progress: bool = True

    def __post_init__(self):
        if self.world_size < 2:
            raise ValueError("--world-size must be at least 2: the noise scale compares each rank's gradient "
                             "with the averaged one")
        for flag, value in (("--batch-size", self.per_device_batch_size), ("--steps", self.steps), ("--every", self.every)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")


def measure_spec(config: NoiseConfig, launch_config=None) -> dict:
    """Train the spec on ``world_size`` ranks with the noise scale attached; rank 0's report."""
    from ddplab.launch import LaunchConfig, launch
    from ddplab.spec import load_spec

    load_spec(config.spec_path)  # fail fast in the parent, before any rank starts
    launch_config = launch_config or LaunchConfig(world_size=config.world_size)
    return launch(_measure_on_rank, launch_config, config)[0]


def _measure_on_rank(ctx, config: NoiseConfig):
    from torch.nn.parallel import DistributedDataParallel

    from ddplab import training
    from ddplab.spec import load_spec

    spec = load_spec(config.spec_path)
    dataset = spec.dataset()
    model = training.seeded_model(spec, config.seed, device=ctx.device)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    gns = GradientNoiseScale(ddp, per_device_batch_size=config.per_device_batch_size, every=config.every)
    optimizer = spec.optimizer(ddp.parameters())
    with _progress(ctx.is_main and config.progress, config.steps) as advance:
        for step in range(config.steps):
            # Full batches only: the estimator needs every rank's batch to hold exactly b samples.
            indices = training.rank_batch(len(dataset), world_size=ctx.world_size, rank=ctx.rank, drop_last=True,
                                          per_device_batch_size=config.per_device_batch_size, seed=config.seed, step=step)
            optimizer.zero_grad(set_to_none=True)
            spec.step(ddp, training.collate(dataset, indices, ctx.device), spec.loss).backward()
            gns.step()
            optimizer.step()
            advance(gns.b_simple)
    return {"history": [dataclasses.asdict(r) for r in gns.history], "summary": gns.summary(),
            "b_small": gns.b_small, "b_big": gns.b_big} if ctx.is_main else None


class _progress:
    """A rich progress bar on rank 0 (started inside the rank, after forking)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.bar = enabled, total, None

    def __enter__(self):
        if not self.enabled:
            return lambda b_simple: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from ddplab.render import console

        self.bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[status]}"), console=console(stderr=True), transient=True)
        self.bar.start()
        task = self.bar.add_task("noise", total=self.total, status="")
        return lambda b_simple: self.bar.update(task, advance=1, status=f"B_simple ≈ {b_simple:.4g}")

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
