"""The ``ddplab`` console script: parse, hand off to a command module, render.

Nothing here imports torch, so ``ddplab --help`` and ``ddplab plan`` answer instantly;
each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("sandbox", "plan", "check", "audit", "noise", "study")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One sentence, not argparse's usage dump; --help has the rest.
        raise SystemExit(_fail(f"{message} (see '{self.prog} --help')"))


def _fail(message: str) -> int:
    print(f"ddplab: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ddplab",
        description=(
            "See, plan, audit and measure data-parallel training with PyTorch DDP.\n\n"
            "Vocabulary: --batch-size is always the per-device (per-rank) loader batch; the global\n"
            "(effective) batch is per-device batch × devices × nodes × accumulation steps."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in COMMANDS:
        importlib.import_module(f"ddplab.commands.{name}").add_parser(subparsers)
    return parser


def _version() -> str:
    from ddplab import __version__

    return f"ddplab {__version__}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    # Bad input raises ValueError with one sentence: exit code 2, no traceback.
    except ValueError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
