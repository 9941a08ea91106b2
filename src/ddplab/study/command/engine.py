"""The engine of a command study: each run of a group is one launch of the user's command, started by the executor,
read back from the guest's records, and kept in its own folder so a driver started again repeats no finished run.

A run whose command fails (an exit code other than 0 before the guest decided it, a task or job that died) is
started once more; failing again it is reported with the last lines of its output and counts as not reached. A run
the guest never saw train, or one that printed no metric, ends the study in one line: every other run would too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable

from ddplab.errors import UsageError, literal
from ddplab.guest.output import program_error, tail
from ddplab.serialize import write_json_atomic
from ddplab.study.command import points
from ddplab.study.command.config import CommandOptions
from ddplab.study.command.executors import Executor
from ddplab.study.command.job import LOG, JobOutcome, RunJob
from ddplab.study.command.template import CommandTemplate
from ddplab.study.config import StudyConfig
from ddplab.study.runs import DIVERGED_LOSS, RunGroup, RunResult, prune_bound, settle

RESULT = "result.json"
TRIES = 2
ALL_REDUCE_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandWorkload:
    """A command study's workload as the grid and the report name it."""

    name: str
    fingerprint: str
    """The command as written and the content of every file it names: a changed script reuses no run."""
    train_size: int | None = None
    own_optimizer: dict | None = None


def workload_of(template: CommandTemplate, options: CommandOptions) -> CommandWorkload:
    digest = hashlib.sha256(json.dumps([template.args, options.metric]).encode())
    for arg in template.args:
        if os.path.isfile(arg):
            with open(arg, "rb") as fh:
                digest.update(fh.read())
    script = next((os.path.basename(a) for a in template.args if a.endswith(".py")), os.path.basename(template.args[0]))
    return CommandWorkload(name=script, fingerprint=digest.hexdigest()[:16])


