"""A global batch that follows a batch schedule of samples seen, by accumulation steps (Merrill et al. 2025).

    schedule = BatchSchedule(ddp_model, optimizer, "runs/branched.json", per_device_batch_size=32)
    for x, y in loader:
        with schedule.accumulate():                # no_sync on every micro-batch but a window's last
            (loss_fn(ddp_model(x), y) / schedule.accumulation_steps).backward()
        if schedule.should_step():
            optimizer.step()                       # at the schedule's lr for the current global batch
            optimizer.zero_grad()

The schedule is what ``ddplab study --branch-at/--branch-from`` writes (``branched.json``'s
``schedule``: ``[{"samples_seen": n, "global_batch_size": B, "lr": x}]``), the ``schedule`` of
``ddplab noise --every K``'s JSON report (the measured B_simple over samples seen, no lrs), the same list given
directly, or Megatron-LM's ``--step-batch-size-schedule`` string (``"0:32 416:64"``, no lrs). The
samples seen are counted as the global batch of each optimizer step, summed; after each step the
entry in force is the last whose ``samples_seen`` has been reached, and the accumulation steps
become its global batch ÷ (per-device batch × data-parallel size), a division checked for every
entry when the schedule is built. The per-device batch and the world size stay fixed, so the
loader and its DistributedSampler go on unchanged (see :mod:`ddplab.adapt.accumulation`).

The lr: each update runs at the optimizer's own lr × (the entry's lr ÷ the first entry's lr),
during ``optimizer.step()`` only, moving linearly from the old factor to the new over
``warmup_steps`` steps after each change. Build the optimizer at the schedule's first lr and the
updates run at exactly the schedule's lrs; a scheduler on the optimizer keeps shaping its own lr
(a decay, a warmup) underneath. An entry without an lr keeps the one before (a Megatron string:
the optimizer's own lr throughout). Checkpoints: ``state_dict()`` beside the optimizer's. A step
GradScaler skips (an overflow) never reaches the optimizer's hooks, so its samples are not counted:
the schedule runs on the samples the model was updated with.
"""

from __future__ import annotations

import dataclasses

from ddplab.adapt import thresholds as th
from ddplab.adapt.accumulation import AccumulatedBatch
from ddplab.adapt.during_step import require_optimizer
from ddplab.errors import UsageError
from ddplab.runtime import strategies


@dataclasses.dataclass(frozen=True)
class ScheduleChange:
    """One change of the global batch, at a threshold of the schedule."""

    step: int
    """The optimizer step after which it changed (0-based)."""
    samples_seen: int
    """The samples trained when it changed (at or past the entry's threshold)."""
    entry: int
    """The schedule's entry now in force."""
    accumulation_steps: int
    global_batch_size: int
    lr_factor: float
    """The entry's lr over the first entry's: the factor on the optimizer's lr once any warmup is done."""


class BatchSchedule(AccumulatedBatch):
    """Follow a batch schedule of samples seen with ``ddp_model``'s global batch, and ``optimizer``'s lr with it.

    Args:
        ddp_model: the DistributedDataParallel (or FSDP2/HSDP) model, or on one process the module, being trained.
        optimizer: the torch optimizer stepping it, built at the schedule's first lr.
        schedule: a list of ``{"samples_seen", "global_batch_size", "lr"}`` entries, the path of a
            ``branched.json`` (its ``schedule``) or of a JSON list of entries, or a Megatron-style
            ``"SAMPLES:BATCH ..."`` string.
        per_device_batch_size: samples per process per micro-step (the loader's batch size).
        warmup_steps: optimizer steps over which the lr moves to its new value after each change.
        samples_seen: samples already trained (resuming a run by hand; a checkpoint's ``state_dict`` says it too).
        advance_after_step: follow the schedule after every optimizer step (a plain loop); False leaves it to
            :meth:`advance`, for a framework that can change its accumulation only at set points (Lightning:
            an epoch's start).
    """

    def __init__(self, ddp_model, optimizer, schedule, *, per_device_batch_size: int, warmup_steps: int = 0,
                 samples_seen: int = 0, advance_after_step: bool = True):
        require_optimizer(optimizer)
        for name, value, low in (("per_device_batch_size", per_device_batch_size, 1),
                                 ("warmup_steps", warmup_steps, 0), ("samples_seen", samples_seen, 0)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise UsageError(f"{{{name}}} must be an integer ≥ {low}, got {value!r}")
        self.thresholds = th.parse(schedule)
        strategy = strategies.of(ddp_model)
        self.data_parallel_size = strategy.data_parallel_size(ddp_model) if strategy is not None else 1
        # Global samples in one micro-step: data-parallel size × per-device batch.
        micro = per_device_batch_size * self.data_parallel_size
        self.entry_accumulation_steps = th.accumulation_steps(self.thresholds, micro)
        self.entry_lr_factors = th.lr_factors(self.thresholds)
        self.per_device_batch_size, self.advance_after_step = per_device_batch_size, advance_after_step
        self.samples_seen = samples_seen
        self.entry = th.index_at(self.thresholds, samples_seen)
        self.changes: list[ScheduleChange] = []
        super().__init__(ddp_model, optimizer, accumulation_steps=self.entry_accumulation_steps[self.entry],
                         samples_per_micro_step=micro, warmup_steps=warmup_steps,
                         lr_factor=self.entry_lr_factors[self.entry])

    def _stepped(self) -> None:
        self.samples_seen += self.global_batch_size
        if self.advance_after_step:
            self.advance()

    def advance(self) -> bool:
        """Move to the entry the samples seen have reached; True when the global batch or the lr changed."""
        entry = th.index_at(self.thresholds, self.samples_seen)
        if entry == self.entry:
            return False
        self.entry = entry
        accumulation, factor = self.entry_accumulation_steps[entry], self.entry_lr_factors[entry]
        if (accumulation, factor) == (self.accumulation_steps, self._to_factor):
            return False
        self._change(accumulation, factor)
        self.changes.append(ScheduleChange(self.steps - 1, self.samples_seen, entry, accumulation,
                                           self.global_batch_size, factor))
        return True

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume at the same samples seen, batch, lr factor and warmup."""
        return {"samples_seen": self.samples_seen, "entry": self.entry, "global_batch_size": self.global_batch_size,
                **self._warmup_state(), "changes": [dataclasses.asdict(c) for c in self.changes]}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; a different schedule is followed from the checkpoint's samples seen on."""
        self.samples_seen = state["samples_seen"]
        self.entry = th.index_at(self.thresholds, self.samples_seen)
        self.accumulation_steps = self.entry_accumulation_steps[self.entry]
        self._load_warmup_state(state)
        self.changes = [ScheduleChange(**c) for c in state["changes"]]
        if (self.global_batch_size, self.entry_lr_factors[self.entry]) != (state["global_batch_size"],
                                                                          state["to_factor"]):
            # Another schedule (or per-device batch) than the checkpoint's: its entry at once, without a warmup.
            self._from_factor = self._to_factor = self.entry_lr_factors[self.entry]
