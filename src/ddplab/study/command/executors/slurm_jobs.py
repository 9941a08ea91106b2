"""The Slurm executor: each run a Slurm job through submitit (one node; ``--slurm-partition``, ``--slurm-time``,
``--gpus-per-run``, CPUs for ``--world-size`` ranks); ``--slurm-cluster local`` runs the same jobs through
submitit's local executor, with no Slurm. Job files and logs are kept under OUT/slurm."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from ddplab.errors import UsageError
from ddplab.study.command.config import CommandOptions
from ddplab.study.command.executors.registry import Listener, failed, register
from ddplab.study.command.job import JobOutcome, RunJob, run_job

POLL_S = 1.0


@register("slurm")
class SlurmExecutor:
    name = "slurm"

    def __init__(self, options: CommandOptions, ranks: int, out: str):
        try:
            import submitit
        except ImportError:
            raise UsageError("--executor slurm needs submitit: pip install 'ddplab[slurm]'") from None
        local = options.slurm_cluster == "local"
        executor = submitit.AutoExecutor(folder=os.path.join(out, "slurm"), cluster="local" if local else None)
        if executor.cluster != ("local" if local else "slurm"):
            raise UsageError("--executor slurm found no Slurm here (no sbatch on PATH): run it where Slurm is, or pass "
                             "--slurm-cluster local to try it on this machine")
        parameters = {"timeout_min": options.slurm_time, "nodes": 1, "tasks_per_node": 1, "cpus_per_task": ranks}
        if options.gpus_per_run:
            parameters["gpus_per_node"] = options.gpus_per_run
        if options.slurm_partition:
            parameters["slurm_partition"] = options.slurm_partition
        executor.update_parameters(**parameters)
        self.executor = executor

    def run(self, jobs: list[RunJob], listen: Listener) -> Iterator[tuple[RunJob, JobOutcome]]:
        submitted = {self.executor.submit(run_job, job): job for job in jobs}
        pending, done = dict(submitted), 0
        try:
            while pending:
                finished = [j for j in pending if j.done()]
                if not finished:
                    running = sum(j.state in ("RUNNING", "COMPLETING") for j in pending)
                    listen(len(pending) - running, running, done)
                    time.sleep(POLL_S)
                    continue
                for slurm_job in finished:
                    job = pending.pop(slurm_job)
                    done += 1
                    yield job, _outcome(slurm_job)
        finally:
            for slurm_job in pending:
                slurm_job.cancel(check=False)


def _outcome(slurm_job) -> JobOutcome:
    try:
        return slurm_job.result()
    except Exception as exc:  # noqa: BLE001 - a job that died is a failed run
        return failed(f"the Slurm job {slurm_job.job_id} failed: {type(exc).__name__}: {str(exc)[-500:]}")
