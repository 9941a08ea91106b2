"""Measure the gradient noise scale of a data-parallel run from its own gradient reduction.

During backward each rank sees its local gradient (batch b) before the reduction, and after it
its share of the averaged one (batch W·b); the model's parallelism strategy says where
(:mod:`ddplab.runtime.strategies`). The two squared norms give unbiased |G|² and tr(Σ) every
measured step, for one extra all-reduce of two scalars. Training is unchanged: DDP's own
reduction is left alone, or, on the comm-hook path, reproduced bit for bit.

Batches drawn without replacement from a dataset of N examples (one shuffled pass per epoch)
make a batch mean less noisy than N = ∞ predicts; pass ``dataset_size=len(dataset)`` to correct
for it (ddplab.noise.estimators explains the estimators, the 1/N convention for Σ and the interval).

    gns = GradientNoiseScale(ddp_model, per_device_batch_size=64)   # measures every 4th step
    for batch in loader:
        loss_fn(ddp_model(x), y).backward()
        gns.step()              # after backward, once per optimizer step
        optimizer.step(); optimizer.zero_grad()
    print(gns.summary().b_simple)
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Literal

import torch
import torch.distributed as dist

from ddplab.errors import UsageError
from ddplab.noise import estimators as est
from ddplab.runtime import strategies

Via = Literal["auto", "grad_hooks", "comm_hook"]


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """One measured step."""

    step: int
    g_small_sq: float
    g_big_sq: float
    g2: float
    trace_sigma: float
    b_simple_ema: float


class GradientNoiseScale:
    """Gradient noise scale (B_simple) of a data-parallel model, measured from its own gradient reduction.

    The model's strategy (:func:`ddplab.runtime.strategies.of`) says where the local gradient can be
    seen. On a model sharded with FSDP2's ``fully_shard`` (a 1-D mesh, or HSDP's 2-D one), hooks on the
    unsharded parameters read it before the reduce-scatter, and each rank's shard of the averaged
    gradient gives its share of |G_big|² after it (``via`` "auto" or "grad_hooks"). For DDP, two ways,
    chosen by ``via``:

    - ``"grad_hooks"`` (the default without a user hook): per-parameter post-accumulate-grad
      hooks read ``.grad`` while it still holds the local gradient (DDP copies it into its
      bucket and writes the averaged result back only when backward ends). DDP's built-in C++
      reduction stays untouched, so training is identical by construction and the comm-hook
      slot stays free. On CPU any Python comm hook costs ~5% of a step by itself, so this is
      the path that meets a 3% overhead budget (benchmarks/noise_overhead.py).
    - one process (world size 1) with ``accumulation_steps`` ≥ 2: post-accumulate-grad hooks
      difference consecutive micro-batches, each a small batch of b, their mean the big one of A·b.
    - ``"comm_hook"``: DDP's one comm-hook slot, wrapping your own hook when given (needed
      then, and with ``gradient_as_bucket_view=True``, where ``.grad`` is the bucket itself).
      Without a user hook it reproduces the reducer's arithmetic: ×1/W, then all-reduce.

    Args:
        ddp_model: the ``DistributedDataParallel`` model (any model a registered parallelism strategy wraps), or
            on one process the module itself.
        per_device_batch_size: samples per rank per micro-step.
        accumulation_steps: micro-steps per optimizer step (the others run under ``no_sync``).
        comm_hook: your own DDP comm hook, which this wraps (e.g. fp16/bf16 compression).
        state: your comm hook's state.
        every: measure every K-th optimizer step (default 4: ≤ 1% of a step on the 10M-parameter
            CPU benchmark, ~5% when measuring every step); the others cost nothing but the hook calls.
        ema_decay: decay of the running averages behind ``b_simple``.
        process_group: the group DDP reduces over; default the DDP model's own ``process_group``.
        via: "auto", "grad_hooks" or "comm_hook" (see above).
        dataset_size: N, when each epoch draws the batches without replacement from N examples
            (a shuffled sampler): corrects |G|² and tr Σ for it. Leave None for sampling with
            replacement or a stream; on a finite dataset B_simple then reads high by about B_simple/N.

    A measured step whose norms are not finite (an fp16 GradScaler overflow, a NaN loss) is left
    out of every average and counted in ``skipped_steps``; every rank sees the same reduced
    norms, so all skip together. With GradScaler the norms are in scaled units; B_simple is not.
    """

    def __init__(self, ddp_model, *, per_device_batch_size: int, accumulation_steps: int = 1, comm_hook=None,
                 state=None, every: int = 4, ema_decay: float = 0.95, process_group=None, via: Via = "auto",
                 dataset_size: int | None = None):
        strategy = strategies.of(ddp_model)
        # A DDP model over a subgroup reduces over that group, not WORLD; a plain module is one process.
        group = process_group or (strategy.data_parallel_group(ddp_model) if strategy is not None else None)
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        # Held weakly (the default group as None): holding it would keep it (and its gloo threads) alive past the
        # user's destroy_process_group(), to die at interpreter exit, where they can abort the process.
        self._group = None if group is None or group is dist.group.WORLD else weakref.ref(group)
        _validate(self.world_size, per_device_batch_size, accumulation_steps, every)
        self.per_device_batch_size, self.dataset_size = per_device_batch_size, dataset_size
        self.set_accumulation_steps(accumulation_steps)
        self.every, self.comm_hook, self.user_state = every, comm_hook, state
        self.steps, self.skipped_steps, self.history = 0, 0, []
        self._ema_g2, self._ema_trace = est.Ema(ema_decay), est.Ema(ema_decay)
        # Weak: the model must be freed when the user's loop lets it go, whatever still holds this object.
        self._ddp = weakref.ref(ddp_model)
        self._params = [p for p in ddp_model.parameters() if p.requires_grad]
        self._sums = torch.zeros(2, dtype=torch.float64, device=self._params[0].device)  # |g_small|², |G_big|² share
        self._previous: dict[int, torch.Tensor] = {}
        self._strategy = strategy
        self.via = self._attach(ddp_model, via)

    def _attach(self, model, via: Via) -> str:
        """Hook where the local gradients can be seen; the path taken."""
        # The parameters (or the wrapper) hold the hooks: a weak reference keeps them from holding this object.
        if _one_process(via, self.comm_hook, self._strategy, self.world_size, self._params):
            ready = _WeakHook(self, GradientNoiseScale._micro_grad_ready)
            self._handles = [p.register_post_accumulate_grad_hook(ready) for p in self._params]
            return "micro_steps"
        self._tap = self._strategy.tap_local_gradients(model, self._params,
                                                       _WeakHook(self, GradientNoiseScale._local_gradient),
                                                       via=via, comm_hook=self.comm_hook, state=self.user_state)
        return self._tap.via

    @property
    def group(self):
        """The process group the measurement reduces over; None for the default group (and on one process)."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise UsageError("the noise scale's process group was destroyed: measure with a live group")
        return group

    def set_accumulation_steps(self, accumulation_steps: int) -> None:
        """The micro-steps of the next optimizer steps (a batch ramp changes them between steps)."""
        _validate(self.world_size, self.per_device_batch_size, accumulation_steps, 1)
        if self.world_size == 1:
            # One process: each micro-batch is a small batch, their mean the big one.
            b_small, b_big = self.per_device_batch_size, self.per_device_batch_size * accumulation_steps
        else:
            # Accumulated micro-batches make the synchronising gradient one over A·b samples.
            b_small = self.per_device_batch_size * accumulation_steps
            b_big = self.world_size * b_small
        if self.dataset_size is not None and self.dataset_size < max(b_big, 2):
            raise UsageError(f"{{dataset_size}} {self.dataset_size} is smaller than the batch of {b_big} it must "
                             "supply")
        self.accumulation_steps, self.b_small, self.b_big = accumulation_steps, b_small, b_big

    def _local_gradient(self, tensor: torch.Tensor) -> None:
        # The strategy shows the local gradient of reducing backward passes only: under no_sync it only accumulates,
        # and the synchronising micro-step holds all A·b samples.
        if self.measuring:
            self._sums[0] += squared_norm(tensor)

    def _micro_grad_ready(self, param) -> None:
        # One process: this micro-batch's gradient is what it added to the accumulated .grad.
        if not self.measuring:
            return
        previous = self._previous.get(id(param))
        self._sums[0] += squared_norm(param.grad if previous is None else param.grad - previous)
        self._previous[id(param)] = param.grad.detach().clone()

    @property
    def measuring(self) -> bool:
        return self.steps % self.every == 0

    def _global_share(self) -> torch.Tensor:
        """This rank's share of |averaged gradient|², read from the reduced gradients as the strategy shares them."""
        model = self._ddp()
        if model is None:
            raise UsageError("the model this noise scale measures was freed: measure a model that is still training")
        total = torch.zeros((), dtype=torch.float64, device=self._sums.device)
        for share in self._strategy.reduced_gradient_share(model, self._params):
            total += squared_norm(share)
        return total

    def step(self) -> StepEstimate | None:
        """Close one optimizer step: call after backward, before the optimizer touches the gradients.

        On measured steps this reads the averaged gradient and makes one small all-reduce.
        Returns the step's estimate; None on unmeasured and skipped (non-finite) steps.
        """
        if self.via == "micro_steps":
            measured = self.measuring
            self.steps += 1
            return self._record(*self._micro_step_norms(), self.b_small, self.b_big) if measured else None
        sums = self.local_sums()
        if sums is None:
            return None
        dist.all_reduce(sums, group=self.group)
        return self.close(sums)

    def local_sums(self) -> torch.Tensor | None:
        """:meth:`step` in two halves, for a caller that all-reduces these sums in a collective of its own.

        Call where :meth:`step` goes; on measured steps it returns this rank's two sums (float64), which every
        rank must all-reduce (sum) and pass to :meth:`close` before the next step; None on the others.
        """
        if self.via == "micro_steps":
            raise UsageError("one process makes no all-reduce: call step()")
        measured = self.measuring
        self.steps += 1
        if not measured:
            return None
        self._sums[1] = self._global_share()
        sums = self._sums.clone()
        self._sums.zero_()
        # The step's batch sizes: a ramp may change them before close().
        self._measured_sizes = self.b_small, self.b_big
        return sums

    def close(self, reduced: torch.Tensor) -> StepEstimate | None:
        """The estimate of the step whose :meth:`local_sums` were all-reduced into ``reduced``."""
        return self._record(reduced[0].item() / self.world_size, reduced[1].item(), *self._measured_sizes)

    def _record(self, g_small_sq: float, g_big_sq: float, b_small: int, b_big: int) -> StepEstimate | None:
        # One overflowed step would make every later average inf or NaN: leave it out, count it.
        if not (math.isfinite(g_small_sq) and math.isfinite(g_big_sq)):
            self.skipped_steps += 1
            return None
        g2, trace = est.unbiased_estimates(g_small_sq, g_big_sq, b_small, b_big, self.dataset_size)
        ema = _ratio(self._ema_trace.update(trace), self._ema_g2.update(g2))
        record = StepEstimate(self.steps - 1, g_small_sq, g_big_sq, g2, trace, ema)
        self.history.append(record)
        return record

    def _micro_step_norms(self) -> tuple[float, float]:
        """|g|² of one micro-batch (mean over them) and of all of them, from the contributions c_i.

        With each micro-step's loss divided by A (the usual recipe, as on the DDP path) a
        micro-batch's gradient is A·c_i and the accumulated Σc_i is the mean over A·b samples.
        B_simple does not depend on that convention; |G|² and tr(Σ) are in its units.
        """
        accumulation = self.accumulation_steps
        g_small_sq = self._sums[0].item() * accumulation
        g_big_sq = torch.stack([squared_norm(g) for g in self._grads()]).sum().item()
        self._sums.zero_()
        self._previous.clear()
        return g_small_sq, g_big_sq

    def _grads(self):
        return [p.grad for p in self._params if p.grad is not None]

    @property
    def b_simple(self) -> float:
        """Running B_simple = EMA(tr Σ) / EMA(|G|²); math.inf while EMA(|G|²) ≤ 0, NaN before the first step."""
        return _ratio(self._ema_trace.get(), self._ema_g2.get())

    def summary(self, last: int | None = None) -> est.Summary:
        """B_simple over the measured steps (the last ``last`` of them), with Fieller's 95% interval."""
        window = self.history[-last:] if last else self.history
        if not window:
            raise ValueError(f"no finite measured steps to summarize ({self.skipped_steps} skipped as non-finite)")
        return est.summarize([r.g2 for r in window], [r.trace_sigma for r in window])


