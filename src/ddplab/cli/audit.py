"""``ddplab audit -- COMMAND``: run a training command with the auditor injected into every Python process."""

from __future__ import annotations

import argparse

from ddplab.auditor import rendering
from ddplab.auditor.runner import AuditConfig
from ddplab.cli import render
from ddplab.cli.args import EndedBySignal, HelpFormatter, mark
from ddplab.cli.options import add_field, fields_given

DESCRIPTION = """\
Run your own training command unchanged, with ddplab's auditor injected into every Python
process it starts (torchrun workers, torch.multiprocessing spawn and fork children), and report
the DDP mistakes that silently change training:

  NO_ALLREDUCE (error)             the optimizer stepped on gradients DDP never all-reduced
  PARAMS_DIVERGED (error)          parameters or broadcast buffers differ across ranks
  SAME_DATA_ON_ALL_RANKS (error)   ranks trained on the same batches (under a mesh: data-parallel ranks)
  TP_RANKS_SEE_DIFFERENT_DATA      error: ranks of one tensor-parallel group were fed different batches
                                   (a DistributedSampler split by the world size in a tp x dp run)
  NOT_DISTRIBUTED (error)          several processes started, each training alone: no process group,
                                   Accelerate on CPU without cpu=True, or a group in which optimizer
                                   steps pass with no collective at all (a model never wrapped in DDP)
  SET_EPOCH_MISSING (warning)      two training passes drew the same DistributedSampler order
  SUM_REDUCTION (warning)          backward from a summed loss (reduction='sum', or 'none' then .sum())
  BATCHNORM_NOT_SYNCED (info)      BatchNorm statistics are per rank (SyncBatchNorm makes them global)
  ACCUMULATION_SYNCS_EVERY_STEP    warning (performance): micro-batches all-reduced before they accumulate
  ACCUMULATION_REDUCES_EVERY_STEP  info: FSDP2 reduced every micro-batch (set_requires_gradient_sync on)
  SCHEDULER_STEPS_PER_PROCESS      the lr scheduler steps several times per optimizer step (Accelerate):
                                   warning once the lr reaches 0 while training goes on, info otherwise
  LR_SCALED_NOT_SCHEDULE           the lr was scaled by W or sqrt(W) after its scheduler was built:
                                   warning where the scheduler recomputes from base_lrs (LambdaLR,
                                   OneCycleLR), info where it keeps the scaling (StepLR, ExponentialLR)
  LR_SCALED_BY_WORLD_SIZE          warning: that scaling was by the world size on a mesh whose
                                   data-parallel size is smaller (tensor parallelism)
  SUM_REDUCTION also covers sums written by hand (model(x).sum(), -(logp * onehot).sum())
  LOSS_NORMALISED_PER_DEVICE       warning: each rank divided its (token) loss by its own, different count
  LOSS_NORMALISED_PER_MICRO_BATCH  warning: each accumulated micro-batch divided by its own count
  GLOBAL_COUNT_WITHOUT_WORLD_SIZE  warning: a global token count without x W: the gradient is 1/W
  EVAL_SAMPLES_DUPLICATED          warning: evaluation over a padded DistributedSampler, its results
                                   combined across ranks: the padded samples count twice
  GRADIENTS_NOT_CLEARED            warning: no zero_grad between optimizer steps
  AUDIT_INCOMPLETE (info)          the auditor turned itself off somewhere; training went on unchanged

The auditor only watches: it adds no collective, never changes what training computes, and
turns itself off rather than fail. Your command's output and exit code are passed through;
the report goes to stderr when the command ends (rank 0 also prints one during the run, after
the audited steps). The report is written with --json or --json-file even when nothing could be
audited (its RUN_INFO says why). Ctrl-C or SIGTERM reach the whole command, and the report still
follows. The command keeps its own Python environment: only ddplab itself is put on its path.

Lightning, Accelerate and the Transformers Trainer are audited through the DDP wrapper they build:
run the command you would run anyway. FSDP2 (fully_shard) and tensor parallelism on a device mesh
are audited in the script's own torchrun run; the report then shows the mesh, the strategy and the
data-parallel size, by which the global batch is counted.

examples:
  ddplab audit -- torchrun --nproc_per_node 2 train.py --epochs 1
  ddplab audit -- python train_lightning.py          # Lightning starts its own worker processes
  ddplab audit -- accelerate launch --num_processes 2 train.py
  ddplab audit --steps 10 --json-file audit.json --strict -- python train_spawn.py
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("audit", help="find silent DDP mistakes in your own training command",
                                   description=DESCRIPTION, formatter_class=HelpFormatter)
    add_field(parser, AuditConfig, "steps")
    parser.add_argument("--json", action="store_true",
                        help="print the merged report as one JSON object on stdout (the command's own stdout goes "
                             "to stderr)")
    mark(parser.add_argument("--json-file", metavar="PATH", help="also write the merged report as JSON to PATH"),
         "json_file")
    parser.add_argument("--strict", action="store_true",
                        help="exit 3 when an error-level finding was made and the command itself succeeded")
    mark(parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS...",
                             help="the training command, after --"), "command", "COMMAND")
    parser.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> AuditConfig:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return AuditConfig(command=tuple(command), **fields_given(args, AuditConfig, only=("steps",)))


def run(args: argparse.Namespace) -> int:
    from ddplab import serialize
    from ddplab.auditor.runner import run_audited
    from ddplab.guest.runner import check_writable

    config = config_from_args(args)
    if args.json_file is not None:
        check_writable(args.json_file, "json_file")
    # Under --json stdout holds the report alone: the command's own stdout goes to stderr.
    outcome = run_audited(config, program_stdout_to_stderr=args.json)
    _print(outcome)
    if args.json:
        render.print_json(outcome.report)
    if args.json_file is not None:
        _write_report(args.json_file, serialize.dumps(outcome.report))
    if outcome.signal is not None:
        raise EndedBySignal(outcome.signal)
    if args.strict and outcome.report.has_error and outcome.returncode == 0:
        return 3
    return outcome.returncode


def _write_report(path: str, text: str) -> None:
    # The command has run: a report that cannot be written is said, never turned into the command's failure.
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as exc:
        render.console(stderr=True).print(f"ddplab audit: could not write the report to {path}: "
                                          f"{exc.strerror or exc}", markup=False)


def _print(outcome) -> None:
    report = outcome.report
    out = render.console(stderr=True)
    if report.why_nothing is not None:
        out.print(f"ddplab audit: {report.why_nothing}", markup=False)
        return
    if outcome.interim_matches:
        out.print(f"ddplab audit: {report.headline()}; the findings are those rank 0 reported above", markup=False)
        return
    style = {"headline": "bold", "clean": "bold green", "error": "bold red", "warning": "bold yellow", "info": "cyan",
             "fix": "dim"}
    for kind, line in rendering.report_lines(report):
        out.print(line, style=style[kind], markup=False, highlight=False)
