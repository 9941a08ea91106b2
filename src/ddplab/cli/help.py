"""Help that fits a screen: ``-h``/``--help`` short, ``--help-all`` every flag; an unknown flag names the nearest.

The short help of a subcommand is its description's opening (what it does), the flags in :data:`COMMON`,
the first two of its examples and the manual's page; ``--help-all`` prints argparse's full help, as
``python --help-all`` does. A command absent from :data:`COMMON` prints its full help for both.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import re

COMMON: dict[str, tuple[str, ...]] = {
    # The flags a first run needs, per subcommand (its prog without "ddplab "); --help-all lists the rest.
    "plan": ("--ref-batch-size", "--ref-lr", "--optimizer", "--devices", "--nodes", "--batch-size",
             "--global-batch-size", "--keep", "--dataset-size", "--epochs", "--json"),
    "study": ("SPEC.py", "--workload", "--target-accuracy", "--target-loss", "--global-batch-sizes", "--rules",
              "--ref-lr", "--seeds", "--out", "--executor", "--json"),
    "check": ("SPEC.py", "--world-size", "--global-batch-size", "--batch-size", "--steps", "--strategy", "--strict",
              "--json"),
    "noise": ("SPEC.py", "--world-size", "--batch-size", "--steps", "--json", "--plot"),
    "audit": ("--steps", "--json", "--strict", "COMMAND"),
    "sandbox single": ("--batch-size", "--noisy", "--lr", "--json"),
    "sandbox multi": ("--world-size", "--batch-size", "--noisy", "--bypass-ddp", "--json"),
    "sandbox table": ("--seed", "--json"),
}
SYNONYMS: dict[str, tuple[str, ...]] = {
    # Other tools' words for ddplab's flags, tried before spelling: difflib cannot see that --gpus means --devices.
    "--gpus": ("--devices", "--world-size"), "--num-gpus": ("--devices", "--world-size"),
    "--nproc-per-node": ("--devices", "--world-size"), "--num-processes": ("--world-size", "--devices"),
    "--nnodes": ("--nodes",), "--num-nodes": ("--nodes",), "--lr": ("--ref-lr",),
    "--global-batch": ("--global-batch-size", "--global-batch-sizes"),
}
EXAMPLES_SHOWN = 2
BRIEF_MIN = 12
"""A flag's short help is its help up to the first clause that ends after this many characters."""
INTRO_LINES = 4
"""The description's first paragraph is shown whole up to this many lines, else its first sentence."""


class ShortHelp(argparse.Action):
    """``-h``/``--help``: the short help (the full one where the command has none)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(short_help(parser) or parser.format_help(), end="")
        parser.exit()


class FullHelp(argparse.Action):
    """``--help-all``: every flag, argparse's own help."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.print_help()
        parser.exit()


def add_help_flags(parser: argparse.ArgumentParser) -> None:
    """``-h``/``--help`` and ``--help-all`` on ``parser`` (built with ``add_help=False``)."""
    short = "a short help: what it does, the common flags, examples" if _key(parser) in COMMON else \
        "show this help and exit"
    parser.add_argument("-h", "--help", action=ShortHelp, nargs=0, default=argparse.SUPPRESS, help=short)
    parser.add_argument("--help-all", action=FullHelp, nargs=0, default=argparse.SUPPRESS,
                        help="every flag, with its default")


def _key(parser: argparse.ArgumentParser) -> str:
    return parser.prog.partition(" ")[2]


def short_help(parser: argparse.ArgumentParser) -> str | None:
    """What the command does, its common flags, two examples and where to read on; None without a COMMON entry."""
    common = COMMON.get(_key(parser))
    if common is None:
        return None
    formatter = parser._get_formatter()
    formatter.add_text(_intro(parser.description or ""))
    formatter.start_section("common flags")
    formatter.add_arguments([_briefly(action_for(parser, flag)) for flag in common])
    formatter.end_section()
    examples = "\n".join(examples_of(parser.description or "")[:EXAMPLES_SHOWN])
    page = f"docs/commands/{_key(parser).split()[0]}.md"
    return (f"usage: {_usage(parser)}\n\n{formatter.format_help()}\nexamples:\n{examples}\n\n"
            f"every flag: {parser.prog} --help-all; the manual: {page}\n")


