"""``ddplab study``: measure steps-to-target versus global batch per lr rule, fit B_crit, plot and report."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ddplab.cli import render
from ddplab.cli.args import HelpFormatter, mark, number, split_at_command
from ddplab.cli.options import add_fields, fields_given, help_text
from ddplab.errors import SpecError, UsageError, literal
from ddplab.study.branched.config import BranchConfig
from ddplab.study.command.config import CommandOptions
from ddplab.study.config import (
    DEFAULT_ACCURACY,
    WORKLOADS,
    OptimizerConfig,
    StudyConfig,
    StudyOptions,
)
from ddplab.study.kernels import pin_cpu_kernels
from ddplab.study.report.text import front_lines
from ddplab.study.rules import registry

DESCRIPTION = f"""\
Train a grid of runs — global batch sizes × lr rules × seeds — each until it first reaches a
target, and fit steps-to-target S(B) = S_min(1 + B_crit/B) (McCandlish et al. 2018) per rule:
perfect scaling (S ∝ 1/B) below B_crit, diminishing returns around it, no further gain past it
(Shallue et al. 2019). Rules scale an lr at the reference batch: constant, linear (× B/B_ref),
sqrt (× √(B/B_ref)); tuned sweeps lrs at every batch size and keeps the best: the ground truth
the rules are judged against. The reference batch trains first, and the rules scale from its best
tuned lr (--ref-lr: from that lr instead). B_simple (the gradient noise scale, as in ddplab noise) is measured
along the best tuned runs and printed beside B_crit. With Adam or AdamW the sweep also trains
every lr with each Adam rule's betas, eps and weight decay; a scorecard gives each rule's distance
from the best tuned lr and its steps over the best tuned runs'.

