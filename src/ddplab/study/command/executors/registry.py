"""What an executor is, and the executors by name (``--executor``): a table of their modules, the one a study
names imported when it is built."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ddplab.study.command.config import CommandOptions
    from ddplab.study.command.job import JobOutcome, RunJob

Listener = Callable[[int, int, int], None]
"""Told (queued, running, done) as runs move."""


class Executor(Protocol):
    """Starts runs and hands back each one's outcome as it ends."""

    name: str

    def run(self, jobs: list[RunJob], listen: Listener) -> Iterator[tuple[RunJob, JobOutcome]]:
        """Every job's outcome, in the order they end; closing the iterator (an error, Ctrl-C) cancels what is
        queued and stops what runs."""
        ...


BUILT_IN = {"local": "ddplab.study.command.executors.local", "ray": "ddplab.study.command.executors.ray_tasks",
            "slurm": "ddplab.study.command.executors.slurm_jobs"}
"""Each built-in executor's module, by name: Ray's and submitit's are imported only by a study that uses them."""
EXECUTORS: dict[str, Callable[[CommandOptions, int, str], Executor]] = {}
"""Each executor's factory ``(options, ranks per run, out folder)``, as its module registers it."""


def register(name: str):
    def add(factory):
        EXECUTORS[name] = factory
        return factory

    return add


def build(options: CommandOptions, ranks: int, out: str) -> Executor:
    """The executor ``options.executor`` names, ready to run (connected to its cluster)."""
    if options.executor not in EXECUTORS:
        importlib.import_module(BUILT_IN[options.executor])
    return EXECUTORS[options.executor](options, ranks, out)


def failed(reason: str) -> JobOutcome:
    """The outcome of a run its executor could not run to an end (its task or job died)."""
    from ddplab.study.command.job import JobOutcome

    return JobOutcome(returncode=-1, events=[], log_tail=[reason])
