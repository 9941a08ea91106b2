"""``ddplab study``: measure steps-to-target versus global batch per lr rule, fit B_crit, plot and report."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from ddplab import render
from ddplab.commands import positive_float, positive_int

DESCRIPTION = """\
Train a grid of runs — global batch sizes × lr rules × seeds — each until it first reaches a
target, and fit steps-to-target S(B) = S_min(1 + B_crit/B) (McCandlish et al. 2018) per rule:
perfect scaling (S ∝ 1/B) below B_crit, diminishing returns around it, no further gain past it
(Shallue et al. 2019). Rules scale the reference lr: constant, linear (× B/B_ref), sqrt
(× √(B/B_ref)); tuned sweeps lrs at every batch size and keeps the best: the ground truth the
rules are judged against. B_simple (the gradient noise scale, as in ddplab noise) is measured
along the best tuned runs and printed beside B_crit.

A global batch B trains the same on W DDP ranks as in one process with B, so the grid runs in one
process, all runs of a batch size vectorized (torch.func.vmap); --verify-ddp K replays K grid points
on real DDP ranks and reports the largest difference.

Without SPEC.py: sklearn's digits, an MLP, SGD with momentum, target validation accuracy 0.95
(pip install 'ddplab[study]'). SPEC.py defines model(), dataset(), loss(output, target), as for
ddplab check, plus val_dataset() (evaluated as accuracy or loss, per the target flag) or
evaluate(model, dataset) -> float (compared with the target; called on val_dataset() if defined).

Results are cached under --out per batch size: running again continues, --fresh starts over.

