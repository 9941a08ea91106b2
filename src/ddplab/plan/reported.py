"""The reference run a ddplab report measured (a noise report, a study), completed by the flags (no torch).

A report says what it ran: its world size, per-device batch, accumulation steps, global batch, and the lr where it
saw one. Those are the reference's fields unless a flag gives them; a flag wins, and each flag that contradicts the
report is a warning, so a plan never silently mixes a run's B_simple with another run's batch.

>>> reported = Reported(source="noise.json", fields={"per_device_batch_size": 8, "accumulation_steps": 1,
...                                                  "global_batch_size": 16, "lr": 0.1}, world_size=2)
>>> reference, warnings = reported.merge({"lr": 0.2})
>>> reference.per_device_batch_size, reference.devices, reference.lr
(8, 2, 0.2)
>>> warnings
('{reference.lr} 0.2 contradicts noise.json (0.1): the plan takes {reference.lr}',)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ddplab.errors import UsageError, literal
from ddplab.plan.inputs import Reference

BATCH = ("per_device_batch_size", "accumulation_steps", "global_batch_size")
DEGREES = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")
OPTIMIZER_SETTINGS = ("betas", "eps", "weight_decay")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reported:
    """What a report says of the run it measured, as ``Reference`` fields."""

    source: str
    """The report as a sentence names it (its path)."""
    fields: dict[str, Any]
    """The ``Reference`` fields the report gives: its batch, lr and optimizer, where it says them."""
    world_size: int | None = None
    """The ranks that ran, where the report says."""
    data_parallel_size: int | None = None
    """The ranks of those that loaded their own samples (the world size unless the run had a device mesh)."""

    def merge(self, given: Mapping[str, Any]) -> tuple[Reference, tuple[str, ...]]:
        """The reference the flags in ``given`` and the report make (the flags win), and a warning template for
        each flag that contradicts the report."""
        fields = dict(given)
        reported = self._reported_for(given)
        warnings = [self._contradiction(name, given[name], value) for name, value in reported.items()
                    if name in given and not _same(given[name], value)]
        fields |= {name: value for name, value in reported.items() if name not in BATCH and name not in given}
        warnings += self._world(given, fields)
        self._batch(given, fields)
        reference = Reference(**fields)
        measured = self.fields.get("global_batch_size")
        if measured is not None and reference.global_batch_size != measured and not warnings:
            warnings.append(f"the flags make the reference's global batch {reference.global_batch_size} and "
                            f"{literal(self.source)} measured {measured}: the plan takes the flags'")
        return reference, tuple(warnings)

    def _reported_for(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The report's fields, less its optimizer's settings where the flags name another optimizer."""
        optimizer = self.fields.get("optimizer")
        if optimizer is None or given.get("optimizer", optimizer) == optimizer:
            return self.fields
        return {name: value for name, value in self.fields.items() if name not in OPTIMIZER_SETTINGS}

    def _contradiction(self, name: str, flag: Any, value: Any) -> str:
        return (f"{{reference.{name}}} {_show(flag)} contradicts {literal(self.source)} ({_show(value)}): the plan "
                f"takes {{reference.{name}}}")

    def _world(self, given: Mapping[str, Any], fields: dict[str, Any]) -> list[str]:
        """Devices and nodes from the report's world where the flags leave them; a warning where they differ."""
        world = self.world_size
        if world is None:
            return []
        if (self.data_parallel_size or world) != world and not any(name in given for name in DEGREES):
            raise UsageError(f"{literal(self.source)} ran {world} ranks, {self.data_parallel_size} of them "
                             "data-parallel: give the reference's {reference.tensor_parallel_size}, "
                             "{reference.pipeline_parallel_size} and {reference.context_parallel_size}")
        devices, nodes = given.get("devices"), given.get("nodes")
        if devices is None and nodes is None:
            fields["devices"] = world
        elif devices is None and world % nodes == 0:
            fields["devices"] = world // nodes
        elif nodes is None and devices is not None and world % devices == 0:
            fields["nodes"] = world // devices
        ranks = fields.get("devices", 1) * fields.get("nodes", 1)
        if ranks == world:
            return []
        return [f"{{reference.devices}} × {{reference.nodes}} = {ranks} ranks contradicts {literal(self.source)}, "
                f"which ran on {world}: the plan takes the flags"]

    def _batch(self, given: Mapping[str, Any], fields: dict[str, Any]) -> None:
        """The report's per-device batch and accumulation, unless the flags give the reference's batch by its global
        size; its global batch only where no per-device batch derives one."""
        by_global = "global_batch_size" in given and "per_device_batch_size" not in given
        for name in ("per_device_batch_size", "accumulation_steps"):
            if name in self.fields and name not in given and not by_global:
                fields[name] = self.fields[name]
        if "per_device_batch_size" not in fields and "global_batch_size" in self.fields and not by_global:
            fields["global_batch_size"] = self.fields["global_batch_size"]


def positive_whole(source: str, report: Mapping[str, Any], key: str) -> int | None:
    """A report's key as a positive whole number (None where absent); UsageError naming the key where it is not one."""
    value = report.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise UsageError(f"{literal(source)} holds {key} {literal(repr(value))}, not a positive whole number: give a "
                         "report ddplab wrote")
    return int(value)


def _same(flag: Any, value: Any) -> bool:
    if isinstance(flag, (int, float)) and isinstance(value, (int, float)):
        return math.isclose(flag, value, rel_tol=1e-9)
    if isinstance(flag, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(flag) == len(value) and all(_same(a, b) for a, b in zip(flag, value))
    return flag == value


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(_show, value))
    return f"{value:g}" if isinstance(value, float) else literal(str(value))
