"""``ddplab check -- COMMAND``: the user's command run on W ranks and in one process over one global batch, compared.

Both runs go through the guest runner (:func:`ddplab.guest.runner.run_guest`: their own process group, signals
forwarded, the bootstrap on PYTHONPATH) with ``DDPLAB_GUEST`` naming :mod:`ddplab.check.command.guest`; each ends
after the compared steps. The split run's output is the program's own, shown as it runs; the reference's goes to a
log file, shown where it fails. Torch-free: the comparison reads the records the guests wrote.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ddplab.auditor import findings
from ddplab.check.command import compare, judgement
from ddplab.check.command.config import ENV_SETTINGS, CommandCheckConfig, Side
from ddplab.check.command.config import RECORD_PREFIX as PREFIX
from ddplab.errors import UsageError
from ddplab.guest import record, runner
from ddplab.guest.output import free_port, program_error, tail

GUEST = "ddplab.check.command.guest"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SideRun:
    """One of the two runs: how it was launched, how it ended, what its guests recorded."""

    side: Side
    command: list[str]
    returncode: int
    seconds: float
    events: list[dict]
    log: str | None
    audit: findings.Report | None = None

    @property
    def stepped(self) -> int:
        return len({e["step"] for e in self.events if e.get("kind") == "step" and e.get("optimizer") == 0})

    @property
    def notes(self) -> list[str]:
        return [e["text"] for e in self.events if e.get("kind") == "note"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandCheckResult:
    """What ``check -- COMMAND`` found."""

    config: CommandCheckConfig
    verdict: judgement.Verdict
    cause: str | None
    explanation: str
    tolerance: float
    first_divergent_step: int | None
    steps: list[judgement.StepComparison]
    notes: list[str]
    samples: judgement.SampleCheck
    runs: tuple[SideRun, SideRun]
    audit_findings: list[dict]
    check_s: float

    @property
    def passed(self) -> bool:
        return self.verdict in ("EQUIVALENT", "ROUNDING")

    def to_json(self) -> dict[str, Any]:
        cfg, (ranks, one) = self.config, self.runs
        return {"verdict": self.verdict, "cause": self.cause, "explanation": self.explanation,
                "tolerance": self.tolerance, "first_divergent_step": self.first_divergent_step,
                "world_size": cfg.world_size, "data_parallel_size": cfg.world_size,
                "global_batch_size": cfg.global_batch_size,
                "per_device_batch_size": ranks.side.per_device_batch_size,
                "accumulation_steps": ranks.side.accumulation_steps,
                "reference": {"world_size": 1, "per_device_batch_size": one.side.per_device_batch_size,
                              "accumulation_steps": one.side.accumulation_steps},
                "steps": cfg.steps, "per_step": [s.to_json() for s in self.steps], "notes": self.notes,
                "samples": self.samples.to_json(), "audit_findings": self.audit_findings,
                "runs": [{"side": r.side.label, "command": r.command, "returncode": r.returncode,
                          "seconds": round(r.seconds, 2)} for r in self.runs],
                "check_s": round(self.check_s, 2)}


class CommandFailed(UsageError):
    """A run of the command failed before its compared steps: it is named, with its output's end."""


