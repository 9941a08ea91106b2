"""The critical batch where a training is: short branches from its checkpoints at larger global batches.

From each checkpoint (a model, its optimizer state and the samples it has seen), branches train at
the reference global batch × 1, 2, 4, … for the same number of samples, each batch with a small lr
sweep around the rule's lr and a few seeds, all runs of one batch vectorized as in the study's
engine (``torch.func.vmap`` over ``functional_call``, torch.optim's update as stacked foreach
steps). Each branch continues the data where the checkpoint left it: seed s draws DistributedSampler's
epoch permutations for s from the checkpoint's samples seen on, so at one seed every batch size
trains on the very same samples, only grouped differently. What is compared is the training loss
on the held-out split at the end of each branch; :mod:`ddplab.study.branched.judgement` judges it.

``branch_at`` first trains the reference run itself (reference batch and lr, seed 0) to the target,
then trains it again to the largest fraction, keeping its state (model and torch.optim's state) at each.

What cannot be vectorized (a spec's own ``step()``, another optimizer, a model that does not vmap), a sharding
strategy, ``--engine ddp`` and torchrun train the branches on real ranks instead
(:mod:`ddplab.study.engines.ddp_branches`), one launch per checkpoint; the reference run and B_simple stay in this
process (under torchrun: in every rank, and rank 0's checkpoints are everyone's).
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

from ddplab.errors import UsageError
from ddplab.progress import Progress, silent
from ddplab.runtime.launch import LaunchConfig, RankContext, launch, world_size_for
from ddplab.runtime.launch_config import under_torchrun
from ddplab.serialize import write_json_atomic
from ddplab.study import engines
from ddplab.study.branched import judgement, schedule
from ddplab.study.branched.cache import BranchCache, checkpoint_digest
from ddplab.study.branched.checkpoint import BranchTrainer, Checkpoint, Groups, Runs, Trained, held_out
from ddplab.study.branched.config import BranchConfig, scaled_lr
from ddplab.study.branched.judgement import Judge, _by_lr
from ddplab.study.branched.loading import load_checkpoint
from ddplab.study.branched.noise_scale import b_simple_at_checkpoint
from ddplab.study.branched.reference import reference_checkpoints
from ddplab.study.config import StudyConfig, StudyOptions
from ddplab.study.engines.choice import BranchEngine, engine_for, resolve_device
from ddplab.study.engines.vmap import threads
from ddplab.study.report.branched import BranchReport
from ddplab.study.report.branched_figure import branched_plot
from ddplab.study.report.branched_page import write_branched_html
from ddplab.study.report.output import check_out, require_matplotlib
from ddplab.study.workloads import Workload


def check_branches(workload: Workload, config: StudyConfig, branch: BranchConfig,
                   world_size: int | None = None) -> None:
    """Refuse what the branches cannot train, before anything trains (``world_size``: the ranks they train on,
    None when vectorized)."""
    reference = config.reference_global_batch_size
    largest = branch.global_batch_sizes(reference)[-1]
    if largest > workload.train_size:
        raise UsageError(f"the largest branched global batch {largest} is larger than the {workload.train_size} "
                         "training samples: lower {branch_doublings} or {reference_global_batch_size}")
    # Every branched batch is the reference × 2^i: the reference splitting evenly is enough.
    if world_size is not None and reference % world_size:
        raise UsageError(f"the reference global batch {reference} does not split evenly over {world_size} ranks "
                         f"({{world_size}}): give a {{reference_global_batch_size}} that is a multiple of {world_size}")
    if config.seeds < 2 and branch.branch_tolerance is None and branch.branch_lag is None:
        raise UsageError("the default tolerance is the reference batch's spread over its seeds, and one seed has "
                         "none: give {seeds} 2 or more, a {branch_tolerance} or a {branch_lag}")
    branch.samples(reference)
    held_out(workload)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Setup:
    """What the branches train on, decided (and every checkpoint file read) before anything trains."""

    workload: Workload
    config: StudyConfig
    branch: BranchConfig
    options: StudyOptions
    engine: BranchEngine
    why: str
    world_size: int | None
    device: torch.device
    checkpoints: list[Checkpoint]


def measure(workload: Workload, config: StudyConfig, branch: BranchConfig, options: StudyOptions | None = None, *,
            progress: Progress = silent, launch_config: LaunchConfig | None = None) -> BranchReport:
    """Branch from each checkpoint (``branch_from``) or from the reference run (``branch_at``), judge the critical
    batch at each, and write ``branched.json`` under ``out``, then (with ``plots``) draw ``branched.png``.

    Under torchrun every process calls this: the branches train across the job's ranks, and rank 0 alone writes
    branched.json and the figure (every rank returns the same measurement)."""
    options = options or StudyOptions()
    if options.plots:
        require_matplotlib()  # said before anything trains
    engine, why = engine_for(workload, options)
    world_size = world_size_for(None, default=options.world_size) if not engines.vectorized(engine) else None
    check_branches(workload, config, branch, world_size)
    # Every checkpoint is read and checked before the first branch trains.
    checkpoints = [load_checkpoint(workload, config, path) for path in branch.branch_from or ()]
    setup = _Setup(workload=workload, config=config, branch=branch, options=options, engine=engine, why=why,
                   world_size=world_size, device=resolve_device(options.device), checkpoints=checkpoints)
    if under_torchrun():
        return launch(_measure_in_group, launch_config or LaunchConfig(), setup, progress)[0]
    return _measure(setup, progress, launch_config, None)


def _measure_in_group(ctx: RankContext, setup: _Setup, progress: Progress) -> BranchReport:
    # The group stays up for the whole measurement: each checkpoint's launch joins it.
    return _measure(setup, progress if ctx.is_main else silent, LaunchConfig(), ctx)


def _measure(setup: _Setup, progress: Progress, launch_config: LaunchConfig | None,
             ctx: RankContext | None) -> BranchReport:
    started = time.monotonic()
    workload, config, branch, options = setup.workload, setup.config, setup.branch, setup.options
    main = ctx is None or ctx.is_main
    if main:
        check_out(options.out)
    # Under torchrun what trains in-process (the reference run, B_simple) does so on the rank's own device.
    device = ctx.device if ctx is not None and setup.device.type == "cuda" else setup.device
    samples = branch.samples(config.reference_global_batch_size)
    batches = branch.global_batch_sizes(config.reference_global_batch_size)
    rule = branch.lr_rule(config.optimizer.adam)
    per_checkpoint = sum(samples // b for b in batches)
    reference_steps = config.max_steps * 2 if branch.branch_at else 0
    total = reference_steps + per_checkpoint * (len(branch.branch_at or ()) or len(setup.checkpoints))
    advance = _Advance(progress, total)
    train = engines.branch_trainer(setup.engine, workload, config, device, options, launch_config, advance)
    cache = BranchCache(options.out, _cache_setting(setup, samples), fresh=options.fresh,
                        by_group=engines.vectorized(setup.engine)) if main else None
    with threads(options.threads):
        checkpoints, reference_run = setup.checkpoints, None
        if branch.branch_at:
            checkpoints, reference_run = reference_checkpoints(workload, config, branch.branch_at, device, advance)
            if ctx is not None and ctx.world_size > 1:
                checkpoints, reference_run = _rank_zeros(checkpoints, reference_run)
            advance.skip_to(reference_steps)
        found = []
        for checkpoint in checkpoints:
            remaining = reference_run["samples"] - checkpoint.samples_seen if reference_run else None
            batches_here, length = branch.ladder(config.reference_global_batch_size, remaining)
            found.append(_branch_from(workload, config, branch, checkpoint, rule, length, device,
                                      _Training(train, cache, checkpoint, length, advance, ctx, samples),
                                      batches_here, remaining))
    advance.finish()
    # A checkpoint whose branches cannot tell its critical batch (its interval spans the grid) takes no schedule step.
    steps = schedule.schedule([(f["samples_seen"], f["critical_batch_size"] if f["resolved"] else None,
                                {row["global_batch_size"]: row["lr"] for row in f["batches"]}) for f in found],
                              config.reference_global_batch_size, config.reference_lr)
    on_ranks = not engines.vectorized(setup.engine)
    report = BranchReport(workload=workload.name, config=config, branch=branch, lr_rule=rule, samples=samples,
                          branches=found, schedule=steps, reference_run=reference_run,
                          branch_samples_total=sum(f["branch_samples"] for f in found), out=options.out,
                          engine=setup.engine,
                          engine_reason=setup.why, world_size=setup.world_size,
                          strategy=options.strategy if on_ranks else None,
                          own_optimizer=workload.own_optimizer)
    report.seconds = time.monotonic() - started
    if main:
        values = report.to_json()
        write_json_atomic(os.path.join(options.out, "branched.json"), values)
        if options.plots:
            # branched.json is written before the plot is drawn, so a failing plot never loses a measurement.
            report.plots = [branched_plot(values, options.out)]
            # The page beside them: the curve, each checkpoint's row and the schedule.
            write_branched_html({**values, "plots": report.plots}, os.path.join(options.out, "branched.html"))
    return report


def _rank_zeros(checkpoints: list[Checkpoint], run: dict) -> tuple[list[Checkpoint], dict]:
    """Rank 0's reference checkpoints on every rank: each trained its own, and the branches must start alike."""
    shared = [checkpoints, run]
    dist.broadcast_object_list(shared, src=0)
    return shared[0], shared[1]


