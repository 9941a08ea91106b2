"""``ddplab sandbox``: the one-neuron toy, single process vs DDP ranks, theory beside measurement."""

from __future__ import annotations

import argparse

from ddplab.cli import render
from ddplab.cli.args import HelpFormatter, mark
from ddplab.cli.options import add_field, add_fields, add_launch_flags, fields_given, launch_config
from ddplab.sandbox.config import SandboxConfig

EXPLAIN = """\
A one-parameter model w·x (w starts at 1.0) trained with plain SGD on an L1 loss over 256
samples per epoch. Deterministic data: x = 1, y = 0. Noisy data: x = 1 + N(0,1), y = N(0,1).
Thousands of independent experiments train at once in one parameter tensor, through one
real DistributedDataParallel wrapper.
"""
EXAMPLES = {
    "single": "\nexamples:\n  ddplab sandbox single\n  ddplab sandbox single --noisy --batch-size 16 --json\n",
    "multi": "\nexamples:\n  ddplab sandbox multi                       # 8 CPU ranks × 16\n"
             "  ddplab sandbox multi --world-size 4 --batch-size 32 --noisy\n"
             "  ddplab sandbox multi --noisy --bypass-ddp  # the classic bug, caught\n"
             "  torchrun --nproc_per_node 2 -m ddplab sandbox multi --batch-size 16\n",
}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "sandbox", help="compare single-process and multi-rank DDP training on a one-neuron toy",
        description=EXPLAIN, formatter_class=HelpFormatter)
    modes = mark(parser.add_subparsers(dest="mode", metavar="MODE", parser_class=type(parser)), "mode")
    modes.required = True
    single = modes.add_parser("single", help="one process, batch B", description=EXPLAIN + (
        "\nOne process, loader batch B → 256/B steps per epoch.\n" + EXAMPLES["single"]),
        formatter_class=HelpFormatter)
    _add_run_flags(single)
    multi = modes.add_parser("multi", help="W DDP ranks of batch b each", description=EXPLAIN + (
        "\nW ranks with per-rank batch b; DistributedSampler shards the 256 samples, so an epoch is\n"
        "256/(b·W) steps and DDP averages the W gradients. Under torchrun it joins torchrun's group.\n"
        + EXAMPLES["multi"]), formatter_class=HelpFormatter)
    _add_run_flags(multi)
    add_fields(multi, SandboxConfig, ("world_size", "bypass_ddp"))
    add_launch_flags(multi)
    table = modes.add_parser(
        "table", help="the classic nine-run study in one go, measurement beside theory",
        description="Runs the classic study: single vs 8 DDP ranks of 16, deterministic and noisy, with the\n"
                    "linear and square-root LR rules. All multi runs share one launch of the ranks.\n\n"
                    "examples:\n  ddplab sandbox table\n  ddplab sandbox table --json --seed 1\n",
        formatter_class=HelpFormatter)
    add_field(table, SandboxConfig, "seed")
    table.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_launch_flags(table)
    parser.set_defaults(run=run)


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, SandboxConfig, ("lr", "per_device_batch_size", "deterministic", "n_experiments", "n_epochs",
                                       "seed"), deterministic={"optional_value": True})
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def config_from_args(args: argparse.Namespace) -> SandboxConfig:
    return SandboxConfig(**fields_given(args, SandboxConfig))


def run(args: argparse.Namespace) -> int:
    if args.mode == "table":
        return _run_table(args)
    from ddplab.sandbox.train import run as run_sandbox

    result = run_sandbox(config_from_args(args), launch_config(args) if args.mode == "multi" else None)
    if result is None:  # a non-zero rank under torchrun: rank 0 reports
        return 0
    if args.json:
        render.print_json(result)
    else:
        _print_run(result)
    return 0


def _print_run(result) -> None:
    cfg, theory = result.config, result.theory()
    data = "deterministic" if cfg.deterministic else f"noisy, {cfg.n_experiments:,} experiments"
    title = (f"sandbox {cfg.mode}: world size {cfg.world_size}, per-device batch {cfg.per_device_batch_size} "
             f"→ global batch {cfg.global_batch_size}, lr {cfg.lr:g}, {data}, {cfg.steps} steps")
    rows = [
        ["world size", str(cfg.world_size), ""],
        ["my_net.w", _pm(result.w, result.w_stderr), render.num(theory.w, 6)],
        ["update step variance", _pm(result.update_step_variance, result.update_step_variance_stderr),
         render.num(theory.update_step_variance)],
    ]
    if cfg.mode == "multi":
        rows.append(["gradient all-reduces", str(result.allreduces), f"{cfg.steps} (one per step)"])
    if result.adascale_gain is not None:
        rows.append([f"AdaScale gain (S = {cfg.world_size})", render.num(result.adascale_gain),
                     render.num(cfg.adascale_theory())])
    if cfg.bypass_ddp:
        alone = cfg.theory(batch_size=cfg.per_device_batch_size)
        rows.append(["w spread across ranks", render.num(result.w_rank_spread), "0 when DDP syncs"])
        rows.append(["variance if ranks train alone", "", render.num(alone.update_step_variance)])
    rows.append(["wall time", f"{result.seconds:.2f} s", ""])
    out = render.console()
    out.print(render.table(title, ["quantity", "measured", "theory"], rows))
    if cfg.bypass_ddp:
        out.print(f"[bold red]Bypassed DDP:[/] {result.allreduces} all-reduces, ranks disagree on w by "
                  f"{render.num(result.w_rank_spread)} on average, and each update is "
                  f"{result.bypass_variance_ratio:.1f}× as noisy as DDP's (≈ world size {cfg.world_size}): every "
                  f"rank trained alone on batch {cfg.per_device_batch_size}.")


def _pm(value: float, stderr: float) -> str:
    return render.num(value, 6) if stderr == 0 else f"{render.num(value, 6)} ± {render.num(stderr, 2)}"


def _run_table(args: argparse.Namespace) -> int:
    from ddplab.sandbox.table import WORLD_SIZE, run_table

    table = run_table(**fields_given(args, SandboxConfig, only=("seed",)), launch_config=launch_config(args))
    if args.json:
        render.print_json(table)
        return 0
    out = render.console()
    out.print(_render_table(table))
    out.print(f"wall time {table.seconds:.2f} s for the nine runs, starting the {WORLD_SIZE} ranks included (Python "
              "and torch imports not); the multi runs shared one launch")
    return 0


def _render_table(table):
    from rich.console import Group
    from rich.text import Text

    rows = []
    for i, (label, result) in enumerate(zip(table.labels, table.results), start=1):
        theory = result.theory()
        rows.append([str(i), label, render.num(result.w, 6), render.num(theory.w, 6),
                     render.num(result.update_step_variance), render.num(theory.update_step_variance)])
    grid = render.table("ddplab sandbox table: one neuron, single process vs 8 DDP ranks",
                        ["#", "run", "w", "w theory", "update var", "var theory"], rows)
    lines = [Text.assemble(("✓ " if c.holds else "✗ ", "green" if c.holds else "bold red"),
                           f"{c.runs[0]} vs {c.runs[1]}: {c.claim} ({c.evidence})")
             for c in table.conclusions]
    return Group(grid, *lines)
