"""``ddplab audit -- COMMAND``: run a training command with the auditor injected into every Python process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from ddplab import render
from ddplab.commands import positive_int

DESCRIPTION = """\
Run your own training command unchanged, with ddplab's auditor injected into every Python
process it starts (torchrun workers, torch.multiprocessing.spawn children), and report the
DDP mistakes that silently change training:

  NO_ALLREDUCE (error)             a forward bypassed the DDP wrapper, or the wrapper died before backward
  PARAMS_DIVERGED (error)          parameters or synchronised buffers differ across ranks
  SAME_DATA_ON_ALL_RANKS (error)   every rank got the same batches and no sharding sampler
  SET_EPOCH_MISSING (warning)      a shuffling DistributedSampler repeated an epoch's order
  SUM_REDUCTION (warning)          backward from a reduction='sum' loss as it is
  BATCHNORM_NOT_SYNCED             warning under 16 samples per rank, info otherwise
  ACCUMULATION_SYNCS_EVERY_STEP    warning (performance): no no_sync during accumulation

The auditor only watches: it never changes what training computes.

examples:
  ddplab audit -- torchrun --nproc_per_node 2 train.py --epochs 1
  ddplab audit --steps 10 --json audit.json --strict -- python train_spawn.py
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("audit", help="find silent DDP mistakes in your own training command",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=5, help="optimizer steps to audit (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write the merged report as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 3 when an error-level finding was made")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS...",
                        help="the training command, after --")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("give the training command after --, e.g. ddplab audit -- torchrun --nproc_per_node 2 train.py")
    from ddplab.auditor import findings

    with tempfile.TemporaryDirectory(prefix="ddplab-audit-") as out_dir:
        returncode = _run_audited(command, out_dir, args.steps)
        records = findings.read_records(out_dir)
    if not records:
        print("ddplab audit: no DistributedDataParallel model was built, so there was nothing to audit",
              file=sys.stderr)
        return returncode
    report = findings.merge(records)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report.to_json(), fh, indent=2)
    _print(report)
    if args.strict and report.has_error and returncode == 0:
        return 3
    return returncode


def _run_audited(command: list[str], out_dir: str, steps: int) -> int:
    import ddplab

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(ddplab.__file__)))
    bootstrap = os.path.join(os.path.dirname(os.path.abspath(ddplab.__file__)), "auditor", "bootstrap")
    env = dict(os.environ, DDPLAB_AUDIT_DIR=out_dir, DDPLAB_AUDIT_STEPS=str(steps))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (bootstrap, package_root, os.environ.get("PYTHONPATH")) if p)
    try:
        return subprocess.call(command, env=env)
    except FileNotFoundError:
        raise ValueError(f"command not found: {command[0]}") from None


def _print(report) -> None:
    style = {"error": "bold red", "warning": "bold yellow", "info": "cyan"}
    out = render.console()
    out.print(f"[bold]ddplab audit[/]: world size {report.world_size}, global batch {report.global_batch_size}, "
              f"lr {report.lr}, {report.steps_audited} optimizer steps audited")
    problems = [f for f in report.findings if f.code != "RUN_INFO"]
    if not problems:
        out.print("[bold green]no DDP mistakes found[/]")
    for finding in problems:
        data = finding.to_json()
        out.print(f"[{style[finding.severity]}]{finding.severity.upper()}[/] [bold]{finding.code}[/] "
                  f"(ranks {', '.join(map(str, data['ranks']))}): {data['message']}")
        out.print(f"    [dim]fix:[/] {finding.fix}")
