"""Prove that a spec trains the same on W data-parallel ranks as in one process, or find out why not.

The ranks train K steps with b samples each, under the configured parallelism strategy (DDP, FSDP2
or HSDP); one process trains K steps on the ranks' batches concatenated in rank order. Both run in
float64, so rounding stays far below the tolerance. Sharded parameters and gradients are gathered
whole before they are compared. When the two diverge, each suspected cause is tested by a reference
run that reproduces it (:mod:`ddplab.check.diagnosis`): a cause is named only when that reference
then matches the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from ddplab.check import diagnosis
from ddplab.check.config import DEFAULT_WORLD_SIZE, CheckConfig
from ddplab.check.result import CheckResult
from ddplab.errors import UsageError
from ddplab.progress import Progress, silent
from ddplab.runtime import ranks as rank_tools
from ddplab.runtime import strategies
from ddplab.runtime.deadline import Deadline
from ddplab.runtime.launch import LaunchConfig, RankContext, world_size_for
from ddplab.runtime.sharding import RankOrder, ReferenceOrder
from ddplab.runtime.spec import Spec, load_spec
from ddplab.runtime.strategies.training import Training, flat
from ddplab.text import count

CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """Flattened float64 parameters after each step and gradients before it."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    used_rng: bool = False
    divide_factors: frozenset[float] = frozenset()
    """What the ranks' reduction divided the summed gradients by, at any step (the data-parallel size: an average)."""
    reduction_errors: list[torch.Tensor] | None = None
    """Per step, the reduced gradient minus the exact float64 average of the ranks' local gradients (measured
    under a reduce_dtype only)."""
    reduction_bounds: list[torch.Tensor] | None = None
    """Per step and element, the most that rounding to the reduce_dtype can make of that difference."""

    def first_non_finite(self) -> tuple[int, int, str] | None:
        """(step, 0 for gradients or 1 for parameters, which) of the first inf or nan, else None."""
        for step, (grad, param) in enumerate(zip(self.grads, self.params)):
            for order, (what, values) in enumerate((("gradients", grad), ("parameters", param))):
                if not torch.isfinite(values).all():
                    return step, order, what
        return None

    def first(self, steps: int) -> Trajectory:
        cut = {name: getattr(self, name)[:steps] for name in ("reduction_errors", "reduction_bounds")
               if getattr(self, name) is not None}
        return dataclasses.replace(self, params=self.params[:steps], grads=self.grads[:steps], **cut)

    def reduction_error_of_bound(self) -> list[float] | None:
        """Per step, the largest |reduction error| as a fraction of its rounding bound (≤ 1: rounding explains it)."""
        if self.reduction_errors is None:
            return None
        return [_fraction_of_bound(error, bound) for error, bound in zip(self.reduction_errors, self.reduction_bounds)]

    def matches(self, other: Trajectory, tolerance: float) -> bool:
        return all(diff(a, b)["max_rel_diff"] <= tolerance for a, b in zip(self.params, other.params))

    def largest_difference(self, other: Trajectory) -> float:
        """The largest relative parameter difference from ``other`` over the steps both hold."""
        return max((diff(a, b)["max_rel_diff"] for a, b in zip(self.params, other.params)), default=0.0)


def check(cfg: CheckConfig, launch_config: LaunchConfig | None = None,
          progress: Progress = silent) -> CheckResult | None:
    """Train on the ranks, then in one process, compare, and diagnose a divergence.

    Under torchrun every rank calls this: rank 0 computes the reference and returns the
    result, the other ranks return None. ``progress`` is called after every step: in rank 0
    while the ranks train, then in this process during the single-process reference.
    """
    # Under torchrun the reference must split batches over torchrun's ranks, not a requested count.
    cfg = dataclasses.replace(cfg, world_size=world_size_for(cfg.world_size, default=DEFAULT_WORLD_SIZE))
    # A strategy that cannot run here (its options, the world size, this torch) says so before anything starts.
    strategy_of(cfg).check_runnable(cfg.world_size)
    deadline = Deadline.of(launch_config)
    with deadline.guard("loading the spec (its model() and dataset())"):
        spec = load_spec(cfg.spec_path)
        # The spec's mistakes surface here, in one sentence, before any rank starts.
        facts, dataset = rank_tools.validate(spec, world_size=cfg.world_size, seed=cfg.seed, dtype=torch.float64,
                                             per_device_batch_size=cfg.rank_step_batch_size)
    rank_tools.check_capacity(cfg.world_size, facts)
    if strategy_of(cfg).owns_optimizer:
        _refuse_short_steps(len(dataset), cfg)
    launch_config = (launch_config or LaunchConfig()).for_ranks(cfg.world_size)
    with deadline.launching():
        results, facts = rank_tools.launch_spec(_train_on_rank, launch_config, (cfg, progress), facts, deadline)
    ranks = results[0]
    if ranks is None:  # a torchrun rank other than 0
        return None
    with deadline.guard("the single-process reference run"):
        single = reference(spec, dataset, cfg, "global", progress)
        return _compare(spec, dataset, cfg, ranks, single, facts)


