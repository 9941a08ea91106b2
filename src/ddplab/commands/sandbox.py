"""``ddplab sandbox``: the one-neuron toy, single process vs DDP ranks, theory beside measurement."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from ddplab import render
from ddplab.commands import add_launch_flags, launch_config, parse_bool, positive_float, positive_int

EXPLAIN = """\
A one-parameter model w·x (w starts at 1.0) trained with plain SGD on an L1 loss over 256
samples per epoch. Deterministic data: x = 1, y = 0. Noisy data: x = 1 + N(0,1), y = N(0,1).
Thousands of independent experiments train at once in one parameter tensor, through one
real DistributedDataParallel wrapper.
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "sandbox", help="compare single-process and multi-rank DDP training on a one-neuron toy",
        description=EXPLAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", metavar="MODE", parser_class=type(parser))
    modes.required = True
    single = modes.add_parser("single", help="one process, batch B",
                              description=EXPLAIN + "\nOne process, loader batch B → 256/B steps per epoch.",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_flags(single, default_batch=128)
    multi = modes.add_parser("multi", help="W DDP ranks of batch b each", description=EXPLAIN + (
        "\nW ranks with per-rank batch b; DistributedSampler shards the 256 samples, so an epoch is\n"
        "256/(b·W) steps and DDP averages the W gradients. Under torchrun it joins torchrun's group."),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_flags(multi, default_batch=16)
    multi.add_argument("--world-size", type=positive_int, default=None,
                       help="ranks to start (default: the visible GPUs when ≥ 2, else 8 CPU ranks; "
                            "under torchrun its WORLD_SIZE)")
    multi.add_argument("--bypass-ddp", action="store_true",
                       help="reproduce the classic bug: forward through the inner module, "
                            "so DDP never all-reduces (noisy data)")
    add_launch_flags(multi)
    table = modes.add_parser(
        "table", help="the classic nine-run study in one go, measurement beside theory",
        description="Runs the classic study: single vs 8 DDP ranks of 16, deterministic and noisy, with the\n"
                    "linear and square-root LR rules. All multi runs share one launch of the ranks.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    table.add_argument("--seed", type=int, default=0, help="data and sampler seed (default 0)")
    table.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_launch_flags(table)
    parser.set_defaults(run=run)


def _add_run_flags(parser: argparse.ArgumentParser, *, default_batch: int) -> None:
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="SGD learning rate (default 1e-3)")
    parser.add_argument("--batch-size", type=positive_int, default=default_batch,
                        help=f"per-device (per-rank) loader batch (default {default_batch})")
    parser.add_argument("--deterministic", nargs="?", const=True, default=True, type=parse_bool,
                        help="x = 1, y = 0 (default True); '--deterministic False' for noisy data")
    parser.add_argument("--no-deterministic", "--noisy", dest="deterministic", action="store_false",
                        help="noisy data: x = 1 + N(0,1), y = N(0,1)")
    parser.add_argument("--n-experiments", type=positive_int, default=None,
                        help="independent experiments, vectorized (default 1 deterministic, 10,000 noisy)")
    parser.add_argument("--n-epochs", type=positive_int, default=1, help="epochs (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="data and sampler seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    if args.mode == "table":
        return _run_table(args)
    from ddplab import sandbox
    from ddplab.launch import default_world_size, under_torchrun

    world_size = 1
    if args.mode == "multi":
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else (args.world_size or default_world_size())
    cfg = sandbox.SandboxConfig(
        mode=args.mode, lr=args.lr, per_device_batch_size=args.batch_size, world_size=world_size,
        deterministic=args.deterministic, n_experiments=args.n_experiments or (1 if args.deterministic else 10_000),
        n_epochs=args.n_epochs, seed=args.seed, bypass_ddp=getattr(args, "bypass_ddp", False))
    started = time.perf_counter()
    result = sandbox.run(cfg, launch_config(args, world_size) if args.mode == "multi" else None)
    if result is None:  # a non-zero rank under torchrun: rank 0 reports
        return 0
    result = dataclasses.replace(result, seconds=time.perf_counter() - started)
    if args.json:
        render.print_json(result.to_json())
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
    if cfg.bypass_ddp:
        alone = cfg.theory(batch_size=cfg.per_device_batch_size)
        rows.append(["w spread across ranks", render.num(result.w_rank_spread), "0 when DDP syncs"])
        rows.append(["variance if ranks train alone", "", render.num(alone.update_step_variance)])
    rows.append(["wall time", f"{result.seconds:.2f} s", ""])
    out = render.console()
    out.print(render.table(title, ["quantity", "measured", "theory"], rows))
    if cfg.bypass_ddp:
        ratio = result.update_step_variance / max(cfg.theory().update_step_variance, 1e-300)
        out.print(f"[bold red]Bypassed DDP:[/] {result.allreduces} all-reduces, ranks disagree on w by "
                  f"{render.num(result.w_rank_spread)} on average, and each update is {ratio:.1f}× as noisy as "
                  f"DDP's (≈ world size {cfg.world_size}): every rank trained alone on batch "
                  f"{cfg.per_device_batch_size}.")


def _pm(value: float, stderr: float) -> str:
    return render.num(value, 6) if stderr == 0 else f"{render.num(value, 6)} ± {render.num(stderr, 2)}"


def _run_table(args: argparse.Namespace) -> int:
    from ddplab import sandbox_table

    started = time.perf_counter()
    study = sandbox_table.run_study(seed=args.seed, launch_config=launch_config(args, sandbox_table.WORLD_SIZE))
    seconds = time.perf_counter() - started
    if args.json:
        render.print_json({**study.to_json(), "seconds": seconds})
        return 0
    out = render.console()
    out.print(sandbox_table.render_study(study))
    out.print(f"wall time {seconds:.2f} s for the nine runs, starting the 8 ranks included (Python and torch "
              "imports not); the multi runs shared one launch")
    return 0
