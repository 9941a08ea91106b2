"""What a study of the user's own command runs, and where (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from ddplab.errors import UsageError
from ddplab.guest.runner import check_runnable
from ddplab.validation import at_least, one_of, positive

Executor = Literal["local", "ray", "slurm"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandOptions:
    """How each run of the command is started and read."""

    command: tuple[str, ...]
    """The launch command with placeholders, after --."""
    metric: str | None = None
    """Judge the target on a metric the program reports (NAME=value, NAME: value or 'NAME': value on stdout, or
    Lightning's self.log) instead of the training loss that reaches backward."""
    executor: Executor = "local"
    """Where runs start: local (this machine, ``parallel`` at once), ray (a Ray task each, on the cluster ray.init
    reaches) or slurm (a Slurm job each, through submitit)."""
    parallel: int = 1
    """Runs at once on the local executor."""
    run_deadline_s: float | None = None
    """Seconds a run may take before its processes are stopped (it then counts as failed)."""
    ray_address: str | None = None
    """The Ray cluster to connect to (default: RAY_ADDRESS, else a local one)."""
    gpus_per_run: int = 0
    """GPUs a run asks of Ray or Slurm (CPUs: ``--world-size``)."""
    slurm_partition: str | None = None
    """The Slurm partition of each run's job."""
    slurm_time: int = 60
    """Minutes each run's Slurm job may take."""
    slurm_cluster: Literal["auto", "local"] = "auto"
    """auto: Slurm where sbatch is found; local: submitit's local executor (jobs on this machine, no Slurm)."""

    def __post_init__(self):
        one_of("executor", self.executor, get_args(Executor))
        one_of("slurm_cluster", self.slurm_cluster, ("auto", "local"))
        at_least("parallel", self.parallel)
        at_least("slurm_time", self.slurm_time)
        positive("run_deadline_s", self.run_deadline_s)
        if self.gpus_per_run < 0:
            raise UsageError(f"{{gpus_per_run}} must be 0 or more, got {self.gpus_per_run}")
        if self.parallel > 1 and self.executor != "local":
            raise UsageError(f"{{parallel}} is the local executor's: the {self.executor} executor starts every run "
                             "of a batch size at once and its scheduler fits them to the resources")
        if self.command:
            check_runnable(self.command[0])
        if self.metric is not None and not self.metric.strip():
            raise UsageError("{metric} needs a name, such as val_loss")
