"""What every subcommand shares: argument types that only parse, the field-to-flag table, the launch flags.

Values are validated once, by the library's configs, in their own words: ``{per_device_batch_size}``
in a library error is a field, and :data:`FLAGS` says which flag sets it, so the command line
reads ``--batch-size`` where a Python user reads ``per_device_batch_size``. The flags themselves are
generated from the configs' fields (:mod:`ddplab.cli.options`), and FLAGS is read off the parsers.
"""

from __future__ import annotations

import argparse
import functools
import textwrap

from ddplab.errors import UsageError


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; help texts wrapped at spaces only, so a flag such as --world-size stays whole."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class EndedBySignal(Exception):
    """The command a subcommand ran was killed by a signal: the console script dies by the same one."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def __getattr__(name: str):
    # FLAGS is read off the parsers, which import this module: built on first use.
    if name == "FLAGS":
        return flags()
    raise AttributeError(name)


@functools.cache
def flags() -> dict[str, str]:
    """{field: flag} over every subcommand's parser: the name each field an error names has on the command line."""
    from ddplab.cli.main import build_parser

    found: dict[str, str] = {}
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            field, flag = getattr(action, "field", None), getattr(action, "flag", None)
            if field is None:
                continue
            if found.setdefault(field, flag) != flag:
                raise TypeError(f"{field} is {found[field]} on one command and {flag} on another")
    return found


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def mark(action: argparse.Action, field: str, flag: str | None = None) -> argparse.Action:
    """Record that ``action`` sets ``field`` (shown as ``flag``, by default its first option or its metavar)."""
    action.field = field
    action.flag = flag or (action.option_strings[0] if action.option_strings else action.metavar)
    return action


def flag_error(error: UsageError) -> str:
    """A library error as the command line says it: each field as its flag."""
    return error.render(flags())


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


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """--timeout and --deadline, for every command that starts ranks."""
    from ddplab.cli.options import add_fields
    from ddplab.runtime.launch_config import LaunchConfig

    group = parser.add_argument_group("launch")
    seconds = {"metavar": "SECONDS"}
    add_fields(group, LaunchConfig, ("pg_timeout_s", "deadline_s"), pg_timeout_s=seconds, deadline_s=seconds)


def launch_config(args: argparse.Namespace):
    """The LaunchConfig the launch flags ask for (the world size is the command's to choose)."""
    from ddplab.cli.options import fields_given
    from ddplab.runtime.launch_config import LaunchConfig

    return LaunchConfig(**fields_given(args, LaunchConfig, only=("pg_timeout_s", "deadline_s")))
