"""Running the user's command with a guest armed in every Python process it starts: the layer below the products.

The command runs unchanged, in its own process group, with ``PYTHONPATH`` holding one folder in front of the user's
own: the bootstrap sitecustomize (:mod:`ddplab.guest.bootstrap`) and ddplab itself, nothing else of ddplab's
environment (the command keeps its own torch). ``DDPLAB_GUEST`` names the guest module the bootstrap arms (the
auditor by default; noise, the command study and check arm their own). SIGINT, SIGTERM and SIGHUP reach the whole
group; a second signal, or the grace period, ends it with SIGKILL. Torch-free.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import ddplab
from ddplab.errors import UsageError, literal
from ddplab.guest import record
from ddplab.runtime import timescale
from ddplab.runtime.signals import signal_group, sweep_group

# Seconds a cancelled command gets to exit before the rest of its process group is killed.
GRACE_S = 10.0
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap", "sitecustomize.py")


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


def run_guest(command: list[str], out_dir: str, guest_env: dict[str, str], stdout=None,
              deadline_s: float | None = None, *, stderr=None, sweep: bool = False,
              received: list[int] | None = None) -> int:
    """Run the command with a guest armed in its Python processes; its status (−N: signal N).

    The command runs in its own process group, signals forwarded to the whole group. ``guest_env`` is added to
    its environment (``DDPLAB_GUEST`` names the guest module, the auditor by default); the guest writes to
    ``out_dir``. After ``deadline_s`` seconds the group gets SIGTERM, as if one had been received. ``sweep``: what
    is left of the group once the command has ended (a worker its guest left behind) is ended too. ``received``
    is told the signals this process forwarded (a Ctrl-C the command turned into exit code 1 is still a Ctrl-C).
    """
    env = dict(os.environ, **{record.ENV_DIR: out_dir}, **guest_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path(out_dir), os.environ.get("PYTHONPATH")) if p)
    # Its own group, so a signal reaches torchrun and every worker, not torchrun alone.
    child = subprocess.Popen(located(command), env=env, start_new_session=True, stdout=stdout, stderr=stderr)
    received = [] if received is None else received

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
    if sweep and not received:
        signal_group(child.pid, signal.SIGTERM)  # the command has ended: what is left of its group is left over
    if received or sweep:
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
