"""Plan from what ``ddplab noise`` measured: its B_simple, and the run it measured as the reference (no torch).

The report says the run: its world size, per-device batch, accumulation steps and global batch, and, for a spec, the
lr its optimizer ran at. Those are the reference unless flags say otherwise (:mod:`ddplab.plan.reported`); B_simple is
the plan's critical batch size, or with the surge rule the reference's noise scale.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, Literal

from ddplab.errors import UsageError, literal, render
from ddplab.plan import planner
from ddplab.plan.reported import Reported, positive_whole

Window = Literal["last", "whole"]


def plan_from_noise(reference: planner.Reference | Mapping[str, Any], target: planner.Target,
                    data: planner.Data | None, report: str | dict, *,
                    names: Mapping[str, str] | None = None, window: Window = "last") -> planner.Plan:
    """:func:`ddplab.plan.plan` with the noise report's B_simple; ``reference`` is a Reference, or the fields given
    for it (flags), which the report's run completes and is checked against (a warning per contradiction).

    A report over training gives B_simple per window of steps: ``window`` "last" takes the last resolved one (where
    training is now), "whole" the run's one ratio; either must be resolved (a finite 95% interval)."""
    source = report if isinstance(report, str) else "the noise report"
    loaded = read_report(report)
    warnings: tuple[str, ...] = ()
    if not isinstance(reference, planner.Reference):
        _check_lr(source, loaded, reference)
        reference, warnings = reported_run(source, loaded).merge(reference)
    b_simple, taken = _b_simple(source, loaded, window)
    data = data or planner.Data()
    size = positive_whole(source, loaded, "dataset_size")
    if data.dataset_size is None and size is not None:
        # The samples the report's run drew from: the plan's epochs and warmup need them too.
        data = dataclasses.replace(data, dataset_size=size)
    if target.rule == "surge":
        if reference.noise_scale is not None:
            raise UsageError("{reference.noise_scale} and {from_noise} both give the noise scale: drop one")
        reference = dataclasses.replace(reference, noise_scale=b_simple)
    elif data.critical_batch_size is not None:
        raise UsageError("{data.critical_batch_size} and {from_noise} both give the critical batch size: drop one")
    else:
        data = dataclasses.replace(data, critical_batch_size=b_simple)
    result = planner.plan(reference, target, data, names=names)
    # The reference's contradictions first: every number after them follows from the flags' reference.
    said = tuple(render(warning, names) for warning in (*warnings, *taken))
    return dataclasses.replace(result, warnings=said + result.warnings) if said else result


def read_report(report: str | dict) -> dict:
    """A ``ddplab noise`` JSON report (a path, or the loaded dict as it is)."""
    if isinstance(report, dict):
        return report
    try:
        with open(report) as fh:
            loaded = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{{from_noise}} {literal(repr(report))} is not a readable ddplab noise JSON report "
                         f"({type(exc).__name__})") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{{from_noise}} {literal(repr(report))} is not a ddplab noise JSON report (no object)")
    return loaded


def reported_run(source: str, report: Mapping[str, Any]) -> Reported:
    """The run the report measured, as Reference fields (its lr only where its optimizer had one)."""
    fields = {name: value for name in ("per_device_batch_size", "accumulation_steps", "global_batch_size")
              if (value := positive_whole(source, report, name)) is not None}
    lrs = report.get("lr")
    if isinstance(lrs, list) and len(lrs) == 1 and isinstance(lrs[0], (int, float)) and lrs[0] > 0:
        fields["lr"] = float(lrs[0])
    return Reported(source=source, fields=fields, world_size=positive_whole(source, report, "world_size"),
                    data_parallel_size=positive_whole(source, report, "data_parallel_size"))


def _check_lr(source: str, report: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """A run whose parameter groups had several lrs leaves the reference's to the flag."""
    lrs = report.get("lr")
    if "lr" not in given and isinstance(lrs, list) and len(lrs) > 1:
        shown = ", ".join(literal(f"{lr:g}" if isinstance(lr, (int, float)) else repr(lr)) for lr in lrs[:4])
        raise UsageError(f"{literal(source)} saw {len(lrs)} learning rates ({shown}), one per parameter group: give "
                         "the reference's with {reference.lr}")


def _b_simple(source: str, report: Mapping[str, Any], window: Window) -> tuple[float, tuple[str, ...]]:
    """The B_simple the plan takes, and what it says of the choice where the report has several windows."""
    windows = report.get("by_samples")
    if window == "last" and isinstance(windows, list) and len(windows) > 1:
        resolved = [w for w in windows if isinstance(w, dict) and w.get("b_simple_status") == "resolved"]
        if not resolved:
            raise UsageError(f"{{from_noise}} {literal(repr(source))}: none of its {len(windows)} windows has a "
                             "resolved B_simple (a finite 95% interval): measure more steps per window, or pass "
                             "{noise_window} whole")
        last = resolved[-1]
        low, high = last["b_simple_ci95"]
        return _finite(source, last.get("b_simple")), (
            f"B_simple {last['b_simple']:.4g} [{low:.4g}, {high:.4g}] is {literal(repr(source))}'s last resolved "
            f"window (window {windows.index(last) + 1} of {len(windows)}, steps {last['steps'][0]}-"
            f"{last['steps'][1]}, at {last['samples_seen']:,.0f} samples seen); {{noise_window}} whole takes the "
            f"whole run's {report.get('b_simple', math.nan):.4g}",)
    status = report.get("b_simple_status", "resolved")
    if status != "resolved":
        raise UsageError(f"{{from_noise}} {literal(repr(source))}'s B_simple is not resolved ({status}: no finite "
                         "95% interval): measure more steps")
    return _finite(source, report.get("b_simple")), ()


def _finite(source: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise UsageError(f"{{from_noise}} {literal(repr(source))} holds no finite B_simple (|G|² was not resolved): "
                         "measure more steps")
    return float(value)
