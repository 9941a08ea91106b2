"""``schedule``: ``ddplab.BatchSchedule`` following a batch schedule from scratch, one run per seed.

The schedule is ``StudyConfig.schedule``: a ``branched.json`` (what ``--branch-at/--branch-from``
writes), a ``schedule.json`` list of ``{"samples_seen", "global_batch_size", "lr"}`` entries, or a
Megatron-style ``"0:32 416:64"`` string. Each seed's run starts at the schedule's first global batch
(a batch of the grid) from the grid's initial weights for that seed, and trains as the ramp does
(:mod:`ddplab.study.rules.changing`) with the batch and lr the schedule sets, without a warmup. Like
the ramp's, each run starts at the best tuned lr at its first batch (else the linear rule's), and each
later entry scales it by that entry's lr ÷ the first entry's, as ``BatchSchedule`` scales a user's own
lr; a schedule without lrs (a Megatron string) keeps it throughout. So the schedule is judged on its
batches and lr ratios from the same lr as the best tuned fixed run at its starting batch, not on the
reference lr it was measured from. Not fitted.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

from ddplab.adapt import thresholds as th
from ddplab.errors import UsageError
from ddplab.study.rules import changing
from ddplab.study.rules.base import BatchRuns
from ddplab.study.rules.registry import register

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig


class Schedule(changing.ChangingRule):
    name = "schedule"
    summary = "ddplab.BatchSchedule following {schedule} from scratch, from its first global batch"
    help = "schedule adds one BatchSchedule run per seed following ``schedule``"
    colour = "crimson"

    def check(self, config: StudyConfig) -> None:
        if config.schedule is None:
            raise UsageError("the schedule rule follows {schedule}: give a branched.json, a schedule.json or a "
                             "Megatron-style string such as '0:32 416:64'")
        first = thresholds(config)[0].global_batch_size
        if first not in config.global_batch_sizes:
            raise UsageError(f"{{schedule}} starts at global batch {first}, which {{global_batch_sizes}} does not "
                             "hold: add it, as the schedule is judged against the tuned runs there")

    def start(self, config: StudyConfig) -> int | None:
        """The global batch schedule runs start from (the schedule's first), or None without the rule."""
        return thresholds(config)[0].global_batch_size if self.name in config.rules else None

    def cache_tag(self, config: StudyConfig) -> str:
        return digest(config)

    def micro_batch_size(self, config: StudyConfig) -> int:
        # Micro-batches that divide every entry's global batch.
        return math.gcd(*(t.global_batch_size for t in thresholds(config)))

    def adapter(self, workload, config: StudyConfig, model, optimizer):
        """The library's BatchSchedule following the schedule from the run's lr (no warmup, nothing before a step)."""
        from ddplab.adapt.schedule import BatchSchedule

        micro = self.micro_batch_size(config)
        return BatchSchedule(model, optimizer, config.schedule, per_device_batch_size=micro), lambda: None

    def report(self, config: StudyConfig, batches: dict[int, BatchRuns], tuned: list[dict]) -> dict:
        """Median steps and samples of the schedule's runs beside the best-tuned fixed lr's at its first batch."""
        start = self.start(config)
        runs = self.seeds_at(batches[start]) if start in batches else None
        return {"adaptive": {self.name: changing.adaptive(start, runs, tuned)}} if runs else {}


def thresholds(config: StudyConfig) -> tuple[th.Threshold, ...]:
    return th.parse(config.schedule)


def digest(config: StudyConfig) -> str:
    """A short hash of the schedule's entries: its runs are cached apart from another schedule's."""
    text = ";".join(f"{t.samples_seen}:{t.global_batch_size}:{t.lr!r}" for t in thresholds(config))
    return "-" + hashlib.sha256(text.encode()).hexdigest()[:8]


register(Schedule())
