"""``ddplab noise``: the gradient noise scale (critical batch size) of your own training command, or of a spec."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys

from ddplab.cli import render
from ddplab.cli.args import EndedBySignal, HelpFormatter, mark, split_at_command
from ddplab.cli.options import add_field, add_fields, add_launch_flags, fields_given, launch_config
from ddplab.errors import UsageError, literal
from ddplab.noise.command.config import CommandConfig
from ddplab.noise.config import DEFAULT_WORLD_SIZE, NoiseConfig
from ddplab.text import count

DESCRIPTION = f"""\
Measure the gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018) of your own
training command, run unchanged: each rank's local gradient over its batch b before the
data-parallel reduction, the averaged gradient over the global batch B after it. B_simple
predicts the critical batch size: past it, a larger global batch buys little, as steps fall
only as 1 + B_simple/B.

  ddplab noise [options] -- COMMAND ...

A guest in every Python process of the command (torchrun workers, mp.spawn and fork children,
Lightning, Accelerate) finds the DDP model (or FSDP2 / HSDP root; on one process with accumulation,
the model whose micro-steps it compares) at its first training forward,
counts its optimizer steps and reads the gradients of --steps steps from --start-step (under
no_sync the synchronising micro-step holds every micro-batch); with --every K every K-th step to
the end of training, and the report's by_samples gives B_simple over samples seen (--plot draws
it; its schedule is a batch schedule BatchSchedule follows). It only reads: training is bit for
bit what it is without it, the exit code is the command's, no collective is added (each rank
writes its own file, merged after the command ends), and it turns itself off with a note where
it cannot measure. The dataset size of a DistributedSampler corrects for drawing without
replacement. Ctrl-C and --deadline stop the command and report the steps measured.

The spec form trains SPEC.py (model(), dataset(), loss(output, target), optionally optimizer(params)
and step(model, batch, loss_fn)) on W ranks itself: --strategy fsdp/hsdp shard it with FSDP2.
In both, the 95% interval is Fieller's, from batch means over the measured steps; when |G|² is
within its error of zero it reads "|G|² not resolved: B_simple > X at 95%".

examples:
  ddplab noise -- torchrun --nproc_per_node 2 train.py                  # steps 10-49 of your run
  ddplab noise --every 20 --plot gns.png --json-file gns.json -- torchrun --nproc_per_node 4 train.py
  ddplab noise --start-step 100 --deadline 600 -- python train_lightning.py
  ddplab noise examples/linear_regression_spec.py --batch-size 16 --steps 800   # spec: {DEFAULT_WORLD_SIZE} CPU ranks
  ddplab noise spec.py --world-size 1 --batch-size 16 --accumulation 4          # one process, 4 micro-batches
  ddplab noise spec.py --batch-size 16 --strategy hsdp --world-size 4 --replicate 2
