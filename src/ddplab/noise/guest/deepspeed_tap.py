"""DeepSpeed's engine, ZeRO 0-3, measured: each rank's local gradient before the engine reduces it, and the norm of
the reduced one after.

Where the engine reduces decides what the small batch is (DeepSpeed 0.19, ``runtime/engine.py`` and
``runtime/zero/stage_1_and_2.py``):

- ZeRO 0 and 1 reduce once per optimizer step, at the accumulation boundary (``allreduce_gradients`` in the
  boundary micro-step's ``engine.backward``): just before, every ``.grad`` holds this rank's gradient over its
  micro-batches together (each divided by the accumulation steps by the engine), as DDP's ``no_sync`` does. The
  small batch is the rank's samples of the step.
- ZeRO 2 reduces every micro-batch, bucket by bucket (``DeepSpeedZeroOptimizer.average_tensor``), so the rank's step
  gradient never exists whole: each micro-batch's local gradient is read from the buckets before they are reduced,
  and the small batch is one micro-batch (the engine's 1/K is undone: the step's mean of |g_micro|² is K times the
  sum of the buckets' squared norms over its K micro-batches).
- ZeRO 3 does the same inside its backward hooks: each bucket's parameters hold their whole local ``.grad`` when
  ``DeepSpeedZeroOptimizer_Stage3.__reduce_and_partition_ipg_grads`` is called on it, before the reduce-scatter
  partitions them, and the last bucket of a backward goes through it too; the micro-batch is the small batch, as at
  ZeRO 2.

The reduced gradient's squared norm is the engine's own: ``engine.get_global_grad_norm()`` after the step at ZeRO
1-3, which DeepSpeed computes for its clipping anyway (no collective is added); at ZeRO 0 the averaged ``.grad`` is
whole on every rank before the optimizer steps. Each rank records 1/W of it, so the shares sum to |G|² as DDP's
do. A DeepSpeed whose ZeRO-3 optimizer has no such method is not measured at that stage, and the guest says so.
Nothing is written into the engine's tensors; every patch calls through unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time

import torch

from ddplab.guest import tensors
from ddplab.guest.patches import Patches
from ddplab.noise.guest import state
from ddplab.noise.guest.state import GuestState
from ddplab.noise.guest.tokens import TokenCount
from ddplab.noise.scale import squared_norm
from ddplab.runtime.strategies.deepspeed import ENGINE_MODULE, is_engine

__all__ = ["ENGINE_MODULE", "STAGE3_MODULE", "EngineMeasurement", "is_engine", "patch", "patch_stage3"]

ZERO_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
STAGE3_MODULE = "deepspeed.runtime.zero.stage3"
STAGE3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
"""ZeRO-3's one path from a bucket of whole local gradients to their reduce-scatter (name-mangled: private)."""
MEASURED_STAGES = (0, 1, 2, 3)
PER_MICRO_BATCH_STAGES = (2, 3)
"""Stages that reduce every micro-batch's gradient: there the small batch is one micro-batch."""


def patch(patches: Patches, on_step, module) -> None:
    """Wrap the engine's reduction and step (``on_step(guest)`` after each optimizer step of the measured engine)."""
    engine = module.DeepSpeedEngine
    patches.replace(engine, "allreduce_gradients", _first(_before_reduction, passes_argument=False))
    patches.replace(engine, "_take_model_step", functools.partial(_watched_step, on_step))
    zero = getattr(sys.modules.get(ZERO_MODULE), "DeepSpeedZeroOptimizer", None)
    if isinstance(zero, type):
        # The bucket about to be reduced is its first argument.
        patches.replace(zero, "average_tensor", _first(_local_bucket, passes_argument=True))


def patch_stage3(patches: Patches, module) -> None:
    """Wrap ZeRO-3's bucket reduction, once the engine imports its ZeRO-3 optimizer (when it configures one)."""
    stage3 = zero3_optimizer()
    if stage3 is not None:
        # The bucket's communication dtype is its first argument.
        patches.replace(stage3, STAGE3_REDUCE, _first(_local_stage3_bucket, passes_argument=True))


def zero3_optimizer() -> type | None:
    """DeepSpeed's ZeRO-3 optimizer class, imported, where it has the reduction this tap reads; None otherwise."""
    stage3 = getattr(sys.modules.get(STAGE3_MODULE), "DeepSpeedZeroOptimizer_Stage3", None)
    return stage3 if isinstance(stage3, type) and callable(getattr(stage3, STAGE3_REDUCE, None)) else None


def _first(hook, *, passes_argument: bool):
    """A patch whose method calls ``hook(self)`` (or ``hook(self, its first argument)``), then itself unchanged."""
    def wrap(original):
        @functools.wraps(original)
        def watched(self, *args, **kwargs):
            if passes_argument:
                hook(self, *args[:1])
            else:
                hook(self)
            return original(self, *args, **kwargs)

        return watched

    return wrap


def _watched_step(on_step, original):
    @functools.wraps(original)
    def _take_model_step(self, *args, **kwargs):
        _before_step(self)
        result = original(self, *args, **kwargs)
        _after_step(self, on_step)
        return result

    return _take_model_step