def check_command(config: CommandCheckConfig, *, say: Callable[[str], None] = lambda text: None,
                  program_stdout_to_stderr: bool = False) -> CommandCheckResult:
    """Run both sides, compare what their optimizer steps computed, judge."""
    begun = time.monotonic()
    ranks_side, one_side = config.sides()
    work = tempfile.mkdtemp(prefix="ddplab-check-")
    try:
        say(f"the split run: {ranks_side.describe()} (its output follows)")
        ranks = _run_side(config, ranks_side, work, shown=True, audit=config.audit,
                          stdout_to_stderr=program_stdout_to_stderr)
        say(f"the reference: {one_side.describe()} (its output goes to a log)")
        one = _run_side(config, one_side, work, shown=False, audit=False, stdout_to_stderr=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _judged(config, ranks, one, time.monotonic() - begun)


def _run_side(config: CommandCheckConfig, side: Side, work: str, *, shown: bool, audit: bool,
              stdout_to_stderr: bool) -> SideRun:
    folder = os.path.join(work, side.label.replace(" ", "-"))
    out_dir = os.path.join(folder, "records")
    os.makedirs(out_dir)
    command = config.fill(side, free_port(), folder)
    settings = {"steps": config.steps, "samples": side.per_device_batch_size * side.accumulation_steps * config.steps,
                "audit": audit}
    env = {"DDPLAB_GUEST": GUEST, ENV_SETTINGS: json.dumps(settings)}
    log = None if shown else os.path.join(folder, "output.log")
    begun = time.monotonic()
    if log is None:
        status = runner.run_guest(command, out_dir, env, 2 if stdout_to_stderr else None, config.run_deadline_s,
                                  sweep=True)
    else:
        with open(log, "w") as fh:
            status = runner.run_guest(command, out_dir, env, fh, config.run_deadline_s, stderr=fh, sweep=True)
    seconds = time.monotonic() - begun
    returncode = 128 - status if status < 0 else status
    events = record.read_all(out_dir, PREFIX)
    audited = findings.read_records(out_dir) if audit else []
    report = findings.merge(audited) if audited else None
    run = SideRun(side=side, command=command, returncode=returncode, seconds=seconds, events=events, log=log,
                  audit=report)
    _refuse_unfinished(config, run, seconds)
    return run


def _refuse_unfinished(config: CommandCheckConfig, run: SideRun, seconds: float) -> None:
    """A run that did not reach its compared steps is named, with what it printed last."""
    if run.stepped >= config.steps:
        return
    what = f"{run.side.describe()} ({' '.join(run.command)})"
    stopped = seconds >= config.run_deadline_s
    ended = (f"was stopped after {config.run_deadline_s:g} s (--run-deadline)" if stopped
             else f"exited with code {run.returncode}" if run.returncode else "ended")
    # Advice that fits how it ended: a failure is the program's, a deadline may be a rank that hangs.
    advice = ("raise --run-deadline, or look for a rank that waits on a collective the others never reach" if stopped
              else "its error is in its output above" if run.returncode and run.log is None
              else "see its error" if run.returncode else "lower --steps or let the command train longer")
    steps = run.stepped
    said = f"; the guest said: {run.notes[0]}" if run.notes else ""
    end = ""
    if run.log is not None:
        lines = tail(run.log, 400)
        error = program_error(lines)
        shown = [line for line in lines if line.strip()][-8:]
        end = (f"; its error: {error}" if error else "") + \
            ("; its output ends:\n  " + "\n  ".join(shown) if shown and not error else "")
    if steps == 0:
        first = "check compares the steps an optimizer takes" if not run.returncode or stopped else advice
        raise CommandFailed(f"the run on {what} {ended} before any optimizer step{said}: {first}{end}")
    raise CommandFailed(f"the run on {what} {ended} after {steps} of the {config.steps} steps to compare{said}: "
                        f"{advice}{end}")


def _judged(config: CommandCheckConfig, ranks: SideRun, one: SideRun, seconds: float) -> CommandCheckResult:
    merged_ranks, merged_one = compare.merge_side(ranks.events), compare.merge_side(one.events)
    kept, dropped = compare.matching_optimizers(merged_ranks, merged_one)
    if not kept:
        raise CommandFailed("the optimizers step parameters of other shapes on the two sides (DeepSpeed ZeRO's flat "
                            "partitions, or an optimizer sharded over the ranks): check compares what a torch "
                            "optimizer steps on the model's own parameters, and cannot read these")
    steps_ranks = judgement.by_step({k: v for k, v in merged_ranks.items() if k[0] in kept})
    steps_one = judgement.by_step({k: v for k, v in merged_one.items() if k[0] in kept})
    compared = [s for s in steps_ranks if s in steps_one][:config.steps]
    params = [p for s in compared for p in steps_ranks[s].values()]
    autocast = any(e.get("autocast") for e in ranks.events + one.events if e.get("kind") == "step")
    tolerance, half = judgement.tolerance_for(config, params, autocast)
    first = compared[0]
    replicas = max((p.replica_difference for p in steps_ranks[first].values()), default=0.0)
    update_replicas = max((p.update_replica_difference for p in steps_ranks[first].values()), default=0.0)
    # The ranks' .grad differ, their updates do not: an optimizer that reduces into buffers of its own.
    by_updates = replicas > tolerance and update_replicas <= judgement.update_tolerance(tolerance)
    steps = [judgement.compare_step(s, steps_ranks[s], steps_one[s], tolerance, by_updates) for s in compared]
    problems = ranks.audit.problems if ranks.audit is not None else []
    dropout = max((e["p"] for e in ranks.events + one.events if e.get("kind") == "dropout"), default=0.0)
    samples = sample_check(config, ranks, one)
    start = judgement.start_difference(steps_ranks[first], steps_one[first])
    verdict = judgement.judge(config, steps, tolerance, half, start=start, replicas=replicas, samples=samples,
                              audit_codes=[f.code for f in problems], dropout=dropout, by_updates=by_updates)
    if dropped:
        verdict.notes.append(f"{len(dropped)} optimizer(s) stepped parameters of other shapes on the two sides (a "
                             "sharded optimizer's local part) and were left out of the comparison")
    return CommandCheckResult(config=config, verdict=verdict.verdict, cause=verdict.cause,
                              explanation=verdict.explanation, tolerance=verdict.tolerance,
                              first_divergent_step=verdict.first_divergent_step, steps=verdict.steps,
                              notes=verdict.notes, samples=samples, runs=(ranks, one),
                              audit_findings=[f.to_json() for f in problems], check_s=seconds)


def sample_check(config: CommandCheckConfig, ranks: SideRun, one: SideRun) -> judgement.SampleCheck:
    """Whether the first global batch was the same samples on both sides: by each rank's first DistributedSampler's
    indices where both sides have one, else by fingerprints of the samples the first step's forwards took."""
    first_ranks, first_one = _first_sampler(ranks.events), _first_sampler(one.events)
    if first_ranks and first_one:
        take = ranks.side.per_device_batch_size * ranks.side.accumulation_steps
        split = [i for r in sorted(first_ranks) for i in first_ranks[r]["indices"][:take]]
        reference = first_one[min(first_one)]["indices"][:config.global_batch_size]
        seeds = {record["seed"] for record in first_ranks.values()}
        return _compared(split, reference, "indices", inconsistent=len(seeds) > 1 or len(set(split)) < len(split))
    split, reference = _first_inputs(ranks.events), _first_inputs(one.events)
    if split and reference:
        shapes = {f.split(":", 1)[0] for f in split + reference}
        if len(shapes) == 1:
            return _compared(split, reference, "inputs", inconsistent=len(set(split)) < len(split))
    return judgement.SampleCheck(compared=False, same=False,
                                 why="the first global batch's samples were not compared: no DistributedSampler fed "
                                     "both sides, and the inputs' shapes differ (padding) or were not seen")


def _compared(split: list, reference: list, how: str, inconsistent: bool) -> judgement.SampleCheck:
    shared = sum((Counter(split) & Counter(reference)).values())
    return judgement.SampleCheck(compared=True, same=Counter(split) == Counter(reference), shared=shared,
                                 size=len(reference), how=how, ranks_inconsistent=inconsistent)


def _first_sampler(events: list[dict]) -> dict[int, dict]:
    return {e["rank"]: e for e in events if e.get("kind") == "sampler" and e.get("order") == 0}


def _first_inputs(events: list[dict]) -> list[str]:
    steps = [e for e in events if e.get("kind") == "step" and e.get("optimizer") == 0 and e.get("step") == 0]
    return [f for e in sorted(steps, key=lambda e: e["rank"]) for f in e.get("inputs") or []]