def _validate(world_size: int, per_device_batch_size: int, accumulation_steps: int, every: int) -> None:
    if per_device_batch_size < 1 or accumulation_steps < 1 or every < 1:
        raise UsageError("{per_device_batch_size}, {accumulation_steps} and {every} must be positive")
    if world_size == 1 and accumulation_steps < 2:
        raise UsageError("the gradient noise scale compares gradients over two batch sizes: it needs world size >= 2, "
                         "or gradient accumulation with at least 2 micro-steps on one process")


def _one_process(via: str, comm_hook, strategy, world_size: int, params: list[torch.Tensor]) -> bool:
    """True on one process (micro-steps are the batches); else the strategy taps its reduction, which it must have."""
    if via not in ("auto", "grad_hooks", "comm_hook"):
        raise UsageError(f"{{via}} must be auto, grad_hooks or comm_hook, got {via!r}")
    if world_size == 1:
        if comm_hook is not None or via == "comm_hook":
            raise UsageError("on one process there is no all-reduce to hook: drop {comm_hook} / {via}='comm_hook'")
        if any(hasattr(p, "placements") for p in params):
            # FSDP2 writes a sharded parameter's .grad after its reduce-scatter: no hook sees each micro-batch there.
            raise UsageError("on one process the noise scale compares micro-batches in each parameter's .grad, which "
                             "a sharded (fully_shard) model writes only after its reduction: measure on 2 or more "
                             "ranks")
        return True
    if strategy is None:
        raise UsageError(f"on {world_size} processes the noise scale reads the gradient reduction of a data-parallel "
                         f"model (one of: {', '.join(strategies.STRATEGIES)}); this model is a plain module")
    return False


def _ratio(trace: float, g2: float) -> float:
    # |G|² ≤ 0 is "not resolved yet", not a negative noise scale.
    return max(trace, 0.0) / g2 if g2 > 0 else (math.nan if math.isnan(g2) else math.inf)


class _WeakHook:
    """A hook calling ``function(owner, value)`` while ``owner`` lives, without holding it."""

    __slots__ = ("owner", "function")

    def __init__(self, owner, function):
        self.owner, self.function = weakref.ref(owner), function

    def __call__(self, value) -> None:
        owner = self.owner()
        if owner is not None:
            self.function(owner, value)


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """|tensor|² as a float64 scalar on its device (half precision summed in float32)."""
    # Half-precision buckets accumulate in float32; float32 ones in place, with no float64 copy.
    upcast = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else None
    return torch.linalg.vector_norm(tensor, dtype=upcast).double().square()
