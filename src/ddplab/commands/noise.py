"""``ddplab noise``: the gradient noise scale (critical batch size) of a spec trained with real DDP."""

from __future__ import annotations

import argparse
import math
import sys

from ddplab import render
from ddplab.commands import add_launch_flags, launch_config, positive_int

DESCRIPTION = """\
Train SPEC.py on W DDP ranks and measure the gradient noise scale B_simple = tr(Σ)/|G|²
(McCandlish et al. 2018) from DDP's own all-reduce: each rank's gradient over its batch b
before it, the averaged gradient over W·b after it. B_simple predicts the critical batch size:
past it, a larger global batch B buys little: steps fall only as 1 + B_simple/B.

Batches come from one shuffled pass over the dataset's N samples per epoch, so the estimates are
corrected for sampling without replacement (Σ the per-sample covariance with 1/N). The 95%
interval is Fieller's, from batch means over the measured steps; when |G|² is within its error
of zero it reads "|G|² not resolved: B_simple > X at 95%". Steps with non-finite gradients are
skipped and counted.

SPEC.py defines model(), dataset(), loss(output, target) and optionally optimizer(params) and
step(model, batch, loss_fn), as for ddplab check.
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("noise", help="measure the gradient noise scale and critical batch size",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", metavar="SPEC.py", help="the training spec file")
    parser.add_argument("--world-size", type=positive_int, default=None,
                        help="DDP ranks (default 2; under torchrun its WORLD_SIZE); 1 works with --accumulation 2 "
                             "or more")
    parser.add_argument("--batch-size", type=positive_int, required=True, help="per-device (per-rank) batch")
    parser.add_argument("--steps", type=positive_int, default=200, help="optimizer steps to train (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data order seed (default 0)")
    parser.add_argument("--accumulation", type=positive_int, default=1,
                        help="micro-batches of --batch-size per optimizer step, under no_sync (default 1)")
    parser.add_argument("--every", type=positive_int, default=1,
                        help="measure every K-th step (default 1 here; the library defaults to 4 inside training)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of B_simple over steps (needs matplotlib)")
    add_launch_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.plot:
        _require_matplotlib()
    from ddplab.noise_scale import NoiseConfig, measure_spec
    from ddplab.training import world_size_for

    config = NoiseConfig(spec_path=args.spec, world_size=world_size_for(args.world_size, default=2),
                         per_device_batch_size=args.batch_size, steps=args.steps, seed=args.seed, every=args.every,
                         accumulation_steps=args.accumulation)
    raw = measure_spec(config, launch_config(args, config.world_size))
    if raw is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    report = _report(config, raw)
    if args.plot:
        _plot(report, args.plot)
    if args.json:
        render.print_json(report)
    else:
        _print(report)
    return _stopped_early(report)


def _report(config, raw: dict) -> dict:
    """The JSON report: standard JSON throughout (no NaN or Infinity; an unbounded end is null)."""
    summary = raw["summary"]
    global_batch = raw["b_big"]
    scale = raw["b_big"] / raw["b_small"]
    gain = summary.adascale_gain(scale, raw["b_small"])
    interval = summary.b_simple_ci95
    return {
        "b_simple": _finite(summary.b_simple), "b_simple_ci95": interval and [_finite(v) for v in interval],
        "b_simple_status": summary.status, "note": summary.describe(),
        "critical_batch_size": _finite(summary.b_simple), "g2": summary.g2, "trace_sigma": summary.trace_sigma,
        "steps": config.steps, "measured_steps": summary.steps, "skipped_steps": raw.get("skipped_steps", 0),
        "every": config.every, "world_size": config.world_size, "per_device_batch_size": config.per_device_batch_size,
        "accumulation_steps": config.accumulation_steps, "global_batch_size": global_batch,
        "dataset_size": raw.get("dataset_size"), "lr": raw.get("lr"), "weights_moved": raw.get("weights_moved"),
        "steps_factor": _finite(summary.steps_factor(global_batch)),
        "adascale_scale": scale, "adascale_gain": gain, "adascale_lr_multiplier": gain, "b_small": raw["b_small"],
        "per_step": [{key: _finite(value) for key, value in record.items()} for record in raw["history"]],
        "completed_steps": raw.get("completed_steps", config.steps), "stopped_early": raw.get("stopped"),
    }


def _finite(value):
    # JSON has no Infinity or NaN: an unbounded or undefined number is null.
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _stopped_early(report: dict) -> int:
    """Exit code 1, with the reason on stderr, when the figures cover only part of the run."""
    if report["stopped_early"] is None:
        return 0
    print(f"ddplab: stopped early: the figures cover the first {report['completed_steps']} of {report['steps']} "
          f"steps. {report['stopped_early']}", file=sys.stderr)
    return 1


def _print(report: dict) -> None:
    rows = [["B_simple (critical batch)", *_b_simple_cells(report)],
            ["|G|²", f"{report['g2']:.4g}", "squared norm of the true gradient"],
            ["tr(Σ)", f"{report['trace_sigma']:.4g}", "per-sample gradient variance, summed over parameters"]]
    if report["steps_factor"] is not None:
        rows.append(["steps factor", f"{report['steps_factor']:.3f}", f"1 + B_simple/B at global batch "
                     f"{report['global_batch_size']}: steps relative to the fewest possible"])
    rows.append(["AdaScale gain", f"{report['adascale_gain']:.3f}",
                 f"lr multiplier AdaScale implies for a batch of {report['global_batch_size']} vs {report['b_small']} "
                 f"(scale {report['adascale_scale']:g})"])
    if report["skipped_steps"]:
        rows.append(["skipped steps", str(report["skipped_steps"]),
                     "measured steps left out: non-finite gradients (e.g. an fp16 overflow)"])
    out = render.console()
    out.print(render.table(_title(report), ["", "value", "meaning"], rows))
    if report["note"]:
        out.print(f"note: {report['note']}")


def _b_simple_cells(report: dict) -> list[str]:
    interval, measured = report["b_simple_ci95"], report["measured_steps"]
    value = "—" if report["b_simple"] is None else f"{report['b_simple']:.4g}"
    if report["b_simple_status"] == "resolved":
        low, high = interval
        return [value, f"95% interval [{low:.4g}, {high:.4g}] (Fieller) over {measured} measured steps"]
    if report["b_simple_status"] == "g2_unresolved":
        return [value, f"|G|² not resolved: B_simple > {interval[0]:.4g} at 95% over {measured} measured steps"]
    return [value, f"no interval: {measured} measured step{'s' if measured != 1 else ''}"]


def _title(report: dict) -> str:
    lr = ", ".join(f"{v:g}" for v in report["lr"] or []) or "?"
    motion = "weights move: B_simple averages over the trajectory" if report["weights_moved"] else "weights fixed"
    size = report["dataset_size"]
    samples = f"; {size} samples, corrected for drawing without replacement" if size else ""
    return (f"ddplab noise: {report['world_size']} ranks × {report['per_device_batch_size']} per device "
            f"(global {report['global_batch_size']}), {report['steps']} steps\nlr {lr}, {motion}{samples}")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'ddplab[plot]'") from None


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in report["per_step"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    # Steps whose running |G|² was still ≤ 0 have no B_simple: gaps in the line.
    ema = [math.nan if r["b_simple_ema"] is None else r["b_simple_ema"] for r in report["per_step"]]
    ax.plot(steps, ema, label="B_simple (EMA)")
    interval = report["b_simple_ci95"]
    if interval and interval[1] is not None:
        ax.axhspan(interval[0], interval[1], alpha=0.2, label="95% interval over the run")
    elif interval:
        ax.axhline(interval[0], color="gray", linewidth=1, label=f"|G|² not resolved: B_simple > {interval[0]:.4g}")
    if report["b_simple"] is not None:
        ax.axhline(report["b_simple"], linestyle="--", linewidth=1, label=f"run estimate {report['b_simple']:.4g}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("B_simple")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
