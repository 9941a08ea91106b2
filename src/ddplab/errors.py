"""ddplab's one error policy: bad input is a UsageError, a failed rank a LaunchError; anything else is a bug.

A UsageError names what to change by its *field*, written ``{name}`` in its template
(``"{reference.lr} must be a positive number, got 0"``). ``str(error)`` shows the field's Python
name, as a library user wrote it; the command line renders the same template with its flags
(``--ref-lr must be ...``) from one table, ``ddplab.cli.main.FLAGS``. Text that is not a field
(a path, another program's message) goes through :func:`literal` so its braces stay braces.

A rank's failure crosses the process boundary as a :class:`RankFailure` record (the model is torch
elastic's error file): exception type, message, traceback, whether it failed inside a collective,
and a UsageError's template when the rank's error was bad input. Nothing parses error text.

Torch-free: the command line imports this to build its parser.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

# A field: a dotted name, optionally with a value ("{plots=False}", shown as --no-plots on the command line).
_TOKEN = re.compile(r"\{\{|\}\}|\{([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*(?:=[A-Za-z0-9_]+)?)\}")


def literal(text: str) -> str:
    """``text`` for a UsageError template, shown as it is (its braces are not fields)."""
    return str(text).replace("{", "{{").replace("}", "}}")


def render(template: str, names: Mapping[str, str] | None = None) -> str:
    """``template`` with each ``{field}`` shown as ``names[field]`` (by default its own name), ``{{``/``}}`` as braces.

    Library prose that names fields (an error, a plan's reasons) is such a template: a Python
    caller reads field names, the command line reads its flags.
    """
    names = names or {}

    def show(match: re.Match) -> str:
        if match[1] is None:
            return match[0][0]
        return names.get(match[1], match[1])

    return _TOKEN.sub(show, template)


class UsageError(ValueError):
    """Bad input, in one sentence that says what to change (exit code 2 on the command line)."""

    def __init__(self, template: str):
        self.template = template
        super().__init__(self.render())

    @property
    def fields(self) -> list[str]:
        """The fields the sentence names, in order."""
        return [match[1] for match in _TOKEN.finditer(self.template) if match[1]]

    def render(self, names: Mapping[str, str] | None = None) -> str:
        """The sentence, each field shown as ``names[field]`` (by default its own name)."""
        return render(self.template, names)

    def __reduce__(self):
        # Pickled (a spawned rank's record, a result file) as its template, not its rendered text.
        return type(self), (self.template,)


class SpecError(UsageError):
    """A spec file failed or broke its contract; the sentence names the file and the function."""


class DdplabWarning(UserWarning):
    """Something the user should know that does not stop the command (the command line prints one line)."""


FailureKind = Literal["raised", "died", "stopped_answering", "deadline", "cancelled"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFailure:
    """What one rank's failure was, recorded where it happened."""

    rank: int
    exc_type: str
    """Qualified name of the exception class, e.g. 'ValueError' or 'ddplab.errors.SpecError'."""
    message: str
    traceback: str
    collective: bool
    """Raised inside a collective (timed out, or a peer went away): a symptom of another rank's failure."""
    time: float
    """When it was raised (time.time()), to tell the first failure from its consequences."""
    usage: str | None = None
    """The template of a UsageError (or SpecError) raised in the rank: bad input, not a crash."""
    spec_error: bool = False
    """The UsageError was a SpecError."""
    unused_parameters: bool = False
    """DDP refused a step because some parameter got no gradient (find_unused_parameters was off)."""

    def usage_error(self) -> UsageError | None:
        """The rank's bad-input error, rebuilt in this process; None for a crash."""
        if self.usage is None:
            return None
        kind = SpecError if self.spec_error else UsageError
        return kind(f"{self.usage} (on rank {self.rank})")


class LaunchError(RuntimeError):
    """A rank raised, died or stopped answering, the launch outlived its deadline, or it was cancelled.

    ``kind`` says which; ``rank`` is the rank to blame (None when there is none); ``failure`` is that
    rank's record when it raised; ``partial`` maps a rank to the last object it checkpointed, so a
    caller can report what was measured before the run stopped.
    """

    def __init__(self, message: str, *, kind: FailureKind, rank: int | None = None,
                 failure: RankFailure | None = None, partial: dict[int, Any] | None = None):
        super().__init__(message)
        self.kind, self.rank, self.failure = kind, rank, failure
        self.partial = partial or {}
