"""``ddplab noise``: train a spec on data-parallel ranks with the noise scale attached, and report what it measured.

Rank 0 checkpoints what it has measured at most once a second: a few fixed fields, and the new
measured steps appended to its journal (never the whole history again), so a run stopped by its
deadline, a failing rank or Ctrl-C still reports the steps it finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time

import torch

from ddplab.errors import LaunchError, UsageError
from ddplab.noise import report as noise_report
from ddplab.noise.config import DEFAULT_WORLD_SIZE, NoiseConfig
from ddplab.noise.scale import GradientNoiseScale
from ddplab.progress import Progress, silent
from ddplab.runtime import ranks as rank_tools
from ddplab.runtime import strategies
from ddplab.runtime.deadline import Deadline
from ddplab.runtime.launch import LaunchConfig, RankContext, world_size_for
from ddplab.runtime.launch_config import under_torchrun
from ddplab.runtime.sharding import RankOrder
from ddplab.runtime.signals import ReturnOnSignals
from ddplab.runtime.spec import load_spec


def measure_spec(config: NoiseConfig, launch_config: LaunchConfig | None = None,
                 progress: Progress = silent) -> noise_report.NoiseReport | None:
    """Train the spec on its ranks with the noise scale attached; rank 0's report.

    Under torchrun every rank calls this: rank 0 returns the report, the others None. A run
    stopped early (a deadline, a failing rank, or SIGINT/SIGTERM/SIGHUP while the ranks run)
    returns what rank 0 measured until then, with ``stopped_early`` saying why and, for a signal,
    ``cancelled_by`` naming it: the caller decides how to end. With nothing measured yet, the
    error is raised (a signal acts as it would have). ``progress`` is called in rank 0 after every step.
    """
    config = dataclasses.replace(config, world_size=world_size_for(config.world_size, default=DEFAULT_WORLD_SIZE))
    # A strategy that cannot run here (its options, the world size, this torch) says so before anything starts.
    strategy = strategy_of(config)
    strategy.check_runnable(config.world_size)
    if not strategy.taps_local_gradients:
        raise UsageError(f"the {config.strategy} strategy's local gradients are not read on a spec: measure its noise "
                         "scale on your own command (ddplab noise -- COMMAND), which reads them where the engine "
                         "reduces")
    deadline = Deadline.of(launch_config)
    with deadline.guard("loading the spec (its model() and dataset())"):
        # The spec's mistakes surface here, in one sentence, before any rank starts.
        facts, _ = rank_tools.validate(load_spec(config.spec_path), world_size=config.world_size, seed=config.seed,
                                       per_device_batch_size=config.per_device_batch_size, drop_last=True)
    rank_tools.check_capacity(config.world_size, facts)
    launch_config = (launch_config or LaunchConfig()).for_ranks(config.world_size)
    # Under torchrun the launcher owns the signals: a recorded Ctrl-C would only be lost there.
    with contextlib.nullcontext() if under_torchrun() else ReturnOnSignals() as signals:
        try:
            with deadline.launching():
                results, _ = rank_tools.launch_spec(_measure_on_rank, launch_config, (config, progress), facts,
                                                    deadline)
        except LaunchError as exc:
            # Nothing measured yet: the error (or the signal, delivered again on exit) stands.
            report = _partial_report(config, exc)
            if exc.kind == "cancelled" and signals is not None:
                signals.handled = True
                report = dataclasses.replace(report, cancelled_by=signal.Signals(signals.received).name)
            return report
    return results[0]


def strategy_of(config: NoiseConfig) -> strategies.Strategy:
    """The strategy the ranks train with, its options given; UsageError naming an option it does not have."""
    return strategies.get(config.strategy, **config.strategy_options())


def _measure_on_rank(ctx: RankContext, job: tuple[NoiseConfig, Progress], facts: rank_tools.SpecFacts):
    config, progress = job
    spec = load_spec(config.spec_path)
    dataset = spec.dataset()
    model = rank_tools.seeded_model(spec, config.seed, device=ctx.device)
    strategy = strategy_of(config)
    wrapped = strategy.wrap(model, ctx, facts)
    gns = GradientNoiseScale(wrapped, per_device_batch_size=config.per_device_batch_size, every=config.every,
                             accumulation_steps=config.accumulation_steps, dataset_size=len(dataset))
    optimizer = spec.optimizer(wrapped.parameters())
    # Full batches only: the estimator needs every batch to hold exactly b samples.
    order = RankOrder(len(dataset), world_size=ctx.world_size, rank=ctx.rank, drop_last=True,
                      per_device_batch_size=config.per_device_batch_size, seed=config.seed)
    run = _Run(ctx, config, spec, gns, model, optimizer, len(dataset))
    show = progress if ctx.is_main else silent
    for step in range(config.steps):
        optimizer.zero_grad(set_to_none=True)
        _accumulate(ctx, config, spec, dataset, strategy, wrapped, order, step)
        gns.step()
        optimizer.step()
        if show is not silent:
            show(step + 1, config.steps, f"B_simple ≈ {gns.b_simple:.4g}")
        run.publish(completed_steps=step + 1)
    return run.report(config.steps) if ctx.is_main else None


def _accumulate(ctx, config: NoiseConfig, spec, dataset, strategy: strategies.Strategy, wrapped, order: RankOrder,
                step: int) -> None:
    """One optimizer step's micro-batches: all but the last under no_sync, each loss divided by their count."""
    accumulation = config.accumulation_steps
    for micro in range(accumulation):
        indices = order.batch(step * accumulation + micro)
        context = strategy.no_sync(wrapped) if micro < accumulation - 1 else contextlib.nullcontext()
        with context:
            batch = rank_tools.collate(dataset, indices, ctx.device)
            (spec.step(wrapped, batch, spec.loss) / accumulation).backward()


