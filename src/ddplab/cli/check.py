"""``ddplab check``: prove a program trains the same on N ranks as in one process, or say why not."""

from __future__ import annotations

import argparse

from ddplab.check.command.config import CommandCheckConfig
from ddplab.check.config import DEFAULT_WORLD_SIZE, FLOAT32_TOLERANCE, FLOAT64_TOLERANCE, CheckConfig
from ddplab.cli import render
from ddplab.cli.args import HelpFormatter, split_at_command
from ddplab.cli.options import add_fields, add_launch_flags, fields_given, launch_config
from ddplab.errors import UsageError, literal
from ddplab.text import count

DESCRIPTION = f"""\
Prove that N ranks compute what one process computes on the same global batch: your own
training command run split two ways and compared step by step, or a spec trained both ways.

  ddplab check [--world-size N] [--global-batch-size G] [--steps K] -- COMMAND

runs COMMAND on N ranks × G/N and on one process × G, with {{world_size}} and
{{per_device_batch_size}} (or {{global_batch_size}}; {{accumulation_steps}}, {{master_port}}) filled in
for each run, and compares the gradient each of its first K optimizer steps received and the
update it made, per parameter and module: gradient_ratio (exact) and cosine (from seeded
sketches, the same on both sides: nothing is gathered). Verdicts: EQUIVALENT, ROUNDING (half
precision), INCOMPARABLE (the one process drew another first batch), or DIVERGES with its cause
(SUM_REDUCTION, ACCUMULATION_DIVIDED_TWICE, ACCUMULATION_NOT_DIVIDED, GATHERED_LOSS_WITHOUT_WORLD_SIZE,
GATHERED_TERMS_MISSING, GRADIENT_SCALE, NO_ALLREDUCE, SAMPLES_DIFFER, INITIALISATION,
LR_SCALED_BY_WORLD_SIZE, UPDATE_DIFFERS, or the audit's finding on the same run, which runs beside
the split run unless --no-audit). Dropout is turned off in both runs (said so); each run ends
after its K steps.

The spec form: train SPEC.py for K steps on W DDP ranks with --batch-size b each, and for K steps in one
process on the ranks' batches concatenated in rank order (global batch W·b), both in float64;
compare the parameters after every step. --strategy fsdp trains the ranks with FSDP2
(fully_shard), --strategy hsdp on a 2-D mesh of --replicate replicas, --strategy deepspeed with
DeepSpeed's engine at --zero-stage 0-3 (its own backward, accumulation and step; in float32, which
is all it reduces: tolerance 1e-5); sharded parameters and gradients are gathered whole to be compared.

Verdicts: EQUIVALENT (within --tolerance); DIVERGES with the cause that a reproducing reference
confirms (SUM_REDUCTION, GRADIENT_SCALE, DIVIDE_FACTOR, PADDING, BATCHNORM,
LOSS_NORMALISED_PER_DEVICE, LOSS_NORMALISED_PER_MICRO_BATCH, UNUSED_PARAMETERS_STEPPED, or UNKNOWN);
ROUNDING (REDUCE_PRECISION) when FSDP2 reduces in --reduce-dtype and the difference is that dtype's
rounding, within its bound; STOCHASTIC when the model draws random numbers in training (dropout);
NON_FINITE when inf or nan appears on either side (named: the ranks, the single process, or both)
before any difference. The exit code is 0 whatever the verdict, unless
--strict: then 3 for any verdict but EQUIVALENT and ROUNDING.

Under torchrun (torchrun --nproc_per_node N -m ddplab check SPEC.py ...) the ranks are
torchrun's: W is its WORLD_SIZE, and rank 0 runs the single-process reference and reports.

SPEC.py defines model() → nn.Module, dataset() → Dataset of (input, target), loss(output,
target) → scalar, and optionally optimizer(params) (default SGD lr 0.1) and
step(model, batch, loss_fn) → loss when the forward is more than loss(model(x), y), and
collate(items) → batch for items of different lengths (padding them). --accumulation K trains
K micro-batches of b per rank and step (no_sync on all but the last), each loss divided by K.

examples:
  ddplab check -- torchrun --nproc_per_node {{world_size}} train.py --batch-size {{per_device_batch_size}}
  ddplab check tests/specs/correct.py --batch-size 8                 # {DEFAULT_WORLD_SIZE} CPU ranks
  ddplab check spec.py --world-size 4 --batch-size 16 --steps 10 --json
  ddplab check spec.py --batch-size 8 --strict                       # exit 3 unless EQUIVALENT (CI)
  ddplab check spec.py --batch-size 8 --strategy fsdp                # FSDP2 on 2 ranks
  ddplab check spec.py --batch-size 4 --accumulation 4               # 4 micro-batches of 4 per step
  ddplab check spec.py --batch-size 8 --strategy hsdp --world-size 4 --replicate 2
  ddplab check spec.py --batch-size 4 --accumulation 2 --strategy deepspeed --zero-stage 3
  torchrun --nproc_per_node 4 -m ddplab check spec.py --batch-size 8
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("check", help="prove a model trains the same on N ranks as on one",
                                   description=DESCRIPTION, formatter_class=HelpFormatter)
    add_fields(parser, CheckConfig, ("spec_path", "world_size", "per_device_batch_size", "accumulation_steps", "steps",
                                     "seed", "tolerance"), spec_path={"nargs": "?"},
               per_device_batch_size={"required": False},
               steps={"help": "optimizer steps to compare (default 5); with a command after --, 3 by default"},
               tolerance={"help": "largest relative parameter difference called equal (default "
                                  f"{FLOAT64_TOLERANCE:g} in float64, {FLOAT32_TOLERANCE:g} under deepspeed, in "
                                  "float32); "
                                  "with a command after --, the gradient's, by default 1e-4 in float32, 1e-9 in "
                                  "float64, 5e-2 in half precision"})
    command_form = parser.add_argument_group("your own command (after --)")
    add_fields(command_form, CommandCheckConfig, ("global_batch_size", "reference_accumulation_steps",
                                                  "run_deadline_s", "audit"))
    add_fields(parser.add_argument_group("parallelism"), CheckConfig, ("strategy", "replicate", "reduce_dtype",
                                                                           "zero_stage"))
    parser.add_argument("--strict", action="store_true", help="exit 3 when the verdict is not EQUIVALENT or ROUNDING")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_launch_flags(parser)
    parser.set_defaults(run=run, command=None)
    split_at_command(parser)


# Flags of one form only.
COMMAND_FIELDS = ("world_size", "global_batch_size", "accumulation_steps", "reference_accumulation_steps", "steps",
                  "tolerance", "audit", "run_deadline_s")
SPEC_ONLY = ("per_device_batch_size", "seed", "strategy", "replicate", "reduce_dtype", "zero_stage", "pg_timeout_s",
             "deadline_s")


def config_from_args(args: argparse.Namespace) -> CheckConfig | CommandCheckConfig:
    if args.command is not None:
        if args.spec_path is not None:
            raise UsageError(f"give either SPEC.py or a command after --, not both (got {literal(args.spec_path)})")
        for field in SPEC_ONLY:
            if getattr(args, field, None) is not None:
                instead = (": with a command after --, give {global_batch_size}, which check splits over the ranks"
                           if field == "per_device_batch_size" else
                           ": a command after -- runs under its own launcher, each run bounded by {run_deadline_s}"
                           if field in ("pg_timeout_s", "deadline_s") else "")
                raise UsageError(f"{{{field}}} belongs to the spec form (ddplab check SPEC.py ...){instead}")
        return CommandCheckConfig(command=tuple(args.command), **fields_given(args, CommandCheckConfig,
                                                                                only=COMMAND_FIELDS))
    for field in ("global_batch_size", "reference_accumulation_steps", "audit", "run_deadline_s"):
        if getattr(args, field, None) is not None:
            raise UsageError(f"{{{field}}} belongs to the form that runs your own command (ddplab check [options] "
                             "-- COMMAND)")
    if args.spec_path is None:
        raise UsageError("give a SPEC.py, or your training command after --, e.g. ddplab check -- torchrun "
                         "--nproc_per_node {{world_size}} train.py --batch-size {{per_device_batch_size}}")
    if args.per_device_batch_size is None:
        raise UsageError("the spec form needs {per_device_batch_size}: samples per rank per step")
    return CheckConfig(**fields_given(args, CheckConfig))


def run(args: argparse.Namespace) -> int:
    from ddplab.check import check

    config = config_from_args(args)
    if isinstance(config, CommandCheckConfig):
        from ddplab.cli import check_command

        return _show(args, check_command.check(args, config), check_command.print_result)
    progress = render.ProgressBar("ddplab check", status=True)
    result = check(config, launch_config(args), progress=progress)
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    return _show(args, result, _print)


def _show(args: argparse.Namespace, result, print_result) -> int:
    if args.json:
        render.print_json(result)
    else:
        print_result(result)
    return 3 if args.strict and not result.passed else 0


def _print(result) -> None:
    cfg = result.config
    rows = [[str(i), f"{d['max_abs_diff']:.2e}", f"{d['max_rel_diff']:.2e}",
             "✓" if d["max_rel_diff"] <= cfg.tolerance else "✗"] for i, d in enumerate(result.per_step)]
    columns = ["step", "max |Δparam|", "relative", ""]
    if cfg.reduce_dtype:
        # How much of the reduce dtype's rounding bound the reduction's error took, per step.
        columns.append("reduction error / bound")
        for row, d in zip(rows, result.per_step):
            row.append(f"{d['reduction_error_of_bound']:.2f}" if "reduction_error_of_bound" in d else "")
    strategy = cfg.strategy_text(cfg.world_size)
    reduced = f" (gradients reduced in {cfg.reduce_dtype})" if cfg.reduce_dtype else ""
    micro = f" × {cfg.accumulation_steps} micro-batches" if cfg.accumulation_steps > 1 else ""
    title = (f"ddplab check: {count(cfg.world_size, 'rank')} × {cfg.per_device_batch_size}{micro}"
             f"{f' ({strategy})' if strategy else ''} vs one process × {cfg.global_batch_size}, "
             f"{_dtypes(cfg)}{reduced}, "
             f"tolerance {cfg.tolerance:g}")
    out = render.console()
    out.print(render.table(title, columns, rows))
    style = {"EQUIVALENT": "bold green", "ROUNDING": "bold green", "DIVERGES": "bold red",
             "STOCHASTIC": "bold yellow", "NON_FINITE": "bold red"}[result.verdict]
    cause = f" ({result.cause})" if result.cause else ""
    out.print(f"[{style}]{result.verdict}[/]{cause}: {result.explanation}")
    if result.fix:
        out.print(f"[bold]fix:[/] {result.fix}")
    for note in _notes(result):
        out.print(f"note: {note}")


def _dtypes(cfg) -> str:
    """The dtypes the two sides trained in: float64, or the ranks' float32 against the float64 reference."""
    return "float32 ranks, float64 reference" if cfg.strategy == "deepspeed" else "float64"


