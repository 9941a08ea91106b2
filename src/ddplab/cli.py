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
    """argparse with one spelling policy and one error style for every subcommand."""

    def error(self, message):
        # One sentence, not argparse's usage dump; this (sub)command's --help has the rest.
        raise SystemExit(_fail(f"{message} (see '{self.prog} --help')"))

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        # Report unknown flags here, so the hint names this subcommand's --help rather than the top level's.
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def _parse_optional(self, arg_string):
        # --world_size means --world-size on every subcommand; values and a command after `--` are never touched.
        return super()._parse_optional(_hyphenated(arg_string, self._option_string_actions))


def _hyphenated(arg_string: str, known) -> str:
    """``--foo_bar[=x]`` as ``--foo-bar[=x]`` unless the parser knows the underscore spelling itself."""
    name, sep, value = arg_string.partition("=")
    if not name.startswith("--") or "_" not in name or name in known:
        return arg_string
    return name.replace("_", "-") + sep + value


def _friendly_types(parser: argparse.ArgumentParser) -> None:
    """Swap ``type=int``/``float`` for types whose errors are a sentence, on every (sub)parser."""
    from ddplab.commands import integer, number

    for action in parser._actions:
        action.type = {int: integer, float: number}.get(action.type, action.type)
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _friendly_types(subparser)


def _fail(message: str) -> int:
    print(f"ddplab: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ddplab",
        description=(
            "See, plan, audit and measure data-parallel training with PyTorch DDP.\n\n"
            "Vocabulary: --batch-size is always the per-device (per-rank) loader batch; the global\n"
            "(effective) batch is per-device batch × devices × nodes × accumulation steps.\n"
            "Every flag may be spelled with underscores too: --world_size is --world-size."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in COMMANDS:
        importlib.import_module(f"ddplab.commands.{name}").add_parser(subparsers)
    _friendly_types(parser)
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
    except RuntimeError as exc:
        # A failed launch says which rank failed and why; the parent's own traceback adds nothing.
        launch = sys.modules.get("ddplab.launch")
        if launch is None or not isinstance(exc, launch.LaunchError):
            raise
        print(f"ddplab: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
