"""``ddplab noise``: the gradient noise scale (critical batch size) of a spec trained with real DDP."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys

from ddplab.cli import render
from ddplab.cli.args import EndedBySignal, HelpFormatter, mark
from ddplab.cli.options import add_fields, add_launch_flags, fields_given, launch_config
from ddplab.errors import UsageError, literal
from ddplab.noise.config import DEFAULT_WORLD_SIZE, NoiseConfig
from ddplab.text import count

DESCRIPTION = f"""\
Train SPEC.py on W DDP ranks and measure the gradient noise scale B_simple = tr(Σ)/|G|²
(McCandlish et al. 2018) from DDP's own all-reduce: each rank's gradient over its batch b
before it, the averaged gradient over W·b after it. B_simple predicts the critical batch size:
past it, a larger global batch B buys little: steps fall only as 1 + B_simple/B.
--strategy fsdp trains the ranks with FSDP2 (fully_shard) and reads each rank's gradient before
the reduce-scatter and the shards of the averaged one after it; --strategy hsdp does so on a
2-D mesh of --replicate replicas (each shard, held by every replica, counted once).

Batches come from one shuffled pass over the dataset's N samples per epoch, so the estimates are
corrected for sampling without replacement (Σ the per-sample covariance with 1/N). The 95%
interval is Fieller's, from batch means over the measured steps; when |G|² is within its error
of zero it reads "|G|² not resolved: B_simple > X at 95%". Steps with non-finite gradients are
skipped and counted. --deadline, a failing rank, Ctrl-C or SIGTERM stop the run with the figures
of the steps it measured, printed and written to --json-file (exit 1; 130 for Ctrl-C).

SPEC.py defines model(), dataset(), loss(output, target) and optionally optimizer(params) and
step(model, batch, loss_fn), as for ddplab check.

examples:
  ddplab noise examples/linear_regression_spec.py --batch-size 16 --steps 800   # {DEFAULT_WORLD_SIZE} CPU ranks
  ddplab noise spec.py --world-size 4 --batch-size 32 --json --plot gns.png
  ddplab noise spec.py --batch-size 32 --steps 5000 --json-file gns.json   # Ctrl-C keeps what was measured
  ddplab noise spec.py --world-size 1 --batch-size 16 --accumulation 4          # one process, 4 micro-batches
  ddplab noise spec.py --batch-size 16 --strategy fsdp                           # FSDP2 on 2 ranks
  ddplab noise spec.py --batch-size 16 --strategy hsdp --world-size 4 --replicate 2
  torchrun --nproc_per_node 8 -m ddplab noise spec.py --batch-size 64
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("noise", help="measure the gradient noise scale and critical batch size",
                                   description=DESCRIPTION, formatter_class=HelpFormatter)
    add_fields(parser, NoiseConfig, ("spec_path", "world_size", "per_device_batch_size", "steps", "seed",
                                     "accumulation_steps", "every"))
    add_fields(parser.add_argument_group("parallelism"), NoiseConfig, ("strategy", "replicate", "reduce_dtype"))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    mark(parser.add_argument("--json-file", metavar="PATH",
                             help="also write the JSON object to PATH (what was measured, even when the run is "
                                  "stopped early by --deadline, a failing rank or Ctrl-C)"), "json_file")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of B_simple over steps (needs matplotlib)")
    add_launch_flags(parser)
    parser.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> NoiseConfig:
    return NoiseConfig(**fields_given(args, NoiseConfig))


def run(args: argparse.Namespace) -> int:
    from ddplab.auditor.runner import check_writable
    from ddplab.runtime.spec import check_spec_path

    config = config_from_args(args)
    check_spec_path(config.spec_path)
    # Both files are checked before the run: a path that cannot be written would lose a whole measurement.
    if args.json_file is not None:
        check_writable(args.json_file, "json_file")
    if args.plot:
        _check_plot(args.plot)
    from ddplab.noise.measure import measure_spec

    report = measure_spec(config, launch_config(args), progress=render.ProgressBar("training", status=True))
    if report is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    # The figures first: a plot that fails never loses them.
    if args.json:
        render.print_json(report)
    else:
        _print(report)
    if args.json_file is not None:
        _write_json(args.json_file, report)
    if args.plot:
        _plot(report, args.plot)
    return _stopped_early(report)


def _write_json(path: str, report) -> None:
    from ddplab import serialize

    # The run is over: a file that cannot be written after all is said, and the printed figures stand.
    try:
        serialize.write_json_atomic(path, report)
    except OSError as exc:
        render.console(stderr=True).print(f"ddplab noise: could not write the JSON to {path}: "
                                          f"{exc.strerror or exc}", markup=False)


