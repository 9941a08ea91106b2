"""``ddplab study`` as one library call: train the grid, analyse, verify, save the results, then draw."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from ddplab.errors import UsageError, literal
from ddplab.progress import Progress, silent
from ddplab.runtime.launch import LaunchConfig, RankContext, launch
from ddplab.runtime.launch_config import under_torchrun
from ddplab.serialize import write_json_atomic
from ddplab.study import engines
from ddplab.study.config import StudyConfig, StudyOptions
from ddplab.study.engines.choice import build_engine, choose_engine, resolve_device
from ddplab.study.engines.vmap import threads
from ddplab.study.grid import analysis, training
from ddplab.study.grid.cache import Cache, RankZeroCache
from ddplab.study.grid.verify import verify_ddp
from ddplab.study.report.output import check_out, require_matplotlib
from ddplab.study.report.records import StudyReport
from ddplab.study.workloads import Workload


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Setup:
    """What a study runs on, decided before anything trains."""

    workload: Workload
    config: StudyConfig
    options: StudyOptions
    engine: str
    """The engine asked for or chosen: vmap, ddp or fastest."""
    why: str
    device: torch.device


def run_study(workload: Workload, config: StudyConfig, options: StudyOptions | None = None, *,
              progress: Progress = silent, launch_config: LaunchConfig | None = None) -> StudyReport:
    """Train (or read from the cache) every run of the grid, fit, and write study.json, plots and report.html.

    study.json is written before anything is drawn, so a failing plot never loses a finished study.
    Under torchrun every process calls this: the grid's runs train across the job's ranks, and rank 0
    owns the cache, study.json and the plots.
    """
    options = options or StudyOptions()
    engine, why = choose_engine(workload, config, options)
    setup = _Setup(workload=workload, config=config, options=options, engine=engine, why=why,
                   device=resolve_device(options.device))
    if under_torchrun():
        return launch(_study_in_group, launch_config or LaunchConfig(), setup, progress)[0]
    return _study(setup, progress, launch_config, rank=None)


def _study_in_group(ctx: RankContext, setup: _Setup, progress) -> StudyReport:
    # The group stays up for the whole study: each batch's launch joins it, and the cache's answers are broadcast.
    return _study(setup, progress if ctx.is_main else silent, LaunchConfig(), rank=ctx.rank)


def _study(setup: _Setup, progress, launch_config, *, rank) -> StudyReport:
    started = time.monotonic()
    workload, config, options = setup.workload, setup.config, setup.options
    main = rank in (None, 0)
    if options.plots and main:
        require_matplotlib()
    other = load_compared(options.compare) if options.compare and main else None
    cache = None
    if main:
        check_out(options.out)
        training.check_grid(workload, config)
        cache = Cache(options.out, config.fingerprint(workload.fingerprint), fresh=options.fresh,
                           settings=config.settings(workload.fingerprint))
    if rank is not None:
        cache = RankZeroCache(cache, rank)
    engine = build_engine(setup.engine, setup.device, options, launch_config)
    with threads(options.threads if engines.vectorized(setup.engine) else torch.get_num_threads()):
        results = training.run_grid(workload, config, cache, engine, _advance(progress, config))
    name, why = engine.summary() if isinstance(engine, engines.Fastest) else (setup.engine, setup.why)
    found = analysis.analyze(config, results)
    report = StudyReport(workload=workload.name, config=config, train_size=workload.train_size, analysis=found,
                         own_optimizer=workload.own_optimizer,
                         out=options.out, engine=name, engine_reason=why, device=str(setup.device))
    if options.verify_ddp and engines.vectorized(name):
        report.verify_ddp = verify_ddp(workload, config, options.verify_ddp, world_size=options.verify_world_size,
                                       steps=options.verify_steps, tuned=found.tuned_lr, launch_config=launch_config)
    if not main:
        return report
    _save(report, options, started)
    if options.plots and found.fit:  # a figure needs a curve: some rule fitted at two batch sizes
        from ddplab.study.report import figures, html

        report.plots = figures.plots(report.to_json(), results, options.out, compare=other)
        report.report = html.write_html(report.to_json(), os.path.join(options.out, "report.html"))
        _save(report, options, started)
    return report


def load_compared(path: str) -> dict:
    """The study.json given to compare with, checked before anything trains."""
    import json

    try:
        with open(path) as fh:
            other = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{{compare}} {literal(path)} cannot be read as a study's JSON ({literal(exc)})") from None
    if not isinstance(other, dict) or not all(key in other for key in ("tuned_lr", "reference", "optimizer")):
        raise UsageError(f"{{compare}} {literal(path)} is no study.json of ddplab study (no tuned_lr, reference or "
                         "optimizer)")
    return other


def _save(report: StudyReport, options: StudyOptions, started: float) -> None:
    report.seconds = time.monotonic() - started
    write_json_atomic(os.path.join(options.out, "study.json"), report.to_json())


def _advance(progress: Progress, config: StudyConfig):
    total, done = config.max_steps * training.groups(config), 0

    def advance(steps: int) -> None:
        nonlocal done
        done += steps
        progress(done, total, "")

    return advance
