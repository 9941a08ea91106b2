"""The command line's parsers as the tests walk them."""

import argparse


def leaves(parser, prefix=()):
    """(command path, parser) of every command that takes no subcommand, e.g. (("study",), <parser>)."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield prefix, parser
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from leaves(sub, prefix + (name,))
