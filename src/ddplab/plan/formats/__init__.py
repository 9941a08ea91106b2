"""The config files people train with, read into a plan and written back: one module per format, by name.

Each format follows :class:`~ddplab.plan.formats.base.ConfigFormat`; :data:`FORMATS` is the registry
``config_format`` chooses from, and :func:`choose` detects a file's format from its name and keys.
"""

from __future__ import annotations

from ddplab.errors import literal
from ddplab.plan.formats import deepspeed, lightning, litgpt, megatron, torchtitan, transformers
from ddplab.plan.formats.base import ConfigFormat, bad, check_syntax

FORMATS: dict[str, ConfigFormat] = {format.name: format for format in (
    torchtitan.FORMAT, deepspeed.FORMAT, megatron.FORMAT, lightning.FORMAT, litgpt.FORMAT, transformers.FORMAT)}
"""Every format by its name; detection tries them in this order."""


def choose(path: str, text: str, name: str | None = None) -> ConfigFormat:
    """The format ``name`` names, else the first whose detection accepts the file."""
    if name is not None:
        if name not in FORMATS:
            raise bad(path, "", f"cannot be read as {literal(name)}: {{config_format}} takes "
                                f"{', '.join(FORMATS)}")
        return FORMATS[name]
    for format in FORMATS.values():
        if format.detect(path, text):
            return format
    check_syntax(path, text)
    raise bad(path, "", f"is of no known format: pass {{config_format}} ({', '.join(FORMATS)})")