def _branch_from(workload: Workload, config: StudyConfig, branch: BranchConfig, checkpoint: Checkpoint, rule: str,
                 samples: int, device: torch.device, train: _Training, batches: tuple[int, ...],
                 run_left: int | None) -> dict:
    """One checkpoint's branches, batch after batch up ``batches`` until the judgement is settled, each batch's
    sweep extended past an edge its best lr sits on; judged. ``run_left``: the reference run's samples after the
    checkpoint (None for your own checkpoints)."""
    reference = config.reference_global_batch_size
    ref_steps = samples // reference
    lag_step = round((1 - branch.branch_lag) * ref_steps) if branch.branch_lag is not None else None
    groups: Groups = {}
    for batch in batches:
        lrs = judgement.sweep(scaled_lr(config.reference_lr, batch, reference, rule), config.sweep_factor)
        groups[batch] = ([(lr, seed) for lr in lrs for seed in range(config.seeds)],
                         {lag_step} if batch == reference and lag_step is not None else set())
    judge = Judge(groups=groups, reference=reference, samples=samples, tolerance=branch.branch_tolerance,
                  lag_step=lag_step, paired=branch.branch_paired)
    trained: Trained = {}
    while True:
        remaining = {batch: group for batch, group in groups.items() if batch not in trained}
        if remaining and (branch.branch_every_batch or not trained or not judge.settled(trained)):
            trained.update(train(remaining, None if branch.branch_every_batch else
                                 dataclasses.replace(judge, prior=dict(trained))))
        extra = _extensions(groups, trained, samples, config)
        if not extra:
            break
        # An lr past the edge may turn a miss into a match: the loop then goes on up the grid.
        train.advance.grow(sum(samples // batch for batch in extra))
        for batch, losses in train(extra, None).items():
            groups[batch] = (groups[batch][0] + extra[batch][0], groups[batch][1])
            trained[batch] = {step: trained[batch][step] + losses[step] for step in trained[batch]}
    judged = judge(trained)
    b_simple = b_simple_at_checkpoint(workload, config, checkpoint, branch.global_batch_sizes(reference)[-1], device)
    unresolved = judged.unresolved_note(checkpoint.samples_seen)
    cut = [b for b in branch.global_batch_sizes(reference) if b not in batches]
    return {"samples_seen": checkpoint.samples_seen, "source": checkpoint.source,
            "notes": [*checkpoint.notes, *([unresolved] if unresolved else []),
                      *_length_notes(checkpoint.samples_seen, samples, run_left, cut)],
            "length": samples, "beyond_run_global_batch_sizes": cut,
            "resolved": judged.resolved,
            "critical_batch_size": judged.critical_batch_size, "interval": list(judged.interval),
            "at_edge": judged.at_edge, "b_simple": b_simple, "reference_loss": judged.reference_loss,
            "tolerance": judged.tolerance, "batches": judged.rows,
            "untrained_global_batch_sizes": [batch for batch in groups if batch not in trained],
            "branch_samples": sum(len(groups[batch][0]) for batch in trained) * samples}


def _length_notes(samples_seen: int, length: int, remaining: int | None, cut: list[int]) -> list[str]:
    """What a checkpoint says of its branches' length against what the reference run had left after it."""
    notes = []
    if cut:
        notes.append(f"at {samples_seen} samples the reference run had {remaining} samples left: the branches train "
                     f"{length}, and global batch{'es' if len(cut) > 1 else ''} {', '.join(map(str, cut))}, whose 8 "
                     "steps would not fit, are left out")
    if remaining is not None and length > remaining:
        notes.append(f"at {samples_seen} samples the branches ({length} samples) run {length - remaining} samples past "
                     "the reference run's end: they judge each batch over training the run does not have, where a "
                     "larger batch catches up")
    return notes


def _extensions(groups: Groups, trained: Trained, samples: int, config: StudyConfig) -> Groups:
    """Each trained batch's next lr past the edge of its sweep (:func:`judgement.next_lr`), with every seed."""
    extra: Groups = {}
    for batch in trained:
        runs, record = groups[batch]
        lr = judgement.next_lr(_by_lr(runs, trained[batch][samples // batch]), config.sweep_factor)
        if lr is not None:
            extra[batch] = ([(lr, seed) for seed in range(config.seeds)], record)
    return extra


class _Training:
    """One checkpoint's branches trained through the cache: what it holds is read (by rank 0, under torchrun, and
    shared), what it lacks is trained and kept."""

    def __init__(self, train: BranchTrainer, cache: BranchCache | None, checkpoint: Checkpoint, samples: int,
                 advance: _Advance, ctx: RankContext | None, setting_samples: int):
        self.train, self.cache, self.checkpoint, self.samples, self.advance = train, cache, checkpoint, samples, advance
        self.shared = ctx is not None and ctx.world_size > 1
        # A branch shorter than the cache's setting says (cut to the run's end) is cached under its own length.
        own = "" if samples == setting_samples else f"|{samples}"
        self.digest = checkpoint_digest(checkpoint.model, checkpoint.optimizer, checkpoint.samples_seen) + own \
            if cache is not None else None

    def __call__(self, groups: Groups, judge: Judge | None) -> Trained:
        """The batches of ``groups`` in order, each read from the cache where it is there, none after one at which
        ``judge`` finds the judgement settled (no judge: every batch)."""
        trained: Trained = {}
        order = list(groups)
        found = {batch: self._cached(batch, *groups[batch]) for batch in order}
        while order:
            if found[order[0]] is not None:
                batch = order.pop(0)
                trained[batch] = found[batch]
                self.advance(self.samples // batch)
            else:
                # The batches up to the next cached one train together (one launch on ranks).
                block = {}
                while order and found[order[0]] is None:
                    batch = order.pop(0)
                    block[batch] = groups[batch]
                stop = dataclasses.replace(judge, prior={**judge.prior, **trained}).settled if judge else None
                fresh = self.train(self.checkpoint, block, self.samples, stop)
                for batch, losses in fresh.items():
                    if self.cache is not None:
                        self.cache.save(self.digest, batch, block[batch][0], losses)
                trained.update(fresh)
            if judge is not None and judge.settled({**judge.prior, **trained}):
                break
        return trained

    def _cached(self, batch: int, runs: Runs, record: set[int]) -> dict[int, list[float]] | None:
        found = self.cache.load(self.digest, batch, runs, record | {self.samples // batch}) \
            if self.cache is not None else None
        if self.shared:
            import torch.distributed as dist

            # Rank 0 reads the cache: every rank must take the same batches from it.
            shared = [found]
            dist.broadcast_object_list(shared, src=0)
            found = shared[0]
        return found


def _cache_setting(setup: _Setup, samples: int) -> dict:
    """What a branch's losses depend on besides its checkpoint, batch, lr and seed."""
    options, config = setup.options, setup.config
    ranks = {"world_size": setup.world_size, "strategy": options.strategy, "replicate": options.replicate,
             "reduce_dtype": options.reduce_dtype, "max_per_device": options.max_batch_size_per_device} \
        if not engines.vectorized(setup.engine) else {}
    return {"workload": setup.workload.fingerprint, "optimizer": config.optimizer.to_json(), "dtype": config.dtype,
            "own_optimizer": setup.workload.own_optimizer, "samples": samples, "engine": setup.engine,
            "device": setup.device.type, **ranks}


class _Advance:
    """The progress callback told of steps as they are trained, toward ``total``."""

    def __init__(self, progress: Progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, steps: int) -> None:
        self.done += steps
        # Lrs past a sweep's edge may still add steps: the bar reaches its end only when the measurement does.
        self.progress(min(self.done, self.total - 1), self.total, "")

    def finish(self) -> None:
        self.done = self.total
        self.progress(self.total, self.total, "")

    def grow(self, steps: int) -> None:
        """Steps the measurement adds as it goes (lrs past a sweep's edge)."""
        self.total += steps

    def skip_to(self, done: int) -> None:
        """Steps budgeted but not needed (a reference run that reached its target early) count as done."""
        if done > self.done:
            self(done - self.done)
