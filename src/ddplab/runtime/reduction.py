"""What a data-parallel reduction does to the ranks' gradients: the sum of the W local gradients divided by D (pure).

DDP and FSDP2 average by default (D = W, the data-parallel size); a program can change that: FSDP2's
``set_gradient_divide_factor(1.0)`` sums (torchtitan with a global token count), a DDP communication hook may sum
or scale. Every judgement of how a loss is normalised asks this one description, so that a report never says
"DDP averages" of a run that sums. The divisor is read from the objects the program built
(:meth:`ddplab.runtime.strategies.base.Strategy.divide_factors`) or measured (a DDP communication hook of the
program's own, :mod:`ddplab.auditor.comm_hooks`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# A measured divisor this close to a whole number is that number (float32 sums of one bucket's elements).
SNAP = 1e-3

_NAMES = {"ddp": "DDP", "fsdp": "FSDP2", "hsdp": "HSDP", "manual": "the program's own reduction"}
# Elements of one probe agree on a divisor this closely (float32 sums against the auditor's float64).
AGREE = 1e-4


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How one model's gradients are combined over its data-parallel ranks."""

    strategy: str
    """``ddp``, ``fsdp``, ``hsdp`` (model-parallel dimensions after a '+': ``fsdp+tp``), or another engine's name."""
    data_parallel_size: int
    """W: the ranks whose gradients are combined."""
    divisor: float | None
    """D: what the sum of the W local gradients is divided by (W averages, 1 sums); None where it is unknown."""
    source: str = ""
    """Where D comes from when the program set it (``set_gradient_divide_factor(1.0)``, a comm hook's name)."""

    @property
    def known(self) -> bool:
        return self.divisor is not None

    @property
    def averages(self) -> bool:
        return self.divisor is not None and math.isclose(self.divisor, self.data_parallel_size, rel_tol=SNAP)

    @property
    def sums(self) -> bool:
        return self.divisor is not None and math.isclose(self.divisor, 1.0, rel_tol=SNAP)

    @property
    def name(self) -> str:
        """The engine's own name: DDP, FSDP2, HSDP, DeepSpeed ZeRO-2 (the mesh's other dimensions are not the
        reduction's)."""
        base = self.strategy.split("+")[0]
        if base.startswith("deepspeed-zero"):
            return f"DeepSpeed ZeRO-{base.removeprefix('deepspeed-zero')}"
        return _NAMES.get(base, base)

    @property
    def engine(self) -> str:
        """What a clean report says it checked: "no DDP mistakes", "no data-parallel mistakes" for a reduction the
        program wrote itself."""
        return "data-parallel" if self.strategy == "manual" else self.name

    def describe(self) -> str:
        """One clause a finding's message can hold: what this reduction does, in the engine's own words.

        >>> Reduction("ddp", 2, 2.0).describe()
        'DDP averages the gradients over the 2 data-parallel ranks'
        >>> Reduction("fsdp", 4, 1.0, "set_gradient_divide_factor(1.0)").describe()
        "FSDP2 sums the 4 data-parallel ranks' gradients here (set_gradient_divide_factor(1.0))"
        """
        ranks = f"{self.data_parallel_size} data-parallel ranks"
        why = f" ({self.source})" if self.source else ""
        if self.divisor is None:
            return f"{self.name} combines the gradients over the {ranks} in a way ddplab could not read{why}"
        if self.averages:
            return f"{self.name} averages the gradients over the {ranks}{why}"
        if self.sums:
            return f"{self.name} sums the {ranks}' gradients here{why}"
        return f"{self.name} divides the sum of the {ranks}' gradients by {self.divisor:g} here{why}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Reduction | None:
        if not data:
            return None
        return cls(data["strategy"], int(data["data_parallel_size"]), data.get("divisor"), data.get("source", ""))


def averaging(strategy: str, data_parallel_size: int) -> Reduction:
    """The default of DDP and FSDP2: the mean of the ranks' gradients."""
    return Reduction(strategy, data_parallel_size, float(data_parallel_size))


def measured_divisor(local_sums: list[float], reduced_sum: float) -> float | None:
    """D from linear functionals of the gradients: Σ_r f(local_r) = D · f(reduced), snapped to a whole number.

    None where the measurement says nothing (a zero functional) or the result is no plain divisor (a lossy
    compression hook).

    >>> measured_divisor([3.0, 5.0], 4.0)
    2.0
    >>> measured_divisor([3.0, 5.0], 8.0)
    1.0
    """
    total = math.fsum(local_sums)
    if reduced_sum == 0 or not math.isfinite(total) or not math.isfinite(reduced_sum):
        return None
    divisor = total / reduced_sum
    whole = round(divisor)
    if whole >= 1 and math.isclose(divisor, whole, rel_tol=SNAP):
        return float(whole)
    return None


def divisor_by_elements(probes_by_rank: dict[int, list[dict[str, Any]]], data_parallel_size: int) -> float | None:
    """D of a reduction written by hand, from the same few elements of a few gradients on every rank: each rank's
    own before its collective (``local``: shard by shard as the group's ranks receive them, one for an all-reduce)
    and where the step took them (``reduced``: its own ``shard``). D = Σ_r local_r[shard] / reduced, one number for
    every element of every probe, snapped to a whole number; None where they disagree or nothing was read.

    A probe read after the optimizer's own step (``in_step``) counts only where it gives 1 or W: an optimizer that
    updates its reduced buffer in place (a momentum blended into it) scales it by a factor of its own.

    >>> divisor_by_elements({0: [{"shard": 0, "local": [[1.0, 2.0]], "reduced": [2.0, 3.0], "in_step": False}],
    ...                      1: [{"shard": 0, "local": [[3.0, 4.0]], "reduced": [2.0, 3.0], "in_step": False}]}, 2)
    2.0
    """
    counts = {len(probes) for probes in probes_by_rank.values()}
    if len(counts) != 1 or len(probes_by_rank) < 2:
        return None
    found = []
    for index in range(counts.pop()):
        entries = [probes[index] for probes in probes_by_rank.values()]
        divisor = _probe_divisor(entries)
        if divisor is None:
            continue
        if any(e.get("in_step") for e in entries) and not any(
                math.isclose(divisor, d, rel_tol=SNAP) for d in (1.0, float(data_parallel_size))):
            continue
        found.append(divisor)
    if not found or not all(math.isclose(d, found[0], rel_tol=SNAP) for d in found):
        return None
    whole = round(found[0])
    return float(whole) if whole >= 1 and math.isclose(found[0], whole, rel_tol=SNAP) else found[0]


def _probe_divisor(entries: list[dict[str, Any]]) -> float | None:
    """One probe's D over every rank and element; None where no one number fits."""
    ratios = []
    for entry in entries:
        shard, reduced = entry["shard"], entry.get("reduced")
        locals_ = [other["local"][shard] for other in entries if shard < len(other["local"])]
        if reduced is None or len(locals_) != len(entries):
            return None
        for j, value in enumerate(reduced):
            terms = [local[j] for local in locals_ if j < len(local)]
            total, size = math.fsum(terms), max((abs(t) for t in terms), default=0.0)
            if size == 0 or abs(total) < 1e-3 * size:
                continue  # cancelling terms: float32 rounding is all that is left of them
            if value == 0:
                return None
            ratios.append(total / value)
    if not ratios or min(ratios) <= 0:
        return None
    low, high = min(ratios), max(ratios)
    return (low + high) / 2 if high - low <= AGREE * high else None