class CommandEngine:
    """Trains a group by starting one command per run (``ddplab study -- COMMAND``)."""

    name = "command"
    overhead = 1.0
    per_run = True

    def __init__(self, template: CommandTemplate, options: CommandOptions, executor: Executor, *, world_size: int,
                 max_per_device: int | None, folder: str, listen: Callable[[int, int, int], None],
                 finished: Callable[[str], None] = lambda line: None):
        self.template, self.options, self.executor = template, options, executor
        self.world_size, self.max_per_device, self.folder, self.listen = world_size, max_per_device, folder, listen
        self.finished = finished
        """Told a line per run as it ends: what it trained, how far and how long."""
        self.failed: list[str] = []
        """A line per run that failed twice: its batch, lr, seed and the end of its output."""

    def train(self, workload, config: StudyConfig, group: RunGroup, progress=None) -> list[RunResult]:
        """Every run of ``group``: from its folder where an earlier driver finished it, else started (twice at most).

        As on the other engines, a run of an (lr, variant) in ``group.sweep_only`` stops once it can no longer be its
        batch's best: those runs start after the others, each bounded by the best median settled by then."""
        results = group.results()
        pairs = list(zip(results, group.run_optimizers()))
        waves = [[p for p in pairs if (p[0].lr, p[0].variant) not in group.sweep_only],
                 [p for p in pairs if (p[0].lr, p[0].variant) in group.sweep_only]]
        finished: list[RunResult] = []
        for wave in waves:
            todo: dict[RunJob, RunResult] = {}
            for result, optimizer in wave:
                bound = prune_bound(config, finished, (result.lr, result.variant)) if wave is waves[1] else math.inf
                job = self._job(config, group, result, optimizer, bound)
                if not _cached(job, result):
                    todo[job] = result
                elif progress:
                    progress(config.max_steps)
            self._run(config, todo, progress)
            finished += [result for result, _ in wave]
        return results

    def _run(self, config: StudyConfig, todo: dict[RunJob, RunResult], progress) -> None:
        for attempt in range(TRIES):
            again: dict[RunJob, RunResult] = {}
            with contextlib.closing(self.executor.run(list(todo), self.listen)) as outcomes:
                for job, outcome in outcomes:
                    if not self._read(config, job, outcome, todo[job], last=attempt == TRIES - 1):
                        again[job] = todo[job]
                        continue
                    self.finished(_ended(job, outcome, todo[job]))
                    if progress:
                        progress(config.max_steps)
            todo = again

    def _read(self, config: StudyConfig, job: RunJob, outcome: JobOutcome, result: RunResult, *, last: bool) -> bool:
        """Fill ``result`` from the run's outcome; False where it failed and may be tried again."""
        evals = [e for e in outcome.events if e.get("kind") == "eval"]
        decided = any(e.get("kind") == "end" for e in outcome.events)
        # The settings the command was given are those its placeholders carry; the rest are its own.
        result.optimizer = placed(result.optimizer, self.template.names)
        if (outcome.returncode == 0 and not outcome.timed_out) or decided:
            self._check_trained(config, job, outcome, evals)
            replay(config, evals, result, metric=self.options.metric is not None)
            result.pruned = any(e.get("kind") == "end" and e.get("pruned") for e in outcome.events)
            notes = [e["text"] for e in outcome.events if e.get("kind") == "note"]
            if notes:
                self.failed.append(f"{job.label}: the study's guest turned itself off ({notes[0]}); the run counts "
                                   "as far as it was read")
            write_json_atomic(os.path.join(job.run_dir, RESULT), {"args": list(job.args), "seconds": outcome.seconds,
                                                                  "guest_seconds": evals[-1].get("guest_s"),
                                                                  "result": result.to_json()}, standard=False)
            return True
        if not last:
            return False
        why = (f"stopped at its deadline of {self.options.run_deadline_s:g} s" if outcome.timed_out else
               f"exit code {outcome.returncode}")
        result.failed = why
        log = os.path.join(job.run_dir, LOG)
        error = program_error(tail(log, 400))
        # The program's own error where its traceback has one, not the launcher's report of a failed rank.
        said = (f"its error: {error}" if error else
                "its output ends:\n    " + "\n    ".join(outcome.log_tail or ["(nothing)"]) + "\n  ")
        self.failed.append(f"{job.label}: failed twice ({why}); {said}{'; ' if error else ''}its output is in "
                           f"{log}")
        return True

    def _check_trained(self, config: StudyConfig, job: RunJob, outcome: JobOutcome, evals: list[dict]) -> None:
        """One line, ending the study, where a run shows that no run of this command can be read."""
        log = os.path.join(job.run_dir, "output.log")
        if outcome.failures:
            raise UsageError("the study's guest could not start in the command's processes "
                             f"({literal(outcome.failures[0])})")
        if not evals:
            seen = ("no Python process of the command imported torch" if not outcome.guest_loaded else
                    f"the command ended (exit code {outcome.returncode}) before its optimizer stepped "
                    f"{_steps(job)} times after a backward")
            raise UsageError(f"{seen}: nothing to count steps to the target by; its output is in {literal(log)}")
        world = evals[0].get("world_size", 1)
        if world != self.world_size:
            raise UsageError(f"the command ran {world} rank{'s' if world != 1 else ''} and {{world_size}} is "
                             f"{self.world_size}, so its batches were not the grid's: pass {{world_size}} {world}, or "
                             "put {{world_size}} where the command sets its ranks")
        stepped, named = evals[0].get("optimizer"), config.optimizer.family
        if FAMILIES.get(stepped, named) != named:
            raise UsageError(f"the command steps torch's {stepped} and {{optimizer.family}} is {named}: the rules' "
                             f"lrs and settings follow the family named, so pass {{optimizer.family}} "
                             f"{FAMILIES[stepped]}")
        if self.options.metric and all(e.get("metric") is None for e in evals):
            name = literal(self.options.metric)
            raise UsageError(f"the command printed no {name} in {evals[-1]['step']} steps (looked for {name}=VALUE, "
                             f"{name}: VALUE or '{name}': VALUE on stdout): check {{metric}} against what it prints, "
                             f"in {literal(log)}")

    def _job(self, config: StudyConfig, group: RunGroup, result: RunResult, optimizer, bound: float) -> RunJob:
        tag = result.variant or group.rule or ("extension" if group.extension else "grid")
        settings = hashlib.sha256(json.dumps(optimizer.to_json(), sort_keys=True).encode()).hexdigest()[:6]
        run_dir = os.path.abspath(os.path.join(self.folder, f"b{result.global_batch_size}-lr{result.lr:.6g}-"
                                                            f"s{result.seed}-{tag}-{settings}"))
        os.makedirs(run_dir, exist_ok=True)
        filled = points.values(config, self.world_size, self.max_per_device, result.global_batch_size, result.lr,
                               result.seed, optimizer, run_dir)
        guest = {"target": config.target.to_json(), "eval_every": config.eval_every, "max_steps": config.max_steps,
                 "patience": config.patience, "metric": self.options.metric, "timeout_s": ALL_REDUCE_TIMEOUT_S,
                 "prune_after": None if math.isinf(bound) else bound}
        return RunJob(args=tuple(self.template.fill(filled)), run_dir=run_dir, settings=json.dumps(guest),
                      deadline_s=self.options.run_deadline_s,
                      label=f"global batch {result.global_batch_size}, lr {result.lr:g}, seed {result.seed}")


