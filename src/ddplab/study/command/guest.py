"""The study's guest in one process of the user's command: count its optimizer steps, read its training loss (or a
metric it prints), and stop the run on every rank at once when it is decided.

Armed from the injected sitecustomize (``DDPLAB_GUEST`` names this module; ``DDPLAB_STUDY_RUN`` holds the run's
settings as JSON). What it reads:

- the loss: every scalar that reaches ``Tensor.backward``, summed between two optimizer steps (the step's loss where
  each micro-batch's loss is divided by the accumulation steps, as Accelerate, Lightning, the Trainer and DeepSpeed
  do), kept on its device until an evaluation;
- a metric (``metric``): the last ``NAME=value``, ``NAME: value`` or ``'NAME': value`` the process wrote to stdout
  (the Trainer's logged dicts among them), or Lightning's value of ``self.log(NAME, ...)`` as its trainer reduced
  it into ``callback_metrics``.

Every ``eval_every`` optimizer steps of the first optimizer that stepped after a backward, the ranks' sums are
all-reduced once (every rank reaches that step: data-parallel ranks step together), with a timeout; the mean is one
evaluation, judged by :func:`ddplab.study.runs.settle`, the decision every engine takes. A run decided (target reached,
diverged, stalled, ``max_steps``) ends on every rank at the same step: the record is written, output flushed and the
process leaves with exit code 0 (``os._exit``: no atexit handler, no traceback, no collective left half-done). Any
error of the guest disarms it with a note; the program then runs on as it would alone.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
import sys
import time
import types
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddplab.guest import guard, imports, record
from ddplab.guest.patches import Patches
from ddplab.runtime import timescale
from ddplab.study.config import Target
from ddplab.study.runs import DIVERGED_LOSS, RunResult, settle

ENV_SETTINGS = "DDPLAB_STUDY_RUN"
LIGHTNING_MODULES = ("lightning.pytorch.core.module", "pytorch_lightning.core.module")
NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"


class StudyGuest:
    """What the guest knows in this process."""

    def __init__(self, settings: dict, out_dir: str):
        self.out_dir = out_dir
        self.target = Target(**settings["target"])
        self.eval_every, self.max_steps = int(settings["eval_every"]), int(settings["max_steps"])
        # Scaled here, not in the settings, so a run's cached settings are the same on a slow machine.
        self.timeout_s = timescale.scaled(float(settings.get("timeout_s", 300.0)))
        # A tuned-sweep lr stops past this step: it can no longer be its batch's best.
        self.prune_after = settings.get("prune_after") or math.inf
        self.judge = types.SimpleNamespace(target=self.target, patience=int(settings.get("patience", 0)))
        self.metric = settings.get("metric")
        self.pattern = re.compile(rf"(?<![\w.]){re.escape(self.metric)}['\"]?\s*[:=]?\s*{NUMBER}") \
            if self.metric else None
        self.disabled: str | None = None
        self.optimizer_id: int | None = None  # the optimizer whose steps are counted
        self.optimizer_class = ""  # its class, said to the driver: the study's rules follow the family named
        self.pending = None  # losses backward saw since the last counted step (a tensor on their device)
        self.window_loss, self.window_steps = 0.0, 0  # the evaluation's sum over its steps (a tensor once summed)
        self.seen: float | None = None  # the last metric value printed since the previous evaluation
        self.seen_at = 0  # the optimizer steps taken when it was printed
        self.lightning = None  # a weak reference to the LightningModule that self.log-s the metric
        self.last_logged: float | None = None
        self.steps = 0
        self.seconds = 0.0  # the guest's own time in this process: its hooks, the evaluations' all-reduce
        self.result = RunResult(global_batch_size=0, lr=0.0, seed=0)
        self.rank = 0

    def disarm(self, reason: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            record.append(self.out_dir, {"kind": "note", "rank": self.rank, "text": reason})


_SLOT = guard.Slot()
guarded = _SLOT.guarded
_PATCHES: Patches | None = None


def install_from_env() -> StudyGuest | None:
    """Arm the guest where ``ddplab study -- COMMAND`` set the environment; None otherwise."""
    global _PATCHES
    armed = guard.armed_settings(ENV_SETTINGS)
    if armed is None or _SLOT.guest is not None:
        return _SLOT.guest
    _SLOT.guest = guest = StudyGuest(*armed)
    _PATCHES = Patches()
    _PATCHES.replace(torch.Tensor, "backward", _watched_backward)
    _PATCHES.hook(register_optimizer_step_post_hook(_after_optimizer_step))
    if guest.pattern is not None:
        sys.stdout = _Tee(sys.stdout, guest)
        for module in LIGHTNING_MODULES:
            imports.when_imported(_PATCHES, module, _watch_lightning_log)
    return guest


@guarded("watching Lightning's self.log")
def _watch_lightning_log(guest: StudyGuest, module) -> None:
    _PATCHES.replace(module.LightningModule, "log", _watched_log)


def _watched_log(original):
    @functools.wraps(original)
    def log(self, name, value, *args, **kwargs):
        _logged(self, name)
        return original(self, name, value, *args, **kwargs)

    return log


@guarded("reading a metric from self.log")
def _logged(guest: StudyGuest, module, name) -> None:
    # What self.log is given per batch is not yet the metric: Lightning reduces it into callback_metrics.
    if name == guest.metric and guest.lightning is None:
        guest.lightning = weakref.ref(module)


def _lightning_metric(guest: StudyGuest) -> None:
    """The metric as Lightning last reduced it (its trainer's callback_metrics), where it changed."""
    module = guest.lightning()
    trainer = getattr(module, "_trainer", None) if module is not None else None
    value = trainer.callback_metrics.get(guest.metric) if trainer is not None else None
    if value is None:
        return
    value = float(value.detach() if isinstance(value, torch.Tensor) else value)
    if value != guest.last_logged:
        guest.last_logged, guest.seen, guest.seen_at = value, value, guest.steps


def _watched_backward(original):
    @functools.wraps(original)
    def backward(self, *args, **kwargs):
        _saw_loss(self)
        return original(self, *args, **kwargs)

    return backward


@guarded("reading the loss")
def _saw_loss(guest: StudyGuest, loss) -> None:
    begin = time.perf_counter()
    if loss.numel() == 1 and loss.requires_grad:
        value = loss.detach().reshape(()).float()
        guest.pending = value if guest.pending is None else guest.pending + value
    guest.seconds += time.perf_counter() - begin


@guarded("after an optimizer step")
def _after_optimizer_step(guest: StudyGuest, optimizer, args, kwargs) -> None:
    begin = time.perf_counter()
    try:
        _count_step(guest, optimizer)
    finally:
        guest.seconds += time.perf_counter() - begin


def _count_step(guest: StudyGuest, optimizer) -> None:
    if guest.lightning is not None:
        _lightning_metric(guest)
    if guest.pending is None:
        return  # no loss reached backward since the last step: another optimizer's step, or not training
    if guest.optimizer_id is None:
        guest.optimizer_id, guest.optimizer_class = id(optimizer), type(optimizer).__qualname__
    if id(optimizer) != guest.optimizer_id:
        return
    guest.window_loss = guest.pending + guest.window_loss
    guest.pending, guest.window_steps, guest.steps = None, guest.window_steps + 1, guest.steps + 1
    if guest.steps % guest.eval_every == 0 or guest.steps >= guest.max_steps:
        _evaluate(guest)


def _evaluate(guest: StudyGuest) -> None:
    loss, metric, printed_at = _reduced(guest)
    guest.window_loss, guest.window_steps, guest.seen = 0.0, 0, None
    if guest.disabled is not None:
        return
    # A printed metric counts from the step it was printed after, as an evaluation of the program's own.
    step = round(printed_at) if guest.pattern is not None and metric is not None else guest.steps
    if guest.pattern is not None and metric is None and math.isfinite(loss) and loss <= DIVERGED_LOSS:
        done = False  # nothing printed since the last evaluation: no new metric to judge
    else:
        value = metric if guest.pattern is not None else loss
        if not math.isfinite(loss) or loss > DIVERGED_LOSS:
            value = math.nan
        guest.result.history.append([step, loss, value])
        done = settle(guest.judge, guest.result, step, value)
    if guest.rank == 0:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        record.append(guest.out_dir, {"kind": "eval", "rank": 0, "step": step, "loss": _finite(loss),
                                      "metric": _finite(metric), "world_size": world, "guest_s": guest.seconds,
                                      "optimizer": guest.optimizer_class})
    pruned = not done and guest.steps > guest.prune_after
    if done or pruned or guest.steps >= guest.max_steps:
        _stop(guest, pruned)


def _reduced(guest: StudyGuest) -> tuple[float, float | None, float]:
    """The evaluation's mean loss over its steps and the ranks, the mean of the metric the ranks printed and of the
    steps they printed it at."""
    device = guest.window_loss.device if isinstance(guest.window_loss, torch.Tensor) else torch.device("cpu")
    seen = guest.seen is not None
    values = torch.stack([torch.as_tensor(guest.window_loss, dtype=torch.float64, device=device).reshape(()),
                          torch.tensor(float(guest.window_steps), dtype=torch.float64, device=device),
                          torch.tensor(guest.seen if seen else 0.0, dtype=torch.float64, device=device),
                          torch.tensor(float(seen), dtype=torch.float64, device=device),
                          torch.tensor(float(guest.seen_at if seen else 0), dtype=torch.float64, device=device)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        guest.rank = dist.get_rank()
        values = _all_reduced(guest, values)
    loss_sum, steps, metric_sum, printed, printed_at = values.tolist()
    return loss_sum / max(steps, 1.0), (metric_sum / printed if printed else None), printed_at / max(printed, 1.0)


def _all_reduced(guest: StudyGuest, values: torch.Tensor) -> torch.Tensor:
    if dist.get_backend() == "nccl" and values.device.type != "cuda":
        values = values.to(torch.device("cuda", torch.cuda.current_device()))
    elif dist.get_backend() == "gloo" and values.device.type != "cpu":
        values = values.cpu()
    work = dist.all_reduce(values, async_op=True)
    if not work.wait(timeout=datetime.timedelta(seconds=guest.timeout_s)):
        raise TimeoutError(f"the ranks' sums were not all-reduced within {guest.timeout_s:g} s")
    return values.cpu()


def _stop(guest: StudyGuest, pruned: bool) -> None:
    if guest.rank == 0:
        record.append(guest.out_dir, {"kind": "end", "rank": 0, "step": guest.steps, "pruned": pruned})
    guard.leave()


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class _Tee:
    """The process's stdout, unchanged, with each line it writes searched for the metric."""

    def __init__(self, stream, guest: StudyGuest):
        self._stream, self._guest, self._line = stream, guest, ""

    def write(self, text):
        written = self._stream.write(text)
        self._read(text)
        return written

    @guarded("reading the metric from stdout")
    def _read(guest: StudyGuest, self, text) -> None:  # noqa: N805 - the guard passes the guest first
        lines = (self._line + text).split("\n")
        self._line = lines.pop()[-4096:]
        for line in lines:
            found = guest.pattern.findall(line)
            if found:
                guest.seen, guest.seen_at = float(found[-1]), guest.steps

    def __getattr__(self, name):
        return getattr(self._stream, name)
