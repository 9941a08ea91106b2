"""One run of the user's command: its words filled, the study's guest armed, its output kept in the run's folder.

:func:`run_job` is what every executor calls, in this process (a thread of it), a Ray worker or a Slurm job: a
plain function of a picklable :class:`RunJob`, returning a JSON-able :class:`JobOutcome`. The command runs in its
own process group; a deadline, Ctrl-C or a cancelled task stops that whole group (SIGTERM, then SIGKILL after the
grace period). Torch-free.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from ddplab.guest import record, runner
from ddplab.guest.output import free_port, tail
from ddplab.runtime import timescale
from ddplab.runtime.signals import signal_group, sweep_group

GUEST = "ddplab.study.command.guest"
LOG = "output.log"
AGAIN = "\n=== ddplab study: the run started again ===\n"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunJob:
    """One run as an executor ships it."""

    args: tuple[str, ...]
    """The command's words with every placeholder but ``{master_port}`` filled."""
    run_dir: str
    settings: str
    """The guest's settings (JSON), as ``DDPLAB_STUDY_RUN``."""
    deadline_s: float | None = None
    label: str = ""
    """The run as progress names it (batch, lr, seed)."""


@dataclasses.dataclass(kw_only=True)
class JobOutcome:
    """What one run of the command left: its exit, the guest's records, the end of its output."""

    returncode: int
    """The command's exit code; 128 + N when signal N ended it."""
    events: list[dict]
    log_tail: list[str]
    timed_out: bool = False
    seconds: float = 0.0
    """From the command's start to its exit."""
    guest_loaded: bool = False
    """The guest armed itself in some process of the command (it imported torch)."""
    failures: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def run_job(job: RunJob, started: Callable[[subprocess.Popen], None] | None = None, *,
            threads: int | None = None) -> JobOutcome:
    """Run ``job``'s command to its end (or its deadline) with the guest armed; ``started(child)`` is told the
    process once it runs (the local executor cancels through it); ``threads`` is OMP_NUM_THREADS where the
    environment sets none."""
    guest_dir = os.path.join(job.run_dir, "guest")
    shutil.rmtree(guest_dir, ignore_errors=True)
    os.makedirs(guest_dir)
    env = dict(os.environ, DDPLAB_AUDIT_DIR=guest_dir, DDPLAB_GUEST=GUEST, DDPLAB_STUDY_RUN=job.settings)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (runner.python_path(guest_dir), os.environ.get("PYTHONPATH")) if p)
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    port = free_port()
    # torchrun reads its flags from PET_* as well: runs side by side each get their own rendezvous port.
    env.setdefault("PET_MASTER_PORT", str(port))
    args = runner.located([arg.replace("{master_port}", str(port)) for arg in job.args])
    # Appended: a run tried again keeps what its first try printed, above a line that says where the next begins.
    with open(os.path.join(job.run_dir, LOG), "ab") as log:
        if log.tell():
            log.write(AGAIN.encode())
            log.flush()
        child = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=os.getcwd())
        began = time.monotonic()
        if started is not None:
            started(child)
        status, timed_out = _wait(child, job.deadline_s)
        seconds = time.monotonic() - began
    started_count, loaded, failures = runner.markers(guest_dir)
    return JobOutcome(returncode=128 - status if status < 0 else status, events=record.read_all(guest_dir),
                      log_tail=tail(os.path.join(job.run_dir, LOG)), timed_out=timed_out, seconds=seconds,
                      guest_loaded=loaded > 0,
                      failures=failures)


def _wait(child: subprocess.Popen, deadline_s: float | None) -> tuple[int, bool]:
    """The command's status once it ends; a deadline, or an interrupt of this thread, stops its whole group."""
    stop_at = None if deadline_s is None else time.monotonic() + deadline_s
    handlers = _stop_on_signals(child)
    try:
        while True:
            try:
                return child.wait(timeout=0.2), False
            except subprocess.TimeoutExpired:
                pass
            if stop_at is not None and time.monotonic() > stop_at:
                stop(child)
                return child.wait(), True
    except BaseException:
        stop(child)
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _stop_on_signals(child: subprocess.Popen) -> dict:
    """In a job's main thread (a Slurm job cancelled by SIGTERM), a signal stops the command's group first."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        stop(child)
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)
            if signal.getsignal(sig) is not signal.SIG_IGN}


def stop(child: subprocess.Popen) -> None:
    """SIGTERM to the command's whole group, SIGKILL to what is left after the grace period."""
    signal_group(child.pid, signal.SIGTERM)
    sweep_group(child.pid, timescale.scaled(runner.GRACE_S))
