"""What the auditor knows about learning-rate schedulers and the training frameworks around DDP.

Lightning, Accelerate and the Transformers Trainer all build an ordinary ``DistributedDataParallel``
wrapper and step an ordinary ``torch.optim.Optimizer``, so :mod:`hooks` audits them as it audits a
plain loop. This module adds what only their idioms make possible, each judged by its effect:

- ``NOT_DISTRIBUTED``: a launcher started W processes but each trains alone (no process group, or
  Accelerate reporting one process), so the W runs duplicate each other.
- ``SCHEDULER_STEPS_PER_PROCESS``: a scheduler steps several times per optimizer step (Accelerate
  steps a prepared scheduler once per process); a warning once the lr reaches 0 while training goes on.
- ``LR_SCALED_NOT_SCHEDULE``: the optimizer's lr was scaled by W or √W after its scheduler was built,
  so the scheduler's ``base_lrs`` hold the old value and its next step undoes the scaling.
- ``LOSS_NORMALISED_PER_DEVICE``: the Trainer normalises a token-level loss by each device's own token
  count (``average_tokens_across_devices`` off, or a model that takes no ``num_items_in_batch``);
  each rank records its label-token count per step, and the finding needs counts that differ.
- ``SUM_REDUCTION`` through the framework's own division of the loss by the accumulation steps
  (Lightning's closure, ``Accelerator.backward``), which hides the summed loss from :mod:`hooks`.

Framework modules are never imported here: they are patched only once the user's program has
imported them (seen when a DDP wrapper is built or an optimizer steps).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.weak import WeakIdKeyDictionary

from ddplab.auditor import guard

# Optimizer steps whose lr the detail lists.
LR_HISTORY = 8
# Closed optimizer-step intervals that must all show several scheduler steps before it is reported.
SCHEDULER_EVIDENCE = 2


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


class FrameworkState:
    """This process's side tables (weak: they die with the user's optimizers and schedulers)."""

    def __init__(self):
        self.optimizers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.schedulers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.scheduler_depth = 0
        self.patched: set[str] = set()
        self.not_distributed_checked = False


_FRAMEWORKS = FrameworkState()


def _guarded(where: str):
    """Like hooks' guard: an error here disarms the audit instead of reaching the user's program."""
    return guard.guarded(_audit_state, where)


def _audit_state():
    # hooks imports this module, so its state is looked up when a hook runs.
    from ddplab.auditor import hooks

    return hooks._STATE


# --- called from hooks ---

def install() -> None:
    """Watch every lr scheduler's construction and steps (called once, from hooks.install)."""
    original_init, original_step = LRScheduler.__init__, LRScheduler.step

    @functools.wraps(original_init)
    def __init__(self, optimizer, *args, **kwargs):
        # Registered first: the scheduler's own initial step happens inside __init__.
        _scheduler_built(self, optimizer)
        original_init(self, optimizer, *args, **kwargs)
        _scheduler_ready(self)

    @functools.wraps(original_step)
    def step(self, *args, **kwargs):
        _FRAMEWORKS.scheduler_depth += 1
        try:
            return original_step(self, *args, **kwargs)
        finally:
            _FRAMEWORKS.scheduler_depth -= 1
            # Only the outermost step counts: SequentialLR and ChainedScheduler step their children.
            if _FRAMEWORKS.scheduler_depth == 0:
                _scheduler_stepped(self)

    LRScheduler.__init__ = __init__
    LRScheduler.step = step


def on_attach(audit, ddp) -> None:
    """A DDP wrapper was built: patch the frameworks the program has imported by now."""
    _patch_imported_frameworks(audit)


def on_optimizer_step(audit, optimizer, info) -> None:
    """After an optimizer step (``info``: its DDP wrapper's, or None)."""
    _patch_imported_frameworks(audit)
    if info is None:
        if audit.wrapper_count == 0:
            _check_not_distributed(audit, optimizer)
            _check_schedulers(audit, optimizer)
        return
    _check_schedulers(audit, optimizer)


# --- schedulers ---

@_guarded("watching an lr scheduler")
def _scheduler_built(audit, scheduler, optimizer) -> None:
    watch = _FRAMEWORKS.optimizers.get(optimizer)
    if watch is None:
        watch = _FRAMEWORKS.optimizers[optimizer] = OptimizerWatch()
    watch.schedulers.add(scheduler)
    _FRAMEWORKS.schedulers[scheduler] = SchedulerWatch()


@_guarded("watching an lr scheduler")
def _scheduler_ready(audit, scheduler) -> None:
    watch = _FRAMEWORKS.schedulers.get(scheduler)
    if watch is not None:
        watch.base_lrs = list(getattr(scheduler, "base_lrs", []))


@_guarded("counting lr scheduler steps")
def _scheduler_stepped(audit, scheduler) -> None:
    watch = _FRAMEWORKS.schedulers.get(scheduler)
    if watch is None and getattr(scheduler, "optimizer", None) is not None:
        # Built before the auditor was installed (ddplab.audit called from the script): watched from now on.
        _scheduler_built(scheduler, scheduler.optimizer)
        return
    if watch is not None:
        watch.since_step += 1


