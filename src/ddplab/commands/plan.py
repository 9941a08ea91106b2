"""``ddplab plan``: batch size, lr, warmup and steps for new hardware, with a reason for each (no torch)."""

from __future__ import annotations

import argparse

from ddplab import render
from ddplab.commands import non_negative_float, non_negative_int, parse_bool, positive_float, positive_int

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
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="translate batch size, lr, warmup and steps to new hardware",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ref = parser.add_argument_group("reference (the run you trust)")
    ref.add_argument("--ref-batch-size", type=positive_int, required=True,
                     help="per-device loader batch (DataParallel: the loader batch DP splits)")
    ref.add_argument("--ref-lr", type=positive_float, required=True, help="its learning rate")
    ref.add_argument("--ref-devices", type=positive_int, default=1, help="devices per node (default 1)")
    ref.add_argument("--ref-nodes", type=positive_int, default=1, help="nodes (default 1)")
    ref.add_argument("--ref-accumulation", type=positive_int, default=1, help="gradient accumulation steps (default 1)")
    ref.add_argument("--ref-wrapper", choices=("single", "dp", "ddp"), default=None,
                     help="single device, DataParallel or DDP (default: single for one device, else ddp)")
    ref.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd", help="(default sgd)")
    ref.add_argument("--betas", type=_betas, default=(0.9, 0.999), help="Adam betas as B1,B2 (default 0.9,0.999)")
    ref.add_argument("--eps", type=positive_float, default=1e-8, help="Adam epsilon (default 1e-8)")
    ref.add_argument("--reduction", choices=("mean", "sum"), default="mean", help="loss reduction (default mean)")
    tgt = parser.add_argument_group("target (the new hardware)")
    tgt.add_argument("--devices", type=positive_int, required=True, help="devices (GPUs) per node")
    tgt.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    tgt.add_argument("--batch-size", type=positive_int, default=None, help="per-device loader batch")
    tgt.add_argument("--global-batch-size", type=positive_int, default=None, help="global (effective) batch")
    tgt.add_argument("--accumulation", type=positive_int, default=None, help="gradient accumulation steps")
    tgt.add_argument("--max-batch-size-per-device", type=positive_int, default=None,
                     help="most samples a device fits per micro-step (a larger batch becomes accumulation steps)")
    tgt.add_argument("--keep", choices=("trajectory", "per-device"), default=None, help="what to hold fixed")
    tgt.add_argument("--rule", choices=("auto", "none", "linear", "sqrt"), default="auto",
                     help="lr rule (default auto: linear for SGD, square root for Adam/AdamW)")
    data = parser.add_argument_group("data and schedule (for step counts)")
    data.add_argument("--dataset-size", type=positive_int, default=None, help="samples in the training set")
    data.add_argument("--epochs", type=positive_float, default=1.0,
                      help="epochs in the run (default 1); the warmup is clamped to fit in it")
    data.add_argument("--drop-last", nargs="?", const=True, default=False, type=parse_bool,
                      help="the DataLoader's drop_last")
    data.add_argument("--sampler-drop-last", nargs="?", const=True, default=False, type=parse_bool,
                      help="DistributedSampler's drop_last")
    data.add_argument("--warmup-epochs", type=non_negative_float, default=5.0,
                      help="warmup length when warmup is recommended (default 5; needs --dataset-size for steps)")
    data.add_argument("--warmup-steps", type=non_negative_int, default=None,
                      help="warmup length in optimizer steps (overrides the epochs)")
    data.add_argument("--warmup-threshold", type=positive_float, default=4.0,
                      help="recommend warmup when the lr grows at least this much (default 4)")
    data.add_argument("--critical-batch-size", type=positive_float, default=None,
                      help="measured critical batch size (ddplab noise): warn when the plan is well past it")
    # --- ddplab study ---
    data.add_argument("--from-study", metavar="STUDY.json", default=None,
                      help="a ddplab study's study.json: its measured B_crit and best lr at the global batch "
                           "replace --critical-batch-size and the rule")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def _betas(text: str) -> tuple[float, float]:
    try:
        first, second = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers like 0.9,0.999, got {text!r}") from None
    return first, second


def run(args: argparse.Namespace) -> int:
    from ddplab import planner

    wrapper = args.ref_wrapper or ("single" if args.ref_devices * args.ref_nodes == 1 else "ddp")
    reference = planner.Reference(
        per_device_batch_size=args.ref_batch_size, lr=args.ref_lr, devices=args.ref_devices, nodes=args.ref_nodes,
        accumulation_steps=args.ref_accumulation, wrapper=wrapper, optimizer=args.optimizer, betas=args.betas,
        eps=args.eps, reduction=args.reduction)
    target = planner.Target(
        devices=args.devices, nodes=args.nodes, per_device_batch_size=args.batch_size,
        global_batch_size=args.global_batch_size, accumulation_steps=args.accumulation,
        max_batch_size_per_device=args.max_batch_size_per_device, keep=args.keep, rule=args.rule)
    data = planner.Data(
        dataset_size=args.dataset_size, epochs=args.epochs, drop_last=args.drop_last,
        sampler_drop_last=args.sampler_drop_last, warmup_epochs=args.warmup_epochs, warmup_steps=args.warmup_steps,
        warmup_threshold=args.warmup_threshold, critical_batch_size=args.critical_batch_size)
    result = planner.plan(reference, target, data)
    if args.from_study:
        result = _from_study(args.from_study, result.global_batch_size, reference, target, data, planner)
    if args.json:
        render.print_json(result.to_json())
    else:
        _print_plan(result)
    return 0


def _from_study(path: str, global_batch: int, reference, target, data, planner):
    """Re-plan with what ``ddplab study`` measured: its B_crit, and its best lr at this global batch."""
    import dataclasses

    from ddplab.study_fit import study_overrides

    lr, b_crit, reason, warnings = study_overrides(path, global_batch)
    result = planner.plan(reference, target, dataclasses.replace(data, critical_batch_size=b_crit))
    reasons = {**result.reasons, "lr": reason,
               "lr_multiplier": f"measured lr / reference lr = {lr:.4g} / {reference.lr:g}"}
    return dataclasses.replace(result, lr=lr, lr_multiplier=lr / reference.lr, reasons=reasons,
                               warnings=(*result.warnings, *warnings))


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
    title = f"ddplab plan: keep {result.mode}, {result.rule} rule"
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
