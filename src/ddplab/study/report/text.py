"""The sentences a study's results are told in, the command line's and the library's alike: each rule whose batch
changes against the fixed-batch front."""

from __future__ import annotations

import math

from ddplab.text import num_or_dash


def front_lines(values: dict) -> list[str]:
    """Per rule whose batch changes: the fixed batches that beat it on both steps and samples, and where it lies
    against the tuned fit's front at its median steps, in sentences."""
    lines = []
    # A batch whose median tuned run never arrived is no point of the front.
    fixed = {p["global_batch_size"]: p["median_steps"] for p in values["tuned_lr"]
             if p["median_steps"] is not None and math.isfinite(p["median_steps"])}
    for name, entry in (values.get("adaptive") or {}).items():
        steps, samples = entry["median_steps"], entry["median_samples"]
        if steps is None:
            beaten = f": dominated by every fixed batch that did ({_batches(entry['dominated_by'])})" \
                if entry["dominated_by"] else ""
            lines.append(f"{name}: its median run did not reach the target{beaten}")
            continue
        if not fixed:
            lines.append(f"{name}: no fixed batch of the tuned sweep reached the target: no front to judge it against")
            continue
        where = f"{name} ({num_or_dash(steps)} steps, {num_or_dash(samples)} samples): "
        if entry["dominated_by"]:
            beaten = ", ".join(f"{b} ({num_or_dash(fixed[b])} steps, {num_or_dash(fixed[b] * b)} samples)"
                               for b in entry["dominated_by"])
            noun = "global batch" if len(entry["dominated_by"]) == 1 else "global batches"
            where += f"above the fixed-batch front: dominated by {noun} {beaten}"
        else:
            where += ("on or below the fixed-batch front (no fixed batch reaches the target in both fewer steps and "
                      "fewer samples)")
        lines.append(where + _versus_fit(steps, samples, entry["front_samples_at_steps"]))
    return lines


def _batches(batches: list[int]) -> str:
    return ", ".join(map(str, batches))


def _versus_fit(steps: float, samples: float, front: float | None) -> str:
    """Where a (steps, samples) point lies against the tuned fit's front, in words ("" without a fit)."""
    if front is None:
        return ""
    side = "below" if samples < front else "above" if samples > front else "on"
    return f"; {side} the tuned fit's front, which needs {num_or_dash(front)} samples at {num_or_dash(steps)} steps"
