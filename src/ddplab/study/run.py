"""``ddplab study`` as one library call: train the grid, analyse, verify, save the results, then draw."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import torch

from ddplab.errors import UsageError, literal
from ddplab.progress import Progress, silent
from ddplab.runtime import strategies
from ddplab.runtime.launch import LaunchConfig, RankContext, launch, world_size_for
from ddplab.runtime.launch_config import under_torchrun
from ddplab.serialize import write_json_atomic
from ddplab.study import analysis, engines, grid, rules, workloads
from ddplab.study.config import StudyConfig, StudyOptions
from ddplab.study.engines.base import Engine
from ddplab.study.engines.ddp import DdpEngine
from ddplab.study.engines.vmap import VmapEngine, threads
from ddplab.study.report import StudyReport
from ddplab.study.verify import verify_ddp
from ddplab.study.workloads import Workload


def workload_for(spec: str | None, name: str | None = None) -> Workload:
    """The spec's workload, or the built-in one named (digits by default)."""
    if spec:
        return workloads.from_spec(spec)
    return workloads.load((name or "digits", ()))


def workload_defaults(workload: Workload) -> dict:
    """StudyConfig fields the workload sets (what a flag or a caller gives wins): a built-in workload's documented
    target and grid; a spec's optimizer() family and hyperparameters, and its lr as the reference lr."""
    out = dict(workload.defaults)
    if workload.optimizer is not None:
        out["optimizer"] = workload.optimizer
    if workload.lr is not None:
        out["reference_lr"] = workload.lr
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Setup:
    """What a study runs on, decided before anything trains."""

    workload: Workload
    config: StudyConfig
    options: StudyOptions
    engine: str
    """The engine asked for or chosen: vmap, ddp or auto."""
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
        grid.check_grid(workload, config)
        cache = grid.Cache(options.out, config.fingerprint(workload.fingerprint), fresh=options.fresh,
                           settings=config.settings(workload.fingerprint))
    if rank is not None:
        cache = grid.RankZeroCache(cache, rank)
    engine = build_engine(setup.engine, setup.device, options, launch_config)
    with threads(options.threads if setup.engine == "vmap" else torch.get_num_threads()):
        results = grid.run_grid(workload, config, cache, engine, _advance(progress, config))
    name, why = engine.summary() if isinstance(engine, engines.Auto) else (setup.engine, setup.why)
    found = analysis.analyze(config, results)
    report = StudyReport(workload=workload.name, config=config, train_size=workload.train_size, analysis=found,
                         own_optimizer=workload.own_optimizer,
                         out=options.out, engine=name, engine_reason=why, device=str(setup.device))
    if options.verify_ddp and name == "vmap":
        report.verify_ddp = verify_ddp(workload, config, options.verify_ddp, world_size=options.verify_world_size,
                                       steps=options.verify_steps, tuned=found.tuned_lr, launch_config=launch_config)
    if not main:
        return report
    _save(report, options, started)
    if options.plots and found.fit:  # a figure needs a curve: some rule fitted at two batch sizes
        from ddplab.study import plots

        report.plots = plots.plots(report.to_json(), results, options.out, compare=other)
        report.report = plots.write_html(report.to_json(), os.path.join(options.out, "report.html"))
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


def choose_engine(workload: Workload, config: StudyConfig, options: StudyOptions) -> tuple[str, str]:
    """(engine, why): what trains the grid, and the reason in words."""
    if options.engine == "vmap" or (options.engine == "auto" and not workload.not_vectorized
                                    and not under_torchrun() and options.wraps_in_ddp):
        if not options.wraps_in_ddp:
            raise UsageError(f"{{strategy}} {options.strategy} wraps the model on ranks, which only the DDP engine "
                             "starts: use {engine} ddp (or auto)")
        if workload.not_vectorized:
            raise UsageError(f"{{engine}} vmap cannot train {literal(workload.name)}: "
                             f"{literal(workload.not_vectorized)}; use {{engine}} ddp (or auto)")
        if under_torchrun():
            raise UsageError("under torchrun the grid runs across the job's ranks: use {engine} ddp (or auto)")
        if options.engine == "auto" and not _has_buffers(workload):
            return "auto", "timed per batch size"
        return "vmap", ("asked for" if options.engine == "vmap" else
                        "the model and optimizer vectorize: every run of a batch size trains at once in one process")
    for rule in rules.of(config):
        if rule.multi_rank and world_size_for(None, default=options.world_size) < 2:
            raise UsageError(f"the rule {rule.name} on the DDP engine measures the noise scale across ranks: give "
                             "{world_size} 2 or more, or drop it from {rules}")
        if rule.single_process and under_torchrun():
            raise UsageError(f"the rule {rule.name} trains in one process: drop it from {{rules}} under torchrun")
    if options.engine == "ddp":
        return "ddp", "asked for"
    if not options.wraps_in_ddp:
        return "ddp", f"the {options.strategy} strategy wraps the model on ranks"
    if under_torchrun():
        return "ddp", "under torchrun: the grid's runs train across the job's ranks"
    return "ddp", f"the spec cannot be vectorized: {workload.not_vectorized}"


def _has_buffers(workload: Workload) -> bool:
    # BatchNorm normalizes over the global batch when vectorized, per rank on DDP: one engine for all batches.
    return any(True for _ in workload.model().buffers())


def resolve_device(device: str) -> torch.device:
    """The device runs train on: ``auto`` is CUDA where there is one."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("{device} cuda, but torch sees no CUDA device here: use {device} cpu (or auto)")
    return torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")


def build_engine(name: str, device: torch.device, options: StudyOptions, launch_config: LaunchConfig | None):
    """The engine ``name`` (vmap, ddp, or auto over both) on ``device``."""
    vectorized = VmapEngine(device)
    if name == "vmap":
        return vectorized
    world_size = world_size_for(None, default=options.world_size)
    if device.type == "cuda" and not under_torchrun() and world_size > torch.cuda.device_count():
        if name == "auto":
            # No rank could have a GPU of its own: the grid stays vectorized rather than fail mid-study.
            return engines.Auto([vectorized])
        raise UsageError(f"the DDP engine gives each of its {world_size} ranks a GPU of its own, but torch sees "
                         f"{torch.cuda.device_count()}: give {{world_size}} {torch.cuda.device_count()} or fewer, or "
                         "{device} cpu")
    launch_config = dataclasses.replace(launch_config or LaunchConfig(), world_size=world_size,
                                        backend="nccl" if device.type == "cuda" else "gloo")
    strategy = strategies.get(options.strategy, **options.strategy_options())
    strategy.check_runnable(world_size)
    on_ranks: Engine = DdpEngine(launch_config, max_per_device=options.max_batch_size_per_device, device=device,
                                 strategy=strategy)
    return on_ranks if name == "ddp" else engines.Auto([vectorized, on_ranks])


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
