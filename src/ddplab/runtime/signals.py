"""Cancelling with signals: SIGTERM, SIGINT and SIGHUP stop what ddplab started, then act as they would have.

Three users: :func:`ddplab.runtime.launch.launch` (ranks it forked or spawned), ``ddplab audit`` (a
command in its own process group) and ``ddplab study -- COMMAND``, whose driver unwinds on them
(:class:`RaiseOnSignals`). None keeps state in module globals:
each cancellation is an object, so launches may nest and run one after another. A caller that
reports what a cancelled launch measured (``ddplab noise``) wraps the launch in
:class:`ReturnOnSignals`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

CANCEL_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Cancelled(BaseException):
    """A cancelling signal arrived (BaseException: no ``except Exception`` swallows it)."""


class CancelOnSignals:
    """While active, turn SIGTERM/SIGINT/SIGHUP into a request the supervising loop acts on.

    The handler only records the signal (``requested`` is set). On exit the handlers are put back
    and the signal is raised again under the caller's own handler, so the caller sees exactly what
    it would have without us (SIG_DFL: the process ends by that signal, 128+signum in a shell).
    A signal the process ignores (nohup's SIGHUP, SIGINT in a background job) stays ignored.
    """

    def __init__(self):
        self.owner = os.getpid()
        self.previous: dict[int, Any] = {}
        self.received: int | None = None
        self.requested = threading.Event()

    def __enter__(self) -> CancelOnSignals:
        # Python delivers signals to the main thread only; elsewhere leave dispositions alone.
        if threading.current_thread() is threading.main_thread():
            for signum in CANCEL_SIGNALS:
                current = signal.getsignal(signum)
                if current not in (signal.SIG_IGN, None):
                    self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self.owner:
            # A child forked a moment ago that has not restored its handlers yet.
            signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        if self.received is None:
            self.received = signum
        self.requested.set()

    def check(self) -> None:
        """Raise :class:`Cancelled` once a signal arrived."""
        if self.requested.is_set():
            raise Cancelled()

    def restore_in_child(self) -> None:
        """In a forked child: the handlers the parent had before us."""
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.restore_in_child()
        if self.received is not None:
            signal.raise_signal(self.received)
        # The caller's handler returned: the caller sees ``received`` set, and no Cancelled.
        return exc_type is Cancelled


class ReturnOnSignals:
    """While active, SIGTERM/SIGINT/SIGHUP are only recorded: a launch they cancel returns to its caller.

    :class:`CancelOnSignals` stops the ranks and then delivers the signal again under the handler it
    found: this one records it and returns, so the launch raises ``LaunchError(kind="cancelled")``
    carrying what the ranks checkpointed, for the caller to report. On exit the handlers are put back
    and, unless the caller set ``handled``, the signal is delivered once more under them (by default:
    KeyboardInterrupt for SIGINT, the end of the process for SIGTERM), as if this had not been there.
    Main thread only, and never for a signal the process ignores.
    """

    SIGNALS = CANCEL_SIGNALS

    def __init__(self):
        self.owner = os.getpid()
        self.previous: dict[int, Any] = {}
        self.received: int | None = None
        self.handled = False

    def __enter__(self) -> ReturnOnSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                current = signal.getsignal(signum)
                if current not in (signal.SIG_IGN, None):
                    self.previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame) -> None:
        if os.getpid() != self.owner:
            # A forked rank inherits this handler: there the signal acts as it did before us.
            signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        if self.received is None:
            self.received = signum

    def __exit__(self, exc_type, exc, tb) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        if self.received is not None and not self.handled:
            signal.raise_signal(self.received)


class RaiseOnSignals(ReturnOnSignals):
    """While active, SIGTERM and SIGHUP unwind the main thread as Ctrl-C does, then end the process as they would.

    For a driver whose main thread blocks on work running elsewhere (``ddplab study -- COMMAND`` waiting on its
    runs): by default SIGTERM ends the process at once, and the runs, in process groups of their own, train on
    with nothing to stop them. Here the first signal raises :class:`Cancelled` where the main thread waits, so its
    ``finally`` clauses stop the runs; a second one only waits for that. On exit the handlers are put back and the
    signal is delivered again under them; where that handler returns (a program's own), :class:`Cancelled` goes on
    to the caller, which has no result to use. SIGINT keeps its KeyboardInterrupt.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def _record(self, signum, frame) -> None:
        first = self.received is None
        super()._record(signum, frame)
        if first and self.received is not None:  # not in a forked child, where the signal acted as before us
            raise Cancelled()


def signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to a process group that may already be gone."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def sweep_group(pgid: int, grace_s: float) -> None:
    """Wait up to ``grace_s`` for a process group to end, then SIGKILL what is left."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)
