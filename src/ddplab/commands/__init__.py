"""One module per ddplab subcommand: ``add_parser`` declares flags, ``run`` does the work.

Modules import torch inside ``run`` only, so building the parser stays instant. The argument
types raise ``argparse.ArgumentTypeError`` with a sentence, so a bad number reads
"argument --devices: expected a positive integer, got 'x'" and never names a Python function.
"""

from __future__ import annotations

import argparse
import math


def parse_bool(text: str) -> bool:
    """Accept the classic spellings: True/False, yes/no, 1/0."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def integer(text: str) -> int:
    """Any integer (the CLI's replacement for ``type=int``)."""
    return _parse(int, text, "an integer")


def number(text: str) -> float:
    """Any number ``float`` accepts (the CLI's replacement for ``type=float``)."""
    return _parse(float, text, "a number")


def positive_int(text: str) -> int:
    value = _parse(int, text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _parse(int, text, "an integer, zero or more")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer, zero or more, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _parse(float, text, "a positive number")
    # `not value > 0` also rejects NaN.
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _parse(float, text, "a number, zero or more")
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number, zero or more, got {text!r}")
    return value


def _parse(kind: type, text: str, expected: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


DEFAULT_TIMEOUT_S = 60.0
"""The collective timeout (``LaunchConfig.pg_timeout_s``), repeated here so --help needs no torch."""


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """--timeout and --deadline, for every command that starts ranks."""
    group = parser.add_argument_group("launch")
    group.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                       help="how long a collective waits for the other ranks before the run fails, naming the rank "
                            f"that stopped answering (the process-group timeout; default {DEFAULT_TIMEOUT_S:g})")
    group.add_argument("--deadline", type=positive_float, default=None, metavar="SECONDS",
                       help="wall-clock limit for the whole run; ranks still running are stopped and what they "
                            "measured so far is reported where the command can (default: none; SIGTERM/Ctrl-C "
                            "cancel cleanly). Not applied under torchrun")


def launch_config(args: argparse.Namespace, world_size: int):
    """The LaunchConfig the launch flags ask for."""
    from ddplab.launch import LaunchConfig

    return LaunchConfig(world_size=world_size, pg_timeout_s=args.timeout, deadline_s=args.deadline)
