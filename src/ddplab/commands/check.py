"""``ddplab check``: prove a spec trains the same on W DDP ranks as in one process, or say why not."""

from __future__ import annotations

import argparse

from ddplab import render
from ddplab.commands import add_launch_flags, launch_config, positive_float, positive_int

DESCRIPTION = """\
Train SPEC.py for K steps on W DDP ranks with --batch-size b each, and for K steps in one
process on the ranks' batches concatenated in rank order (global batch W·b), both in float64;
compare the parameters after every step.

Verdicts: EQUIVALENT (within --tolerance); DIVERGES with the cause that a reproducing reference
confirms (SUM_REDUCTION, GRADIENT_SCALE, PADDING, BATCHNORM, PER_RANK_LOSS, or UNKNOWN);
STOCHASTIC when the model draws random numbers in training (dropout); NON_FINITE when inf or
nan appears on either side (named: the ranks, the single process, or both) before any difference.

Under torchrun (torchrun --nproc_per_node N -m ddplab check SPEC.py ...) the ranks are
torchrun's: W is its WORLD_SIZE, and rank 0 runs the single-process reference and reports.

SPEC.py defines model() → nn.Module, dataset() → Dataset of (input, target), loss(output,
target) → scalar, and optionally optimizer(params) (default SGD lr 0.1) and
step(model, batch, loss_fn) → loss when the forward is more than loss(model(x), y).
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("check", help="prove a model trains the same on N ranks as on one",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", metavar="SPEC.py", help="the training spec file")
    parser.add_argument("--world-size", type=positive_int, default=None,
                        help="DDP ranks (default 2; under torchrun its WORLD_SIZE)")
    parser.add_argument("--batch-size", type=positive_int, required=True, help="per-device (per-rank) batch")
    parser.add_argument("--steps", type=positive_int, default=5, help="optimizer steps to compare (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data order seed (default 0)")
    parser.add_argument("--tolerance", type=positive_float, default=1e-9,
                        help="largest relative parameter difference called equal (default 1e-9, float64)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_launch_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ddplab.equivalence import CheckConfig, check
    from ddplab.training import world_size_for

    config = CheckConfig(spec_path=args.spec, world_size=world_size_for(args.world_size, default=2),
                         per_device_batch_size=args.batch_size, steps=args.steps, seed=args.seed,
                         tolerance=args.tolerance)
    result = check(config, launch_config(args, config.world_size))
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    if args.json:
        render.print_json(result.to_json())
    else:
        _print(result)
    return 0


def _print(result) -> None:
    cfg = result.config
    rows = [[str(i), f"{d['max_abs_diff']:.2e}", f"{d['max_rel_diff']:.2e}",
             "✓" if d["max_rel_diff"] <= cfg.tolerance else "✗"] for i, d in enumerate(result.per_step)]
    title = (f"ddplab check: {cfg.world_size} ranks × {cfg.per_device_batch_size} vs one process × "
             f"{cfg.global_batch_size}, float64, tolerance {cfg.tolerance:g}")
    out = render.console()
    out.print(render.table(title, ["step", "max |Δparam|", "relative", ""], rows))
    style = {"EQUIVALENT": "bold green", "DIVERGES": "bold red", "STOCHASTIC": "bold yellow",
             "NON_FINITE": "bold red"}[result.verdict]
    cause = f" ({result.cause})" if result.cause else ""
    out.print(f"[{style}]{result.verdict}[/]{cause}: {result.explanation}")
    if result.fix:
        out.print(f"[bold]fix:[/] {result.fix}")
    for note in _notes(result):
        out.print(f"note: {note}")


def _notes(result) -> list[str]:
    cfg, notes = result.config, []
    partial = [(i, d["samples_per_rank"]) for i, d in enumerate(result.per_step)
               if d["samples_per_rank"] != cfg.per_device_batch_size]
    if partial:
        steps = ", ".join(f"{i} ({n} per rank)" for i, n in partial)
        label, verb = ("step", "ends") if len(partial) == 1 else ("steps", "end")
        notes.append(f"{label} {steps} {verb} an epoch with a partial batch of fewer than --batch-size "
                     f"{cfg.per_device_batch_size} samples per rank, as a DataLoader without drop_last does")
    if result.unused_parameters:
        names = ", ".join(result.unused_parameters[:5]) + (" …" if len(result.unused_parameters) > 5 else "")
        notes.append(f"the forward does not use {names} (no gradient): DDP ran with find_unused_parameters=True, "
                     "and those parameters are compared like the rest")
    elif result.find_unused_parameters:
        notes.append("the forward left some parameter without a gradient on a later step: DDP ran again with "
                     "find_unused_parameters=True")
    return notes
