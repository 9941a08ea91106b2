"""``ddplab plan``: batch size, lr, warmup and steps for new hardware, with a reason for each (no torch)."""

from __future__ import annotations

import argparse

from ddplab.cli import render
from ddplab.cli.args import betas, default, given, integer, number, parse_bool
from ddplab.errors import UsageError
from ddplab.plan.planner import Data, Reference

DESCRIPTION = """\
Translate a reference setup to new hardware (DDP, one process per device).

  --keep trajectory   same global batch and lr as the reference: derive the per-device batch
                      and accumulation steps that reach it exactly
  --keep per-device   keep the reference's per-device batch: the global batch grows by k and
                      the lr follows --rule (linear for SGD, square root for Adam by default)

Without --keep: per-device when no target batch is given, else whichever mode the resulting
global batch implies. --batch-size is the per-device loader batch; the global (effective)
batch is per-device batch × devices × nodes × accumulation steps.

examples:
  ddplab plan --ref-batch-size 32 --ref-lr 0.1 --devices 8 --dataset-size 1281167 --epochs 90
  ddplab plan --ref-batch-size 32 --ref-lr 3e-4 --optimizer adamw --devices 8 --nodes 2
  ddplab plan --ref-batch-size 256 --ref-devices 4 --ref-wrapper dp --ref-lr 0.1 --devices 4
  ddplab plan --from-study study-out/study.json --ref-batch-size 32 --ref-lr 0.1 --devices 8
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="translate batch size, lr, warmup and steps to new hardware",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ref = parser.add_argument_group("reference (the run you trust)")
    ref.add_argument("--ref-batch-size", type=integer, required=True,
                     help="per-device loader batch (DataParallel: the loader batch DP splits)")
    ref.add_argument("--ref-lr", type=number, required=True, help="its learning rate")
    ref.add_argument("--ref-devices", type=integer, help=f"devices per node (default {default(Reference, 'devices')})")
    ref.add_argument("--ref-nodes", type=integer, help=f"nodes (default {default(Reference, 'nodes')})")
    ref.add_argument("--ref-accumulation", type=integer,
                     help=f"gradient accumulation steps (default {default(Reference, 'accumulation_steps')})")
    ref.add_argument("--ref-wrapper", choices=("single", "dp", "ddp"),
                     help="single device, DataParallel or DDP (default: single for one device, else ddp)")
    ref.add_argument("--optimizer", choices=("sgd", "adam", "adamw"),
                     help=f"(default {default(Reference, 'optimizer')})")
    ref.add_argument("--betas", type=betas,
                     help="Adam betas as B1,B2 (default {},{})".format(*default(Reference, "betas")))
    ref.add_argument("--eps", type=number, help=f"Adam epsilon (default {default(Reference, 'eps'):g})")
    ref.add_argument("--reduction", choices=("mean", "sum"),
                     help=f"loss reduction (default {default(Reference, 'reduction')})")
    tgt = parser.add_argument_group("target (the new hardware)")
    tgt.add_argument("--devices", type=integer, required=True, help="devices (GPUs) per node")
    tgt.add_argument("--nodes", type=integer, help="nodes (default 1)")
    tgt.add_argument("--batch-size", type=integer, help="per-device loader batch")
    tgt.add_argument("--global-batch-size", type=integer, help="global (effective) batch")
    tgt.add_argument("--accumulation", type=integer, help="gradient accumulation steps")
    tgt.add_argument("--max-batch-size-per-device", type=integer,
                     help="most samples a device fits per micro-step (a larger batch becomes accumulation steps)")
    tgt.add_argument("--keep", choices=("trajectory", "per-device"), help="what to hold fixed")
    tgt.add_argument("--rule", choices=("auto", "none", "linear", "sqrt"),
                     help="lr rule (default auto: linear for SGD, square root for Adam/AdamW)")
    data = parser.add_argument_group("data and schedule (for step counts)")
    data.add_argument("--dataset-size", type=integer, help="samples in the training set")
    data.add_argument("--epochs", type=number,
                      help=f"epochs in the run (default {default(Data, 'epochs'):g}); the warmup is clamped to fit in "
                           "it")
    data.add_argument("--drop-last", nargs="?", const=True, type=parse_bool, help="the DataLoader's drop_last")
    data.add_argument("--sampler-drop-last", nargs="?", const=True, type=parse_bool,
                      help="DistributedSampler's drop_last")
    data.add_argument("--warmup-epochs", type=number,
                      help=f"warmup length when warmup is recommended (default {default(Data, 'warmup_epochs'):g}; "
                           "needs --dataset-size for steps)")
    data.add_argument("--warmup-steps", type=integer, help="warmup length in optimizer steps (overrides the epochs)")
    data.add_argument("--warmup-threshold", type=number,
                      help="recommend warmup when the lr grows at least this much "
                           f"(default {default(Data, 'warmup_threshold'):g})")
    data.add_argument("--critical-batch-size", type=number,
                      help="measured critical batch size (ddplab noise): warn when the plan is well past it")
    data.add_argument("--from-study", metavar="STUDY.json",
                      help="a ddplab study's study.json: its measured B_crit, and its best lr at the planned global "
                           "batch in place of --rule (not with --critical-batch-size)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ddplab.plan import planner
    from ddplab.plan.from_study import plan_from_study

    reference, target, data = config_from_args(args)
    if args.from_study:
        result = plan_from_study(reference, target, data, args.from_study)
    else:
        result = planner.plan(reference, target, data)
    if args.json:
        render.print_json(result)
    else:
        _print_plan(result)
    return 0


def config_from_args(args: argparse.Namespace):
    """(Reference, Target, Data) from the flags; each validates itself, naming its fields."""
    from ddplab.plan import planner

    if args.optimizer in (None, "sgd"):
        adam_only = [flag for flag, value in (("--betas", args.betas), ("--eps", args.eps)) if value is not None]
        if adam_only:
            raise UsageError(f"{' and '.join(adam_only)} set Adam's moments and the plan's optimizer is SGD, where "
                             "they would change nothing: pass --optimizer adam or adamw")
    reference = planner.Reference(**given(
        args, per_device_batch_size="ref_batch_size", lr="ref_lr", devices="ref_devices", nodes="ref_nodes",
        accumulation_steps="ref_accumulation", wrapper="ref_wrapper", optimizer="optimizer", betas="betas",
        eps="eps", reduction="reduction"))
    target = planner.Target(**given(
        args, devices="devices", nodes="nodes", per_device_batch_size="batch_size",
        global_batch_size="global_batch_size", accumulation_steps="accumulation",
        max_batch_size_per_device="max_batch_size_per_device", keep="keep", rule="rule"))
    data = planner.Data(**given(
        args, dataset_size="dataset_size", epochs="epochs", drop_last="drop_last",
        sampler_drop_last="sampler_drop_last", warmup_epochs="warmup_epochs", warmup_steps="warmup_steps",
        warmup_threshold="warmup_threshold", critical_batch_size="critical_batch_size"))
    return reference, target, data


ROWS = (
    ("reference_global_batch_size", "reference global batch"), ("world_size", "world size"),
    ("per_device_batch_size", "per-device batch (--batch-size)"), ("accumulation_steps", "accumulation steps"),
    ("global_batch_size", "global batch"), ("lr", "learning rate"), ("lr_multiplier", "lr multiplier"),
    ("betas", "Adam betas"), ("eps", "Adam eps"), ("warmup_recommended", "warmup"),
    ("warmup_steps", "warmup steps"), ("samples_per_rank", "samples per rank"),
    ("padded_samples", "padded samples"), ("dropped_samples", "dropped samples"),
    ("loader_batches_per_rank", "loader batches per rank"), ("steps_per_epoch", "optimizer steps per epoch"),
    ("total_steps", "total steps"), ("samples_per_epoch", "samples per epoch"),
    ("steps_factor", "steps vs minimum"), ("compute_factor", "compute vs minimum"),
)


def _print_plan(result) -> None:
    values = result.to_json()
    rows = []
    for key, label in ROWS:
        value = values.get(key)
        if key == "warmup_steps" and value is None and result.warmup_recommended:
            value = "unknown"
        if value is None:
            continue
        rows.append([label, _show(value), result.reasons.get(key, "")])
    how = "lr measured by ddplab study" if result.rule == "measured" else f"{result.rule} rule"
    title = f"ddplab plan: keep {result.mode}, {how}"
    out = render.console()
    out.print(render.table(title, ["", "value", "why"], rows))
    out.print(f"[dim]other mode:[/] {result.other_mode}")
    for warning in result.warnings:
        out.print(f"[bold yellow]warning:[/] {warning}")


def _show(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(f"{v:.6g}" for v in value)
    return f"{value:,}" if isinstance(value, int) else str(value)
