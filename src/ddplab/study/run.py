"""``ddplab study`` as one library call: train the grid, analyse, verify, save the results, then draw."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator

import torch

from ddplab.errors import UsageError, literal
from ddplab.progress import Progress, silent
from ddplab.runtime.launch import LaunchConfig
from ddplab.serialize import write_json_atomic
from ddplab.study import analysis, grid, workloads
from ddplab.study.config import StudyConfig, StudyOptions
from ddplab.study.report import StudyReport
from ddplab.study.verify import verify_ddp
from ddplab.study.workloads import Workload


def workload_for(spec: str | None) -> Workload:
    """The spec's workload, or the built-in digits one."""
    return workloads.from_spec(spec) if spec else workloads.digits()


def spec_defaults(workload: Workload) -> dict:
    """StudyConfig fields the spec's own optimizer() sets: its family and hyperparameters, and its lr as the
    reference lr (what a flag or a caller gives wins)."""
    if workload.not_vectorized:
        raise UsageError(f"spec {literal(workload.name)}: {literal(workload.not_vectorized)}; the study trains SGD, "
                         "Adam and AdamW: give {optimizer.family} and its settings")
    out = {}
    if workload.optimizer is not None:
        out["optimizer"] = workload.optimizer
    if workload.lr is not None:
        out["reference_lr"] = workload.lr
    return out


def run_study(workload: Workload, config: StudyConfig, options: StudyOptions | None = None, *,
              progress: Progress = silent, launch_config: LaunchConfig | None = None) -> StudyReport:
    """Train (or read from the cache) every run of the grid, fit, and write study.json, plots and report.html.

    study.json is written before anything is drawn, so a failing plot never loses a finished study.
    """
    started = time.monotonic()
    options = options or StudyOptions()
    if options.plots:
        require_matplotlib()
    check_out(options.out)
    grid.check_grid(workload, config)
    cache = grid.Cache(options.out, config.fingerprint(workload.fingerprint), fresh=options.fresh)
    with _threads(options.threads):
        results = grid.run_grid(workload, config, cache, _advance(progress, config))
    found = analysis.analyze(config, results)
    report = StudyReport(workload=workload.name, config=config, train_size=workload.train_size, analysis=found,
                         out=options.out)
    if options.verify_ddp:
        report.verify_ddp = verify_ddp(workload, config, options.verify_ddp, world_size=options.verify_world_size,
                                       steps=options.verify_steps, tuned=found.tuned_lr, launch_config=launch_config)
    _save(report, options, started)
    if options.plots and found.reached:
        from ddplab.study import plots

        report.plots = plots.plots(report.to_json(), results, options.out)
        report.report = plots.write_html(report.to_json(), os.path.join(options.out, "report.html"))
        _save(report, options, started)
    return report


def _save(report: StudyReport, options: StudyOptions, started: float) -> None:
    report.seconds = time.monotonic() - started
    write_json_atomic(os.path.join(options.out, "study.json"), report.to_json())


def _advance(progress: Progress, config: StudyConfig):
    total, done = config.max_steps * grid.groups(config), 0

    def advance(steps: int) -> None:
        nonlocal done
        done += steps
        progress(done, total, "")

    return advance


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def check_out(directory: str) -> None:
    """Make sure the output directory exists and takes files, before anything trains."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"{{out}} {literal(directory)} is a file: give a directory for the study's cache and results")
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise UsageError(f"{{out}} {literal(directory)} is not writable ({literal(exc.strerror or exc)}): choose "
                         "another {out}") from None


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("ddplab study's plots need matplotlib: pip install 'ddplab[study]' (or {plots=False})") \
            from None