def _check_schedulers(audit, optimizer) -> None:
    watch = _FRAMEWORKS.optimizers.get(optimizer)
    if watch is None:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    if watch.steps == 0:
        _check_lr_scaled(audit, watch, optimizer)
    # The interval before the first step holds the scheduler's own initial step: it is not a step's worth.
    for scheduler in list(watch.schedulers):
        sched = _FRAMEWORKS.schedulers.get(scheduler)
        if sched is not None:
            if watch.steps > 0:
                sched.per_step.append(sched.since_step)
            sched.since_step = 0
    _note_lr(watch, lrs)
    watch.steps += 1
    _check_steps_per_process(audit, watch)


def _note_lr(watch: OptimizerWatch, lrs: list[float]) -> None:
    if len(watch.lrs) < LR_HISTORY:
        watch.lrs.append(lrs[0])
    if any(lr > 0 for lr in lrs):
        watch.positive_seen = True
    elif watch.positive_seen and watch.zero_at is None:
        # The schedule reached its end (lr 0) and the optimizer still steps: the rest of training is lost.
        watch.zero_at = watch.steps


def _check_steps_per_process(audit, watch: OptimizerWatch) -> None:
    counts = [c for s in watch.schedulers if (w := _FRAMEWORKS.schedulers.get(s)) is not None
              for c in [w.per_step[:SCHEDULER_EVIDENCE]] if len(c) == SCHEDULER_EVIDENCE and min(c) >= 2]
    if not counts:
        return
    per_step = counts[0][0]
    code = "SCHEDULER_STEPS_PER_PROCESS"
    known = audit.findings.get(code)
    lrs = ", ".join(f"{lr:.4g}" for lr in watch.lrs)
    what = f"the lr scheduler stepped {per_step} times per optimizer step{_accelerate_note(per_step)}"
    if watch.zero_at is not None and (known is None or known.severity != "warning"):
        audit.findings.pop(code, None)
        audit.add(code, f"{what}; the lr reached 0 at optimizer step {watch.zero_at} and training went on at lr 0 "
                        f"(lr at optimizer steps 0-{len(watch.lrs) - 1}: {lrs})", severity="warning")
    elif known is None and len(watch.lrs) >= min(LR_HISTORY, 4):
        audit.add(code, f"{what}, so a warmup or decay given in optimizer steps ends {per_step} times early, unless "
                        f"its lengths were multiplied by {per_step} (lr at optimizer steps 0-{len(watch.lrs) - 1}: "
                        f"{lrs})", severity="info")


def _accelerate_note(per_step: int) -> str:
    state = _accelerate_state()
    if state is not None and state.get("num_processes") == per_step:
        return " (Accelerate steps a prepared scheduler once per process: split_batches=False)"
    return ""


def _check_lr_scaled(audit, watch: OptimizerWatch, optimizer) -> None:
    """At the first step: an lr that is W or √W times what its scheduler last set was scaled behind its back."""
    world_size = _world_size()
    if world_size < 2:
        return
    for scheduler in list(watch.schedulers):
        last = getattr(scheduler, "_last_lr", None) or []
        built = _FRAMEWORKS.schedulers.get(scheduler)
        for index, (group, scheduled) in enumerate(zip(optimizer.param_groups, last)):
            # base_lrs scaled too (by hand, or by ScaleLearningRate): the schedule follows the new lr.
            if not scheduled or group["lr"] == scheduled or built is None or built.base_lrs != scheduler.base_lrs:
                continue
            ratio = group["lr"] / scheduled
            for name, factor in (("W", world_size), ("sqrt(W)", math.sqrt(world_size))):
                if math.isclose(ratio, factor, rel_tol=1e-6):
                    base = scheduler.base_lrs[index]
                    audit.add("LR_SCALED_NOT_SCHEDULE",
                              f"param group {index}: lr {group['lr']:.6g} is {name} = {factor:.4g} times what "
                              f"{type(scheduler).__name__} set ({scheduled:.6g}); its base_lrs still hold {base:.6g}")
                    return


# --- several processes, each training alone ---

def _check_not_distributed(audit, optimizer) -> None:
    if _FRAMEWORKS.not_distributed_checked:
        return
    _FRAMEWORKS.not_distributed_checked = True
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size < 2:
        return
    evidence = _not_distributed_evidence(world_size)
    if evidence is None:
        return  # a process group and no sign of a lone process: FSDP, DeepSpeed or hand-made all-reduce
    audit.rank = int(os.environ.get("RANK", "0") or 0)
    audit.world_size = world_size
    audit.lr = optimizer.param_groups[0].get("lr")
    audit.optimizer = type(optimizer).__name__
    # Records are written only by an attached process: this one has no wrapper, and still has a finding.
    audit.attached_pid = os.getpid()
    audit.add("NOT_DISTRIBUTED", evidence)


