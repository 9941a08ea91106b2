"""What every subcommand shares: argument types that only parse, the field-to-flag table, the launch flags.

Values are validated once, by the library's configs, in their own words: ``{per_device_batch_size}``
in a library error is a field, and :data:`FLAGS` says which flag sets it, so the command line
reads ``--batch-size`` where a Python user reads ``per_device_batch_size``. Defaults live in the
configs; ``--help`` quotes them from there (:func:`default`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ddplab.errors import UsageError


class EndedBySignal(Exception):
    """The command a subcommand ran was killed by a signal: the console script dies by the same one."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


FLAGS: dict[str, str] = {
    # check, noise and the launch layer
    "spec_path": "SPEC.py", "per_device_batch_size": "--batch-size", "world_size": "--world-size",
    "steps": "--steps", "seed": "--seed", "tolerance": "--tolerance", "every": "--every",
    "accumulation_steps": "--accumulation", "pg_timeout_s": "--timeout", "deadline_s": "--deadline",
    "backend": "--backend", "start_method": "--start-method",
    # plan
    "reference.per_device_batch_size": "--ref-batch-size", "reference.global_batch_size": "--ref-batch-size",
    "reference.lr": "--ref-lr", "reference.devices": "--ref-devices", "reference.nodes": "--ref-nodes",
    "reference.accumulation_steps": "--ref-accumulation", "reference.wrapper": "--ref-wrapper",
    "reference.optimizer": "--optimizer", "reference.betas": "--betas", "reference.eps": "--eps",
    "reference.reduction": "--reduction", "target.devices": "--devices", "target.nodes": "--nodes",
    "target.per_device_batch_size": "--batch-size", "target.global_batch_size": "--global-batch-size",
    "target.accumulation_steps": "--accumulation", "target.max_batch_size_per_device": "--max-batch-size-per-device",
    "target.keep": "--keep", "target.rule": "--rule", "data.dataset_size": "--dataset-size", "data.epochs": "--epochs",
    "data.drop_last": "--drop-last", "data.sampler_drop_last": "--sampler-drop-last",
    "data.warmup_epochs": "--warmup-epochs", "data.warmup_steps": "--warmup-steps",
    "data.warmup_threshold": "--warmup-threshold", "data.critical_batch_size": "--critical-batch-size",
    "from_study": "--from-study",
    # study
    "target.accuracy": "--target-accuracy", "target.loss": "--target-loss",
    "global_batch_sizes": "--global-batch-sizes", "rules": "--rules",
    "reference_global_batch_size": "--ref-global-batch-size", "reference_lr": "--ref-lr", "seeds": "--seeds",
    "optimizer.family": "--optimizer", "optimizer.momentum": "--momentum", "optimizer.dampening": "--dampening",
    "optimizer.nesterov": "--nesterov", "optimizer.weight_decay": "--weight-decay", "optimizer.betas": "--betas",
    "optimizer.eps": "--eps", "patience": "--patience", "max_steps": "--max-steps", "eval_every": "--eval-every",
    "sweep_factor": "--sweep-factor", "sweep_margin": "--sweep-margin", "dtype": "--dtype", "out": "--out",
    "fresh": "--fresh", "plots=False": "--no-plots", "verify_ddp": "--verify-ddp",
    "verify_world_size": "--verify-world-size", "verify_steps": "--verify-steps", "threads": "--threads",
    "workload": "--workload", "max_runs": "--max-runs", "compare": "--compare", "engine": "--engine",
    "device": "--device",
    "max_batch_size_per_device": "--max-batch-size-per-device",
    # sandbox
    "mode": "MODE", "lr": "--lr", "n_experiments": "--n-experiments", "n_epochs": "--n-epochs",
    "bypass_ddp": "--bypass-ddp", "deterministic=False": "--noisy",
    # audit
    "command": "COMMAND", "json_file": "--json-file",
}


def flag_error(error: UsageError) -> str:
    """A library error as the command line says it: each field as its flag."""
    return error.render(FLAGS)


def default(config: type, field: str) -> Any:
    """A config field's default, for --help (the config holds it, not the parser)."""
    found = {f.name: f for f in dataclasses.fields(config)}[field]
    return found.default


def given(args: argparse.Namespace, **fields: str) -> dict[str, Any]:
    """{field: args.<dest>} for the flags the user gave (None means not given: the config's default applies)."""
    return {field: getattr(args, dest) for field, dest in fields.items() if getattr(args, dest, None) is not None}


def parse_bool(text: str) -> bool:
    """Accept the classic spellings: True/False, yes/no, 1/0."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def integer(text: str) -> int:
    """Any integer (the CLI's replacement for ``type=int``); the config says whether it is allowed."""
    return _parse(int, text, "an integer")


def number(text: str) -> float:
    """Any number ``float`` accepts (the CLI's replacement for ``type=float``)."""
    return _parse(float, text, "a number")


def integers(text: str) -> tuple[int, ...]:
    """Comma-separated integers, like 8,16,32."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 8,16,32, got {text!r}") from None


def betas(text: str) -> tuple[float, float]:
    """Two numbers, like Adam's 0.9,0.999."""
    try:
        first, second = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers like 0.9,0.999, got {text!r}") from None
    return first, second


def _parse(kind: type, text: str, expected: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def add_spec_run_flags(parser: argparse.ArgumentParser, config: type, *, world_size: int, steps: str,
                       world_size_note: str = "") -> None:
    """SPEC.py, --world-size, --batch-size, --steps and --seed: what every command that trains a spec takes."""
    parser.add_argument("spec", metavar="SPEC.py", help="the training spec file")
    parser.add_argument("--world-size", type=integer,
                        help=f"DDP ranks (default {world_size}; under torchrun its WORLD_SIZE){world_size_note}")
    parser.add_argument("--batch-size", type=integer, required=True, help="per-device (per-rank) batch")
    parser.add_argument("--steps", type=integer,
                        help=f"optimizer steps to {steps} (default {default(config, 'steps')})")
    parser.add_argument("--seed", type=integer,
                        help=f"model init and data order seed (default {default(config, 'seed')})")


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """--timeout and --deadline, for every command that starts ranks."""
    from ddplab.runtime.launch_config import LaunchConfig

    timeout = default(LaunchConfig, "pg_timeout_s")
    group = parser.add_argument_group("launch")
    group.add_argument("--timeout", type=number, default=None, metavar="SECONDS",
                       help="how long a collective waits for the other ranks before the run fails, naming the rank "
                            f"that stopped answering (the process-group timeout; default {timeout:g})")
    group.add_argument("--deadline", type=number, default=None, metavar="SECONDS",
                       help="wall-clock limit for the whole run; ranks still running are stopped and what they "
                            "measured so far is reported where the command can (default: none; SIGTERM/Ctrl-C "
                            "cancel cleanly). Not applied under torchrun")


def launch_config(args: argparse.Namespace):
    """The LaunchConfig the launch flags ask for (the world size is the command's to choose)."""
    from ddplab.runtime.launch_config import LaunchConfig

    return LaunchConfig(**given(args, pg_timeout_s="timeout", deadline_s="deadline"))
