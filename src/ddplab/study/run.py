"""``ddplab study`` as one library call: train the grid, analyse, verify, save the results, then draw."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
import time
from collections.abc import Iterator

import torch

from ddplab.errors import UsageError, literal
from ddplab.progress import Progress, silent
from ddplab.runtime.launch import LaunchConfig, RankContext, launch, world_size_for
from ddplab.runtime.launch_config import under_torchrun
from ddplab.serialize import write_json_atomic
from ddplab.study import analysis, ddp, grid, workloads
from ddplab.study.config import ADAPTIVE_RULES, StudyConfig, StudyOptions
from ddplab.study.engine import seconds_per_step as engine_seconds
from ddplab.study.engine import train_group
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


def run_study(workload: Workload, config: StudyConfig, options: StudyOptions | None = None, *,
              progress: Progress = silent, launch_config: LaunchConfig | None = None) -> StudyReport:
    """Train (or read from the cache) every run of the grid, fit, and write study.json, plots and report.html.

    study.json is written before anything is drawn, so a failing plot never loses a finished study.
    Under torchrun every process calls this: the grid's runs train across the job's ranks, and rank 0
    owns the cache, study.json and the plots.
    """
    options = options or StudyOptions()
    engine, why = choose_engine(workload, config, options)
    device = resolve_device(options.device)
    if under_torchrun():
        return launch(_study_in_group, launch_config or LaunchConfig(), workload, config, options, engine, why,
                      device, progress)[0]
    return _study(workload, config, options, engine, why, device, progress, launch_config, rank=None)


def _study_in_group(ctx: RankContext, workload, config, options, engine, why, device, progress) -> StudyReport:
    # The group stays up for the whole study: each batch's launch joins it, and the cache's answers are broadcast.
    return _study(workload, config, options, engine, why, device, progress if ctx.is_main else silent,
                  LaunchConfig(), rank=ctx.rank)


def _study(workload, config, options, engine, why, device, progress, launch_config, *, rank) -> StudyReport:
    started = time.monotonic()
    main = rank in (None, 0)
    if options.plots and main:
        require_matplotlib()
    other = load_compared(options.compare) if options.compare and main else None
    cache = None
    if main:
        check_out(options.out)
        grid.check_grid(workload, config)
        cache = grid.Cache(options.out, config.fingerprint(workload.fingerprint), fresh=options.fresh)
    if rank is not None:
        cache = grid.RankZeroCache(cache, rank)
    train = _trainer(engine, device, options, launch_config)
    with _threads(options.threads if engine == "vmap" else torch.get_num_threads()):
        results = grid.run_grid(workload, config, cache, _advance(progress, config), train)
    if isinstance(train, TimedTrainer):
        engine, why = train.summary()
    found = analysis.analyze(config, results)
    report = StudyReport(workload=workload.name, config=config, train_size=workload.train_size, analysis=found,
                         own_optimizer=workload.own_optimizer,
                         out=options.out, engine=engine, engine_reason=why, device=str(device))
    if options.verify_ddp and engine == "vmap":
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
    adaptive = [rule for rule in config.rules if rule in ADAPTIVE_RULES]
    if options.engine == "vmap" or (options.engine == "auto" and not workload.not_vectorized
                                    and not under_torchrun()):
        if workload.not_vectorized:
            raise UsageError(f"{{engine}} vmap cannot train {literal(workload.name)}: "
                             f"{literal(workload.not_vectorized)}; use {{engine}} ddp (or auto)")
        if under_torchrun():
            raise UsageError("under torchrun the grid runs across the job's ranks: use {engine} ddp (or auto)")
        if options.engine == "auto" and not _has_buffers(workload):
            return "auto", "timed per batch size"
        return "vmap", ("asked for" if options.engine == "vmap" else
                        "the model and optimizer vectorize: every run of a batch size trains at once in one process")
    if "adascale" in adaptive and world_size_for(None, default=options.world_size) < 2:
        raise UsageError("the rule adascale on the DDP engine measures the noise scale across ranks: give "
                         "{world_size} 2 or more, or drop it from {rules}")
    if "ramp" in adaptive and under_torchrun():
        raise UsageError("the rule ramp trains in one process: drop it from {rules} under torchrun")
    if options.engine == "ddp":
        return "ddp", "asked for"
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


def _trainer(engine: str, device: torch.device, options: StudyOptions, launch_config: LaunchConfig | None):
    """The function that trains one group on the chosen engine and device."""
    vectorized = functools.partial(train_group, device=device)
    if engine == "vmap":
        return vectorized
    launch_config = dataclasses.replace(launch_config or LaunchConfig(),
                                        world_size=world_size_for(None, default=options.world_size),
                                        backend="nccl" if device.type == "cuda" else "gloo")

    def on_ranks(workload, config, global_batch, runs, advance=None, *, sweep_only=(), adascale=False,
                 adam_sqrt=False):
        results = ddp.train_group_ddp(workload, config, global_batch, runs, launch_config, adam_sqrt=adam_sqrt,
                                      adascale=adascale, max_per_device=options.max_batch_size_per_device,
                                      sweep_only=set(sweep_only))
        if advance:
            advance(config.max_steps)
        return results

    return on_ranks if engine == "ddp" else TimedTrainer(vectorized, on_ranks, device)


CLEAR_GAIN = 1.5
"""Run by run must be this much faster per step than the vectorized group for ``--engine auto`` to take it: the
in-process timing leaves out the DDP engine's launch, collectives and rank 0's evaluations."""


def auto_engine(vectorized_s: float, run_by_run_s: float) -> str:
    """The engine ``--engine auto`` takes for a group from its two timed steps."""
    # A few timed steps are noisy: the group leaves the vectorized engine (which also measures B_simple from halves
    # and prunes in step) only for a clear gain.
    return "vmap" if vectorized_s < run_by_run_s * CLEAR_GAIN else "ddp"


class TimedTrainer:
    """``--engine auto``: before each group, a step timed both ways; the group trains where it was faster."""

    def __init__(self, vectorized, on_ranks, device: torch.device):
        self.vectorized, self.on_ranks, self.device = vectorized, on_ranks, device
        self.chosen: dict[int, tuple[str, float, float]] = {}
        """Per global batch: (engine, vectorized s/step, run-by-run s/step)."""

    def __call__(self, workload, config, global_batch, runs, advance=None, *, adascale=False, **kwargs):
        # AdaScale's runs measure at every step, cheapest inside the group: they stay vectorized.
        if adascale or len(runs) < 2:
            return self.vectorized(workload, config, global_batch, runs, advance, adascale=adascale, **kwargs)
        if global_batch not in self.chosen:
            group, loop = engine_seconds(workload, config, global_batch, runs, self.device)
            self.chosen[global_batch] = (auto_engine(group, loop), group, loop)
        train = self.vectorized if self.chosen[global_batch][0] == "vmap" else self.on_ranks
        return train(workload, config, global_batch, runs, advance, adascale=adascale, **kwargs)

    def summary(self) -> tuple[str, str]:
        """(engine, why) for the report: which engine each batch size took, with the timings."""
        engines = sorted({choice for choice, _, _ in self.chosen.values()}, reverse=True)
        parts = [f"{b}: {choice} ({group * 1e3:.3g} ms vectorized vs {loop * 1e3:.3g} ms run by run per step)"
                 for b, (choice, group, loop) in sorted(self.chosen.items())]
        return "+".join(engines) or "vmap", "timed per global batch: " + "; ".join(parts)


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
