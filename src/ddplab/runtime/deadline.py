"""One ``--deadline`` for a whole command: the parent's own work and the launch share it.

A command does work in its own process besides the launch (loading and validating the spec,
which calls the user's ``model()`` and ``dataset()``; ``check``'s single-process reference run).
:class:`Deadline` starts the clock when the command starts; :meth:`Deadline.guard` bounds such work
and :meth:`Deadline.for_launch` hands the launch only the time that is left (and :meth:`Deadline.launching`
makes its error name the deadline the command was given, not that remainder).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Iterator

from ddplab.errors import LaunchError
from ddplab.runtime.launch_config import under_torchrun


class Deadline:
    """The wall-clock limit of one command (``seconds`` None: no limit)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    @classmethod
    def of(cls, launch_config) -> Deadline:
        """The deadline a launch config asks for; none under torchrun, where the launcher bounds the job."""
        return cls(None if launch_config is None or under_torchrun() else launch_config.deadline_s)

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def for_launch(self, launch_config):
        """``launch_config`` with the time left as its deadline; LaunchError when none is left."""
        left = self.remaining()
        if left is None:
            return launch_config
        if left <= 0:
            raise self._passed("the ranks never started")
        return dataclasses.replace(launch_config, deadline_s=left)

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """Around a launch given :meth:`for_launch`'s time: its deadline error names the deadline asked for.

        The launch had only what was left of it, and would name that smaller number instead.
        """
        try:
            yield
        except LaunchError as exc:
            if exc.kind != "deadline" or self.seconds is None:
                raise
            error = self._passed("the ranks were still running")
            error.rank, error.failure, error.partial = exc.rank, exc.failure, exc.partial
            raise error from None

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run the block in this process under the deadline: past it, LaunchError(kind="deadline").

        The block is interrupted as Ctrl-C would interrupt it (a SIGINT to the main thread, so a
        blocking sleep or read wakes too). Only in the main thread, and only where SIGINT is not
        ignored; elsewhere the block runs unbounded.
        """
        left = self.remaining()
        if left is not None and left <= 0:
            raise self._passed(f"{what} never started")
        if left is None or threading.current_thread() is not threading.main_thread() \
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield
            return
        alarm = _Alarm(left)
        try:
            with alarm:
                yield
        except KeyboardInterrupt:
            if not alarm.fired:
                raise
            raise self._passed(f"{what} was still running") from None

    def _passed(self, what: str) -> LaunchError:
        return LaunchError(f"{what} after the {self.seconds:g} s deadline; stopped", kind="deadline")


class _Alarm:
    """A timer thread that interrupts the main thread once, unless disarmed first."""

    def __init__(self, seconds: float):
        self.fired = False
        self._armed = True
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def __enter__(self) -> _Alarm:
        self._timer.start()
        return self

    def _fire(self) -> None:
        with self._lock:
            if self._armed:
                self.fired = True
                signal.pthread_kill(self._main, signal.SIGINT)

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._armed = False
        self._timer.cancel()
