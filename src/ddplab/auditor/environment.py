"""What a process's environment says about its launcher: which one started it, and which variable it lacked.

A torchrun script run as ``python train.py`` stops at its first read of ``RANK``, ``LOCAL_RANK`` or
``MASTER_ADDR`` (a KeyError of its own, or torch's env:// rendezvous). The auditor watches the exception
that ends the program (``sys.excepthook``, chained to the one it replaced, so the traceback and exit code
are what they would be) and, when one of those variables is what was missing, leaves a marker for
``ddplab audit`` to say how to launch the script.
"""

from __future__ import annotations

import functools
import os
import traceback

from ddplab.auditor import findings, state

# What torchrun sets in every process it starts.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# torch's env:// rendezvous functions that raise for a missing variable (torch.distributed.rendezvous).
_RENDEZVOUS = ("_get_env_or_raise", "_env_rendezvous_handler")


def launcher() -> str:
    """The launcher that started this process, named from the environment it set."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        return "accelerate launch" if os.environ.get("ACCELERATE_MIXED_PRECISION") is not None else "torchrun"
    for variable, name in (("OMPI_COMM_WORLD_SIZE", "mpirun"), ("PMI_SIZE", "an MPI launcher"),
                           ("SLURM_NTASKS", "srun")):
        if os.environ.get(variable) is not None:
            return name
    return "the launcher"


def watched_excepthook(original_excepthook):
    @functools.wraps(original_excepthook)
    def excepthook(exc_type, exc, tb):
        _program_ended(exc, tb)
        return original_excepthook(exc_type, exc, tb)

    return excepthook


@state.guarded("reading why the program ended")
def _program_ended(audit, exc, tb) -> None:
    variable = missing_variable(exc, tb)
    if variable is not None and audit.out_dir:
        try:
            with open(os.path.join(audit.out_dir, f"{findings.NEEDS_LAUNCHER_MARKER}{os.getpid()}.txt"), "w") as fh:
                fh.write(variable)
        except OSError:
            pass  # the audit directory is gone: the parent already reported


def missing_variable(exc, tb) -> str | None:
    """The torchrun variable whose absence ended the program, or None (also when a launcher set them)."""
    if os.environ.get("RANK") is not None or os.environ.get("WORLD_SIZE") is not None:
        return None
    if isinstance(exc, KeyError) and exc.args and exc.args[0] in TORCHRUN_VARIABLES:
        return exc.args[0]
    for frame, _ in traceback.walk_tb(tb):
        if frame.f_code.co_name in _RENDEZVOUS and "distributed" in frame.f_code.co_filename:
            named = frame.f_locals.get("env_var")
            if named in TORCHRUN_VARIABLES:
                return named
            return next((v for v in TORCHRUN_VARIABLES if os.environ.get(v) is None), None)
    return None
