"""The verdict on two runs of one command: the same computation, rounding, or a difference and its cause (torch-free).

The verdicts are check's own (EQUIVALENT, ROUNDING, DIVERGES), and a cause has the audit's name where the audit
names the same thing: a gradient exactly 1/W of the one process's is SUM_REDUCTION, whatever made the loss; a
gradient that differs between the ranks at the step is NO_ALLREDUCE; updates that differ while the gradients agree
are the learning rate's (LR_SCALED_BY_WORLD_SIZE when by the world size). Where the numbers show a difference but no
rule of their own names it, the audit's finding on the same run names it, said as the audit's.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Literal

from ddplab.check.command.compare import Comparison, Parameter, compare, module_of
from ddplab.check.command.config import BUCKETS, CommandCheckConfig

Verdict = Literal["EQUIVALENT", "ROUNDING", "DIVERGES", "INCOMPARABLE"]
# Within this of 1, a cosine says the two gradients point the same way (a pure scale).
SAME_DIRECTION = 1e-6
# Within this relative distance, a ratio is the simple fraction named.
SAME_RATIO = 1e-3
HALF_TYPES = ("float16", "bfloat16")
# The audit's findings that say why a gradient differs, in the order they are preferred as the named cause.
GRADIENT_FINDINGS = ("NO_ALLREDUCE", "SUM_REDUCTION", "GLOBAL_COUNT_WITHOUT_WORLD_SIZE", "DIVIDE_FACTOR",
                     "GATHERED_LOSS_WITHOUT_WORLD_SIZE", "ACCUMULATION_DIVIDED_TWICE", "GATHERED_TERMS_MISSING",
                     "LOSS_NORMALISED_PER_DEVICE", "LOSS_NORMALISED_PER_MICRO_BATCH", "ACCUMULATION_NOT_DIVIDED",
                     "BATCHNORM_NOT_SYNCED", "LR_SCALED_BY_WORLD_SIZE", "SAME_DATA_ON_ALL_RANKS")


@dataclasses.dataclass(frozen=True)
class Close:
    """How near a cosine must be to 1, and a ratio to a simple fraction, to be called a pure scale."""

    direction: float
    ratio: float

    @classmethod
    def of(cls, tolerance: float) -> Close:
        # Half precision's rounding moves both: the square of its tolerance off 1, a fifth of it off the fraction.
        return cls(direction=max(SAME_DIRECTION, tolerance ** 2), ratio=max(SAME_RATIO, tolerance / 5))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepComparison:
    """One optimizer step on the two sides."""

    step: int
    gradient: Comparison
    update: Comparison
    modules: dict[str, Comparison]
    parameters: dict[str, Comparison]
    agrees: bool

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, **self.gradient.to_json(),
                "update": self.update.to_json(), "agrees": self.agrees,
                "modules": {name: c.to_json() for name, c in self.modules.items()},
                "parameters": {name: c.to_json() for name, c in self.parameters.items()}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleCheck:
    """Whether the two sides' first global batches were the same samples (DistributedSampler's indices)."""

    compared: bool
    same: bool
    shared: int = 0
    size: int = 0
    how: str | None = None
    """``indices`` (DistributedSampler's) or ``inputs`` (fingerprints of the samples the forwards took)."""
    ranks_inconsistent: bool = False
    """The ranks themselves drew inconsistently: samplers seeded differently, or a sample on two ranks."""
    why: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Judgement:
    verdict: Verdict
    cause: str | None
    explanation: str
    tolerance: float
    first_divergent_step: int | None
    steps: list[StepComparison]
    notes: list[str]


def tolerance_for(config: CommandCheckConfig, params: list[Parameter], autocast: bool) -> tuple[float, bool]:
    """(the relative difference called equal, whether the program computes in half precision)."""
    half = autocast or any(p.dtype in HALF_TYPES for p in params)
    if config.tolerance is not None:
        return config.tolerance, half
    if half:
        return 5e-2, True
    return (1e-9 if all(p.dtype == "float64" for p in params) else 1e-4), False


def by_step(merged: dict[tuple[int, int], dict[str, Parameter]]) -> dict[int, dict[str, Parameter]]:
    """Step number → every optimizer's parameters at that step."""
    steps: dict[int, dict[str, Parameter]] = defaultdict(dict)
    for (_, step), params in merged.items():
        steps[step].update(params)
    return dict(sorted(steps.items()))


def update_tolerance(tolerance: float) -> float:
    """The relative update difference called equal: a float32 parameter's update carries its own rounding."""
    return max(tolerance, 1e-2)


def compare_step(step: int, ranks: dict[str, Parameter], one: dict[str, Parameter], tolerance: float,
                 by_updates: bool = False) -> StepComparison:
    """One step on both sides; ``by_updates``: judged by the updates alone (each rank's .grad was its own)."""
    keys = [k for k in ranks if k in one]
    grads = compare([ranks[k].grad for k in keys], [one[k].grad for k in keys], _exact(ranks, keys))
    updates = compare([ranks[k].update for k in keys], [one[k].update for k in keys], _exact(ranks, keys))
    groups: dict[str, list[str]] = defaultdict(list)
    for k in keys:
        groups[module_of(ranks[k].name, k)].append(k)
    modules = {name: compare([ranks[k].grad for k in ks], [one[k].grad for k in ks], _exact(ranks, ks))
               for name, ks in groups.items()}
    parameters = {ranks[k].name or k: compare([ranks[k].grad], [one[k].grad], _exact(ranks, [k])) for k in keys}
    agrees = _within(updates, update_tolerance(tolerance)) and (by_updates or _within(grads, tolerance))
    return StepComparison(step=step, gradient=grads, update=updates, modules=modules, parameters=parameters,
                          agrees=agrees)


def _exact(params: dict[str, Parameter], keys: list[str]) -> bool:
    return all(math.prod(params[k].shape) <= BUCKETS for k in keys)


def _within(comparison: Comparison, tolerance: float) -> bool:
    return comparison.difference is None or comparison.difference <= tolerance


def start_difference(ranks: dict[str, Parameter], one: dict[str, Parameter]) -> float:
    """Relative difference of the parameters the two sides start from."""
    keys = [k for k in ranks if k in one]
    comparison = compare([ranks[k].param_before for k in keys], [one[k].param_before for k in keys], True)
    return comparison.difference or 0.0


def judge(config: CommandCheckConfig, steps: list[StepComparison], tolerance: float, half: bool, *,
          start: float, replicas: float, samples: SampleCheck, audit_codes: list[str],
          dropout: float, by_updates: bool = False) -> Judgement:
    """The verdict over the compared steps, with its cause and the notes the user needs to read it.

    ``by_updates``: the ranks' .grad differed at the step while their updates agreed (an optimizer that reduces into
    buffers of its own): the steps are judged by their updates."""
    notes = _notes(samples, dropout, half, tolerance)
    if by_updates:
        notes.append("each rank's .grad still held its own gradient at the step while the ranks made the same update: "
                     "the optimizer reduces the gradients into buffers of its own, so the steps are compared by "
                     "their updates")
    first = next((s.step for s in steps if not s.agrees), None)
    common = {"tolerance": tolerance, "steps": steps, "notes": notes}
    if start > tolerance:
        return Judgement(verdict="DIVERGES", cause="INITIALISATION", first_divergent_step=0,
                         explanation=f"the two runs start from different parameters (relative difference "
                                     f"{start:.2e}): seed the model's initialisation the same in every run (DDP "
                                     "broadcasts rank 0's, FSDP2 does not), or nothing after it can be compared",
                         **common)
    if first is None:
        return _agreement(config, steps, tolerance, half, audit_codes, common, by_updates)
    if samples.compared and not samples.same and not samples.ranks_inconsistent:
        return Judgement(verdict="INCOMPARABLE", cause="SAMPLES_DIFFER", first_divergent_step=first,
                         explanation=f"the one process trained on another first batch than the ranks together (they "
                                     f"share {samples.shared} of {samples.size} samples), so their gradients cannot "
                                     "be compared: a program that uses a DistributedSampler only when distributed "
                                     "(a RandomSampler on one device) draws another order; give the one-process run "
                                     "a DistributedSampler too (num_replicas=1, the same seed)", **common)
    diverged = next(s for s in steps if s.step == first)
    if by_updates:
        cause, explanation = _update_cause(config, steps, diverged, _audit_words(audit_codes)[1], by_updates)
    else:
        cause, explanation = _cause(config, steps, diverged, replicas, samples, audit_codes, tolerance)
    return Judgement(verdict="DIVERGES", cause=cause, explanation=explanation, first_divergent_step=first, **common)


def _agreement(config: CommandCheckConfig, steps: list[StepComparison], tolerance: float, half: bool,
               audit_codes: list[str], common: dict, by_updates: bool = False) -> Judgement:
    largest = max(((s.update if by_updates else s.gradient).difference or 0.0 for s in steps), default=0.0)
    ranks, one = config.sides()
    verdict: Verdict = "ROUNDING" if half and largest > 1e-4 else "EQUIVALENT"
    same = "the same gradients and updates" if verdict == "EQUIVALENT" else \
        "gradients and updates that differ by half precision's rounding only"
    if by_updates:
        same = "the same updates"
    bound = update_tolerance(tolerance) if by_updates else tolerance
    text = (f"{ranks.describe()} and {one.describe()} compute {same} at every one of {len(steps)} steps (largest "
            f"relative {'update' if by_updates else 'gradient'} difference {largest:.1e} ≤ {bound:g})")
    refuted = [code for code in audit_codes if code in GRADIENT_FINDINGS]
    if refuted:
        common["notes"].append(f"the audit on the same run warned {', '.join(refuted)}, but the gradients match: "
                               "not confirmed here")
    return Judgement(verdict=verdict, cause="REDUCE_PRECISION" if verdict == "ROUNDING" else None, explanation=text,
                     first_divergent_step=None, **common)


def _audit_words(audit_codes: list[str]) -> tuple[str | None, str]:
    """(the audit's finding that says why a gradient differs, the clause that quotes it)."""
    named = next((code for code in GRADIENT_FINDINGS if code in audit_codes), None)
    return named, f"; the audit on the same run names it {named}" if named else ""


def _cause(config: CommandCheckConfig, steps: list[StepComparison], step: StepComparison, replicas: float,
           samples: SampleCheck, audit_codes: list[str], tolerance: float) -> tuple[str, str]:
    world = config.world_size
    named, audit = _audit_words(audit_codes)
    if samples.compared and not samples.same:
        # The audit's name where it saw the cause: the ranks' samplers seeded apart.
        code = "SAMPLER_SEEDED_PER_RANK" if "SAMPLER_SEEDED_PER_RANK" in audit_codes else "SAMPLES_DIFFER"
        return code, (f"the ranks' first global batch is not the one process's: they share "
                                  f"{samples.shared} of {samples.size} samples, and the ranks draw inconsistently "
                                  "(samplers seeded per rank, or one sample on two ranks): every rank's sampler must "
                                  "draw from one order, the same seed on every rank")
    if replicas > tolerance:
        return "NO_ALLREDUCE", (f"the ranks step with different gradients (relative difference {replicas:.2e} between "
                                f"ranks at step {step.step}): nothing averaged them before the optimizer's step"
                                f"{audit}")
    grad, close = step.gradient, Close.of(tolerance)
    if grad.difference is not None and grad.difference <= tolerance:
        return _update_cause(config, steps, step, audit, False)
    scales = _pure_scales(step, close)
    if scales is not None and max(scales.values()) <= min(scales.values()) * (1 + close.ratio):
        return _scale_cause(config, step, named, audit, close)
    if scales is not None and _gathered(scales, world, close):
        return "GATHERED_LOSS_WITHOUT_WORLD_SIZE", _gathered_text(step, scales, world, close) + audit
    text = f"from step {step.step} {_modules_text(step)}"
    if scales is None:
        text += ": the ranks' loss weighs its terms differently from the one process's, or leaves some out"
    return named or "UNKNOWN", text + audit


# The audit's findings that are a pure scale of the gradient: where the audit names one, its name is the cause.
SCALE_FINDINGS = ("SUM_REDUCTION", "GLOBAL_COUNT_WITHOUT_WORLD_SIZE", "DIVIDE_FACTOR", "ACCUMULATION_DIVIDED_TWICE",
                  "ACCUMULATION_NOT_DIVIDED")


def _scale_cause(config: CommandCheckConfig, step: StepComparison, named: str | None, audit: str,
                 close: Close) -> tuple[str, str]:
    """Every module the same pure scale of the one process's gradient: which scale, and what gives it."""
    grad, world, micro = step.gradient, config.world_size, config.accumulation_steps
    ratio = grad.gradient_ratio
    measured = f"(ratio {ratio:.6f}, cos {grad.cosine:.6f})"
    fits = [code for code, n in (("SUM_REDUCTION", world), ("ACCUMULATION_DIVIDED_TWICE", micro))
            if n > 1 and abs(ratio * n - 1) <= close.ratio]
    if not fits and micro > 1 and abs(ratio / micro - 1) <= close.ratio:
        fits = ["ACCUMULATION_NOT_DIVIDED"]
    cause = named if named in SCALE_FINDINGS else (fits[0] if fits else "GRADIENT_SCALE")
    text = f"from step {step.step} the ranks' gradient is {_fraction(ratio, close)} the one process's {measured}"
    if fits == ["SUM_REDUCTION"] or (cause == "SUM_REDUCTION" and not named):
        text += (f": the loss is summed, or divided by a count fixed in advance, and the {world} ranks' gradients "
                 "are averaged")
    elif fits == ["ACCUMULATION_DIVIDED_TWICE"]:
        text += f": each of the {micro} micro-batches' losses is divided by {micro} twice"
    elif fits == ["ACCUMULATION_NOT_DIVIDED"]:
        text += f": {micro}× is the accumulation steps: each micro-batch's loss is not divided by the {micro} of them"
    elif len(fits) == 2:
        text += (f": 1/{world} is both 1/W and 1/K here, a summed loss or a loss divided twice by the accumulation "
                 "steps; a run with --accumulation other than --world-size tells them apart")
    return cause, text + audit


def _gathered(scales: dict[str, float], world: int, close: Close) -> bool:
    """Some modules get exactly 1/W of the gradient and the rest all of it: the terms of a gathered batch."""
    kinds = {_scale_kind(r, world, close) for r in scales.values()}
    return kinds == {"1/W", "1"}


def _scale_kind(ratio: float, world: int, close: Close) -> str | None:
    if abs(ratio * world - 1) <= close.ratio:
        return "1/W"
    return "1" if abs(ratio - 1) <= close.ratio else None


def _gathered_text(step: StepComparison, scales: dict[str, float], world: int, close: Close) -> str:
    fraction = [name for name, r in scales.items() if _scale_kind(r, world, close) == "1/W"]
    whole = [name for name in scales if name not in fraction]
    return (f"from step {step.step} {', '.join(fraction)} get exactly 1/{world} of the one-process gradient and "
            f"{', '.join(whole)} all of it, each a pure scale (cos 1): the loss reaches this rank's features only "
            f"through its own slice of a batch gathered without autograd, and DDP averages the {world} ranks; "
            "gather with autograd (torch.distributed.nn.functional.all_gather) so each rank's loss reaches every "
            "rank's features")


def _update_cause(config: CommandCheckConfig, steps: list[StepComparison], step: StepComparison, audit: str,
                  by_updates: bool) -> tuple[str, str]:
    """The updates differ where the gradients agree (or cannot be read): the optimizer's lr, or its own reduction."""
    world, update = config.world_size, step.update
    ratios = [s.update.gradient_ratio or 0.0 for s in steps if s.step >= step.step]
    shown = ", ".join(f"{r:.4f}" for r in ratios)
    measured = f"update ratio {shown} at steps {step.step}-{steps[-1].step}, cos {update.cosine:.4f}"
    if by_updates:
        return "UPDATE_DIFFERS", (f"from step {step.step} the updates differ ({measured}), and each rank's .grad held "
                                  "its own gradient: the optimizer reduces the gradients itself, by another scale "
                                  f"than an average over the {world} ranks, or steps its lr differently{audit}")
    # A learning rate set from the world size scales every update alike; a schedule stepped differently does not.
    if len(ratios) > 1 and all(abs(r / world - 1) <= 0.01 for r in ratios):
        return "LR_SCALED_BY_WORLD_SIZE", (f"from step {step.step} the gradients agree and every update is {world}× "
                                           f"the one process's ({measured}): the learning rate is multiplied by the "
                                           f"world size{audit}")
    return "UPDATE_DIFFERS", (f"from step {step.step} the gradients agree but the updates do not ({measured}): the "
                              "optimizer steps differently on the two sides, most often a learning-rate scheduler "
                              f"stepped per micro-batch or per rank, or an lr set from the world size{audit}")


def _pure_scales(step: StepComparison, close: Close) -> dict[str, float] | None:
    """Each module's ratio where every module is a pure scale of the one process's gradient; None otherwise."""
    scales = {}
    for name, comparison in step.modules.items():
        if comparison.gradient_ratio is None:
            continue
        if comparison.cosine is None or comparison.cosine < 1 - close.direction:
            return None
        scales[name] = comparison.gradient_ratio
    return scales or None


def _modules_text(step: StepComparison) -> str:
    parts = [f"{name} {c.gradient_ratio:.3f}× (cos {c.cosine:.4f})" for name, c in step.modules.items()
             if c.gradient_ratio is not None]
    shown = ", ".join(parts[:6]) + (f", and {len(parts) - 6} more" if len(parts) > 6 else "")
    return f"the ranks' gradient against the one process's, by module: {shown}"


def _fraction(ratio: float, close: Close) -> str:
    """``1/2`` or ``2×`` where the ratio is a simple fraction, else ``0.731×``."""
    for n in range(2, 65):
        if abs(ratio * n - 1) <= close.ratio:
            return f"1/{n} of"
        if abs(ratio / n - 1) <= close.ratio:
            return f"{n}×"
    return f"{ratio:.4f}×"


def _notes(samples: SampleCheck, dropout: float, half: bool, tolerance: float) -> list[str]:
    notes = []
    if dropout:
        notes.append(f"dropout (p = {dropout:g}) was turned off in both runs: it draws different numbers on each "
                     "side by design, and the check compares what the rest computes")
    if half:
        notes.append(f"the program computes in half precision (autocast or half parameters): compared to a "
                     f"relative {tolerance:g}")
    if not samples.compared and samples.why:
        notes.append(samples.why)
    return notes
