"""What every subcommand shares at the bottom: argument types that only parse, and the mark a flag carries.

Values are validated once, by the library's configs, in their own words: ``{per_device_batch_size}``
in a library error is a field, and :func:`mark` records which flag sets it. The field-to-flag table,
:data:`ddplab.cli.main.FLAGS`, is read off the marks where the parser tree is built.
"""

from __future__ import annotations

import argparse
import textwrap


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; help texts wrapped at spaces only, so a flag such as --world-size stays whole."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class EndedBySignal(Exception):
    """The command a subcommand ran was killed by a signal: the console script dies by the same one."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def mark(action: argparse.Action, field: str, flag: str | None = None) -> argparse.Action:
    """Record that ``action`` sets ``field`` (shown as ``flag``, by default its first option or its metavar)."""
    action.field = field
    action.flag = flag or (action.option_strings[0] if action.option_strings else action.metavar)
    return action


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


def split_at_command(parser: argparse.ArgumentParser) -> None:
    """Everything after the first ``--`` is the training command (``namespace.command``), never the parser's flags
    or positionals."""
    parse = parser.parse_known_args
    # Its usage line shows the command's place (help._usage).
    parser.takes_command = True

    def parse_known_args(args=None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        if "--" not in args:
            return parse(args, namespace)
        cut = args.index("--")
        namespace, extras = parse(args[:cut], namespace)
        namespace.command = args[cut + 1:]
        return namespace, extras

    parser.parse_known_args = parse_known_args
