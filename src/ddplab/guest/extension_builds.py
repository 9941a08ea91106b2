"""A torch extension the program builds on first use (DeepSpeed's ops): said once before the build, and a lock a
killed build left behind named, not waited on in silence (what is said: :mod:`ddplab.runtime.op_builds`).

DeepSpeed's ``OpBuilder.jit_load`` is wrapped once the program imports its op builder; the note comes from the
process whose ``RANK`` is 0 (or that has none); the build itself is the program's, untouched. Torch-free but for the
wrapped call.
"""

from __future__ import annotations

import functools
import os
import sys

from ddplab.guest import imports
from ddplab.guest.patches import Patches
from ddplab.runtime import op_builds

BUILDER_MODULE = "deepspeed.ops.op_builder.builder"


def watch(patches: Patches) -> None:
    """Wrap DeepSpeed's op loading once the program imports DeepSpeed's op builder (nothing before)."""
    imports.when_imported(patches, BUILDER_MODULE, functools.partial(_patch, patches))


def _patch(patches: Patches, module) -> None:
    try:
        patches.replace(module.OpBuilder, "jit_load", _watched_jit_load)
    except Exception as exc:  # noqa: BLE001 - another DeepSpeed release: its builds go unsaid
        print(f"ddplab: not watching DeepSpeed's op builds ({type(exc).__name__}: {exc})", file=sys.stderr)


def _watched_jit_load(original):
    @functools.wraps(original)
    def jit_load(self, *args, **kwargs):
        try:
            _before_build(self.name)
        except Exception:  # noqa: BLE001, S110 - a note never stands in the program's way
            pass
        return original(self, *args, **kwargs)

    return jit_load


def _before_build(name: str) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    if os.environ.get("RANK", "0") == "0":
        op_builds.say(name, _get_build_directory(name, verbose=False))
