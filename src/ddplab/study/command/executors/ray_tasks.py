"""The Ray executor: each run a Ray task asking for its ranks' CPUs (and ``--gpus-per-run``), on the cluster
``ray.init`` reaches; the task runs the command where Ray places it and returns its outcome to the driver."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

from ddplab.errors import DdplabWarning, UsageError, literal
from ddplab.guest.runner import GRACE_S
from ddplab.runtime import timescale
from ddplab.study.command.config import CommandOptions
from ddplab.study.command.executors.registry import Listener, failed, register
from ddplab.study.command.job import JobOutcome, RunJob, run_job

LOCAL_START_ATTEMPTS = 3
"""Tries at starting a local cluster: Ray's raylet gives its dashboard agent a fixed 15 s to start, which a loaded
machine can miss once (the node then "timed out during startup"); a second start finds the agent's imports cached."""


def _connect(ray, address: str | None) -> None:
    """``ray.init`` on ``address``; a local cluster that did not start is shut down and started again."""
    local = (address or os.environ.get("RAY_ADDRESS") or "local") == "local"
    attempts = LOCAL_START_ATTEMPTS if local else 1
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
            return
        except Exception as exc:  # noqa: BLE001 - any failure to connect is said in one line
            ray.shutdown()  # what the failed start left running
            if attempt == attempts:
                where = literal(address) if address else "a local one"
                raise UsageError(f"--executor ray could not reach the Ray cluster ({where}): {literal(exc)}") from None
            reason = next(iter(str(exc).splitlines()), "") or type(exc).__name__  # its first line, never empty
            warnings.warn(f"Ray's local cluster did not start ({reason}); starting it again ({attempt + 1} of "
                          f"{attempts})", DdplabWarning, stacklevel=2)


@register("ray")
class RayExecutor:
    name = "ray"

    def __init__(self, options: CommandOptions, ranks: int, out: str):
        try:
            import ray
        except ImportError:
            raise UsageError("--executor ray needs Ray: pip install 'ddplab[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            _connect(ray, options.ray_address)
        self.task = ray.remote(num_cpus=ranks, num_gpus=options.gpus_per_run, max_retries=0)(run_job)

    def run(self, jobs: list[RunJob], listen: Listener) -> Iterator[tuple[RunJob, JobOutcome]]:
        ray = self.ray
        pending = {self.task.remote(job): job for job in jobs}
        done = 0
        listen(0, len(jobs), 0)  # Ray queues what its resources cannot hold yet: it does not say which
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                job = pending.pop(ready[0])
                try:
                    outcome = ray.get(ready[0])
                except Exception as exc:  # noqa: BLE001 - a task that died is a failed run
                    outcome = failed(f"the Ray task failed: {type(exc).__name__}: {exc}")
                done += 1
                listen(0, len(pending), done)
                yield job, outcome
        finally:
            # A cancelled task gets KeyboardInterrupt, and run_job stops its command's processes: the driver waits
            # for that, so no run outlives it.
            for ref in pending:
                ray.cancel(ref)
            if pending:
                ray.wait(list(pending), num_returns=len(pending), timeout=timescale.scaled(GRACE_S + 5))
