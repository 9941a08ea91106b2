"""What the auditor knows about learning-rate schedulers, judged by their effect.

- ``SCHEDULER_STEPS_PER_PROCESS``: a scheduler steps several times per optimizer step (Accelerate
  steps a prepared scheduler once per process); a warning once the lr reaches 0 while training
  goes on, which is watched for the whole run (one float read per optimizer step), not only the
  audited window; an info at the run's end where the lr stopped changing for the second half of
  the run or more (the schedule ran out early). A constant lr, or a schedule whose lengths were
  multiplied by the processes (it changes until the end), says nothing.
- ``LR_SCALED_NOT_SCHEDULE``: the optimizer's lr was scaled by W or √W (under a device mesh, also by
  the data-parallel size D or √D) after its scheduler was built. A warning where the scheduler
  recomputes every lr from its ``base_lrs`` (LambdaLR, OneCycleLR, CyclicLR), so its next step
  brings the unscaled schedule back; information where it multiplies the current lr (StepLR,
  ExponentialLR, ...), which keeps the scaling.
- ``LR_SCALED_BY_WORLD_SIZE``: under a device mesh with model-parallel ranks, that scaling was by the
  world size, where the global batch grows with the data-parallel size only (a ratio that D or √D
  also explains is no evidence: on a 2 × 2 mesh √W is D).
"""

from __future__ import annotations

import functools
import math
import sys
import weakref

import torch
from torch.optim import lr_scheduler
from torch.utils.weak import WeakIdKeyDictionary

from ddplab.auditor import state
from ddplab.guest.patches import Patches

# Optimizer steps whose lr the detail lists.
LR_HISTORY = 8
# Closed optimizer-step intervals that must all show several scheduler steps before it is reported.
SCHEDULER_EVIDENCE = 2
# Schedulers whose every step sets lr = base_lr × f(step): a scaling of the lr alone does not survive it.
FROM_BASE_LRS = (lr_scheduler.LambdaLR, lr_scheduler.OneCycleLR, lr_scheduler.CyclicLR)


class SchedulerWatch:
    """Scheduler steps seen between consecutive steps of its optimizer."""

    def __init__(self):
        self.since_step = 0
        self.per_step: list[int] = []
        self.base_lrs: list[float] | None = None  # as built: scaled later together with the lr, no finding


class OptimizerWatch:
    """One optimizer's lr over its steps, and the schedulers built on it."""

    def __init__(self):
        self.steps = 0
        self.schedulers: weakref.WeakSet = weakref.WeakSet()
        self.lrs: list[float] = []
        self.positive_seen = False
        self.zero_at: int | None = None
        self.last_lr: float | None = None
        self.last_change: int | None = None  # the optimizer step at which the lr last changed


class _Tables:
    """This process's side tables (weak: they die with the user's optimizers and schedulers)."""

    def __init__(self):
        self.optimizers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.schedulers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.depth = 0


_TABLES = _Tables()


def install(patches: Patches) -> None:
    """Watch every lr scheduler's construction and steps."""
    global _TABLES
    _TABLES = _Tables()
    patches.replace(lr_scheduler.LRScheduler, "__init__", _watched_init)
    patches.replace(lr_scheduler.LRScheduler, "step", _watched_step)


def _watched_init(original_init):
    @functools.wraps(original_init)
    def __init__(self, optimizer, *args, **kwargs):
        # Registered first: the scheduler's own initial step happens inside __init__.
        _scheduler_built(self, optimizer)
        original_init(self, optimizer, *args, **kwargs)
        _scheduler_ready(self)

    return __init__


def _watched_step(original_step):
    @functools.wraps(original_step)
    def step(self, *args, **kwargs):
        _TABLES.depth += 1
        try:
            return original_step(self, *args, **kwargs)
        finally:
            _TABLES.depth -= 1
            # Only the outermost step counts: SequentialLR and ChainedScheduler step their children.
            if _TABLES.depth == 0:
                _scheduler_stepped(self)

    return step


