"""``ddplab audit -- COMMAND``: run a training command with the auditor injected into every Python process."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ddplab import render
from ddplab.commands import positive_int

DESCRIPTION = """\
Run your own training command unchanged, with ddplab's auditor injected into every Python
process it starts (torchrun workers, torch.multiprocessing spawn and fork children), and report
the DDP mistakes that silently change training:

  NO_ALLREDUCE (error)             the optimizer stepped on gradients DDP never all-reduced
  PARAMS_DIVERGED (error)          parameters or broadcast buffers differ across ranks
  SAME_DATA_ON_ALL_RANKS (error)   ranks trained on the same batches
  SET_EPOCH_MISSING (warning)      two training passes drew the same DistributedSampler order
  SUM_REDUCTION (warning)          backward from a summed loss (reduction='sum', or 'none' then .sum())
  BATCHNORM_NOT_SYNCED             warning under 16 samples per rank, info otherwise
  ACCUMULATION_SYNCS_EVERY_STEP    warning (performance): micro-batches all-reduced before they accumulate
  NOT_DISTRIBUTED (error)          several processes started, each training alone (e.g. Accelerate on CPU
                                   without cpu=True: num_processes 1, no DDP)
  SCHEDULER_STEPS_PER_PROCESS      the lr scheduler steps several times per optimizer step (Accelerate):
                                   warning once the lr reaches 0 while training goes on, info otherwise
  LR_SCALED_NOT_SCHEDULE (warning) the lr was scaled by W or sqrt(W) after its scheduler was built
  LOSS_NORMALISED_PER_DEVICE       warning: the Trainer divided each rank's token loss by its own,
                                   different token count (average_tokens_across_devices off)
  AUDIT_INCOMPLETE (info)          the auditor turned itself off somewhere; training went on unchanged

The auditor only watches: it adds no collective, never changes what training computes, and
turns itself off rather than fail. Your command's output and exit code are passed through;
the report goes to stderr when the command ends (rank 0 also prints one during the run, after
the audited steps). Ctrl-C or SIGTERM reach the whole command, and the report still follows.

Lightning, Accelerate and the Transformers Trainer are audited through the DDP wrapper they build:
run the command you would run anyway.

examples:
  ddplab audit -- torchrun --nproc_per_node 2 train.py --epochs 1
  ddplab audit -- python train_lightning.py          # Lightning starts its own worker processes
  ddplab audit -- accelerate launch --num_processes 2 train.py
  ddplab audit --steps 10 --json-file audit.json --strict -- python train_spawn.py
"""
# Seconds a cancelled command gets to exit before the rest of its process group is killed.
GRACE_S = 10.0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("audit", help="find silent DDP mistakes in your own training command",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=5, help="optimizer steps to audit (default 5)")
    parser.add_argument("--json", action="store_true",
                        help="print the merged report as one JSON object on stdout, after the command's output")
    parser.add_argument("--json-file", metavar="PATH", help="also write the merged report as JSON to PATH")
    parser.add_argument("--strict", action="store_true",
                        help="exit 3 when an error-level finding was made and the command itself succeeded")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS...",
                        help="the training command, after --")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("give the training command after --, "
                         "e.g. ddplab audit -- torchrun --nproc_per_node 2 train.py")
    _check_runnable(command[0])
    if args.json_file:
        _check_writable(args.json_file)
    from ddplab.auditor import findings

    out_dir = tempfile.mkdtemp(prefix="ddplab-audit-")
    try:
        returncode = _run_audited(command, out_dir, args.steps)
        records = findings.read_records(out_dir)
        loaded, failures = _markers(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if not records:
        _say_why_nothing(loaded, failures)
        return returncode
    report = findings.merge(records)
    if args.json_file:
        with open(args.json_file, "w") as fh:
            json.dump(report.to_json(), fh, indent=2)
    _print(report, interim=_interim_signature(records))
    if args.json:
        render.print_json(report.to_json())
    if args.strict and report.has_error and returncode == 0:
        return 3
    return returncode


def _check_runnable(program: str) -> None:
    if os.sep in program:
        if not os.path.isfile(program):
            raise ValueError(f"command not found: {program}")
        if not os.access(program, os.X_OK):
            raise ValueError(f"{program} is not executable: chmod +x it, or run it as 'python {program}'")
    elif shutil.which(program) is None:
        raise ValueError(f"command not found: {program}")


def _check_writable(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"cannot write the report to {path}: check that its folder exists and is writable")


def _run_audited(command: list[str], out_dir: str, steps: int) -> int:
    """Run the command in its own process group; forward signals to the whole group; return its exit code."""
    import ddplab

    package_dir = os.path.dirname(os.path.abspath(ddplab.__file__))
    bootstrap = os.path.join(package_dir, "auditor", "bootstrap")
    env = dict(os.environ, DDPLAB_AUDIT_DIR=out_dir, DDPLAB_AUDIT_STEPS=str(steps))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (bootstrap, os.path.dirname(package_dir),
                                                    os.environ.get("PYTHONPATH")) if p)
    # Its own group, so a signal reaches torchrun and every worker, not torchrun alone.
    child = subprocess.Popen(command, env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        _signal_group(child.pid, signum if len(received) == 1 else signal.SIGKILL)

    # A signal this process ignores (SIGHUP under nohup) stays ignored.
    handled = [sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
               if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        returncode = _wait(child, received)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        _sweep_group(child.pid)
    return 128 - returncode if returncode < 0 else returncode


def _wait(child: subprocess.Popen, received: list[int]) -> int:
    deadline = None
    while True:
        try:
            return child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if received and deadline is None:
            deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _signal_group(child.pid, signal.SIGKILL)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _sweep_group(pgid: int) -> None:
    """After a cancel: workers the launcher left behind get a moment, then SIGKILL."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)


def _markers(out_dir: str) -> tuple[int, list[str]]:
    loaded, failures = 0, []
    for name in os.listdir(out_dir):
        if name.startswith("loaded-"):
            loaded += 1
        elif name.startswith("failed-"):
            with open(os.path.join(out_dir, name)) as fh:
                failures.append(fh.read())
    return loaded, failures


def _say_why_nothing(loaded: int, failures: list[str]) -> None:
    if failures:
        why = f"the auditor could not start in the command's Python processes ({failures[0]})"
    elif loaded:
        why = "no DistributedDataParallel model was built, so there was nothing to audit"
    else:
        why = ("the auditor never loaded: the command started no Python process that reads PYTHONPATH "
               "(python -E or -I ignores it)")
    print(f"ddplab audit: {why}", file=sys.stderr)


def _interim_signature(records: list[dict]) -> list | None:
    """The findings rank 0 printed during the run, if it did."""
    return next((r["interim"] for r in records if r.get("rank") == 0 and r.get("interim") is not None), None)


def _print(report, interim: list | None) -> None:
    out = render.console(stderr=True)
    if interim is not None and interim == report.signature():
        out.print(f"[bold]ddplab audit[/]: {report.headline()}; the findings are those rank 0 reported above")
        return
    style = {"error": "bold red", "warning": "bold yellow", "info": "cyan"}
    out.print(f"[bold]ddplab audit[/]: {report.headline()}")
    if not report.problems:
        out.print("[bold green]no DDP mistakes found[/]")
    for finding in report.problems:
        data = finding.to_json()
        out.print(f"[{style[finding.severity]}]{finding.severity.upper()}[/] [bold]{finding.code}[/] "
                  f"(ranks {', '.join(map(str, data['ranks']))}): {data['message']}")
        out.print(f"    [dim]fix:[/] {finding.fix}")