def strategy_of(cfg: CheckConfig) -> strategies.Strategy:
    """The strategy the ranks train with, its options given; UsageError naming an option it does not have."""
    return strategies.get(cfg.strategy, **cfg.strategy_options())


def _refuse_short_steps(dataset_size: int, cfg: CheckConfig) -> None:
    """An engine that counts its micro-batches (DeepSpeed's) cannot take a step with fewer: say so before starting."""
    for step, samples in enumerate(_samples_per_rank(dataset_size, cfg)):
        parts = -(-samples // cfg.per_device_batch_size)
        if parts < cfg.accumulation_steps:
            raise UsageError(
                f"step {step} ends an epoch with {samples} samples per rank, {count(parts, 'micro-batch')} of "
                f"{{per_device_batch_size}} {cfg.per_device_batch_size}, and DeepSpeed's engine steps only after "
                f"{{accumulation_steps}} {cfg.accumulation_steps}: give {{steps}} {step} or fewer, or a batch whose "
                "micro-batches fill every step")


def _compare(spec: Spec, dataset, cfg: CheckConfig, ranks: Trajectory, single: Trajectory,
             facts: rank_tools.SpecFacts) -> CheckResult:
    per_step = [{**diff(a, b), "samples_per_rank": size}
                for a, b, size in zip(ranks.params, single.params, _samples_per_rank(len(dataset), cfg))]
    for step, fraction in enumerate(ranks.reduction_error_of_bound() or []):
        per_step[step]["reduction_error_of_bound"] = fraction
    # NaN compares false: a step is equal only when its difference is a number within tolerance.
    divergent = next((i for i, d in enumerate(per_step) if not d["max_rel_diff"] <= cfg.tolerance), None)
    non_finite = _first_non_finite(ranks, single)
    has_padding = len(dataset) % cfg.world_size != 0
    common = dict(config=cfg, per_step=per_step, first_divergent_step=divergent, has_padding=has_padding,
                  non_finite=non_finite, unused_parameters=facts.unused_parameters,
                  find_unused_parameters=facts.find_unused_parameters and cfg.wraps_in_ddp,
                  note=diagnosis.one_rank_note(cfg))
    if non_finite is not None and (divergent is None or divergent >= non_finite["step"]):
        explanation, fix = diagnosis.non_finite_text(cfg, non_finite)
        return CheckResult(verdict="NON_FINITE", cause=None, explanation=explanation, fix=fix, **common)
    if divergent is None:
        return CheckResult(verdict="EQUIVALENT", cause=None, fix=None,
                           explanation=diagnosis.equivalent_text(cfg, per_step), **common)
    # Diagnose on the finite steps only: references are compared to the ranks up to there.
    finite_steps = ranks.first(non_finite["step"]) if non_finite else ranks
    found = diagnosis.diagnose(spec, len(dataset), cfg, finite_steps, single, divergent, has_padding,
                               rerun=lambda hypothesis: reference(spec, dataset, cfg, hypothesis, ranks=finite_steps),
                               unused=tuple(facts.unused_parameters))
    explanation = found.explanation
    if non_finite:
        explanation += (f"; from step {non_finite['step']} the {diagnosis.side_text(cfg, non_finite['side'])} "
                        f"{non_finite['what']} are also not finite")
    return CheckResult(verdict=found.verdict, cause=found.cause, explanation=explanation, fix=found.fix, **common)


def micro_batches(indices: list[int], cfg: CheckConfig) -> list[list[int]]:
    """A rank's step split into its micro-batches of ``per_device_batch_size`` (fewer at an epoch's end)."""
    size = cfg.per_device_batch_size
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def _accumulate(spec: Spec, training: Training, dataset, chunks: list[list[int]], device, dtype) -> None:
    """One optimizer step's backward passes: each micro-batch's loss weighed 1/K, reduced on the last only."""
    for index, chunk in enumerate(chunks):
        batch = rank_tools.collate(dataset, chunk, device, dtype, spec.collate)
        with training.micro_batch(last=index == len(chunks) - 1):
            loss = spec.step(training.model, batch, spec.loss)
            with spec.guard("backward through the loss"):
                training.backward(loss, parts=len(chunks))


def train_dtype(strategy: strategies.Strategy) -> torch.dtype:
    """float64, so rounding stays far below the tolerance; float32 where the strategy reduces no float64."""
    return torch.float64 if strategy.reduces_float64 else torch.float32


def _train_on_rank(ctx: RankContext, job: tuple[CheckConfig, Progress],
                   facts: rank_tools.SpecFacts) -> Trajectory | None:
    cfg, progress = job
    show = progress if ctx.is_main else silent
    spec = load_spec(cfg.spec_path)
    dataset = spec.dataset()
    strategy = strategy_of(cfg)
    dtype = train_dtype(strategy)
    model = rank_tools.seeded_model(spec, cfg.seed, dtype=dtype, device=ctx.device)
    training = strategy.training(model, spec.optimizer, ctx, facts, accumulation_steps=cfg.accumulation_steps,
                                 per_device_batch_size=cfg.per_device_batch_size)
    try:
        order = RankOrder(len(dataset), world_size=ctx.world_size, rank=ctx.rank, seed=cfg.seed,
                          per_device_batch_size=cfg.rank_step_batch_size)
        probe = ReductionProbe(strategy, training.model, cfg.reduce_dtype) if cfg.reduce_dtype else None
        params, grads, factors = [], [], set()
        for step in range(cfg.steps):
            _accumulate(spec, training, dataset, micro_batches(order.batch(step), cfg), ctx.device, dtype)
            grads.append(flat(training.gradients()))
            # Read after the spec's step(): where it changed how the reduction divides, this shows it.
            factors |= training.divide_factors()
            if probe is not None:
                probe.close_step(grads[-1])
            with spec.guard("the optimizer's step()"):
                training.step()
            params.append(flat(training.parameters()))
            show(step + 1, cfg.steps, f"{ctx.world_size} {diagnosis.strategy_label(cfg)} ranks")
    finally:
        training.close()
    if not ctx.is_main:
        return None
    measured = {"reduction_errors": probe.errors, "reduction_bounds": probe.bounds} if probe else {}
    return Trajectory(params, grads, divide_factors=frozenset(factors), **measured)


class ReductionProbe:
    """On each rank: the exact float64 average of the ranks' local gradients, beside the strategy's reduced one."""

    def __init__(self, strategy: strategies.Strategy, wrapped, reduce_dtype: str):
        self.strategy, self.wrapped = strategy, wrapped
        self.params = list(wrapped.parameters())
        self.local: list[torch.Tensor | None] = [None] * len(self.params)
        # One tap per parameter: each local gradient lands in its own slot, in the order of the parameters.
        self.taps = [strategy.tap_local_gradients(wrapped, [param], functools.partial(self._seen, index))
                     for index, param in enumerate(self.params)]
        self.gamma = diagnosis.reduction_rounding_bound(reduce_dtype, strategy.data_parallel_size(wrapped))
        self.errors: list[torch.Tensor] = []
        self.bounds: list[torch.Tensor] = []

    def _seen(self, index: int, gradient: torch.Tensor) -> None:
        self.local[index] = gradient.detach().to(torch.float64).clone()

    def close_step(self, reduced: torch.Tensor) -> None:
        """After a reducing backward: ``reduced`` (flattened, whole) against the exact average; one all-reduce."""
        local = torch.cat([(g if g is not None else torch.zeros(p.shape, dtype=torch.float64)).reshape(-1).cpu()
                           for g, p in zip(self.local, self.params)])
        both = torch.stack([local, local.abs()])
        dist.all_reduce(both, group=self.strategy.data_parallel_group(self.wrapped))
        size = self.strategy.data_parallel_size(self.wrapped)
        self.errors.append(reduced - both[0] / size)
        self.bounds.append(self.gamma * both[1] / size)
        self.local = [None] * len(self.params)


def _fraction_of_bound(error: torch.Tensor, bound: torch.Tensor) -> float:
    # Where the bound is 0 every local gradient was 0 there, and so must the reduced one be.
    if bool(((bound == 0) & (error != 0)).any()):
        return math.inf
    covered = bound > 0
    return (error[covered].abs() / bound[covered]).max().item() if bool(covered.any()) else 0.0


def reference(spec: Spec, dataset, cfg: CheckConfig, hypothesis: diagnosis.Hypothesis,
              progress: Progress = silent, *, ranks: Trajectory | None = None) -> Trajectory:
    """One process on the concatenated batches; ``hypothesis`` reproduces a suspected cause.

    'global': the plain single-process run. 'padding': keep DistributedSampler's repeated
    samples. 'per-rank': average W per-rank losses, each over its own rank's batch, as DDP does.
    'per-micro-batch': average the W·K losses of every rank's K micro-batches, each over its own.
    'divide-factor': every gradient times W / f, where the ``ranks`` divided their sum by f.
    'rounding': every gradient plus the ``ranks``' measured reduction error of that step.
    'unused-zero': a zero gradient for every parameter the forward left without one, as DeepSpeed's engine gives.
    """
    model = rank_tools.seeded_model(spec, cfg.seed, dtype=torch.float64)
    optimizer = spec.optimizer(model.parameters())
    order = ReferenceOrder(len(dataset), world_size=cfg.world_size, per_device_batch_size=cfg.rank_step_batch_size,
                           seed=cfg.seed)
    params, grads, used_rng = [], [], False
    for step in range(cfg.steps):
        optimizer.zero_grad(set_to_none=True)
        rng_before = torch.get_rng_state()
        loss = _reference_loss(spec, model, dataset, order, step, hypothesis, cfg)
        with spec.guard("backward through the loss"):
            loss.backward()
        used_rng = used_rng or not torch.equal(rng_before, torch.get_rng_state())
        _reproduce_reduction(model, hypothesis, ranks, step, cfg.world_size)
        grads.append(_flat_grads(model))
        with spec.guard("the optimizer's step()"):
            optimizer.step()
        params.append(flat(p.detach() for p in model.parameters()))
        progress(step + 1, cfg.steps, "one process")
    return Trajectory(params, grads, used_rng)


def _reproduce_reduction(model, hypothesis: diagnosis.Hypothesis, ranks: Trajectory | None, step: int,
                         world_size: int) -> None:
    """Change the reference's gradients as the ranks' reduction did, under 'divide-factor', 'rounding' and
    'unused-zero'."""
    if hypothesis == "unused-zero":
        for param in model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
    elif hypothesis == "divide-factor":
        (factor,) = ranks.divide_factors
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(world_size / factor)
    elif hypothesis == "rounding" and step < len(ranks.reduction_errors):
        error, offset = ranks.reduction_errors[step], 0
        for param in model.parameters():
            if param.grad is not None:
                param.grad.add_(error[offset:offset + param.numel()].view_as(param))
            offset += param.numel()


def _reference_loss(spec: Spec, model, dataset, order: ReferenceOrder, step: int,
                    hypothesis: diagnosis.Hypothesis, cfg: CheckConfig) -> torch.Tensor:
    def loss_of(indices: list[int]) -> torch.Tensor:
        return spec.step(model, rank_tools.collate(dataset, indices, CPU, torch.float64, spec.collate), spec.loss)

    if hypothesis in ("per-rank", "per-micro-batch"):
        # As the ranks normalise: each rank's loss (or each of its micro-batches') over its own elements, averaged.
        parts = [part for rank in range(order.world_size) for part in (
            micro_batches(order.rank_batch(step, rank), cfg) if hypothesis == "per-micro-batch"
            else [order.rank_batch(step, rank)])]
        return sum(loss_of(part) for part in parts) / len(parts)
    return loss_of(order.batch(step, keep_padding=hypothesis == "padding"))


def _samples_per_rank(dataset_size: int, cfg: CheckConfig) -> list[int]:
    """Each rank's real batch per step: smaller than the per-device batch where an epoch ends in a partial batch."""
    order = RankOrder(dataset_size, world_size=cfg.world_size, rank=0, seed=cfg.seed,
                      per_device_batch_size=cfg.rank_step_batch_size)
    return [len(order.batch(step)) for step in range(cfg.steps)]


def _first_non_finite(ranks: Trajectory, single: Trajectory) -> dict[str, Any] | None:
    found = {side: trajectory.first_non_finite() for side, trajectory in
             (("ranks", ranks), ("single_process", single))}
    found = {side: where for side, where in found.items() if where is not None}
    if not found:
        return None
    step, _, what = min(found.values())
    sides = [side for side, where in found.items() if where[0] == step]
    return {"step": step, "side": sides[0] if len(sides) == 1 else "both", "what": what}


def _flat_grads(model) -> torch.Tensor:
    return flat(p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in model.parameters())


def diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Largest absolute difference, and relative to the largest |b|."""
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return {"max_abs_diff": max_abs, "max_rel_diff": max_abs / scale if scale > 0 else max_abs}
