"""What one ``ddplab check -- COMMAND`` compares: the user's command split two ways over one global batch
(torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses

from ddplab.errors import UsageError
from ddplab.guest.runner import check_runnable
from ddplab.study.command.template import CommandTemplate, placeholders
from ddplab.validation import at_least, positive

BUCKETS = 512
"""Numbers a parameter's sketch holds (:mod:`ddplab.check.command.sketch`): a larger tensor's norms are estimated to
±√(2/512) ≈ 6% of the difference at most."""
ENV_SETTINGS = "DDPLAB_CHECK_RUN"
"""The environment variable that carries a run's settings to its guest, as JSON."""
RECORD_PREFIX = "check-"
"""The guest's record files in the run's folder (one per process)."""
FILLED = ("world_size", "per_device_batch_size", "accumulation_steps", "global_batch_size", "master_port", "seed",
          "run_dir")
"""The placeholders ``check`` fills; the study's others (lr, betas) have no value to compare."""
BATCH_PLACEHOLDERS = ("per_device_batch_size", "global_batch_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Side:
    """One of the two runs: its ranks and how each splits its share of the global batch."""

    label: str
    world_size: int
    per_device_batch_size: int
    accumulation_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.per_device_batch_size * self.accumulation_steps

    def describe(self) -> str:
        micro = f" × {self.accumulation_steps} micro-batches" if self.accumulation_steps > 1 else ""
        ranks = f"{self.world_size} ranks" if self.world_size > 1 else "one process"
        return f"{ranks} × {self.per_device_batch_size}{micro}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandCheckConfig:
    """The command run on ``world_size`` ranks and in one process over the same global batch, compared."""

    command: tuple[str, ...]
    """The training command, with {world_size} and {per_device_batch_size} (or {global_batch_size}) placeholders."""
    world_size: int = 2
    """Ranks of the split run; the reference runs on one."""
    global_batch_size: int = 16
    """Samples per optimizer step on both sides."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step on each rank of the split run (needs {accumulation_steps})."""
    reference_accumulation_steps: int = 1
    """Micro-batches per step of the one-process reference, when the global batch does not fit one device at once."""
    steps: int = 3
    """Optimizer steps compared; the runs end after them."""
    tolerance: float | None = None
    """Largest relative gradient difference called equal; by default 1e-9 in float64, 1e-4 in float32, 5e-2 under
    autocast or half-precision parameters."""
    audit: bool = True
    """Audit the split run as well, so that the cause of a difference can be named in the audit's words."""
    run_deadline_s: float = 900.0
    """Seconds each of the two runs may take before it is stopped."""

    def __post_init__(self):
        if not self.command:
            raise UsageError("give your training command after --, e.g. ddplab check -- torchrun --nproc_per_node "
                             "{{world_size}} train.py --batch-size {{per_device_batch_size}}")
        # Check's own placeholders first: the study's others are no part of a check.
        self._check_placeholders(placeholders(self.command))
        at_least("world_size", self.world_size, 2)
        for field in ("global_batch_size", "accumulation_steps", "reference_accumulation_steps", "steps"):
            at_least(field, getattr(self, field))
        positive("tolerance", self.tolerance)
        positive("run_deadline_s", self.run_deadline_s)
        split = self.world_size * self.accumulation_steps
        if self.global_batch_size % split:
            micro = f" × {self.accumulation_steps} micro-batches" if self.accumulation_steps > 1 else ""
            raise UsageError(f"{{global_batch_size}} {self.global_batch_size} does not split over {self.world_size} "
                             f"ranks{micro}: give a multiple of {split}")
        if self.global_batch_size % self.reference_accumulation_steps:
            raise UsageError(f"{{global_batch_size}} {self.global_batch_size} does not split into "
                             f"{self.reference_accumulation_steps} micro-batches of the reference: give a multiple "
                             f"of {self.reference_accumulation_steps}")
        check_runnable(self.fill(self.sides()[0], 0, ".")[0])

    def _check_placeholders(self, names: set[str]) -> None:
        unfilled = sorted(names - set(FILLED))
        if unfilled:
            raise UsageError(f"the command holds {{{{{unfilled[0]}}}}}, which check does not fill: it fills "
                             + ", ".join(f"{{{{{name}}}}}" for name in FILLED))
        if "world_size" not in names:
            raise UsageError("the command needs {{world_size}} where it says how many ranks to start (torchrun "
                             "--nproc_per_node {{world_size}}): check runs it on several ranks and on one")
        if not names & set(BATCH_PLACEHOLDERS):
            raise UsageError("the command needs {{per_device_batch_size}} (or {{global_batch_size}}) where it takes "
                             "its batch size: check splits one global batch two ways")
        if "accumulation_steps" not in names and (self.accumulation_steps > 1 or
                                                  self.reference_accumulation_steps > 1):
            raise UsageError("accumulation needs {{accumulation_steps}} in the command, where it takes its "
                             "gradient accumulation steps")

    def sides(self) -> tuple[Side, Side]:
        """The split run, then the one-process reference."""
        ranks = Side(label="ranks", world_size=self.world_size,
                     per_device_batch_size=self.global_batch_size // (self.world_size * self.accumulation_steps),
                     accumulation_steps=self.accumulation_steps)
        one = Side(label="one process", world_size=1,
                   per_device_batch_size=self.global_batch_size // self.reference_accumulation_steps,
                   accumulation_steps=self.reference_accumulation_steps)
        return ranks, one

    def placeholder_values(self, side: Side, master_port: int, run_dir: str) -> dict:
        return {"world_size": side.world_size, "per_device_batch_size": side.per_device_batch_size,
                "accumulation_steps": side.accumulation_steps, "global_batch_size": side.global_batch_size,
                "master_port": master_port, "seed": 0, "run_dir": run_dir}

    def fill(self, side: Side, master_port: int, run_dir: str) -> list[str]:
        return CommandTemplate(self.command).fill(self.placeholder_values(side, master_port, run_dir))