def _check_plot(path: str) -> None:
    """Before the run: matplotlib is there, knows the file's format, and the plot's folder can take the file."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'ddplab[plot]'") from None
    # No extension saves a PNG; an extension matplotlib cannot write would fail only after the whole run.
    extension = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if extension and extension not in formats:
        raise UsageError(f"--plot {literal(path)}: matplotlib cannot write .{extension} files; use one of "
                         + ", ".join(f".{name}" for name in sorted(formats)))
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(f"--plot {literal(path)} cannot be written: give a file in an existing, writable folder")


def _stopped_early(report) -> int:
    """Exit code 1, with the reason on stderr, when the figures cover only part of the run.

    A run a signal stopped ends as that signal would have ended it: 130 for Ctrl-C, as every command
    does; for SIGTERM or SIGHUP the command then dies by the same signal.
    """
    if report.stopped_early is None:
        return 0
    print(f"ddplab: stopped early: the figures cover the first {report.completed_steps} of {report.config.steps} "
          f"steps. {report.stopped_early}", file=sys.stderr)
    if report.cancelled_by == "SIGINT":
        return 130
    if report.cancelled_by is not None:
        raise EndedBySignal(signal.Signals[report.cancelled_by])
    return 1


def _print(report) -> None:
    values = report.to_json()
    rows = [["B_simple (critical batch)", *_b_simple_cells(values)],
            ["|G|²", f"{values['g2']:.4g}", "squared norm of the true gradient"],
            ["tr(Σ)", f"{values['trace_sigma']:.4g}", "per-sample gradient variance, summed over parameters"]]
    if values["steps_factor"] is not None:
        rows.append(["steps factor", f"{values['steps_factor']:.3f}", f"1 + B_simple/B at global batch "
                     f"{values['global_batch_size']}: steps relative to the fewest possible"])
    rows.append(["AdaScale gain", f"{values['adascale_gain']:.3f}",
                 f"lr multiplier AdaScale implies for a batch of {values['global_batch_size']} vs {values['b_small']} "
                 f"(scale {values['adascale_scale']:g})"])
    if values["skipped_steps"]:
        rows.append(["skipped steps", str(values["skipped_steps"]),
                     "measured steps left out: non-finite gradients (e.g. an fp16 overflow)"])
    out = render.console()
    out.print(render.table(_title(values, report.config.strategy_text(values["world_size"])), ["", "value", "meaning"],
                           rows))
    if values["note"]:
        out.print(f"note: {values['note']}")


def _b_simple_cells(values: dict) -> list[str]:
    interval, measured = values["b_simple_ci95"], values["measured_steps"]
    value = "—" if values["b_simple"] is None else f"{values['b_simple']:.4g}"
    if values["b_simple_status"] == "resolved":
        low, high = interval
        return [value, f"95% interval [{low:.4g}, {high:.4g}] (Fieller) over {measured} measured steps"]
    if values["b_simple_status"] == "g2_unresolved":
        return [value, f"|G|² not resolved: B_simple > {interval[0]:.4g} at 95% over {measured} measured steps"]
    return [value, f"no interval: {measured} measured step{'s' if measured != 1 else ''}"]


def _title(values: dict, strategy: str) -> str:
    lr = ", ".join(f"{v:g}" for v in values["lr"] or []) or "?"
    motion = "weights move: B_simple averages over the trajectory" if values["weights_moved"] else "weights fixed"
    size = values["dataset_size"]
    samples = f"; {size} samples, corrected for drawing without replacement" if size else ""
    ranks = count(values["world_size"], "rank")
    reduced = f", gradients reduced in {values['reduce_dtype']}" if values["reduce_dtype"] else ""
    return (f"ddplab noise: {ranks} × {values['per_device_batch_size']} per device "
            f"(global {values['global_batch_size']}){f', {strategy}' if strategy else ''}{reduced}, "
            f"{values['steps']} steps\nlr {lr}, {motion}{samples}")


def _plot(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = report.to_json()
    steps = [r["step"] for r in values["per_step"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    # Steps whose running |G|² was still ≤ 0 have no B_simple: gaps in the line.
    ema = [math.nan if r["b_simple_ema"] is None else r["b_simple_ema"] for r in values["per_step"]]
    ax.plot(steps, ema, label="B_simple (EMA)")
    interval = values["b_simple_ci95"]
    if interval and interval[1] is not None:
        ax.axhspan(interval[0], interval[1], alpha=0.2, label="95% interval over the run")
    elif interval:
        ax.axhline(interval[0], color="gray", linewidth=1, label=f"|G|² not resolved: B_simple > {interval[0]:.4g}")
    if values["b_simple"] is not None:
        ax.axhline(values["b_simple"], linestyle="--", linewidth=1, label=f"run estimate {values['b_simple']:.4g}")
    # Early spikes dwarf the rest on a linear axis; B_simple is a ratio, read on a log scale.
    if any(v > 0 for v in ema if math.isfinite(v)):
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("B_simple")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
