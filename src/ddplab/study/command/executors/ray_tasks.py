"""The Ray executor: each run a Ray task asking for its ranks' CPUs (and ``--gpus-per-run``), on the cluster
``ray.init`` reaches; the task runs the command where Ray places it and returns its outcome to the driver."""

from __future__ import annotations

from collections.abc import Iterator

from ddplab.auditor.runner import GRACE_S
from ddplab.errors import UsageError, literal
from ddplab.runtime import timescale
from ddplab.study.command.config import CommandOptions
from ddplab.study.command.executors.registry import Listener, failed, register
from ddplab.study.command.job import JobOutcome, RunJob, run_job


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
            try:
                ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            except Exception as exc:  # noqa: BLE001 - any failure to connect is said in one line
                where = literal(options.ray_address) if options.ray_address else "a local one"
                raise UsageError(f"--executor ray could not reach the Ray cluster ({where}): {literal(exc)}") from None
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