class EngineMeasurement:
    """The sums of one measured optimizer step of an engine."""

    def __init__(self, guest: GuestState):
        engine = guest.model()
        self.stage, self.size = guest.engine_stage, guest.data_parallel_size
        # On the engine itself, for the measured steps only: it sees keyword inputs, which a global hook does not.
        self.handles = [engine.register_forward_pre_hook(_count, with_kwargs=True)]
        self.reset()

    def reset(self) -> None:
        self.local_sq, self.share_sq = 0.0, None
        self.samples = self.forwards = self.reductions = 0
        # ZeRO 2-3: forwards whose backward reduced no bucket that was read (coalesce_grad_reduction defers them to
        # one pass a step; ZeRO-2 without contiguous_gradients reduces elsewhere): then no micro-batch was read alone.
        self.unread_forwards, self.read = 0, True
        self.tokens = TokenCount()
        self.guest_s, self.started = 0.0, time.perf_counter()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def finish(self, guest: GuestState, step: int) -> dict | None:
        """The step's record; None (the guest disarmed, saying why) where its micro-batches were not read alone."""
        if self.stage in PER_MICRO_BATCH_STAGES and (self.unread_forwards or not self.read):
            guest.disarm(f"DeepSpeed ZeRO-{self.stage} reduced no bucket this guest reads after some micro-batches "
                         "(coalesce_grad_reduction, or ZeRO-2 without contiguous_gradients): each micro-batch's local "
                         "gradient is not seen alone, so the noise scale is not measured")
            return None
        samples = self.samples
        if guest.plan.per_device_batch_size is not None:
            samples = guest.plan.per_device_batch_size * self.forwards
        per_micro_batch = self.stage in PER_MICRO_BATCH_STAGES
        # ZeRO 2-3: the buckets held each micro-batch's gradient over K; the mean of |g_micro|² is K·Σ|bucket|².
        local_sq = self.local_sq * self.forwards if per_micro_batch else self.local_sq
        line = {"step": step, "micro": False, "per_micro_batch": per_micro_batch, "samples": samples,
                "forwards": self.forwards, "reductions": 1 if per_micro_batch else self.reductions,
                "local_sq": local_sq, "share_sq": self.share_sq, "dataset_size": guest.dataset_size,
                **self.tokens.fields(),
                "guest_s": self.guest_s, "step_s": time.perf_counter() - self.started}
        self.reset()
        return line


def _measuring(guest: GuestState, engine) -> EngineMeasurement | None:
    measurement = guest.measurement
    return measurement if isinstance(measurement, EngineMeasurement) and guest.model() is engine else None


@state.guarded("reading DeepSpeed's local gradient")
def _before_reduction(guest: GuestState, engine) -> None:
    measurement = _measuring(guest, engine)
    if measurement is None or measurement.stage >= 2 or not engine.is_gradient_accumulation_boundary():
        return
    begun = time.perf_counter()
    # ZeRO 0-1: the rank's whole step gradient, accumulated over its micro-batches, before the one reduction.
    measurement.local_sq += _grads_sq(guest)
    measurement.reductions += 1
    measurement.guest_s += time.perf_counter() - begun


def _grads_sq(guest: GuestState) -> float:
    """The squared norm of the model's ``.grad`` as they stand (whole on this rank at ZeRO 0-1)."""
    return sum(squared_norm(p.grad.detach()).item() for p in guest.params() if p.grad is not None)


@state.guarded("reading a DeepSpeed ZeRO-2 bucket")
def _local_bucket(guest: GuestState, optimizer, tensor) -> None:
    _add_local(guest, optimizer, 2, lambda: [tensor])


@state.guarded("reading a DeepSpeed ZeRO-3 bucket")
def _local_stage3_bucket(guest: GuestState, optimizer, communication_data_type) -> None:
    # Each parameter of the bucket holds its whole local gradient of this micro-batch, not yet reduce-scattered; under
    # overlap_comm the engine copied them in on its reduction stream, so they are read on it, after those copies.
    with _on(getattr(optimizer, "reduce_and_partition_stream", None)):
        _add_local(guest, optimizer, 3, lambda: [p.grad for p in optimizer.ipg_buckets[communication_data_type].params
                                                 if p.grad is not None])


def _on(stream):
    """Run on ``stream`` where it is a CUDA stream (the engine's own); as is on the CPU, where there is none."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def _add_local(guest: GuestState, optimizer, stage: int, tensors) -> None:
    """Add the squared norms of ``tensors()`` to the step's local sum, where ``optimizer`` is the measured engine's
    at ``stage``."""
    engine = guest.model()
    measurement = _measuring(guest, engine)
    if measurement is None or measurement.stage != stage or getattr(engine, "optimizer", None) is not optimizer:
        return
    begun = time.perf_counter()
    measurement.local_sq += sum(squared_norm(tensor.detach()).item() for tensor in tensors())
    measurement.read = True
    measurement.guest_s += time.perf_counter() - begun


@state.guarded("reading DeepSpeed's reduced gradient")
def _before_step(guest: GuestState, engine) -> None:
    measurement = _measuring(guest, engine)
    if measurement is not None and measurement.stage == 0:
        # ZeRO 0: every rank holds the whole averaged gradient; each records 1/W of its squared norm.
        measurement.share_sq = _grads_sq(guest) / measurement.size


@state.guarded("after a DeepSpeed step")
def _after_step(guest: GuestState, engine, on_step) -> None:
    if guest.model() is not engine:
        return
    measurement = _measuring(guest, engine)
    if measurement is not None and measurement.stage in (1, 2, 3):
        norm = engine.get_global_grad_norm()
        measurement.share_sq = None if norm is None else float(norm) ** 2 / measurement.size
    on_step(guest)


@state.guarded("counting a DeepSpeed forward's samples")
def _count(guest: GuestState, module, args, kwargs) -> None:
    measurement = guest.measurement
    if isinstance(measurement, EngineMeasurement) and torch.is_grad_enabled():
        if measurement.forwards and not measurement.read:
            measurement.unread_forwards += 1
        measurement.read = False
        measurement.forwards += 1
        measurement.samples += tensors.first_dim((args, kwargs)) or 0