examples:
  ddplab study
  ddplab study --batch-sizes 16,64,256 --seeds 3 --json
  ddplab study spec.py --target-loss 0.1 --ref-batch-size 64 --ref-lr 0.1
  ddplab plan --from-study study-out/study.json --ref-batch-size 32 --ref-lr 0.1 --devices 8 --batch-size 32
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("study", help="measure steps-to-target vs global batch per lr rule; fit B_crit",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", metavar="SPEC.py", nargs="?", default=None,
                        help="training spec file (default: the built-in digits workload)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target-accuracy", type=positive_float, default=None,
                        help="validation accuracy to reach (default 0.95 for the built-in workload)")
    target.add_argument("--target-loss", type=positive_float, default=None, help="validation loss to reach")
    parser.add_argument("--batch-sizes", type=_int_list, default=None,
                        help="global batch sizes, comma-separated (default 8,16,...,1024)")
    parser.add_argument("--rules", type=_rule_list, default=None,
                        help="lr rules, comma-separated among constant,linear,sqrt,tuned (default all)")
    parser.add_argument("--ref-batch-size", type=positive_int, default=32, help="reference global batch (default 32)")
    parser.add_argument("--ref-lr", type=positive_float, default=0.1, help="lr at the reference batch (default 0.1)")
    parser.add_argument("--seeds", type=positive_int, default=3, help="seeds per grid point (default 3)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    parser.add_argument("--max-steps", type=positive_int, default=3000, help="step budget per run (default 3000)")
    parser.add_argument("--eval-every", type=positive_int, default=5, help="evaluate every K steps (default 5)")
    parser.add_argument("--sweep-factor", type=positive_float, default=2.0,
                        help="spacing of the tuned lr sweep (default 2: factors of 2)")
    parser.add_argument("--sweep-margin", type=positive_float, default=4.0,
                        help="the sweep spans the constant and linear lrs widened by this factor (default 4)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="(default float32)")
    parser.add_argument("--out", default="study-out", help="directory for the cache, plots, study.json and report")
    parser.add_argument("--fresh", action="store_true", help="discard cached runs in --out and start over")
    parser.add_argument("--verify-ddp", type=int, default=0, metavar="K",
                        help="re-run K grid points through real DDP ranks and report the largest difference")
    parser.add_argument("--verify-world-size", type=positive_int, default=2, help="ranks for --verify-ddp (default 2)")
    parser.add_argument("--verify-steps", type=positive_int, default=20,
                        help="steps per --verify-ddp point (default 20)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch intra-op threads while training (default 1: the runs are already batched, "
                             "and small models lose more to thread hand-offs than they gain)")
    parser.add_argument("--no-plots", action="store_true", help="skip PNG plots and the HTML report")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 8,16,32, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return values


def _rule_list(text: str) -> tuple[str, ...]:
    from ddplab.study import RULES

    rules = tuple(part.strip() for part in text.split(","))
    bad = [r for r in rules if r not in RULES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown rule {bad[0]!r}; choose among {', '.join(RULES)}")
    return rules


def run(args: argparse.Namespace) -> int:
    if args.verify_ddp < 0:
        raise ValueError(f"--verify-ddp must be zero or more, got {args.verify_ddp}")
    if not args.no_plots:
        _require_matplotlib()
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _study(args)
    finally:
        torch.set_num_threads(threads)


def _study(args: argparse.Namespace) -> int:
    from ddplab import study

    started = time.monotonic()
    workload = study.spec_workload(args.spec) if args.spec else study.digits_workload()
    config = study.StudyConfig(target=_target(args, study), **_grid_flags(args, study))
    study.check_grid(workload, config)
    cache = study.Cache(args.out, config.fingerprint(workload.name), fresh=args.fresh)
    results = _run_grid(study, workload, config, cache)
    analysis = study.analyze(workload, config, results)
    report = _report(workload, config, analysis, args)
    if args.verify_ddp:
        report["verify_ddp"] = study.verify_ddp(workload, config, args.verify_ddp, world_size=args.verify_world_size,
                                                steps=args.verify_steps, tuned=analysis["tuned_lr"])
    if not args.no_plots:
        from ddplab import study_report

        report["plots"] = study_report.plots(report, results, args.out)
        report["report"] = study_report.write_html(report, os.path.join(args.out, "report.html"))
    report["seconds"] = time.monotonic() - started
    study.write_json_atomic(os.path.join(args.out, "study.json"), report)
    if args.json:
        render.print_json(report)
    else:
        _print(report)
    return 0


def _target(args, study):
    if args.target_loss is not None:
        return study.Target(kind="loss", value=args.target_loss)
    if args.target_accuracy is None and args.spec:
        raise ValueError("a spec needs a target: --target-accuracy A or --target-loss L")
    return study.Target(kind="accuracy", value=args.target_accuracy if args.target_accuracy is not None else 0.95)


def _grid_flags(args, study) -> dict:
    flags = {"ref_batch_size": args.ref_batch_size, "ref_lr": args.ref_lr, "seeds": args.seeds,
             "momentum": args.momentum, "max_steps": args.max_steps, "eval_every": args.eval_every,
             "sweep_factor": args.sweep_factor, "sweep_margin": args.sweep_margin, "dtype": args.dtype}
    if args.batch_sizes:
        flags["global_batch_sizes"] = tuple(sorted(set(args.batch_sizes)))
    if args.rules:
        flags["rules"] = args.rules
    return flags


def _run_grid(study, workload, config, cache):
    total = config.max_steps * len(config.global_batch_sizes)
    # A progress bar only for a person at a terminal; logs and pipes stay clean.
    if not sys.stderr.isatty():
        return study.run_grid(workload, config, cache)
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("ddplab study"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=render.console(stderr=True), transient=True) as bar:
        task = bar.add_task("grid", total=total)
        return study.run_grid(workload, config, cache, lambda steps: bar.advance(task, steps))


def _report(workload, config, analysis: dict, args) -> dict:
    return _finite({
        "workload": workload.name, "target": config.target.to_json(), "rules": list(config.rules),
        "global_batch_sizes": sorted(config.global_batch_sizes),
        "reference": {"global_batch_size": config.ref_batch_size, "lr": config.ref_lr},
        "seeds": config.seeds, "momentum": config.momentum, "max_steps": config.max_steps,
        "eval_every": config.eval_every, "dtype": config.dtype,
        "runs": analysis["runs"], "tuned_lr": analysis["tuned_lr"], "fit": analysis["fit"],
        "b_simple": analysis["b_simple"], "warnings": analysis["warnings"], "plots": [], "report": None,
        "out": args.out,
    })


def _finite(value):
    """JSON has no inf or nan: an unbounded or undefined number is null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _print(report: dict) -> None:
    out = render.console()
    rows = []
    for rule, fit in report["fit"].items():
        low, high = fit["b_crit_ci95"]
        rows.append([rule, _num(fit["s_min"]), _num(fit["b_crit"]), f"[{_num(low)}, {_num(high)}]", _num(fit["e_min"])])
    target = report["target"]
    title = (f"ddplab study: {report['workload']}, steps to {target['kind']} {target['value']:g}, "
             f"{len(report['runs'])} runs, {report['seeds']} seeds, {report['seconds']:.0f} s")
    out.print(render.table(title, ["rule", "S_min", "B_crit", "B_crit 95% (seeds)", "E_min (samples)"], rows))
    tuned = ", ".join(f"{p['global_batch_size']}: {p['lr']:.4g}" for p in report["tuned_lr"])
    out.print(f"best tuned lr by global batch: {tuned}")
    b_simple = report["b_simple"]
    if b_simple:
        ratio = b_simple["b_crit_over_b_simple"]
        out.print(f"B_simple along the best tuned runs: {_num(b_simple['value'])} "
                  f"(95% [{_num(b_simple['ci95'][0])}, {_num(b_simple['ci95'][1])}]); "
                  f"B_crit / B_simple = {_num(ratio)}")
    verify = report.get("verify_ddp")
    if verify:
        out.print(f"--verify-ddp: {len(verify['points'])} points × {verify['steps']} steps on {verify['world_size']} "
                  f"DDP ranks ({verify['dtype']}): largest parameter difference {verify['max_abs_diff']:.3g}")
    for warning in report["warnings"]:
        out.print(f"[bold yellow]warning:[/] {warning}")
    if report.get("report"):
        out.print(f"report: {report['report']}")


def _num(value) -> str:
    return "—" if value is None else render.num(value)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("ddplab study's plots need matplotlib: pip install 'ddplab[study]' "
                         "(or pass --no-plots)") from None