"""

# Flags of one form only.
COMMAND_ONLY = ("start_step", "window")
SPEC_ONLY = ("world_size", "seed", "accumulation_steps", "strategy", "replicate", "reduce_dtype", "pg_timeout_s")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("noise", help="measure the gradient noise scale and critical batch size",
                                   description=DESCRIPTION, formatter_class=HelpFormatter)
    add_fields(parser, NoiseConfig, ("spec_path", "world_size", "per_device_batch_size", "steps", "seed",
                                     "accumulation_steps", "every"),
               spec_path={"nargs": "?"}, per_device_batch_size={"required": False})
    command_form = parser.add_argument_group("your own command (after --)")
    for name in COMMAND_ONLY:
        add_field(command_form, CommandConfig, name)
    add_fields(parser.add_argument_group("parallelism"), NoiseConfig, ("strategy", "replicate", "reduce_dtype"))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    mark(parser.add_argument("--json-file", metavar="PATH",
                             help="also write the JSON object to PATH (what was measured, even when the run is "
                                  "stopped early by --deadline, a failing rank or Ctrl-C)"), "json_file")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of B_simple over steps (needs matplotlib)")
    add_launch_flags(parser)
    parser.set_defaults(run=run, command=None)
    split_at_command(parser)


def config_from_args(args: argparse.Namespace) -> NoiseConfig | CommandConfig:
    if args.command is not None:
        _refuse(args, SPEC_ONLY, "belongs to the spec form (ddplab noise SPEC.py ...), not to a command after --")
        if args.spec_path is not None:
            raise UsageError(f"give either SPEC.py or a command after --, not both (got {literal(args.spec_path)})")
        given = fields_given(args, CommandConfig, only=("start_step", "steps", "every", "per_device_batch_size",
                                                        "window", "deadline_s"))
        return CommandConfig(command=tuple(args.command), **given)
    _refuse(args, COMMAND_ONLY, "belongs to the form that runs your own command (ddplab noise [options] -- COMMAND)")
    if args.spec_path is None:
        raise UsageError("give your training command after --, e.g. ddplab noise -- torchrun --nproc_per_node 2 "
                         "train.py, or a SPEC.py with {per_device_batch_size}")
    if args.per_device_batch_size is None:
        raise UsageError("the spec form needs {per_device_batch_size}: samples per rank per micro-step")
    return NoiseConfig(**fields_given(args, NoiseConfig))


def _refuse(args: argparse.Namespace, fields: tuple[str, ...], why: str) -> None:
    for field in fields:
        if getattr(args, field, None) is not None:
            raise UsageError(f"{{{field}}} {why}")


def run(args: argparse.Namespace) -> int:
    from ddplab.guest.runner import check_writable
    from ddplab.runtime.spec import check_spec_path

    config = config_from_args(args)
    if isinstance(config, CommandConfig):
        return _run_command(args, config)
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
    _report(args, report, _print, _plot)
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


def _scale_rows(values: dict) -> list[list[str]]:
    """The rows a spec's report and a command's share: B_simple, |G|², tr(Σ) and the steps factor."""
    rows = [["B_simple (critical batch)", *_b_simple_cells(values)],
            ["|G|²", f"{values['g2']:.4g}", "squared norm of the true gradient"],
            ["tr(Σ)", f"{values['trace_sigma']:.4g}", "per-sample gradient variance, summed over parameters"]]
    if values["steps_factor"] is not None:
        rows.append(["steps factor", f"{values['steps_factor']:.3f}", f"1 + B_simple/B at global batch "
                     f"{values['global_batch_size']}: steps relative to the fewest possible"])
    return rows


def _print(report) -> None:
    values = report.to_json()
    rows = _scale_rows(values)
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
        from matplotlib.ticker import LogFormatter

        ax.set_yscale("log")
        # Plain numbers on the log axis: 40, not 4×10¹.
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    ax.set_title(f"gradient noise scale: {count(values['world_size'], 'rank')} × {values['per_device_batch_size']} "
                 f"per device (global batch {values['global_batch_size']})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("B_simple")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the form that runs your own command ---

def _run_command(args: argparse.Namespace, config: CommandConfig) -> int:
    from ddplab.guest.runner import check_writable
    from ddplab.noise.command.run import measure_command

    if args.json_file is not None:
        check_writable(args.json_file, "json_file")
    if args.plot:
        _check_plot(args.plot)
    # Under --json stdout holds the report alone: the command's own stdout goes to stderr.
    outcome = measure_command(config, program_stdout_to_stderr=args.json)
    if outcome.report is None:
        print(f"ddplab noise: {outcome.why_nothing}", file=sys.stderr)
    else:
        _report_command(args, outcome.report)
    if outcome.timed_out:
        return 1  # the deadline's own SIGTERM is no signal the user sent
    if outcome.signal is not None:
        raise EndedBySignal(outcome.signal)
    return outcome.returncode


def _report_command(args: argparse.Namespace, report) -> None:
    _report(args, report, _print_command, _plot_by_samples)


def _report(args: argparse.Namespace, report, show, plot) -> None:
    """The figures first (a plot that fails never loses them), then the JSON file and the plot."""
    if args.json:
        render.print_json(report)
    else:
        show(report)
    if args.json_file is not None:
        _write_json(args.json_file, report)
    if args.plot:
        plot(report, args.plot)


def _print_command(report) -> None:
    values = report.to_json()
    rows = _scale_rows(values)
    if values["tokens_per_sample"] is not None:
        rows.insert(1, _tokens_row(values))
    for point in values["by_samples"] if len(values["by_samples"]) > 1 else []:
        rows.append([f"  at {point['samples_seen']:,.0f} samples", _point_value(point),
                     f"steps {point['steps'][0]}-{point['steps'][1]}"])
    rows.append(["cost", _cost(values), "the guest's own time in a measured step; nothing outside them"])
    for reason, left in values["left_out"].items():
        rows.append(["left out", str(left), f"measured steps {reason}"])
    out = render.console()
    out.print(render.table(_command_title(values), ["", "value", "meaning"], rows))
    for note in filter(None, [values["note"], values["trend_note"], values["schedule_note"], *values["guest_notes"],
                              values["failed_after_measuring"], values["tokens_note"]]):
        out.print(f"note: {note}", markup=False)
    if values["stopped_early"]:
        out.print(f"stopped early: {values['stopped_early']}; the figures are those of the steps measured before",
                  markup=False)


def _tokens_row(values: dict) -> list[str]:
    """B_simple in tokens: B_simple and its interval × the mean tokens per sample measured."""
    value = "—" if values["b_simple_tokens"] is None else _tokens(values["b_simple_tokens"])
    meaning = f"B_simple × {values['tokens_per_sample']:.4g} tokens per sample (global batch: " \
              f"{_tokens(values['global_batch_tokens'])} tokens)"
    interval = values["b_simple_tokens_ci95"]
    if interval is not None:
        high = "∞" if interval[1] is None else _tokens(interval[1])
        meaning = f"95% interval [{_tokens(interval[0])}, {high}]; {meaning}"
    return ["B_simple in tokens", value, meaning]


def _tokens(value: float) -> str:
    # Token counts run to millions: whole numbers with separators there, 4 figures below a thousand.
    return f"{value:,.0f}" if value >= 1000 else f"{value:.4g}"


def _point_value(point: dict) -> str:
    value = "—" if point["b_simple"] is None else f"{point['b_simple']:.4g}"
    interval = point["b_simple_ci95"]
    if interval is None:
        return value
    high = "∞" if interval[1] is None else f"{interval[1]:.4g}"
    return f"{value} [{interval[0]:.4g}, {high}]"


def _cost(values: dict) -> str:
    guest_ms = 1000 * values["guest_seconds_per_measured_step"]
    if values["overhead"] is None:
        return f"{guest_ms:.3g} ms"
    return f"{guest_ms:.3g} ms of {1000 * values['measured_step_seconds']:.3g} ms ({100 * values['overhead']:.2g}%)"


def _command_title(values: dict) -> str:
    first, last = values["measured_step_range"]
    size = values["dataset_size"]
    samples = f"; {size} samples, corrected for drawing without replacement" if size else ""
    accumulation = values["accumulation_steps"]
    micro = f" × {accumulation} micro-steps" if accumulation > 1 else ""
    return (f"ddplab noise: {values['strategy']}, {count(values['data_parallel_size'], 'data-parallel rank')} × "
            f"{values['per_device_batch_size']} per device{micro} (global {values['global_batch_size']})\n"
            f"optimizer steps {first}-{last} measured{samples}")


def _plot_by_samples(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = report.to_json()["by_samples"]
    points = [p for p in windows if p["b_simple_status"] == "resolved"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [p["samples_seen"] for p in points]
    y = [p["b_simple"] for p in points]
    low = [p["b_simple"] - p["b_simple_ci95"][0] for p in points]
    high = [p["b_simple_ci95"][1] - p["b_simple"] for p in points]
    if points:
        ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, label="B_simple, 95% interval")
    # A window whose |G|² was not resolved has only a lower bound, every one drawn as such: its point estimate
    # (often huge) is no value to read, nor to set the chart's range.
    bounds = [p for p in windows if p["b_simple_status"] != "resolved" and p["b_simple_ci95"]]
    if bounds:
        ax.plot([p["samples_seen"] for p in bounds], [p["b_simple_ci95"][0] for p in bounds], "^", color="gray",
                label="|G|² not resolved: B_simple above")
    ax.set_xlabel("samples seen")
    ax.set_ylabel("B_simple")
    if any(v > 0 for v in y):
        ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
