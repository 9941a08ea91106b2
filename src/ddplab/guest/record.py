"""Each process's record of what it measured: one JSON line per event, appended to a file of its own.

No collective and no store: every rank writes its own file as each measured step ends, so a run killed by
Ctrl-C, a deadline or a failing rank keeps every step finished before; ``ddplab noise`` merges the files after
the command has ended (:mod:`ddplab.noise.command.merge`). Torch-free.

Kinds of line: ``model`` (the data-parallel model found: strategy, rank, its group), ``step`` (one measured
optimizer step: samples, the two squared norms, the class-index loss's targets and tokens, the guest's own time),
``note`` (why the guest disarmed), ``end`` (optimizer steps counted when the process exited).
"""

from __future__ import annotations

import json
import os

PREFIX = "noise-"
ENV_DIR = "DDPLAB_AUDIT_DIR"
"""The environment variable naming the folder every guest of a command writes its records to."""


def append(out_dir: str, line: dict, prefix: str = PREFIX) -> None:
    """Append one event to this process's file; a folder already gone (the parent reported) is no error."""
    path = os.path.join(out_dir, f"{prefix}{os.getpid()}.jsonl")
    try:
        with open(path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
    except OSError:
        pass


def read_all(out_dir: str, prefix: str = PREFIX) -> list[dict]:
    """Every event every process wrote, file by file; a line cut short by a kill is left out."""
    events = []
    for name in sorted(os.listdir(out_dir)):
        if name.startswith(prefix) and name.endswith(".jsonl"):
            with open(os.path.join(out_dir, name)) as fh:
                events += [event for event in map(_parse, fh) if event is not None]
    return events


def _parse(line: str) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:
        return None