def action_for(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    """The action behind an option string or a positional's metavar."""
    for action in parser._actions:
        if flag in action.option_strings or (not action.option_strings and flag in (action.metavar, action.dest)):
            return action
        if not action.option_strings and isinstance(action.metavar, str) and flag in action.metavar.split():
            return action
    raise KeyError(f"{parser.prog} has no flag {flag}")


def _briefly(action: argparse.Action) -> argparse.Action:
    """A copy of ``action`` whose help is its first clause and its default: --help-all has the rest."""
    text = action.help or ""
    if text.startswith("the same as ") and ": " in text:  # a negation: what it does, not which flag it negates
        text = text.partition(": ")[2]
    cut = re.search(r"(: |; | \()", text[BRIEF_MIN:])
    brief = text if cut is None else text[:BRIEF_MIN + cut.start()]
    if brief.count("(") > brief.count(")"):  # cut inside a remark: drop the remark
        brief = brief[:brief.rfind("(")].rstrip()
    # A value the first clause gives itself beats a later default (noise's --steps: a command's 40, a spec's 200).
    default = re.match(r" \(([^;()]* unless given)\)", text[len(brief):]) or \
        re.search(r"[(;] ?(default:? [^;()]*)[;)]", text)
    action = copy.copy(action)
    action.help = brief + (f" ({default[1]})" if default and default[1] not in brief else "")
    return action


def _usage(parser: argparse.ArgumentParser) -> str:
    """The prog, the flags it requires, [FLAGS], then its positionals."""
    required, positionals = [], []
    for action in parser._actions:
        if action.option_strings and action.required:
            required.append(f"{action.option_strings[0]} {action.metavar or action.dest.upper()}")
        elif not action.option_strings:
            name = action.metavar or action.dest
            positionals.append(name if action.nargs in (None, argparse.REMAINDER) else f"[{name}]")
    command = ["[-- COMMAND ARGS...]"] if getattr(parser, "takes_command", False) else []
    return " ".join([parser.prog, *required, "[FLAGS]", *positionals, *command])


def _intro(description: str) -> str:
    """The description's first paragraph, or its first sentence where the paragraph is long."""
    paragraph = description.strip().split("\n\n")[0]
    if paragraph.endswith(":"):  # it introduces a list the short help leaves out
        paragraph = paragraph[:-1] + " (--help-all lists them)."
    if paragraph.count("\n") < INTRO_LINES:
        return paragraph
    return re.split(r"(?<=\.)\s+(?=[A-Z-])", paragraph, maxsplit=1)[0]


def examples_of(description: str) -> list[str]:
    """The examples under ``examples:``, one entry per command (continuation lines kept with theirs)."""
    block = description.partition("\nexamples:\n")[2].split("\n\n")[0]
    out: list[str] = []
    for line in block.splitlines():
        if out and (out[-1].endswith("\\") or line.startswith("    ")):
            out[-1] += "\n" + line
        elif line.strip():
            out.append(line)
    return out


def unknown_flag(parser: argparse.ArgumentParser, arg_strings: list[str]) -> str | None:
    """The first flag ``parser`` does not know, with the nearest it does; None when every flag is known."""
    known = parser._option_string_actions
    remainder = any(action.nargs == argparse.REMAINDER for action in parser._actions)
    takes_value = False
    for token in arg_strings:
        if token == "--":
            return None
        if takes_value or not token.startswith("-") or token == "-" or parser._negative_number_matcher.match(token):
            if remainder and not takes_value:
                return None  # the command a REMAINDER positional takes has flags of its own
            takes_value = False
            continue
        name, equals, _ = token.partition("=")
        action = _known(name, known)
        if action is None:
            return _unrecognized(name, parser)
        takes_value = not equals and action.nargs is None
    return None


def _known(name: str, known: dict) -> argparse.Action | None:
    """The action ``name`` means: itself, its hyphenated spelling, or the one option it abbreviates."""
    for spelling in (name, name.replace("_", "-") if name.startswith("--") else name):
        if spelling in known:
            return known[spelling]
    matches = [option for option in known if option.startswith(name) and name.startswith("--")]
    return known[matches[0]] if len(matches) == 1 else None


def _unrecognized(name: str, parser: argparse.ArgumentParser) -> str:
    hint = nearest(name, [option for option in parser._option_string_actions if option.startswith("--")])
    return f"unrecognized arguments: {name}" + (f"; did you mean {hint}?" if hint else "")


def nearest(flag: str, options: list[str]) -> str | None:
    """The option a mistyped ``flag`` most likely meant: a known synonym, else the closest spelling."""
    spelled = "--" + flag.lstrip("-").replace("_", "-")
    for synonym in SYNONYMS.get(spelled, ()):
        if synonym in options:
            return synonym
    # Compared without the dashes every flag shares, so --gpus is not "close" to --pp.
    bare = {option[2:]: option for option in options}
    close = difflib.get_close_matches(spelled[2:], list(bare), n=1, cutoff=0.6)
    return bare[close[0]] if close else None

