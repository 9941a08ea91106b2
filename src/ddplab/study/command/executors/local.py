"""The local executor: runs on this machine, ``--parallel`` at once, each in a thread that waits on its command."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import threading
from collections.abc import Iterator

from ddplab.study.command.config import CommandOptions
from ddplab.study.command.executors.registry import Listener, register
from ddplab.study.command.job import JobOutcome, RunJob, run_job, stop


@register("local")
class LocalExecutor:
    name = "local"

    def __init__(self, options: CommandOptions, ranks: int, out: str):
        self.parallel = options.parallel
        # Runs side by side share the cores: each process gets its share of threads, as torchrun gives its ranks.
        self.threads = max(1, (os.cpu_count() or 1) // (options.parallel * ranks)) if options.parallel > 1 else None
        self._children: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def run(self, jobs: list[RunJob], listen: Listener) -> Iterator[tuple[RunJob, JobOutcome]]:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.parallel)
        futures = {pool.submit(self._run, job): job for job in jobs}
        done = 0
        listen(len(jobs), 0, 0)
        try:
            for future in concurrent.futures.as_completed(futures):
                done += 1
                listen(len(jobs) - done - len(self._children), len(self._children), done)
                yield futures[future], future.result()
        finally:
            # Closed early (an error, Ctrl-C): nothing queued starts, and what runs is stopped.
            for future in futures:
                future.cancel()
            with self._lock:
                children = list(self._children.values())
            for child in children:
                stop(child)
            pool.shutdown(wait=True)

    def _run(self, job: RunJob) -> JobOutcome:
        def started(child: subprocess.Popen) -> None:
            with self._lock:
                self._children[child.pid] = child

        try:
            return run_job(job, started, threads=self.threads)
        finally:
            with self._lock:
                self._children = {pid: c for pid, c in self._children.items() if c.poll() is None}
