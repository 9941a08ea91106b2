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

_NAMES = {"ddp": "DDP", "fsdp": "FSDP2", "hsdp": "HSDP"}


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
