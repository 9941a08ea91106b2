"""The Slurm executor: each run a Slurm job through submitit (one node; ``--slurm-partition``, ``--slurm-time``,
``--gpus-per-run``, CPUs for ``--world-size`` ranks); ``--slurm-cluster local`` runs the same jobs through
submitit's local executor, with no Slurm. Job files and logs are kept under OUT/slurm."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

from ddplab.errors import UsageError
from ddplab.guest import runner
from ddplab.runtime import timescale
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
        self.executor, self.local = executor, local

    def run(self, jobs: list[RunJob], listen: Listener) -> Iterator[tuple[RunJob, JobOutcome]]:
        with _ctrl_c_for_the_driver() if self.local else contextlib.nullcontext():
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
                    # Told before the run is read: a job that ended is no longer counted running.
                    running = sum(j.state in ("RUNNING", "COMPLETING") for j in pending)
                    listen(len(pending) - running, running, done)
                    yield job, _outcome(slurm_job)
        finally:
            self._cancel(list(pending))

    def _cancel(self, jobs: list) -> None:
        """Slurm's scancel; a local job's controller (its job id is its pid) gets SIGTERM, which it forwards to the
        run, whose command's process group is then stopped; the driver waits for that, so no run outlives it."""
        if not self.local:
            for slurm_job in jobs:
                slurm_job.cancel(check=False)
            return
        for slurm_job in jobs:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(slurm_job.job_id), signal.SIGTERM)
        deadline = time.monotonic() + 2 * timescale.scaled(runner.GRACE_S)
        while any(not j.done() for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.1)


@contextlib.contextmanager
def _ctrl_c_for_the_driver():
    """Local jobs started with SIGINT ignored, as a Slurm job on its node never sees the terminal's Ctrl-C: the
    driver alone takes it and cancels them (:meth:`SlurmExecutor._cancel`; submitit's local controller would
    otherwise print its own traceback)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _outcome(slurm_job) -> JobOutcome:
    try:
        return slurm_job.result()
    except Exception as exc:  # noqa: BLE001 - a job that died is a failed run
        return failed(f"the Slurm job {slurm_job.job_id} failed: {type(exc).__name__}: {str(exc)[-500:]}")
