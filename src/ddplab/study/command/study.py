"""``ddplab study -- COMMAND`` as one library call: check the command can run the study, train the grid through the
executor, analyse, and write study.json, plots and report.html as a spec's study does.

The driver imports no torch: the runs train in the command's own processes. Runs are kept per run under
``OUT/command-runs/`` (each folder: the run's output.log and, once read, result.json) and per batch size in the
grid's cache, both keyed by the command, the content of the files it names and every training setting.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

from ddplab.progress import Progress, silent
from ddplab.runtime.signals import RaiseOnSignals
from ddplab.serialize import write_json_atomic
from ddplab.study.command import executors, points
from ddplab.study.command.config import CommandOptions
from ddplab.study.command.engine import CommandEngine, workload_of
from ddplab.study.command.template import CommandTemplate
from ddplab.study.config import StudyConfig, StudyOptions
from ddplab.study.grid import analysis, training
from ddplab.study.grid.cache import Cache
from ddplab.study.report.output import check_out, require_matplotlib
from ddplab.study.report.records import TRAINING_LOSS, StudyReport


@dataclasses.dataclass(kw_only=True)
class CommandStudy:
    """What a command study found, and the runs that could not be trained."""

    report: StudyReport
    failed: list[str]
    """A line per run whose command failed twice, with the end of its output."""


def run_command_study(command: CommandOptions, config: StudyConfig, options: StudyOptions, *,
                      progress: Progress = silent) -> CommandStudy:
    """Train (or read back) every run of the grid by starting the command, fit, and write the study's files."""
    started = time.monotonic()
    template = CommandTemplate(tuple(command.command))
    points.check(template, config, options.world_size, options.max_batch_size_per_device)
    if options.plots:
        require_matplotlib()
    other = None
    if options.compare:
        from ddplab.study.grid.study import load_compared

        other = load_compared(options.compare)
    check_out(options.out)
    # Connected before the cache is touched: an executor that cannot run leaves no runs behind.
    executor = executors.build(command, options.world_size, options.out)
    workload = workload_of(template, command)
    fingerprint = config.fingerprint(workload.fingerprint)
    cache = Cache(options.out, fingerprint, fresh=options.fresh, settings=config.settings(workload.fingerprint))
    folder = os.path.join(options.out, "command-runs", fingerprint)
    if options.fresh:
        shutil.rmtree(os.path.join(options.out, "command-runs"), ignore_errors=True)
    bar = _Runs(progress, config)
    engine = CommandEngine(template, command, executor,
                           world_size=options.world_size, max_per_device=options.max_batch_size_per_device,
                           folder=folder, listen=bar.listen, finished=bar.finished)
    # SIGTERM or SIGHUP (a scheduler's cancel, `timeout`) stops the runs as Ctrl-C does, then ends the driver.
    try:
        with RaiseOnSignals():
            results = training.run_grid(workload, config, cache, engine, bar.advance)
    finally:
        bar.close()
    found = analysis.analyze(config, results)
    report = StudyReport(workload=workload.name, config=config, train_size=workload.train_size, analysis=found,
                         out=options.out, engine=f"command ({command.executor})",
                         engine_reason=f"each run one launch of: {template.text()}", device="the command's own",
                         own_optimizer=_own_optimizer(config, template),
                         target_read=command.metric or TRAINING_LOSS)
    _save(report, started)
    if options.plots and found.fit:
        from ddplab.study.report import figures, html

        report.plots = figures.plots(report.to_json(), results, options.out, compare=other)
        report.report = html.write_html(report.to_json(), os.path.join(options.out, "report.html"))
        _save(report, started)
    return CommandStudy(report=report, failed=engine.failed)


def _own_optimizer(config: StudyConfig, template: CommandTemplate) -> dict:
    """The optimizer as the report names it: the command's own, judged by the rules of ``--optimizer``'s family."""
    filled = [name for name in ("lr", "beta1", "beta2", "eps", "weight_decay") if name in template.names]
    name = f"the command's own, scaled by {config.optimizer.name}'s rules (ddplab sets its {', '.join(filled)})"
    return {"family": config.optimizer.family, "name": name}


def _save(report: StudyReport, started: float) -> None:
    report.seconds = time.monotonic() - started
    write_json_atomic(os.path.join(report.out, "study.json"), report.to_json())


class _Runs:
    """Progress in runs finished out of the runs planned; its status the runs running now and the last one done."""

    def __init__(self, progress: Progress, config: StudyConfig):
        self.progress, self.planned, self.max_steps = progress, _runs(config), config.max_steps
        self.completed, self.running, self.last, self.told = 0, 0, "", False

    @property
    def total(self) -> int:
        # A sweep's extensions and the rules' own groups add runs past the plan: the total grows with them.
        return max(self.planned, self.completed + self.running)

    def advance(self, steps: int) -> None:
        """The grid's step budget as the engines count it: a run's whole budget per run finished or read back."""
        runs = max(1, round(steps / self.max_steps))
        self.completed += runs
        if not self.told:
            # No run ended: the group was read back from the study's folder.
            self.last = f"{runs} run{'s' if runs > 1 else ''} read back, trained by an earlier driver"
        self.told = False
        self._tell()

    def listen(self, queued: int, running: int, done: int) -> None:
        self.running = running
        self._tell()

    def finished(self, line: str) -> None:
        self.last, self.told = line, True

    def _tell(self) -> None:
        running = f"{self.running} running" if self.running else ""
        self.progress(self.completed, self.total, "; ".join(filter(None, [self.last, running])))

    def close(self) -> None:
        # The runs there were: fewer than planned where runs were read back or pruned.
        self.progress(self.completed, self.completed, self.last)


def _runs(config: StudyConfig) -> int:
    # The grid's runs as planned; a sweep's extensions and the rules' own groups add to it as they come.
    from ddplab.study.rules import sweep

    return max(1, sum(len(sweep.grid_runs(config, b)) for b in config.global_batch_sizes))