def _torch_optimizer(optimizer):
    """The torch optimizer under a framework's wrapper (Accelerate's AcceleratedOptimizer), whose steps hooks see."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


@state.guarded("watching an lr scheduler")
def _scheduler_built(audit, scheduler, optimizer) -> None:
    optimizer = _torch_optimizer(optimizer)
    watch = _TABLES.optimizers.get(optimizer)
    if watch is None:
        watch = _TABLES.optimizers[optimizer] = OptimizerWatch()
    watch.schedulers.add(scheduler)
    _TABLES.schedulers[scheduler] = SchedulerWatch()


@state.guarded("watching an lr scheduler")
def _scheduler_ready(audit, scheduler) -> None:
    watch = _TABLES.schedulers.get(scheduler)
    if watch is not None:
        watch.base_lrs = list(getattr(scheduler, "base_lrs", []))


@state.guarded("counting lr scheduler steps")
def _scheduler_stepped(audit, scheduler) -> None:
    watch = _TABLES.schedulers.get(scheduler)
    if watch is None and getattr(scheduler, "optimizer", None) is not None:
        # Built before the auditor was installed (ddplab.audit called from the script): watched from now on.
        _scheduler_built(scheduler, scheduler.optimizer)
        return
    if watch is not None:
        watch.since_step += 1


def check(audit, optimizer) -> None:
    """After ``optimizer`` stepped: count its schedulers' steps since the last one and follow its lr."""
    watch = _TABLES.optimizers.get(optimizer)
    if watch is None:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    if watch.steps == 0:
        _check_lr_scaled(audit, watch, optimizer)
    # The interval before the first step holds the scheduler's own initial step: it is not a step's worth.
    for scheduler in list(watch.schedulers):
        sched = _TABLES.schedulers.get(scheduler)
        if sched is not None:
            if watch.steps > 0:
                sched.per_step.append(sched.since_step)
            sched.since_step = 0
    _note_lr(watch, lrs)
    watch.steps += 1
    _check_steps_per_process(audit, watch)


def configured_lr(optimizer, seen: float | None) -> float | None:
    """The lr the run is configured with: its schedule's peak or base (``max_lr``, ``initial_lr``, which schedulers
    keep in the param group), else the highest lr seen so far (``seen``) and now: never one step's point on a curve."""
    group = optimizer.param_groups[0]
    for key in ("max_lr", "initial_lr"):
        value = _as_float(group.get(key))
        if value is not None and value > 0:
            return value
    lr = _as_float(group.get("lr"))
    if lr is None:
        return seen
    return lr if seen is None else max(seen, lr)


PEAK_ATTRIBUTES = ("max_lrs", "org_lrs", "base_lrs")
"""Where a scheduler keeps the lrs it rises to: DeepSpeed's WarmupLR, WarmupDecayLR and OneCycle (``max_lrs``), its
WarmupCosineLR (``org_lrs``), torch's (``base_lrs``, each group's ``initial_lr``)."""


def scheduler_peak_lr(scheduler) -> float | None:
    """The highest lr ``scheduler`` is configured to reach (the header's lr on every engine: the configured one,
    never a point the warmup passes through); None where it keeps none."""
    for name in PEAK_ATTRIBUTES:
        values = [_as_float(v) for v in getattr(scheduler, name, None) or ()]
        if values and all(v is not None and v > 0 for v in values):
            return max(values)
    return None


def _as_float(value) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _note_lr(watch: OptimizerWatch, lrs: list[float]) -> None:
    if len(watch.lrs) < LR_HISTORY:
        watch.lrs.append(lrs[0])
    if watch.last_lr is not None and lrs[0] != watch.last_lr:
        watch.last_change = watch.steps
    watch.last_lr = lrs[0]
    if any(lr > 0 for lr in lrs):
        watch.positive_seen = True
    elif watch.positive_seen and watch.zero_at is None:
        # The schedule reached its end (lr 0) and the optimizer still steps: the rest of training is lost.
        watch.zero_at = watch.steps


def _steps_per_process(watch: OptimizerWatch) -> int | None:
    """Scheduler steps per optimizer step, where two intervals each showed several; None otherwise."""
    counts = [c for s in watch.schedulers if (w := _TABLES.schedulers.get(s)) is not None
              for c in [w.per_step[:SCHEDULER_EVIDENCE]] if len(c) == SCHEDULER_EVIDENCE and min(c) >= 2]
    return counts[0][0] if counts else None


def _check_steps_per_process(audit, watch: OptimizerWatch) -> None:
    per_step = _steps_per_process(watch)
    code = "SCHEDULER_STEPS_PER_PROCESS"
    known = audit.findings.get(code)
    if per_step is None or watch.zero_at is None or (known is not None and known.severity == "warning"):
        return
    audit.findings.pop(code, None)
    audit.add(code, f"{_stepped(per_step)}; the lr reached 0 at optimizer step {watch.zero_at} and training went on "
                    f"at lr 0 ({_history(watch)})", severity="warning")


def _stepped(per_step: int) -> str:
    return f"the lr scheduler stepped {per_step} times per optimizer step{_accelerate_note(per_step)}"


def _history(watch: OptimizerWatch) -> str:
    return f"lr at optimizer steps 0-{len(watch.lrs) - 1}: " + ", ".join(f"{lr:.4g}" for lr in watch.lrs)


