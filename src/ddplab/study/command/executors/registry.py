"""What an executor is, and the executors by name (``--executor``); nothing here imports one."""

from __future__ import annotations

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


EXECUTORS: dict[str, Callable[[CommandOptions, int, str], Executor]] = {}
"""Each executor's factory ``(options, ranks per run, out folder)``."""


def register(name: str):
    def add(factory):
        EXECUTORS[name] = factory
        return factory

    return add


def build(options: CommandOptions, ranks: int, out: str) -> Executor:
    """The executor ``options.executor`` names, ready to run (connected to its cluster)."""
    return EXECUTORS[options.executor](options, ranks, out)


def failed(reason: str) -> JobOutcome:
    """The outcome of a run its executor could not run to an end (its task or job died)."""
    from ddplab.study.command.job import JobOutcome

    return JobOutcome(returncode=-1, events=[], log_tail=[reason])
