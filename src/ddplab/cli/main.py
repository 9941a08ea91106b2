"""The ``ddplab`` console script: parse, hand off to a command module, and one error policy for all of them.

- Bad input (``UsageError``, from argparse or the library): one line, exit code 2, each field
  shown as its flag; under torchrun said once, by rank 0, unless one rank's own training raised it.
- A rank that failed (``LaunchError``): what failed and where, exit code 1.
- Ctrl-C or a cancelling signal: one line, exit code 130 (or the signal's own status).
- ``audit``'s command killed by a signal: the console script kills itself with the same signal,
  so a shell sees what it would see without ddplab in between (a loop stops on Ctrl-C).
- Anything else is a bug: its traceback, exit code 1.

Nothing here imports torch, so ``ddplab --help`` and ``ddplab plan`` answer instantly; each
command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import signal
import sys
import warnings
from collections.abc import Iterator

from ddplab.cli.args import EndedBySignal, HelpFormatter
from ddplab.cli.help import add_help_flags, unknown_flag
from ddplab.errors import DdplabWarning, LaunchError, UsageError

COMMANDS = ("sandbox", "plan", "check", "audit", "noise", "study")


class Parser(argparse.ArgumentParser):
    """argparse with one spelling policy, one error style and one help policy for every subcommand."""

    def __init__(self, *args, add_help: bool = True, **kwargs):
        # -h/--help is the short help and --help-all every flag, on every (sub)command alike.
        super().__init__(*args, add_help=False, **kwargs)
        if add_help:
            add_help_flags(self)

    def error(self, message):
        # One sentence, not argparse's usage dump; this (sub)command's --help has the rest.
        raise SystemExit(fail(f"{message} (see '{self.prog} --help')"))

    def parse_known_args(self, args=None, namespace=None):
        # A mistyped flag is named with the nearest known one, before the flags it left missing are.
        unknown = unknown_flag(self, list(args)) if args is not None and not self._subparsers else None
        if unknown:
            self.error(unknown)
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


def fail(message: str) -> int:
    print(f"ddplab: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser; a parse also carries the field-to-flag table as ``flag_names``."""
    parser = _tree()
    parser.set_defaults(flag_names=_flag_table(parser))
    return parser


def _tree() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ddplab",
        description=(
            "See, plan, audit and measure data-parallel training with PyTorch DDP.\n\n"
            "Vocabulary: --batch-size is always the per-device (per-rank) loader batch; the global\n"
            "(effective) batch is per-device batch × devices × nodes × accumulation steps, and flags\n"
            "that set it say so (--global-batch-size, --global-batch-sizes, --ref-global-batch-size).\n"
            "Every flag may be spelled with underscores too: --world_size is --world-size."),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=Parser)
    subparsers.required = True
    for name in COMMANDS:
        importlib.import_module(f"ddplab.cli.{name}").add_parser(subparsers)
    return parser


def __getattr__(name: str):
    # FLAGS is read off the parsers: built on first use, not when the console script starts.
    if name == "FLAGS":
        return flags()
    raise AttributeError(name)


@functools.cache
def flags() -> dict[str, str]:
    """{field: flag} over every subcommand's parser: the name each field an error names has on the command line."""
    return _flag_table(_tree())


def _flag_table(parser: argparse.ArgumentParser) -> dict[str, str]:
    found: dict[str, str] = {}
    for each in _parsers(parser):
        for action in each._actions:
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


def flag_error(error: UsageError) -> str:
    """A library error as the command line says it: each field as its flag."""
    return error.render(flags())


def _version() -> str:
    from ddplab import __version__

    return f"ddplab {__version__}"


def console() -> None:
    """The console script: :func:`main`, then the exit status, or death by the signal that ended the command."""
    try:
        code = main(reraise_signals=True, exiting=True)
    except EndedBySignal as exc:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(exc.signum, signal.SIG_DFL)
        os.kill(os.getpid(), exc.signum)
        code = 128 + exc.signum  # a signal whose default action is not to end the process
    raise SystemExit(code)


def main(argv: list[str] | None = None, *, reraise_signals: bool = False, exiting: bool = False) -> int:
    """Run one command; returns its exit code (128 + N where a signal N ended an audited command).

    ``exiting``: the process ends with the code returned (the console script). Under torchrun a rank other than 0
    that leaves bad input for rank 0 to say then waits for torchrun to stop it (:func:`_leave_it_to_rank_zero`);
    a caller that goes on (a test running several commands in one worker) gets the code at once.
    """
    args = build_parser().parse_args(argv)
    with _warnings_as_lines():
        try:
            return int(args.run(args) or 0)
        except EndedBySignal as exc:
            if reraise_signals:
                raise
            return 128 + exc.signum
        except UsageError as exc:
            if _said_by_rank_zero(exc):
                return _leave_it_to_rank_zero(args) if exiting else 2
            return fail(flag_error(exc) + _on_rank(exc))
        except KeyboardInterrupt:
            print("ddplab: cancelled (Ctrl-C)", file=sys.stderr)
            return 130
        except LaunchError as exc:
            # A failed launch says which rank failed and why; the parent's own traceback adds nothing.
            print(f"ddplab: {exc}", file=sys.stderr)
            return 130 if exc.kind == "cancelled" else 1


def _raised_in_torchrun_rank(exc: BaseException) -> bool:
    """Raised inside the rank function of a torchrun worker (its own training), not before it."""
    launch = sys.modules.get("ddplab.runtime.launch")
    if launch is None:  # never imported: nothing ran in a rank
        return False
    code = launch._run_in_torchrun_group.__code__
    frame = exc.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code is code:
            return True
        frame = frame.tb_next
    return False


def _said_by_rank_zero(exc: BaseException) -> bool:
    """Under torchrun every rank checks the same input before training: rank 0 says what is wrong, once.

    An error raised in a rank's own training is that rank's alone (a spec failing on rank 1 only):
    that rank says it, whichever it is.
    """
    from ddplab.runtime.launch_config import under_torchrun

    return under_torchrun() and os.environ["RANK"] != "0" and not _raised_in_torchrun_rank(exc)


def _leave_it_to_rank_zero(args: argparse.Namespace) -> int:
    """A rank other than 0 with input that rank 0 checks too: wait for torchrun to stop it, then exit code 2.

    torchrun stops every rank as soon as one exits with an error, so a rank that left at once could end rank 0
    (slower to start on a loaded machine) before it says what is wrong. Once rank 0 has said it and left, torchrun
    stops this rank. It leaves on its own after the process-group timeout (``--timeout``), as long as a rank waits for
    its peers: a rank 0 that found nothing wrong waits that long for this one to join the group.
    """
    import time

    from ddplab.runtime.launch_config import DEFAULT_TIMEOUT_S

    timeout_s = getattr(args, "pg_timeout_s", None) or DEFAULT_TIMEOUT_S
    with contextlib.suppress(KeyboardInterrupt):
        time.sleep(timeout_s)
    return 2


def _on_rank(exc: BaseException) -> str:
    from ddplab.runtime.launch_config import under_torchrun

    return f" (on rank {os.environ['RANK']})" if under_torchrun() and _raised_in_torchrun_rank(exc) else ""


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """ddplab's own warnings as one line each on stderr, the command's fields shown as flags."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DdplabWarning):
            print(f"ddplab: warning: {message}", file=sys.stderr)
        else:
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", DdplabWarning)
            yield
    finally:
        warnings.showwarning = previous


if __name__ == "__main__":
    console()