@state.guarded("judging lr schedules at exit")
def at_exit(audit) -> None:
    """At the run's end: a schedule that stopped changing halfway while its scheduler stepped several times per
    optimizer step ran out early (a constant lr, or a schedule that changes to the end, says nothing)."""
    if "SCHEDULER_STEPS_PER_PROCESS" in audit.findings:
        return
    for watch in list(_TABLES.optimizers.values()):
        per_step = _steps_per_process(watch)
        if per_step is None or watch.last_change is None or watch.zero_at is not None:
            continue
        flat = watch.steps - watch.last_change  # optimizer steps taken at the final lr
        if flat >= max(SCHEDULER_EVIDENCE, watch.steps // 2):
            audit.add("SCHEDULER_STEPS_PER_PROCESS",
                      f"{_stepped(per_step)}, and the lr stopped changing at optimizer step {watch.last_change} "
                      f"of {watch.steps}: a warmup or decay given in optimizer steps ended {per_step} times early "
                      f"({_history(watch)}; {watch.last_lr:.4g} from then on)", severity="info")
            return


def _accelerate_note(per_step: int) -> str:
    shared = accelerate_state()
    if shared is not None and shared.get("num_processes") == per_step:
        return " (Accelerate steps a prepared scheduler once per process: split_batches=False)"
    return ""


def accelerate_state() -> dict | None:
    """Accelerate's shared process state, when the program uses Accelerate."""
    module = sys.modules.get("accelerate.state")
    shared = getattr(getattr(module, "PartialState", None), "_shared_state", None)
    return shared if shared else None


def _check_lr_scaled(audit, watch: OptimizerWatch, optimizer) -> None:
    """At the first step: an lr that is W or √W times what its scheduler last set was scaled behind its back."""
    world_size = audit.world_size if audit.world_size > 1 else _launched_world_size()
    if world_size < 2:
        return
    for scheduler in list(watch.schedulers):
        last = getattr(scheduler, "_last_lr", None) or []
        built = _TABLES.schedulers.get(scheduler)
        for index, (group, scheduled) in enumerate(zip(optimizer.param_groups, last)):
            # base_lrs scaled too (by hand, or by ScaleLearningRate): the schedule follows the new lr.
            if not scheduled or group["lr"] == scheduled or built is None or built.base_lrs != scheduler.base_lrs:
                continue
            ratio = group["lr"] / scheduled
            for name, factor, size in _scalings(world_size, audit.data_parallel_size):
                if math.isclose(ratio, factor, rel_tol=1e-6):
                    _scaled_finding(audit, scheduler, index, group["lr"], scheduled, name, factor)
                    if size == world_size and audit.mesh and audit.data_parallel_size < world_size:
                        _scaled_by_world(audit, index, ratio, name, audit.data_parallel_size)
                    return


def _scalings(world_size: int, data_parallel_size: int | None) -> list[tuple[str, float, int]]:
    """(name, factor, the rank count it scales by): W and √W, and under a mesh the data-parallel size D and √D."""
    # D first: a ratio that the data-parallel size explains is the right scaling, whatever W also explains.
    sizes = ([("D", data_parallel_size)] if data_parallel_size and data_parallel_size != world_size else [])
    return [(label, factor, size) for name, size in [*sizes, ("W", world_size)]
            for label, factor in ((name, float(size)), (f"sqrt({name})", math.sqrt(size))) if factor > 1]


def _scaled_by_world(audit, index: int, ratio: float, name: str, data_parallel_size: int) -> None:
    # The batch grows with the data-parallel ranks only: scaling by the world multiplies the rule's lr by W/D (or √).
    right = data_parallel_size if name == "W" else math.sqrt(data_parallel_size)
    audit.add("LR_SCALED_BY_WORLD_SIZE",
              f"param group {index}: the lr was multiplied by {name} = {ratio:.4g} (the world size {audit.world_size}) "
              f"on a {audit.strategy} mesh whose data-parallel size is {data_parallel_size}: the same rule over the "
              f"data-parallel ranks multiplies it by {right:.4g}, so the lr is {ratio / right:.4g} times too high")


def _scaled_finding(audit, scheduler, index: int, lr: float, scheduled: float, name: str, factor: float) -> None:
    kind, base = type(scheduler).__name__, scheduler.base_lrs[index]
    detail = (f"param group {index}: lr {lr:.6g} is {name} = {factor:.4g} times what {kind} set ({scheduled:.6g}); "
              f"its base_lrs still hold {base:.6g}")
    if isinstance(scheduler, FROM_BASE_LRS):
        audit.add("LR_SCALED_NOT_SCHEDULE", f"{detail}, and {kind} sets every lr from base_lrs, so its next step "
                                            "brings the unscaled schedule back", severity="warning")
    else:
        audit.add("LR_SCALED_NOT_SCHEDULE", f"{detail}; {kind} multiplies the current lr, so the scaling is "
                                            "kept, but a scheduler rebuilt from base_lrs or initial_lr (a checkpoint "
                                            "restart, a chained scheduler) would lose it", severity="info")


def _launched_world_size() -> int:
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)
