"""Results float32 rounding can move: runs whose outcome sits on a stop rule's edge, and the fit with them flipped.

Two runs of the same seed on two machines (or two engines) differ by rounding alone, and in float32 that grows
over a training. Where a run ends on the edge of a stop rule — stalled while its sibling seeds reached, or reached
after a plateau nearly as long as the stall rule's patience, or within a tenth of the step budget — a rounding
change can turn it over. The study cannot rerun it on another machine's kernels, so it measures what such a turn
would do: every edge run flipped (a stalled run reaching at its siblings' median steps, a late arrival not
reaching), the fit is taken again, and a B_crit the flip moves outside its own interval is said with both values.
Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import math

from ddplab.study import fit
from ddplab.study.config import StudyConfig
from ddplab.study.runs import RunResult, longest_plateau, steps

NEAR_PATIENCE = 0.5
"""A run that reached after a plateau of at least this share of the stall rule's patience was near its edge."""
NEAR_BUDGET = 0.9
"""A run that reached past this share of ``max_steps`` was near the budget's edge."""


@dataclasses.dataclass(frozen=True)
class EdgeRun:
    """One run whose outcome a rounding change could turn over, and what it is taken as when flipped."""

    run: RunResult
    why: str
    flipped_steps: float
    """Its steps to the target if the outcome turned (inf: a late arrival that no longer arrives)."""

    def to_json(self) -> dict:
        return {"global_batch_size": self.run.global_batch_size, "lr": self.run.lr, "seed": self.run.seed,
                "why": self.why, "flipped_steps": None if math.isinf(self.flipped_steps) else self.flipped_steps}


def edge_runs(config: StudyConfig, seeds: list[RunResult]) -> list[EdgeRun]:
    """The runs among one setting's ``seeds`` that ended on a stop rule's edge."""
    reached = [steps(r) for r in seeds if r.steps_to_target is not None]
    out = []
    for run in seeds:
        if run.steps_to_target is None and not run.diverged and not run.failed and reached:
            how = "stalled" if run.stalled else "ran out of steps"
            out.append(EdgeRun(run, f"{how} while {len(reached)} of its {len(seeds)} seeds reached",
                               fit.median(reached)))
        elif run.steps_to_target is not None:
            why = _near_edge(config, run)
            if why:
                out.append(EdgeRun(run, why, math.inf))
    return out


def _near_edge(config: StudyConfig, run: RunResult) -> str | None:
    plateau = longest_plateau(config, run.history)
    if config.patience and plateau >= NEAR_PATIENCE * config.patience:
        return f"reached after {plateau} evaluations without improving (the stall rule stops at {config.patience})"
    if run.steps_to_target >= NEAR_BUDGET * config.max_steps:
        return f"reached at step {run.steps_to_target} of its {config.max_steps}-step budget"
    return None


def reading(fitted: dict | None) -> str:
    """A fit as the report reads it: a value with its interval, a bound, undefined, or none."""
    if fitted is None:
        return "no fit (fewer than two batches reached)"
    if "undefined" in fitted:
        return "undefined (steps do not fall as the batch grows)"
    if "bound" in fitted:
        return fit.bound_reading(fitted["bound"])
    low, high = fitted["b_crit_ci95"]
    return f"B_crit {fitted['b_crit']:.3g} [{low:.3g}, {high:.3g}]"


def moved(fitted: dict | None, flipped: dict | None) -> bool:
    """The flip changes what the fit says: its kind (value, bound, none) or a value outside the first's interval."""
    kind = _kind(fitted)
    if kind != _kind(flipped):
        return True
    if kind != "value":
        return kind == "bound" and fitted["bound"] != flipped["bound"]
    low, high = fitted["b_crit_ci95"]
    if not (math.isfinite(low) and math.isfinite(high)):
        return not math.isclose(fitted["b_crit"], flipped["b_crit"], rel_tol=1e-6)
    return not low * (1 - 1e-9) <= flipped["b_crit"] <= high * (1 + 1e-9)


def _kind(fitted: dict | None) -> str:
    if fitted is None:
        return "none"
    return "undefined" if "undefined" in fitted else "bound" if "bound" in fitted else "value"


TURNS = {"reaching": "the runs that did not arrive reaching", "not reaching": "the late arrivals not reaching"}
"""The two ways edge runs turn, each taken alone: turned together they can cancel (at one batch, a stalled seed
reaching while a late sibling stalls leaves its median where it was)."""


def turn(edge: EdgeRun) -> str:
    """Which way ``edge`` turns: into reaching the target, or into not reaching it."""
    return "not reaching" if math.isinf(edge.flipped_steps) else "reaching"


def flipped_steps(by_batch: dict[int, list[RunResult]], edges: list[EdgeRun]) -> dict[int, list[float]]:
    """Each batch's seeds' steps with every one of ``edges`` turned over."""
    turned = {id(edge.run): edge.flipped_steps for edge in edges}
    return {b: [turned.get(id(run), steps(run)) for run in seeds] for b, seeds in by_batch.items()}


def rounding_warning(rule: str, edges: list[EdgeRun], fitted: dict | None, turned: dict[str, dict | None]) -> str:
    """The sentence for a fit that a rounding change at its edge runs would move; ``turned`` holds, per way of
    turning that moves it, the fit it gives."""
    named = "; ".join(f"global batch {e.run.global_batch_size}, lr {e.run.lr:g}, seed {e.run.seed} {e.why}"
                      for e in edges[:4]) + (f"; and {len(edges) - 4} more" if len(edges) > 4 else "")
    ways = "; ".join(f"with {TURNS[way]}, {reading(flipped)}" for way, flipped in turned.items())
    return (f"rule {rule}: its fit rests on runs float32 rounding can turn over ({named}): {ways}, instead of "
            f"{reading(fitted)}. Another machine's kernels or the other engine can move the result that far, so "
            "read none of these as measured; --patience 0 runs every seed to --max-steps, and more --seeds make one "
            "run's outcome matter less")
