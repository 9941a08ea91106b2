"""``ddplab audit -- COMMAND``: run a training command with the auditor injected into every Python process.

The command runs unchanged through the guest layer (:func:`ddplab.guest.runner.run_guest`), with the auditor
armed in every Python process. The records every process wrote are merged into one report, which exists even when
nothing could be audited.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import tempfile

from ddplab.auditor import findings  # pure: this process may be audited, where importing torch installs the auditor
from ddplab.errors import UsageError
from ddplab.guest import runner


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
        runner.check_runnable(self.command[0])


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
        started, loaded, failures = runner.markers(out_dir)
        needed = _needed_variables(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    ended = {"returncode": 128 - status if status < 0 else status, "signal": -status if status < 0 else None}
    if not records:
        why = _needs_torchrun(config.command, needed[0]) if needed else _why_nothing(started, loaded, failures)
        return AuditOutcome(**ended, report=findings.nothing_audited(why))
    interim = next((r["interim"] for r in records if r.get("rank") == 0 and r.get("interim") is not None), None)
    return AuditOutcome(**ended, report=findings.merge(records), interim=interim)


def _run(command: list[str], out_dir: str, steps: int, stdout: int | None = None) -> int:
    return runner.run_guest(command, out_dir, {"DDPLAB_AUDIT_STEPS": str(steps)}, stdout)


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