class _Run:
    """Rank 0's measured run: its report, and its checkpoints (at the first measured step, then once a second)."""

    def __init__(self, ctx: RankContext, config: NoiseConfig, spec, gns: GradientNoiseScale, model, optimizer,
                 dataset_size: int, interval_s: float = 1.0):
        self.ctx, self.config, self.spec, self.gns = ctx, config, spec, gns
        self.model, self.optimizer = model, optimizer
        self.dataset_size, self.interval_s = dataset_size, interval_s
        self.start = [p.clone() for p in _local(model.parameters())]
        self.history: list[dict] = []
        self.journaled, self.last = 0, None

    def _sync_history(self) -> None:
        # Each measured step becomes a record once, as it arrives: nothing is rebuilt from the whole history.
        for record in self.gns.history[len(self.history):]:
            self.history.append(dataclasses.asdict(record))

    def _fields(self, completed_steps: int) -> dict:
        # Weights that move make B_simple an average over the trajectory, not one point's value.
        moved = any(not torch.equal(a, b) for a, b in zip(self.start, _local(self.model.parameters())))
        lrs = sorted({float(group["lr"]) for group in self.optimizer.param_groups if "lr" in group})
        return {"b_small": self.gns.b_small, "b_big": self.gns.b_big, "dataset_size": self.dataset_size,
                "skipped_steps": self.gns.skipped_steps, "weights_moved": moved, "lr": lrs,
                "completed_steps": completed_steps}

    def publish(self, *, completed_steps: int) -> None:
        if not self.ctx.is_main or not self.gns.history:
            return
        now = time.monotonic()
        if self.last is not None and now - self.last < self.interval_s:
            return
        self._sync_history()
        self.ctx.journal(self.history[self.journaled:])
        self.journaled = len(self.history)
        self.ctx.checkpoint(self._fields(completed_steps))
        self.last = now

    def report(self, completed_steps: int) -> noise_report.NoiseReport:
        if not self.gns.history:
            # Every measured step overflowed: there is no estimate, and the spec is where to look.
            raise self.spec.error(f"all {self.gns.skipped_steps} measured steps had non-finite gradients (inf or nan), "
                                  "so there is nothing to estimate from: lower the learning rate or guard the loss "
                                  "against overflow")
        self._sync_history()
        fields = self._fields(completed_steps)
        return noise_report.NoiseReport(config=self.config, summary=self.gns.summary(), history=self.history,
                                        **fields)


def _local(params) -> list[torch.Tensor]:
    """This rank's values of ``params``: a sharded parameter's own shard (rank 0 alone reads them: no collective)."""
    return [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params]


def _partial_report(config: NoiseConfig, exc: LaunchError) -> noise_report.NoiseReport:
    """Rank 0's last checkpoint and journal, marked with why the run stopped; re-raises when there is none."""
    partial = exc.partial.get(0)
    if partial is None or not partial.get("journal"):
        raise exc
    return noise_report.from_partial(config, partial, str(exc))
