"""Evaluation over a padded DistributedSampler whose results are combined across ranks: EVAL_SAMPLES_DUPLICATED.

With ``drop_last=False`` a DistributedSampler pads its indices to a multiple of the ranks by repeating the first
ones, so a set of 1,001 samples on 2 ranks is evaluated as 1,002. Training does not care; a metric summed over
ranks counts the repeated samples twice. The evidence, in order: a pass over such a sampler ran to its end with no
optimizer step of an audited model inside it (an evaluation, not training), and the program itself (not torch, nor
a framework that drops the repeats, as Accelerate's ``gather_for_metrics`` does) called a collective that carries
data, during that pass or after it and before training goes on (the next batch any DataLoader returns, or the next
optimizer step). Watched for the whole run: evaluation comes after the audited window more often than inside it.
"""

from __future__ import annotations

import dataclasses

from ddplab.auditor import collectives, state
from ddplab.guest.patches import Patches

# Callers whose collectives are not the program's results: torch itself, frameworks that handle the padding.
NOT_THE_PROGRAM = ("torch.", "ddplab.", "lightning.", "pytorch_lightning.", "lightning_fabric.", "accelerate.",
                   "transformers.", "torchmetrics.")


@dataclasses.dataclass(eq=False)
class _Pass:
    """One pass over a padded DistributedSampler."""

    samples: int
    padded: int
    world_size: int
    rank: int
    steps_at_start: int
    collective: str | None = None  # a collective the program called during the pass
    ended: bool = False


_PASSES: list[_Pass] = []


def install(patches: Patches) -> None:
    """Watch the collectives; DistributedSampler's passes and the loaders' batches come through :mod:`data`."""
    _PASSES.clear()
    collectives.watch(_on_collective)


def watch_pass(sampler, iterator):
    """A DistributedSampler's new pass: watched to its end when the sampler padded the dataset."""
    this_pass = _padded_pass(sampler)
    return iterator if this_pass is None else _until_end(iterator, this_pass)


@state.guarded("watching a padded DistributedSampler")
def _padded_pass(audit, sampler) -> _Pass | None:
    samples = len(sampler.dataset)
    padded = sampler.total_size - samples
    if sampler.drop_last or sampler.num_replicas < 2 or padded <= 0:
        return None
    this_pass = _Pass(samples, padded, sampler.num_replicas, sampler.rank, audit.total_steps)
    _PASSES[:] = [*_PASSES[-7:], this_pass]
    return this_pass


def _until_end(iterator, this_pass: _Pass):
    yield from iterator
    _pass_ended(this_pass)


@state.guarded("watching a padded DistributedSampler")
def _pass_ended(audit, this_pass: _Pass) -> None:
    this_pass.ended = True
    if audit.total_steps != this_pass.steps_at_start:
        _PASSES.remove(this_pass)  # a training pass: its padded samples are just trained on twice
    elif this_pass.collective is not None:
        _duplicated(audit, this_pass, this_pass.collective)


def ended_passes() -> list[_Pass]:
    """The evaluation passes that had ended when a DataLoader was asked for its next batch."""
    return [p for p in _PASSES if p.ended]


def batch_returned(ended: list[_Pass]) -> None:
    """A batch came back after those passes ended: training (or another pass) goes on, so later collectives are not
    their results."""
    for this_pass in ended:
        if this_pass in _PASSES:
            _PASSES.remove(this_pass)


def _on_collective(name: str, args: tuple, kwargs: dict, caller: str) -> None:
    if _PASSES:
        _collective_called(name, caller)


@state.guarded("watching collectives after evaluation")
def _collective_called(audit, name: str, caller: str) -> None:
    if caller.startswith(NOT_THE_PROGRAM) or "EVAL_SAMPLES_DUPLICATED" in audit.findings:
        return
    for this_pass in list(_PASSES):
        if not this_pass.ended:
            this_pass.collective = this_pass.collective or name
        elif audit.total_steps == this_pass.steps_at_start:
            _duplicated(audit, this_pass, name)
        else:
            _PASSES.remove(this_pass)  # training went on after it: later collectives are not its results


def _duplicated(audit, this_pass: _Pass, collective: str) -> None:
    total = this_pass.samples + this_pass.padded
    holders = sorted({p % this_pass.world_size for p in range(this_pass.samples, total)})
    audit.add("EVAL_SAMPLES_DUPLICATED",
              f"an evaluation pass over a DistributedSampler of {this_pass.samples} samples on "
              f"{this_pass.world_size} ranks padded it to {total}: {this_pass.padded} sample"
              f"{'s were' if this_pass.padded > 1 else ' was'} evaluated twice (the padding is on rank"
              f"{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))}), and the program then "
              f"combined its results with dist.{collective}")