def _not_distributed_evidence(world_size: int) -> str | None:
    state = _accelerate_state()
    if state is not None and state.get("num_processes") == 1:
        return (f"the launcher set WORLD_SIZE={world_size}, but Accelerate runs with num_processes 1 "
                f"({state.get('distributed_type')}): prepare() returned the model without DDP and the data "
                f"unsharded (on a CPU machine, Accelerator(cpu=True) or ACCELERATE_USE_CPU=1 makes it distributed)")
    if not dist.is_initialized():
        return (f"the launcher set WORLD_SIZE={world_size}, but this process stepped its optimizer without "
                f"joining a process group or building a DistributedDataParallel model")
    return None


def _accelerate_state() -> dict | None:
    module = sys.modules.get("accelerate.state")
    shared = getattr(getattr(module, "PartialState", None), "_shared_state", None)
    return shared if shared else None


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


# --- summed losses through the frameworks' own division by the accumulation steps ---

def _patch_imported_frameworks(audit) -> None:
    for name, patch in (("lightning.pytorch.loops.optimization.automatic", _patch_lightning),
                        ("pytorch_lightning.loops.optimization.automatic", _patch_lightning),
                        ("accelerate.accelerator", _patch_accelerate),
                        ("transformers.trainer", _patch_trainer)):
        module = sys.modules.get(name)
        if module is not None and name not in _FRAMEWORKS.patched:
            _FRAMEWORKS.patched.add(name)
            patch(module)


def summed(loss) -> bool:
    """Whether a loss reached this point summed over its samples (reduction='sum', or 'none' then .sum())."""
    node = getattr(loss, "grad_fn", None)
    if node is None:
        return False
    if node.metadata.get("ddplab_reduction") == "sum":
        return True
    if node.name() == "SumBackward0" and node.next_functions:
        child = node.next_functions[0][0]
        return child is not None and child.metadata.get("ddplab_reduction") == "none"
    return False


@_guarded("inspecting a framework's loss")
def _check_framework_loss(audit, output, framework: str, divisor) -> None:
    # Lightning's training_step may return the loss itself or a mapping holding it under "loss".
    loss = output.get("loss") if hasattr(output, "get") else output
    if audit.armed and isinstance(loss, torch.Tensor) and summed(loss):
        audit.add("SUM_REDUCTION", f"a summed loss went to {framework}, which divided it only by the "
                                   f"accumulation steps ({divisor}) before backward")


def _patch_lightning(module) -> None:
    closure_result = module.ClosureResult
    original = closure_result.from_training_step_output.__func__

    @functools.wraps(original)
    def from_training_step_output(cls, training_step_output, normalize: int = 1):
        _check_framework_loss(training_step_output, "Lightning", f"accumulate_grad_batches={normalize}")
        return original(cls, training_step_output, normalize)

    closure_result.from_training_step_output = classmethod(from_training_step_output)


def _patch_accelerate(module) -> None:
    accelerator = module.Accelerator
    original = accelerator.backward

    @functools.wraps(original)
    def backward(self, loss, **kwargs):
        _check_framework_loss(loss, "Accelerator.backward", "gradient_accumulation_steps")
        return original(self, loss, **kwargs)

    accelerator.backward = backward


# --- the Trainer's token counts ---

def _patch_trainer(module) -> None:
    trainer = module.Trainer
    original = getattr(trainer, "_get_num_items_in_batch", None)
    if original is None:
        return  # another Trainer version: nothing to watch

    @functools.wraps(original)
    def _get_num_items_in_batch(self, batch_samples, device):
        num_items = original(self, batch_samples, device)
        _record_tokens(self, batch_samples, num_items)
        return num_items

    trainer._get_num_items_in_batch = _get_num_items_in_batch


@_guarded("counting the Trainer's label tokens")
def _record_tokens(audit, trainer, batch_samples, num_items) -> None:
    from ddplab.auditor import hooks

    info = audit.wrappers.get(getattr(trainer, "model_wrapped", None))
    if info is None or not audit.armed:
        return
    across = bool(getattr(trainer.args, "average_tokens_across_devices", False)) and num_items is not None
    if across:
        return  # one count over all devices divides every rank's loss: no per-device normalisation
    tokens = _label_tokens(batch_samples)
    if tokens is not None:
        window = hooks._window(audit, info)
        window["tokens"] = tokens
        window["tokens_why"] = ("average_tokens_across_devices=False" if num_items is not None
                                else "the model takes no num_items_in_batch, so it averages over its own tokens")


def _label_tokens(batch_samples) -> int | None:
    """Label tokens (not -100) in one optimizer step's micro-batches; None unless labels are token sequences."""
    total = 0
    for batch in batch_samples:
        labels = batch.get("labels") if isinstance(batch, dict) or hasattr(batch, "get") else None
        if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.is_floating_point():
            return None
        total += int(labels.ne(-100).sum())
    return total
