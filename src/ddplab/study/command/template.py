"""The user's launch command with placeholders ddplab fills per run (torch-free).

``torchrun --nproc_per_node {world_size} train.py --batch-size {per_device_batch_size} --lr {lr} --seed {seed}``:
each ``{name}`` is a quantity of the run (Python's format syntax, so ``{lr:.3g}`` and ``{{`` work). What the grid
sweeps must be a placeholder; what a run cannot express (a global batch the world does not split, accumulation the
command has no placeholder for) is refused before anything runs.

>>> template = CommandTemplate(("python", "train.py", "--lr={lr}", "--bs", "{per_device_batch_size}"))
>>> sorted(template.names)
['lr', 'per_device_batch_size']
>>> template.fill({"lr": 0.01, "per_device_batch_size": 8})
['python', 'train.py', '--lr=0.01', '--bs', '8']
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any

from ddplab.errors import UsageError, literal

PLACEHOLDERS: dict[str, str] = {
    "world_size": "ranks of one run (--world-size)",
    "per_device_batch_size": "samples per rank per micro-step",
    "accumulation_steps": "micro-steps per optimizer step",
    "global_batch_size": "per-device batch × world size × accumulation steps",
    "lr": "the run's learning rate",
    "seed": "the run's seed (0, 1, ...)",
    "run_dir": "the run's own folder (its output.log is there)",
    "beta1": "Adam's β₁", "beta2": "Adam's β₂", "eps": "Adam's eps",
    "weight_decay": "the optimizer's weight decay",
    "master_port": "a free TCP port for the run's rendezvous",
}
"""Every placeholder a command may hold, and what ddplab puts there."""
ADAM_SETTINGS = {"beta1": 0, "beta2": 1}
"""Adam's betas by placeholder, as indices into the run's betas."""


@dataclasses.dataclass(frozen=True)
class CommandTemplate:
    """The command's words, each possibly holding ``{name}`` placeholders."""

    args: tuple[str, ...]

    def __post_init__(self):
        if not self.args:
            raise UsageError("give your training command after --, e.g. ddplab study --target-loss 2.0 -- torchrun "
                             "--nproc_per_node {{world_size}} train.py --lr {{lr}} --batch-size "
                             "{{per_device_batch_size}}")
        unknown = sorted(self.names - PLACEHOLDERS.keys())
        if unknown:
            raise UsageError(f"the command holds {{{{{literal(unknown[0])}}}}}, which ddplab does not fill: the "
                             "placeholders are " + ", ".join(f"{{{{{name}}}}}" for name in PLACEHOLDERS))

    @property
    def names(self) -> set[str]:
        """The placeholders the command holds."""
        return {name for arg in self.args for name in _names(arg)}

    def fill(self, values: dict[str, Any]) -> list[str]:
        """The command of one run: each placeholder replaced by its value."""
        return [arg.format(**values) if _names(arg) or "{" in arg else arg for arg in self.args]

    def text(self) -> str:
        """The command as the user wrote it (placeholders unquoted), for the report."""
        return " ".join(self.args)


def placeholders(args: tuple[str, ...]) -> set[str]:
    """The placeholders the words ``args`` hold, whatever their names (each product says which it fills)."""
    return {name for arg in args for name in _names(arg)}


def _names(arg: str) -> set[str]:
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(arg) if field is not None]
    except ValueError as exc:
        raise UsageError(f"the command's word {literal(arg)} is no template ({literal(exc)}): write a literal brace "
                         "as {{{{ or }}}}") from None
    bad = [field for field in fields if not field.isidentifier()]
    if bad:
        raise UsageError(f"the command's word {literal(arg)} holds {{{{{literal(bad[0])}}}}}: a placeholder is a "
                         "plain name such as {{lr}}")
    return set(fields)
