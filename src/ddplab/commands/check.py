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
STOCHASTIC when the model draws random numbers in training (dropout).

SPEC.py defines model() → nn.Module, dataset() → Dataset of (input, target), loss(output,
target) → scalar, and optionally optimizer(params) (default SGD lr 0.1) and
step(model, batch, loss_fn) → loss when the forward is more than loss(model(x), y).
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("check", help="prove a model trains the same on N ranks as on one",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", metavar="SPEC.py", help="the training spec file")
    parser.add_argument("--world-size", type=positive_int, default=2, help="DDP ranks (default 2)")
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

    config = CheckConfig(spec_path=args.spec, world_size=args.world_size, per_device_batch_size=args.batch_size,
                         steps=args.steps, seed=args.seed, tolerance=args.tolerance)
    result = check(config, launch_config(args, args.world_size))
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
    style = {"EQUIVALENT": "bold green", "DIVERGES": "bold red", "STOCHASTIC": "bold yellow"}[result.verdict]
    cause = f" ({result.cause})" if result.cause else ""
    out.print(f"[{style}]{result.verdict}[/]{cause}: {result.explanation}")
    if result.fix:
        out.print(f"[bold]fix:[/] {result.fix}")
