"""``ddplab audit -- COMMAND``: run a training command with the auditor injected into every Python process.

The command runs unchanged, in its own process group, with ``PYTHONPATH`` holding one folder in
front of the user's own: the bootstrap sitecustomize and ddplab itself, nothing else of ddplab's
environment (the command keeps its own torch). SIGINT, SIGTERM and SIGHUP reach the whole group;
a second signal, or the grace period, ends it with SIGKILL. The records every process wrote are
merged into one report, which exists even when nothing could be audited.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import ddplab
from ddplab.auditor import findings  # pure: this process may be audited, where importing torch installs the auditor
from ddplab.errors import UsageError, literal
from ddplab.runtime import timescale
from ddplab.runtime.signals import signal_group, sweep_group

# Seconds a cancelled command gets to exit before the rest of its process group is killed.
GRACE_S = 10.0
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap", "sitecustomize.py")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """One audited command."""

    command: tuple[str, ...]
    """The training command and its arguments."""
    steps: int = 5
    """Optimizer steps to audit."""

    def __post_init__(self):
        if not self.command:
            raise UsageError("give the training command after --, e.g. ddplab audit -- torchrun --nproc_per_node 2 "
                             "train.py")
        if not self.steps >= 1:
            raise UsageError(f"{{steps}} must be at least 1, got {self.steps}")
        check_runnable(self.command[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditOutcome:
    """The command's exit code and the merged report."""

    returncode: int
    """The command's exit code; 128 + N when signal N ended it."""
    report: findings.Report
    signal: int | None = None
    """The signal that ended the command, if one did."""
    interim: list | None = None
    """The findings rank 0 printed during the run, if it did."""

    @property
    def interim_matches(self) -> bool:
        """The final report says nothing rank 0 did not already print."""
        return self.interim is not None and self.interim == self.report.signature()


