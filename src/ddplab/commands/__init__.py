"""One module per ddplab subcommand: ``add_parser`` declares flags, ``run`` does the work.

Modules import torch inside ``run`` only, so building the parser stays instant.
"""

from __future__ import annotations

import argparse


def parse_bool(text: str) -> bool:
    """Accept the classic spellings: True/False, yes/no, 1/0."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value
