"""What a guest's command left behind, read by the products that ran it: the end of its log, the program's own
error in it (not its launcher's summary), and a free port for the next run. Torch-free."""

from __future__ import annotations

import os
import re
import socket

LOG_TAIL = 12
"""Lines of a run's output a failure shows by default."""
ERROR_LINE = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt)\b.*)$")
"""A traceback's last line, as Python prints it (torchrun prefixes ``[rank0]:`` to a worker's lines)."""


def tail(path: str, lines: int = LOG_TAIL) -> list[str]:
    """The last ``lines`` lines of the file at ``path`` (read from its last 16 KiB); none where it cannot be read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 16384))
            return fh.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def program_error(lines: list[str]) -> str | None:
    """The program's own exception (its traceback's last line), not the launcher's summary of it.

    >>> program_error(["Traceback (most recent call last):", '  File "train.py", line 3', "[rank0]: RuntimeError: "
    ...                "planted", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"])
    'RuntimeError: planted'
    """
    errors = [m[1] for line in lines if (m := ERROR_LINE.match(line.strip()))
              and "ChildFailedError" not in m[1] and not m[1].startswith("torch.distributed.elastic")]
    return errors[-1] if errors else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