def run_audited(config: AuditConfig, *, program_stdout_to_stderr: bool = False) -> AuditOutcome:
    """Run the command audited; its exit code is 128 + N when signal N ended it (and ``signal`` says N).

    ``program_stdout_to_stderr`` sends the command's own stdout to stderr, keeping stdout for the report.
    """
    out_dir = tempfile.mkdtemp(prefix="ddplab-audit-")
    try:
        status = _run(list(config.command), out_dir, config.steps, 2 if program_stdout_to_stderr else None)
        records = findings.read_records(out_dir)
        started, loaded, failures = markers(out_dir)
        needed = _needed_variables(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    ended = {"returncode": 128 - status if status < 0 else status, "signal": -status if status < 0 else None}
    if not records:
        why = _needs_torchrun(config.command, needed[0]) if needed else _why_nothing(started, loaded, failures)
        return AuditOutcome(**ended, report=findings.nothing_audited(why))
    interim = next((r["interim"] for r in records if r.get("rank") == 0 and r.get("interim") is not None), None)
    return AuditOutcome(**ended, report=findings.merge(records), interim=interim)


def check_runnable(program: str) -> None:
    if os.sep in program:
        if not os.path.isfile(program):
            raise UsageError(f"command not found: {literal(program)}")
        if not os.access(program, os.X_OK):
            raise UsageError(f"{literal(program)} is not executable: chmod +x it, or run it as "
                             f"'python {literal(program)}'")
    elif locate(program) is None:
        raise UsageError(f"command not found: {literal(program)} (looked on PATH and in {literal(_interpreter_bin())})")


def locate(program: str) -> str | None:
    """Where a program named without a folder runs from: PATH, else beside ddplab's own interpreter.

    ``.venv/bin/ddplab audit -- torchrun ...`` from a shell that never activated the virtualenv has torchrun in
    .venv/bin, beside the interpreter, and not on PATH.
    """
    return shutil.which(program) or shutil.which(program, path=_interpreter_bin())


def _interpreter_bin() -> str:
    return os.path.dirname(sys.executable)


def located(command: list[str]) -> list[str]:
    """The command with its program's full path where only ddplab's interpreter's folder has it (Popen reads
    PATH alone)."""
    program = command[0]
    if os.sep in program or shutil.which(program):
        return command
    return [locate(program) or program, *command[1:]]


def check_writable(path: str, field: str) -> None:
    """Refuse a report path that cannot be written, before the command runs."""
    if not path:
        raise UsageError(f"{{{field}}} needs a file name, got an empty one")
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{{{field}}} {literal(path)} is a directory: give a file name for the report")
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write the report to {literal(path)}: check that its folder exists and is writable")


def python_path(out_dir: str) -> str:
    """A folder holding only the bootstrap and ddplab, to put in front of the command's own PYTHONPATH."""
    folder = os.path.join(out_dir, "path")
    os.makedirs(folder)
    shutil.copyfile(BOOTSTRAP, os.path.join(folder, "sitecustomize.py"))
    os.symlink(os.path.dirname(os.path.abspath(ddplab.__file__)), os.path.join(folder, "ddplab"))
    return folder


def _run(command: list[str], out_dir: str, steps: int, stdout: int | None = None) -> int:
    return run_guest(command, out_dir, {"DDPLAB_AUDIT_STEPS": str(steps)}, stdout)


def run_guest(command: list[str], out_dir: str, guest_env: dict[str, str], stdout: int | None = None,
              deadline_s: float | None = None) -> int:
    """Run the command with a guest armed in its Python processes; its status (−N: signal N).

    The command runs in its own process group, signals forwarded to the whole group. ``guest_env`` is added to
    its environment (``DDPLAB_GUEST`` names the guest module, the auditor by default); the guest writes to
    ``out_dir``. After ``deadline_s`` seconds the group gets SIGTERM, as if one had been received.
    """
    env = dict(os.environ, DDPLAB_AUDIT_DIR=out_dir, **guest_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path(out_dir), os.environ.get("PYTHONPATH")) if p)
    # Its own group, so a signal reaches torchrun and every worker, not torchrun alone.
    child = subprocess.Popen(located(command), env=env, start_new_session=True, stdout=stdout)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        signal_group(child.pid, signum if len(received) == 1 else signal.SIGKILL)

    # A signal this process ignores (SIGHUP under nohup) stays ignored.
    handled = [sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
               if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        returncode = _wait(child, received, None if deadline_s is None else time.monotonic() + deadline_s, forward)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        sweep_group(child.pid, timescale.scaled(GRACE_S))
    return returncode


def _wait(child: subprocess.Popen, received: list[int], stop_at: float | None = None, forward=None) -> int:
    deadline = None
    while True:
        try:
            return child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if stop_at is not None and not received and time.monotonic() > stop_at:
            forward(signal.SIGTERM, None)
        if received and deadline is None:
            deadline = time.monotonic() + timescale.scaled(GRACE_S)
        if deadline is not None and time.monotonic() > deadline:
            signal_group(child.pid, signal.SIGKILL)


def markers(out_dir: str) -> tuple[int, int, list[str]]:
    """Python processes that read the bootstrap, those in which the auditor loaded, and why it failed in others."""
    started, loaded, failures = 0, 0, []
    for name in os.listdir(out_dir):
        if name.startswith("site-"):
            started += 1
        elif name.startswith("loaded-"):
            loaded += 1
        elif name.startswith("failed-"):
            with open(os.path.join(out_dir, name)) as fh:
                failures.append(fh.read())
    return started, loaded, failures


def _needed_variables(out_dir: str) -> list[str]:
    """The torchrun variables whose absence ended the command's Python processes (see :mod:`environment`)."""
    needed = []
    for name in sorted(os.listdir(out_dir)):
        if name.startswith(findings.NEEDS_LAUNCHER_MARKER):
            with open(os.path.join(out_dir, name)) as fh:
                needed.append(fh.read().strip())
    return needed


def _needs_torchrun(command: tuple[str, ...], variable: str) -> str:
    return (f"the command stopped because {variable} was not set, which torchrun sets in every process it starts: it "
            f"looks like a torchrun script; launch it as: {_as_torchrun(command)} (--nproc_per_node: the processes "
            "to start)")


def _as_torchrun(command: tuple[str, ...]) -> str:
    """``ddplab audit -- torchrun --nproc_per_node 2 SCRIPT ARGS`` for a command that ran ``python SCRIPT ARGS``."""
    args = list(command)
    if os.path.basename(args[0]).startswith("python"):
        args = args[1:]
        # The interpreter's own options (-u, -O) are not torchrun's; a module (-m NAME) is.
        while args and args[0].startswith("-") and args[0] != "-m":
            args = args[1:]
    return "ddplab audit -- torchrun --nproc_per_node 2 " + shlex.join(args)


def _why_nothing(started: int, loaded: int, failures: list[str]) -> str:
    if failures:
        return f"the auditor could not start in the command's Python processes ({failures[0]})"
    if loaded:
        return "no DistributedDataParallel model was built and no optimizer stepped in a distributed run, so there " \
               "was nothing to audit"
    if started:
        return "no Python process of the command imported torch, so there was nothing to audit"
    return ("the auditor never loaded: the command started no Python process that reads PYTHONPATH "
            "(python -E or -I ignores it)")