def replay(config: StudyConfig, evals: list[dict], result: RunResult, *, metric: bool) -> None:
    """The run's evaluations judged as the guest judged them (:func:`ddplab.study.runs.settle`)."""
    for row in evals:
        loss, value = row.get("loss"), row.get("metric") if metric else row.get("loss")
        broken = loss is None or loss > DIVERGED_LOSS
        if metric and value is None and not broken:
            continue  # nothing printed since the evaluation before
        value = math.nan if broken else value
        result.history.append([row["step"], loss, value])
        if settle(config, result, row["step"], value):
            break
    if result.steps_to_target is not None:
        result.samples_to_target = result.steps_to_target * result.global_batch_size


def _steps(job: RunJob) -> int:
    return int(json.loads(job.settings)["eval_every"])


FAMILIES = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw"}
"""torch's optimizer classes by the family a study names; another class (Lion, a fused or sharded Adam) is the
user's word."""

PLACED = {"betas": ("beta1", "beta2"), "eps": ("eps",), "weight_decay": ("weight_decay",)}
"""Each Adam setting a run records, by the placeholders that hand it to the command."""


def placed(settings: dict | None, names) -> dict | None:
    """A command's run's Adam settings as far as its placeholders set them, marked ``own`` where the command keeps
    any of its own (the study cannot see them); None for SGD.

    >>> placed({"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}, {"lr", "eps"})
    {'eps': 1e-08, 'own': True}
    """
    if settings is None or settings.get("own"):
        return settings
    kept = {key: value for key, value in settings.items() if any(name in names for name in PLACED.get(key, ()))}
    return kept if len(kept) == len(settings) else {**kept, "own": True}


def _ended(job: RunJob, outcome: JobOutcome, result: RunResult) -> str:
    """A finished run in one line: what it trained, how it ended, and how long it took."""
    rule = f"{result.rule} " if result.rule else ""
    if result.failed:
        how = f"failed ({result.failed})"
    elif result.steps_to_target is not None:
        how = f"{result.steps_to_target} steps to the target"
    else:
        how = "diverged" if result.diverged else "stalled" if result.stalled else "pruned" if result.pruned else \
            "not reached"
    return f"{rule}{job.label}: {how}, {outcome.seconds:.0f} s"


def _cached(job: RunJob, result: RunResult) -> bool:
    """Fill ``result`` from the run's folder where an earlier driver finished it."""
    path = os.path.join(job.run_dir, RESULT)
    try:
        with open(path) as fh:
            saved = json.load(fh)
    except (OSError, ValueError):
        return False
    if saved.get("args") != list(job.args):
        return False
    for name, value in saved["result"].items():
        setattr(result, name, value)
    return True
