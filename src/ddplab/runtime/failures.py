"""A rank's exception as a record, classified once, where it was raised (ddplab.errors.RankFailure).

torch gives most distributed failures no type of their own: gloo's timeout and a lost peer are
plain RuntimeErrors. They are recognised here, in the rank that holds the exception object, and
the answer travels as a field; no process ever reads another's error text.
"""

from __future__ import annotations

import os
import time
import traceback

import torch.distributed as dist

from ddplab.errors import RankFailure, SpecError, UsageError

# In DDP's error when a parameter got no gradient and find_unused_parameters was off.
UNUSED_PARAMETERS_MARK = "find_unused_parameters"
# gloo and NCCL say so in words only: a collective that timed out or lost its peer.
_COLLECTIVE_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")
_DISTRIBUTED_DIR = os.path.join("torch", "distributed") + os.sep


def record(rank: int, exc: BaseException) -> RankFailure:
    """The record of ``exc`` raised on ``rank`` (call inside the ``except`` that caught it)."""
    usage = exc.template if isinstance(exc, UsageError) else None
    return RankFailure(rank=rank, exc_type=_qualified(type(exc)), message=str(exc), traceback=traceback.format_exc(),
                       collective=in_collective(exc), time=time.time(), usage=usage,
                       spec_error=isinstance(exc, SpecError), unused_parameters=unused_parameters(exc))


def in_collective(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing (timed out, peer gone): the symptom of another rank's failure."""
    if isinstance(exc, getattr(dist, "DistError", ())) and not isinstance(exc, getattr(dist, "DistStoreError", ())):
        return True
    if not isinstance(exc, RuntimeError) or isinstance(exc, UsageError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    raised_in_c10d = bool(frames) and _DISTRIBUTED_DIR in frames[-1].filename
    text = str(exc).lower()
    return raised_in_c10d or any(word in text for word in _COLLECTIVE_WORDS)


def unused_parameters(exc: BaseException) -> bool:
    """Whether ``exc`` (or the error it was raised from) is DDP refusing a step because a parameter got no gradient."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and UNUSED_PARAMETERS_MARK in str(exc):
            return True
        exc = exc.__cause__
    return False


def _qualified(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