def _notes(result) -> list[str]:
    cfg, notes = result.config, [result.note] if result.note else []
    partial = result.partial_steps
    if partial:
        steps = ", ".join(f"{i} ({n} per rank)" for i, n in partial)
        label, verb = ("step", "ends") if len(partial) == 1 else ("steps", "end")
        notes.append(f"{label} {steps} {verb} an epoch with a partial batch of fewer than the "
                     f"{cfg.rank_step_batch_size} samples per rank a step takes, as a DataLoader without drop_last "
                     "does")
    if result.unused_parameters:
        names = ", ".join(result.unused_parameters[:5]) + (" …" if len(result.unused_parameters) > 5 else "")
        # FSDP2 reduce-scatters the gradients that exist: a parameter no rank used has none to reduce.
        how = ("DDP ran with find_unused_parameters=True" if cfg.wraps_in_ddp
               else "DeepSpeed's engine gives them a zero gradient" if cfg.strategy == "deepspeed"
               else f"{cfg.strategy.upper()} reduces no gradient for them")
        notes.append(f"the forward does not use {names} (no gradient): {how}, and those parameters are compared like "
                     "the rest")
    elif result.find_unused_parameters:
        notes.append("the forward left some parameter without a gradient on a later step: DDP ran again with "
                     "find_unused_parameters=True")
    return notes
