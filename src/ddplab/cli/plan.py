"""``ddplab plan``: batch size, lr, warmup and steps for new hardware, with a reason for each (no torch)."""

from __future__ import annotations

import argparse
import difflib

from ddplab.cli import render
from ddplab.cli.args import HelpFormatter, mark
from ddplab.cli.options import add_fields, fields_given
from ddplab.errors import UsageError
from ddplab.plan.formats import FORMATS
from ddplab.plan.from_config import ConfigPlan, plan_config, write_config
from ddplab.plan.planner import Data, Reference, Target

DESCRIPTION = """\
Translate a reference setup to new hardware: one process per device (DDP, or FSDP2/HSDP with
--strategy), optionally in a device mesh with tensor, pipeline and context parallelism.

  --keep trajectory   same global batch and lr as the reference: derive the per-device batch
                      and accumulation steps that reach it exactly
  --keep per-device   keep the reference's per-device batch: the global batch grows by k and
                      the lr follows --rule (linear for SGD, square root for Adam by default;
                      Adam's β₂, ε and AdamW's weight decay follow the batch too)

Without --keep: per-device when no target batch is given, else whichever mode the resulting
global batch implies. --batch-size is the per-device loader batch; the global (effective)
batch is per-device batch × data-parallel degree × accumulation steps, and the data-parallel
degree is devices × nodes ÷ (--tp × --pp × --cp): tensor, pipeline and context-parallel ranks
work on the same samples and add none. Every rule scales with the data-parallel degree.

examples:
  ddplab plan --ref-batch-size 32 --ref-lr 0.1 --devices 8 --dataset-size 1281167 --epochs 90
  ddplab plan --ref-batch-size 32 --ref-lr 3e-4 --optimizer adamw --devices 8 --nodes 2
  ddplab plan --ref-batch-size 8 --ref-lr 3e-4 --optimizer adamw --devices 8 --nodes 2 --tp 2 --seq-len 4096
  ddplab plan --ref-batch-size 8 --ref-lr 3e-4 --optimizer adamw --devices 8 --nodes 2 --strategy hsdp \\
      --replicate 2 --accumulation 4
  ddplab plan --ref-batch-size 32 --ref-lr 3e-4 --optimizer adamw --devices 8 --rule surge --noise-scale 128
  ddplab plan --ref-batch-size 256 --ref-devices 4 --ref-wrapper dp --ref-lr 0.1 --devices 4
  ddplab plan --from-study study-out/study.json --ref-batch-size 32 --ref-lr 0.1 --devices 8
  ddplab plan --config train.toml --ref-devices 8 --devices 8 --nodes 4 --write-config train-32gpu.toml
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="translate batch size, lr, warmup and steps to new hardware",
                                   description=DESCRIPTION, formatter_class=HelpFormatter)
    add_fields(parser.add_argument_group("reference (the run you trust)"), Reference,
               ("per_device_batch_size", "lr", "devices", "nodes", "accumulation_steps", "tensor_parallel_size",
                "pipeline_parallel_size", "context_parallel_size", "global_batch_size", "wrapper", "optimizer", "betas",
                "eps",
                "weight_decay", "noise_scale", "reduction"), prefix="reference",
               per_device_batch_size={"required": False}, lr={"required": False})
    add_fields(parser.add_argument_group("target (the new hardware)"), Target,
               ("devices", "nodes", "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                "strategy", "data_parallel_replicate_size", "per_device_batch_size", "global_batch_size",
                "accumulation_steps", "max_batch_size_per_device", "keep", "rule", "keep_optimizer_settings"),
               prefix="target")
    data = parser.add_argument_group("data and schedule (for step counts)")
    add_fields(data, Data, ("dataset_size", "seq_len", "epochs", "drop_last", "sampler_drop_last", "warmup_epochs",
                            "warmup_steps", "reference_steps", "reference_warmup_steps", "warmup_threshold",
                            "critical_batch_size"), prefix="data",
               drop_last={"optional_value": True}, sampler_drop_last={"optional_value": True})
    config = parser.add_argument_group("config file (the reference read from a framework's config)")
    mark(config.add_argument("--config", metavar="FILE",
                             help="the reference run's config file: a torchtitan TOML, DeepSpeed JSON, Megatron-LM "
                                  "launch script or args file, Lightning CLI YAML, litgpt YAML or Transformers "
                                  "TrainingArguments JSON/YAML; flags given beside it win over its values"), "config")
    mark(config.add_argument("--config-format", choices=tuple(FORMATS),
                             help="the file's format (default: detected from the file)"), "config_format")
    mark(config.add_argument("--write-config", metavar="OUT",
                             help="write the planned setup to OUT in the same format, changing only the keys the "
                                  "plan changes"), "write_config")
    mark(config.add_argument("--force", action="store_true",
                             help="let --write-config overwrite the file --config read"), "force")
    mark(data.add_argument("--from-study", metavar="STUDY.json",
                           help="a ddplab study's study.json: its reference (global batch, lr, optimizer) where "
                                "flags leave it, its measured B_crit, and its best lr at the planned global batch in "
                                "place of --rule (not with --critical-batch-size); with --rule surge, only its "
                                "B_simple, as --noise-scale; a branched.json (study --branch-at): the critical "
                                "batch of its last resolved checkpoint, the lr by --rule"), "from_study")
    mark(data.add_argument("--from-noise", metavar="REPORT.json",
                           help="a ddplab noise JSON report: the run it measured as the reference (world size, "
                                "per-device batch, accumulation, lr) where flags leave it, and its B_simple as "
                                "--critical-batch-size (with --rule surge, as --noise-scale); a flag that "
                                "contradicts it is warned"), "from_noise")
    mark(data.add_argument("--noise-window", choices=("last", "whole"), default="last",
                           help="which B_simple of a noise report over training the plan takes: its last resolved "
                                "window (default), or the whole run's one ratio"), "noise_window")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ddplab.plan import planner
    from ddplab.plan.from_noise import plan_from_noise
    from ddplab.plan.from_study import plan_from_study

    if args.config:
        return _run_config(args)
    if args.write_config:
        raise UsageError("{write_config} writes the file {config} read: give {config}")
    if args.from_noise and args.from_study:
        raise UsageError("{from_study} and {from_noise} both give the critical batch size: drop one")
    given = fields_given(args, Reference, prefix="reference")
    target, data = Target(**fields_given(args, Target, prefix="target")), Data(**fields_given(args, Data,
                                                                                               prefix="data"))
    if args.from_noise or args.from_study:
        # The report's run completes the reference the flags give, and is checked against them.
        if args.from_noise:
            result = plan_from_noise(given, target, data, args.from_noise, names=args.flag_names,
                                     window=args.noise_window)
        else:
            result = plan_from_study(given, target, data, args.from_study, names=args.flag_names)
    else:
        result = planner.plan(Reference(**given), target, data, names=args.flag_names)
    if args.json:
        render.print_json(result)
    else:
        _print_plan(result)
    return 0


def _run_config(args: argparse.Namespace) -> int:
    for given in ("from_study", "from_noise"):
        if getattr(args, given):
            raise UsageError(f"{{{given}}} and {{config}} both give the reference run, and are not combined yet: "
                             "plan from one of them")
    result = plan_config(args.config, config_format=args.config_format,
                         reference=fields_given(args, Reference, prefix="reference"),
                         target=fields_given(args, Target, prefix="target"),
                         data=fields_given(args, Data, prefix="data"), names=args.flag_names,
                         write_to=args.write_config, force=args.force)
    if args.write_config:
        write_config(result, args.write_config)
    if args.json:
        render.print_json(result)
        return 0
    _print_plan(result.plan, title=f"{result.config} ({result.config_format})", keys=result.config_keys)
    _print_changes(result, args.write_config)
    return 0


ROWS = (
    ("reference_global_batch_size", "reference global batch"), ("world_size", "world size"),
    ("data_parallel_size", "data-parallel degree"),
    ("per_device_batch_size", "per-device batch (--batch-size)"), ("accumulation_steps", "accumulation steps"),
    ("global_batch_size", "global batch"), ("tokens_per_step", "tokens per step"), ("lr", "learning rate"),
    ("lr_multiplier", "lr multiplier"),
    ("betas", "Adam betas"), ("eps", "Adam eps"), ("weight_decay", "weight decay"),
    ("adamw_timescale_epochs", "AdamW timescale (epochs)"), ("warmup_recommended", "warmup"),
    ("warmup_steps", "warmup steps"), ("samples_per_rank", "samples per rank"),
    ("padded_samples", "padded samples"), ("dropped_samples", "dropped samples"),
    ("loader_batches_per_rank", "loader batches per rank"), ("steps_per_epoch", "optimizer steps per epoch"),
    ("total_steps", "total steps"), ("samples_per_epoch", "samples per epoch"),
    ("steps_factor", "steps vs minimum"), ("compute_factor", "compute vs minimum"),
)

EXPLAINED_ONLY = frozenset({"data_parallel_size"})
"""Rows shown only where the plan explains them: the data-parallel degree is news only under a mesh or FSDP2."""


def _print_plan(result, *, title: str = "", keys: dict[str, str] | None = None) -> None:
    values = result.to_json()
    rows = []
    for key, label in ROWS:
        value = values.get(key)
        if key == "warmup_steps" and value is None and result.warmup_recommended:
            value = "unknown"
        if value is None or (key in EXPLAINED_ONLY and key not in result.reasons):
            continue
        if keys is not None:
            # A config's rows name the file's key for the value, not the flag.
            label = label.removesuffix(" (--batch-size)") + (f" ({keys[key]})" if key in keys else "")
        rows.append([label, _show(value), result.reasons.get(key, "")])
    how = "lr measured by ddplab study" if result.rule == "measured" else f"{result.rule} rule"
    title = f"ddplab plan{' ' + title if title else ''}: keep {result.mode}, {how}"
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


def _print_changes(result: ConfigPlan, written: str | None) -> None:
    """The planned file as a diff of the original, then what the format carries over in its own way."""
    out = render.console()
    target = written or f"{result.config} (planned; --write-config OUT writes it)"
    diff = difflib.unified_diff(result.original_text.splitlines(), result.text.splitlines(), fromfile=result.config,
                                tofile=target, lineterm="", n=0)
    lines = list(diff)
    if not lines:
        out.print(f"[dim]config:[/] the plan changes no key of {result.config}")
    for line in lines:
        style = "green" if line.startswith("+") else "red" if line.startswith("-") else "dim"
        out.print(line, style=style, markup=False, highlight=False)
    for note in result.config_notes:
        out.print(f"[dim]note:[/] {note}")
