"""Run the user's training command with the noise scale's guest armed, then merge what its ranks recorded.

The command runs unchanged through the auditor's runner (:func:`ddplab.guest.runner.run_guest`: its own process
group, signals forwarded, the bootstrap sitecustomize on PYTHONPATH), with ``DDPLAB_GUEST`` naming
:mod:`ddplab.noise.guest.install`. Its exit code is kept; a run stopped by ``--deadline``, Ctrl-C or a failure
reports the steps measured before.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import tempfile
import time

from ddplab.guest import record, runner
from ddplab.noise.command import report as command_report
from ddplab.noise.command.config import CommandConfig
from ddplab.noise.command.merge import WITHOUT_ACCUMULATION, Merged, merge


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseOutcome:
    """The command's exit and what was measured: a report, or one sentence saying why there is none."""

    returncode: int
    """The command's exit code; 128 + N when signal N ended it."""
    signal: int | None = None
    """The signal that ended the command, if one did."""
    timed_out: bool = False
    """Whether ``deadline_s`` stopped the command."""
    report: command_report.CommandNoiseReport | None = None
    why_nothing: str | None = None


def measure_command(config: CommandConfig, *, program_stdout_to_stderr: bool = False) -> NoiseOutcome:
    """Run the command with the guest armed in every process; the merged report, or why there is none."""
    out_dir = tempfile.mkdtemp(prefix="ddplab-noise-")
    try:
        begun, received = time.monotonic(), []
        status = runner.run_guest(list(config.command), out_dir, config.plan().to_env(),
                                  2 if program_stdout_to_stderr else None, config.deadline_s, received=received)
        timed_out = config.deadline_s is not None and time.monotonic() - begun >= config.deadline_s
        events = record.read_all(out_dir)
        started, loaded, failures = runner.markers(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    # A signal the driver forwarded is what stopped the command, whatever exit code the command made of it.
    signum = -status if status < 0 else (received[0] if received and status != 0 and not timed_out else None)
    ended = {"returncode": 128 - status if status < 0 else status, "signal": signum, "timed_out": timed_out}
    merged = merge(events)
    if not merged.steps:
        why = _why_nothing(config, merged, ended["returncode"], started, loaded, failures)
        if timed_out:
            why += f" (the command was stopped at --deadline {config.deadline_s:g} s)"
        elif signum is not None:
            why += f" (the command was stopped by {signal.Signals(signum).name})"
        return NoiseOutcome(**ended, why_nothing=why)
    stopped, cancelled, failed_after = _ending(config, merged, ended["returncode"], ended["signal"], timed_out)
    report = command_report.build(config.command, merged, start_step=config.start_step, every=config.every,
                                  window=config.window, returncode=ended["returncode"], stopped_early=stopped,
                                  cancelled_by=cancelled, failed_after_measuring=failed_after)
    return NoiseOutcome(**ended, report=report)


def _ending(config: CommandConfig, merged: Merged, returncode: int, signum: int | None,
            timed_out: bool) -> tuple[str | None, str | None, str | None]:
    """How the command ended: why it stopped early, the signal that cancelled it, and a failure that came only after
    the last planned step was measured (each None when it does not apply)."""
    if timed_out:
        return f"the command was stopped at --deadline {config.deadline_s:g} s", None, None
    if signum is not None or returncode in (130, 143, 129):
        name = signal.Signals(signum or returncode - 128).name
        return f"the command was stopped by {name}", name, None
    if returncode != 0 and _last_planned_step_measured(config, merged):
        # A failure past the plan (gloo's abort at exit, a crash in the script's own ending) cut nothing short.
        return None, None, (f"the command failed with exit code {returncode} after the last planned step was "
                            "measured: the figures are complete")
    if returncode != 0:
        return f"the command failed with exit code {returncode}", None, None
    return None, None, None


def _last_planned_step_measured(config: CommandConfig, merged: Merged) -> bool:
    plan = config.plan()
    return plan.steps is not None and plan.finished(merged.steps[-1].step + 1)


def _why_nothing(config: CommandConfig, merged: Merged, returncode: int, started: int, loaded: int,
                 failures: list[str]) -> str:
    if failures:
        return f"the noise scale's guest could not start in the command's Python processes ({failures[0]})"
    if not merged.group:
        return _no_model(started, loaded, returncode)
    if WITHOUT_ACCUMULATION in merged.left_out:
        return ("the command trains in one process (no distributed run, a world of one) without accumulation: the "
                "noise scale compares gradients over two batch sizes, so it needs 2 or more ranks (e.g. torchrun "
                "--nproc_per_node 2) or 2 or more micro-steps per optimizer step")
    if merged.notes:
        return f"nothing could be measured: {merged.notes[0]}"
    if merged.left_out:
        reason, count = next(iter(merged.left_out.items()))
        return f"no measured step could be used: {count} were {reason}"
    if merged.optimizer_steps is not None and merged.optimizer_steps <= config.start_step:
        return (f"the run made {merged.optimizer_steps} optimizer steps, and measuring starts at step "
                f"{config.start_step}: lower --start-step below {merged.optimizer_steps} or train longer")
    return "the run ended before its first measured step finished"


def _no_model(started: int, loaded: int, returncode: int) -> str:
    if loaded:
        failed = f", or failed before one trained (exit code {returncode})" if returncode else ""
        return (f"the command started no distributed run{failed}: no DDP or FSDP2 model trained in it, so there is "
                "no data-parallel reduction to measure; launch it on 2 or more ranks, e.g. "
                "ddplab noise -- torchrun --nproc_per_node 2 train.py")
    if started:
        return "no Python process of the command imported torch: there was nothing to measure"
    return ("the guest never loaded: the command started no Python process that reads PYTHONPATH "
            "(python -E or -I ignores it)")