Every batch size here is a global batch: per-device batch × devices × nodes × accumulation.
A global batch B trains the same on W DDP ranks as in one process with B, so by default the grid
runs in one process, all runs of a batch size vectorized (torch.func.vmap over the stacked runs,
each with its own dropout masks and BatchNorm statistics; the optimizer is torch.optim's SGD, Adam
or AdamW as stacked updates); --verify-ddp K replays K grid points on real DDP ranks and reports
the largest difference. What cannot be vectorized (a spec's own step(), another optimizer) trains
on the DDP engine: each run on --world-size real DDP ranks, one launch per batch size (--engine
fastest times a step both ways per batch size and takes the faster: quicker, but the numbers then
follow the machine's load; the default never times). Under
torchrun (one node or several) every process runs the command and the grid trains across the
job; rank 0 owns the cache and the report. With BatchNorm, the vectorized engine normalizes over
the whole global batch, as one device would; DDP ranks normalize over their own share.

Without SPEC.py: sklearn's digits, an MLP, SGD with momentum, target validation accuracy
{DEFAULT_ACCURACY} (pip install 'ddplab[study]'). SPEC.py defines model(), dataset(), loss(output,
target), as for ddplab check, plus val_dataset() (evaluated as accuracy or loss, per the target
flag) or evaluate(model, dataset) -> float (compared with the target; called on val_dataset() if
defined).

Results are cached under --out (default {StudyOptions.out}) per batch size: running
again continues, --fresh starts over. A changed setting or spec file is refused there rather than
mixed. study.json is written before the plots, so a failing plot never loses a study. The exit
code is 1 when no run reached the target (the JSON then says how close each batch size came).

Your own training command instead of a spec: after --, with placeholders ddplab fills per run
({{world_size}}, {{per_device_batch_size}}, {{accumulation_steps}}, {{global_batch_size}}, {{lr}}, {{seed}},
{{run_dir}}, {{master_port}}, and Adam's {{beta1}} {{beta2}} {{eps}} {{weight_decay}} for the rules that set
them). A guest in its processes reads the training loss that reaches backward (or --metric NAME
from its stdout), averaged over the ranks every --eval-every steps, and stops the run on every
rank at once when it is decided. --executor local (--parallel N at once), ray or slurm.

examples:
  ddplab study
  ddplab study --target-loss 2 --optimizer adamw --ref-lr 3e-4 -- python t.py --lr {{lr}} --bs {{per_device_batch_size}}
  ddplab study --global-batch-sizes 16,64,256 --seeds 3 --json
  ddplab study --rules tuned,adascale,ramp
  ddplab study spec.py --target-loss 0.1 --ref-global-batch-size 64 --ref-lr 0.1
  ddplab study spec.py --target-loss 1.5 --optimizer adamw --weight-decay 0.1 --rules tuned,adam-sqrt
  ddplab study --optimizer adamw --ref-lr 0.02 --rules sqrt,adam-sqrt,adamw-tau,surge,tuned
  ddplab study spec.py --target-accuracy 0.9 --engine ddp --world-size 4 --max-batch-size-per-device 32
  torchrun --nnodes 2 --nproc-per-node 4 ... -m ddplab study spec.py --target-accuracy 0.9
  ddplab plan --from-study study-out/study.json --ref-batch-size 32 --ref-lr 0.1 --devices 8 --batch-size 32

The critical batch where a training is (Merrill et al. 2025): --branch-at trains the reference run
and branches from fractions of it; --branch-from branches from your own checkpoints. Short branches
at the reference global batch × 1, 2, 4, ... train the same samples with a small lr sweep, and the
critical batch is the largest whose loss on the held-out split still matches the reference batch's.
The branches train vectorized where the spec allows it; with --engine ddp, a sharding --strategy,
under torchrun, or for what cannot be vectorized, on real ranks, one launch per checkpoint:
  ddplab study --workload digits --branch-at 0.1,0.3,0.6
  ddplab study spec.py --branch-from ckpt-1000.pt ckpt-5000.pt --ref-global-batch-size 256 --ref-lr 3e-4
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("study", help="measure steps-to-target vs global batch per lr rule; fit B_crit",
                                   description=DESCRIPTION, formatter_class=HelpFormatter)
    _add_workload_flags(parser)
    add_fields(parser, StudyConfig, ("global_batch_sizes", "rules", "reference_global_batch_size", "reference_lr",
                                     "seeds"), rules={"type": _rule_list, "metavar": "RULES", "help": _rules_help()})
    opt = parser.add_argument_group("optimizer (default: the spec's optimizer(), else SGD with momentum 0.9; "
                                    "flags override single settings)")
    add_fields(opt, OptimizerConfig, ("family", "momentum", "dampening", "nesterov", "weight_decay", "betas", "eps"),
               prefix="optimizer")
    add_fields(parser, StudyConfig, ("patience", "max_steps", "eval_every", "sweep_factor", "sweep_margin",
                                     "max_runs", "dtype", "noise_scale", "schedule"))
    add_fields(parser, StudyOptions, ("out", "fresh", "verify_ddp", "verify_world_size", "verify_steps", "threads"),
               verify_ddp={"metavar": "K"})
    add_fields(parser.add_argument_group("engine"), StudyOptions,
               ("engine", "world_size", "strategy", "replicate", "reduce_dtype", "zero_stage",
                "max_batch_size_per_device", "device"))
    add_fields(parser, StudyOptions, ("compare", "plots"), compare={"metavar": "STUDY.json"})
    add_fields(parser.add_argument_group("the critical batch from checkpoints (Merrill et al. 2025), instead of the "
                                         "grid"), BranchConfig,
               ("branch_at", "branch_from", "branch_samples", "branch_doublings", "branch_lr_rule", "branch_tolerance",
                "branch_lag", "branch_paired", "branch_every_batch"),
               branch_at={"type": _fractions, "metavar": "F,F,..."},
               branch_from={"type": str, "nargs": "+", "metavar": "CKPT"})
    add_fields(parser.add_argument_group("your own command (after --, with placeholders such as {lr})"),
               CommandOptions, COMMAND_FIELDS, metric={"metavar": "NAME"})
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run, command=None)
    split_at_command(parser)


COMMAND_FIELDS = ("metric", "executor", "parallel", "run_deadline_s", "ray_address", "gpus_per_run",
                  "slurm_partition", "slurm_time", "slurm_cluster")
# Flags of the spec form that a command study has no use for: the command trains as it is written.
SPEC_ONLY = ("engine", "verify_ddp", "threads", "device", "strategy", "replicate", "reduce_dtype", "zero_stage",
             "dtype", "branch_at", "branch_from")


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """SPEC.py or --workload, and the target a run must reach (the workload's own when not given)."""
    mark(parser.add_argument("spec", metavar="SPEC.py", nargs="?", default=None,
                             help="training spec file (default: the built-in digits workload)"), "spec_path")
    mark(parser.add_argument("--workload", choices=WORKLOADS,
                             help="a built-in workload instead of a spec, each with its documented target and grid: "
                                  "digits (scikit-learn's digits, an MLP, accuracy 0.95), mnist1d (MNIST-1D built "
                                  "offline, an MLP, accuracy 0.6), charlm (a character-level transformer with "
                                  "LayerNorm, dropout and AdamW on public-domain text, validation loss 2.1), "
                                  "regression (noiseless linear regression in 16 dimensions, where B_simple = 17 "
                                  "exactly; plain SGD, validation loss 1e-4)"),
         "workload")
    target = parser.add_mutually_exclusive_group()
    mark(target.add_argument("--target-accuracy", type=number, dest="target.accuracy", metavar="TARGET_ACCURACY",
                             help=f"validation accuracy to reach (default {DEFAULT_ACCURACY} for the built-in "
                                  "workload)"), "target.accuracy")
    mark(target.add_argument("--target-loss", type=number, dest="target.loss", metavar="TARGET_LOSS",
                             help="validation loss to reach"),
         "target.loss")


def _fractions(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fractions like 0.1,0.3,0.6, got {text!r}") from None


def branch_config_from_args(args: argparse.Namespace) -> BranchConfig | None:
    """The branches asked for (``--branch-at`` or ``--branch-from``), None for the grid."""
    given = fields_given(args, BranchConfig)
    return BranchConfig(**given) if given else None


def _rules_help() -> str:
    # The rules are a registry, not a Literal: its names are the choices.
    text = help_text(StudyConfig, "rules", doc=registry.help_line())
    # Spaced, so the help wraps between names: a list without spaces is one word that wrapping cuts anywhere.
    return text.replace("comma-separated", f"comma-separated among {', '.join(registry.known())}", 1)


def _rule_list(text: str) -> tuple[str, ...]:
    rules = tuple(part.strip() for part in text.split(","))
    bad = [r for r in rules if r not in registry.known()]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown rule {bad[0]!r}; choose among {', '.join(registry.known())}")
    return rules


def config_from_args(args: argparse.Namespace, defaults: dict | None = None) -> tuple[StudyConfig, StudyOptions]:
    """The study's settings: the flags given, else the workload's own (a spec's optimizer and lr, a built-in
    workload's documented target and grid: ``defaults``), else StudyConfig's."""
    from ddplab.study.config import target_for

    # A missing file is the first thing to say: asking it for a target would send the user the wrong way.
    if args.spec and not os.path.exists(args.spec):
        raise SpecError(f"spec file {literal(args.spec)} does not exist")
    if args.spec and args.workload:
        raise UsageError("give a spec file or {workload}, not both")
    accuracy, loss = getattr(args, "target.accuracy"), getattr(args, "target.loss")
    # Branches from checkpoints train no run to a target: a spec need not name one there.
    target = target_for(spec=args.spec if not getattr(args, "branch_from", None) else None, accuracy=accuracy,
                        loss=loss)
    if defaults and "target" in defaults and accuracy is None and loss is None:
        target = defaults["target"]
    grid = fields_given(args, StudyConfig)
    optimizer = fields_given(args, OptimizerConfig, prefix="optimizer")
    if defaults is None and (args.spec or args.workload not in (None, "digits")) and "family" not in optimizer:
        # The workload's optimizer is not known yet: the family its flags or rules name stands in for it (the rules
        # are judged against the optimizer the study trains once the spec is loaded).
        defaults = {"optimizer": OptimizerConfig(family=_stand_in_family(optimizer, grid.get("rules")))}
    if "reference_lr" in grid:
        # An lr one gives is the one the rules scale from; else they scale from the tuned best at the reference batch.
        grid["rules_lr"] = grid["reference_lr"]
    defaults = defaults or {}
    for field in ("reference_lr", "global_batch_sizes", "max_steps"):
        if field not in grid and field in defaults:
            grid[field] = defaults[field]
    grid["optimizer"] = _optimizer(optimizer, defaults.get("optimizer"))
    if "global_batch_sizes" in grid:
        grid["global_batch_sizes"] = tuple(sorted(set(grid["global_batch_sizes"])))
    options = StudyOptions(**fields_given(args, StudyOptions))
    return StudyConfig(target=target, **grid), options


def _stand_in_family(optimizer: dict, asked: tuple[str, ...] | None) -> str:
    """The optimizer family assumed before the workload's own is known: AdamW where a rule asked for needs Adam's
    settings (AdamW suits every such rule), Adam where --betas or --eps are given, else SGD."""
    if any(registry.get(name).adam_only for name in asked or ()):
        return "adamw"
    return "adam" if {"betas", "eps"} & optimizer.keys() else "sgd"


def _optimizer(fields: dict, spec_optimizer: OptimizerConfig | None) -> OptimizerConfig:
    """The spec's optimizer (or the default) with the flags given on top; another --optimizer starts afresh."""
    family = fields.pop("family", None) or (spec_optimizer.family if spec_optimizer else "sgd")
    wrong = [f"{{optimizer.{name}}}" for name in fields
             if name in (("momentum", "dampening", "nesterov") if family != "sgd" else ("betas", "eps"))]
    if wrong:
        raise UsageError(f"{', '.join(wrong)} changes nothing for {family}: drop it or pass {{optimizer.family}} "
                         f"{'sgd' if family != 'sgd' else 'adam or adamw'}")
    base = spec_optimizer if spec_optimizer and spec_optimizer.family == family else OptimizerConfig(family=family)
    return dataclasses.replace(base, **fields)


def run(args: argparse.Namespace) -> int:
    if args.command is not None:
        return _run_command(args)
    _refuse(args, COMMAND_FIELDS, "belongs to the study of your own command (ddplab study [options] -- COMMAND)")
    # Before anything imports torch: the same command and seeds give the same numbers on any machine.
    pin_cpu_kernels()
    config_from_args(args)  # bad flags are said before the spec is loaded (its optimizer guessed from the flags)
    branches = branch_config_from_args(args)
    from ddplab.study.grid.study import run_study
    from ddplab.study.workloads import workload_defaults, workload_for

    workload = workload_for(args.spec, args.workload)
    config, options = config_from_args(args, workload_defaults(workload))
    if branches is not None:
        return _run_branches(args, workload, config, branches, options)
    report = run_study(workload, config, options, progress=render.ProgressBar("ddplab study"))
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun, rank 0 speaks for the study
    return _show(args, config, report)


def _show(args: argparse.Namespace, config: StudyConfig, report) -> int:
    if args.json:
        render.print_json(report)
    else:
        _print(report)
    if not report.analysis.reached and _all_failed(report):
        print("ddplab: every run failed: its error is above, and a run that fails counts as not reached",
              file=sys.stderr)
        return 1
    if not report.analysis.reached:
        print(f"ddplab: no run reached the target ({config.target.kind} {config.target.value:g}) within --max-steps "
              f"{config.max_steps}: lower the target or raise --max-steps (runs are cached)", file=sys.stderr)
        return 1
    return 0


def _all_failed(report) -> bool:
    """Whether no run trained to its end: raising the step budget would change nothing."""
    runs = report.analysis.runs
    return bool(runs) and all(run.get("failed") for run in runs)


def _run_command(args: argparse.Namespace) -> int:
    """``ddplab study [options] -- COMMAND``: the grid trained by starting the user's own command per run."""
    if args.spec or args.workload:
        raise UsageError("give a spec, {workload} or a command after --, not two of them")
    _refuse(args, SPEC_ONLY, "belongs to a spec's study: a command trains as it is written")
    accuracy, loss = getattr(args, "target.accuracy"), getattr(args, "target.loss")
    if accuracy is None and loss is None:
        raise UsageError("a command study needs a target: {target.loss} L (the training loss, by default) or "
                         "{metric} NAME with {target.accuracy} A or {target.loss} L")
    if accuracy is not None and args.metric is None:
        raise UsageError("{target.accuracy} needs {metric} NAME: by default the study reads the training loss")
    _ask_for_the_optimizer(args)
    config, options = config_from_args(args)
    command = CommandOptions(command=tuple(args.command), **fields_given(args, CommandOptions, only=COMMAND_FIELDS))
    from ddplab.study.command.study import run_command_study

    found = run_command_study(command, config, options,
                              progress=render.ProgressBar("ddplab study", status=True, unit="runs"))
    for line in found.failed:
        print(f"ddplab study: warning: {line}", file=sys.stderr)
    return _show(args, config, found.report)


def _ask_for_the_optimizer(args: argparse.Namespace) -> None:
    """A command's optimizer and lr are not seen before it runs, and the rules scale both: they are asked for."""
    unsaid = [text for text, given in (("its optimizer with {optimizer.family} (sgd, adam or adamw)",
                                        getattr(args, "optimizer.family", None)),
                                       ("the lr it trains with at the reference batch with {reference_lr}",
                                        args.reference_lr)) if given is None]
    if unsaid:
        raise UsageError(f"a command study cannot see the command's optimizer before it runs, and the rules scale "
                         f"from it: name {' and '.join(unsaid)}")


def _refuse(args: argparse.Namespace, fields: tuple[str, ...], why: str) -> None:
    for field in fields:
        if getattr(args, field, None) is not None:
            raise UsageError(f"{{{field}}} {why}")


def _run_branches(args, workload, config: StudyConfig, branches: BranchConfig, options: StudyOptions) -> int:
    from ddplab.study.branched.measurement import measure

    report = measure(workload, config, branches, options, progress=render.ProgressBar("ddplab study"))
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun, rank 0 speaks for the branches
    values = report.to_json()
    if args.json:
        render.print_json(values)
    else:
        _print_branches(values)
    return 0


def _print_branches(values: dict) -> None:
    from ddplab.study.report.records import optimizer_text

    out = render.console()
    reference = values["reference"]
    ranks = f" on {values['world_size']} ranks, strategy {values['strategy']}" if values["world_size"] else ""
    out.print(f"optimizer: {optimizer_text(values['optimizer'])}; reference: global batch "
              f"{reference['global_batch_size']} at lr {reference['lr']:.4g}; engine: {values['engine']}{ranks} "
              f"({values['engine_reason']})")
    run = values["reference_run"]
    if run:
        reached = "reached the target" if run["reached"] else "did not reach the target"
        out.print(f"reference run: {run['steps']} steps ({run['samples']} samples), {reached}")
    factor = values["sweep_factor"]
    for b in values["branches"]:
        for note in b.get("notes", []):
            out.print(f"note: {note}")
    checkpoints = _count(len(values["branches"]), "checkpoint")
    title = (f"ddplab study: {values['workload']}, critical batch from {checkpoints}, "
             f"branches of {_lengths(values)} samples at global batches "
             f"{','.join(map(str, values['global_batch_sizes']))}, lrs ×{1 / factor:g},1,{factor:g} of the "
             f"{values['lr_rule']} rule, {_count(values['seeds'], 'seed')}, tolerance: {values['tolerance']}, "
             f"{values['seconds']:.0f} s")
    rows = [[str(b["samples_seen"]), _num(b["critical_batch_size"]) + (" (edge)" if b["at_edge"] else ""),
             f"[{_num(b['interval'][0])}, {_num(b['interval'][1])}]", _num(b["b_simple"]), _num(b["reference_loss"]),
             _num(b["tolerance"])] for b in values["branches"]]
    out.print(render.table(title, ["samples seen", "critical batch", "interval (seeds)", "B_simple",
                                   "reference loss", "tolerance"], rows))
    for b in values["branches"]:
        losses = ", ".join(f"{r['global_batch_size']}: {_num(r['median_loss'])}{_deficit(r)}"
                           f"{'' if r['matches'] else ' ✗'}" for r in b["batches"])
        skipped = b["untrained_global_batch_sizes"]
        if skipped:
            losses += f"; not trained: {', '.join(map(str, skipped))} (a smaller batch missed with every seed)"
        own = f" (branches of {b['length']})" if _lengths(values) != str(values["branch_samples"]) else ""
        out.print(f"at {b['samples_seen']} samples{own}, best median loss by global batch: {losses}")
    out.print("batch schedule (double when the critical batch reaches twice the batch): " + ", ".join(
        f"from {s['samples_seen']} samples: {s['global_batch_size']} (lr {_lr(s['lr'])})" for s in values["schedule"]))
    out.print(f"Megatron-LM: --step-batch-size-schedule \"{values['step_batch_size_schedule']}\"")
    cost = values["cost"]
    relative = f" = {cost['relative']:.3g}× one reference run's {cost['reference_samples']}" \
        if cost["relative"] is not None else ""
    each = "" if cost["relative"] is None or len(values["branches"]) < 2 else \
        "; per checkpoint " + ", ".join(f"{x:.3g}×" for x in cost["per_checkpoint_relative"])
    out.print(f"cost: {cost['branch_samples']} branch samples{relative}{each}")
    for path in values.get("plots", []):
        out.print(f"plot: {path}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _lengths(values: dict) -> str:
    """The branches' length: one for all, or the longest where checkpoints near the run's end train shorter ones."""
    lengths = {b.get("length", values["branch_samples"]) for b in values["branches"]}
    return str(values["branch_samples"]) if lengths <= {values["branch_samples"]} else f"up to {max(lengths)}"


def _deficit(row: dict) -> str:
    """A paired judgement's median deficit over the reference batch on the same seeds (none for the reference)."""
    deficit = row.get("paired_deficit")
    return "" if deficit is None or row["paired_deficits"] == [0.0] * len(row["paired_deficits"]) else \
        f" ({deficit:+.3g} paired)"


def _lr(value) -> str:
    return "—" if value is None else f"{value:.4g}"


def _print(report) -> None:
    values = report.to_json()
    out = render.console()
    target = values["target"]
    title = (f"ddplab study: {values['workload']}, steps to {target['kind']} {target['value']:g}, "
             f"{values['trained_runs']} runs, {values['seeds']} seeds, {values['seconds']:.0f} s")
    rows = []
    from ddplab.study.report.records import optimizer_text

    out.print(f"optimizer: {optimizer_text(values['optimizer'])}; engine: {values['engine']} "
              f"({values['engine_reason']})")
    for rule, fit in values["fit"].items():
        rows.append(_fit_row(rule, fit))
    if rows:
        out.print(render.table(title, ["rule", "S_min", "B_crit", "B_crit 95% (seeds)", "E_min (samples)"], rows))
    else:
        out.print(f"[bold]{title}[/]: no rule reached the target at two batch sizes, so nothing was fitted")
    if values["tuned_lr"]:
        tuned = ", ".join(f"{p['global_batch_size']}: {p['lr']:.4g}" + (f" ({p['variant']}'s settings)"
                                                                          if p.get("variant") else "")
                          for p in values["tuned_lr"])
        out.print(f"best tuned lr by global batch: {tuned}")
    scaled = values["reference"]["rules_lr"]
    if scaled and scaled["source"] == "best_at_reference" and scaled["lr"] != values["reference"]["lr"]:
        out.print(f"the rules scale from lr {scaled['lr']:.4g}, the best tuned lr at the reference batch "
                  f"{values['reference']['global_batch_size']}, not the reference lr {values['reference']['lr']:.4g} "
                  "(--ref-lr keeps one's own)")
    _print_b_simple(out, values["b_simple"])
    _print_scorecard(out, values)
    for rule in registry.known().values():
        for line in rule.text(values):
            out.print(line)
    for line in front_lines(values):
        out.print(line)
    for miss in values["unreached"]:
        best = "no finite metric" if miss["best_metric"] is None else \
            f"its runs' best {target['kind']}: {miss['best_metric']:.4g}"
        if miss.get("arrived"):
            best = f"{miss['arrived']} of its {miss['runs']} runs arrived, short of a median; {best}"
        out.print(f"median run never reached the target: rule {miss['rule']} at global batch "
                  f"{miss['global_batch_size']} ({best})")
    _print_verify(out, values.get("verify_ddp"))
    for warning in values["warnings"]:
        out.print(f"[bold yellow]warning:[/] {warning}")
    if values.get("report"):
        out.print(f"report: {values['report']}")


def _print_scorecard(out, values: dict) -> None:
    """Per rule: how far its lr is from the best tuned lr, and its steps over the best's, with the seeds' range; then
    what each rule says of its lrs."""
    card = values.get("scorecard") or {}
    if not any(row["batches"] for row in card.values()):
        return  # no tuned sweep to judge against: a table of dashes says nothing
    if values.get("scorecard_note"):
        out.print(f"scorecard: not shown: {values['scorecard_note']}")
    else:
        _print_scorecard_table(out, card)
    for rule in registry.known().values():
        for line in rule.lr_text(values):
            out.print(line)
    peak = values.get("lr_peak")
    if peak is not None:
        where = (f"peaks inside the measured range, at global batch {peak['global_batch_size']}"
                 if peak["global_batch_size"] else "does not peak inside the measured range")
        out.print(f"the best tuned lr {where}; B_simple at the reference batch "
                  f"{values['reference']['global_batch_size']}: {_num(peak['b_simple'])} (Li et al. 2024 put Adam's "
                  "peak at B_noise)")


def _print_scorecard_table(out, card: dict) -> None:
    rows = [[rule, _short(row["median_abs_log2_lr_gap"]), _short(row["median_steps_ratio"]),
             "—" if row["steps_ratio_seed_range"] is None else
             f"{_short(row['steps_ratio_seed_range'][0])} to {_short(row['steps_ratio_seed_range'][1])}",
             str(row["batches"])] for rule, row in card.items()]
    out.print(render.table("scorecard: medians over the global batches, against the best tuned setting",
                           ["rule", "|log₂(lr / best lr)|", "steps ÷ tuned", "seeds' range", "batches"], rows))


def _print_b_simple(out, b_simple: dict | None) -> None:
    if not b_simple:
        return
    low, high = b_simple["ci95"]
    ratio = b_simple["b_crit_over_b_simple"]
    versus = f"B_crit / B_simple = {_num(ratio)}" if ratio is not None else \
        "no B_crit / B_simple: B_simple's interval reaches 0 or infinity"
    out.print(f"B_simple along the best tuned runs: {_num(b_simple['value'])} (95% [{_num(low)}, {_num(high)}]); "
              f"{versus}; measured {b_simple['measured']}")


def _print_verify(out, verify: dict | None) -> None:
    if not verify:
        return
    if verify["nothing_to_verify"]:
        out.print(f"--verify-ddp: nothing to verify: {verify['nothing_to_verify']}")
        return
    out.print(f"--verify-ddp: {len(verify['points'])} points × {verify['steps']} steps on {verify['world_size']} "
              f"DDP ranks ({verify['dtype']}): largest parameter difference {verify['max_abs_diff']:.3g}")


def _fit_row(rule: str, fit: dict) -> list[str]:
    """A rule's fit as the table shows it: a fit the analysis calls undefined shows why, not its zeros."""
    if fit.get("undefined"):
        return [rule, _num(fit["s_min"]), "undefined", f"({fit['undefined']})", "undefined"]
    low, high = fit["b_crit_ci95"]
    bound = fit.get("bound")
    if bound:
        # Fitted outside the measured batches: only the side is known.
        side, edge = next(iter(bound.items()))
        return [rule, _num(fit["s_min"]), f"{'<' if side == 'below' else '>'} {edge}", "(outside the batches)", "—"]
    return [rule, _num(fit["s_min"]), _num(fit["b_crit"]), f"[{_num(low)}, {_num(high)}]", _num(fit["e_min"])]


def _num(value) -> str:
    return "—" if value is None else render.num(value)


def _short(value) -> str:
    """A ratio or a gap in octaves to three figures: the seeds' spread makes a fourth noise."""
    return "—" if value is None else f"{value:.3g}"
