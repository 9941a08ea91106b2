"""One measured optimizer step: hooks that only read the local gradient before the reduction and the reduced one.

The model's strategy places the hooks (:meth:`ddplab.runtime.strategies.base.Strategy.tap_local_gradients`):
post-accumulate-grad hooks that see each parameter's local ``.grad`` in the backward pass that reduces (DDP
copies it into its bucket and writes the average back when backward ends; FSDP2 reduce-scatters the unsharded
gradient afterwards). Under ``no_sync`` the micro-steps only accumulate, so the reducing micro-step shows all of
them. At the end of that backward the squared norm of this rank's share of the reduced gradient is read: a
callback queued at the first local gradient re-queues itself once, so it runs after the reducer's own
end-of-backward callback (DDP queues its finaliser when its last bucket is ready; FSDP2 at backward's start).

On one data-parallel rank (one process with accumulation) the small batches are the micro-steps: a
post-accumulate-grad hook takes each micro-batch's gradient as the change it made to ``.grad`` (a copy of the
gradients is kept for the step), and the accumulated ``.grad`` at the end of the last backward is the big batch.

Nothing is written into the user's tensors; the sums are new tensors; the hooks are placed for the measured
steps only and removed after them. A step with more than one reducing backward (every micro-batch reduced, or a
step the GradScaler skipped) is recorded as such and left out when the ranks' records are merged.
"""

from __future__ import annotations

import time

import torch

from ddplab.guest import tensors
from ddplab.noise.guest import state
from ddplab.noise.guest.state import GuestState
from ddplab.noise.guest.tokens import TokenCount
from ddplab.noise.scale import squared_norm
from ddplab.runtime import compat
from ddplab.runtime.strategies.fsdp import param_groups


class Measurement:
    """The hooks of the measured steps on one model, and the sums of the step under way."""

    def __init__(self, guest: GuestState):
        model, params = guest.model(), guest.params()
        self.device, self.micro = params[0].device, guest.micro
        if guest.micro:
            # One rank: each parameter's .grad after a micro-step, less its value before, is that micro-batch's.
            self.handles = [p.register_post_accumulate_grad_hook(_micro_gradient) for p in params]
        else:
            self.handles = [guest.strategy.tap_local_gradients(model, params, _observe, via="grad_hooks")]
        # On the model itself, for the measured steps only: it sees keyword inputs, which a global hook does not.
        self.handles.append(model.register_forward_pre_hook(_count, with_kwargs=True))
        self.reset()

    def reset(self) -> None:
        self.local_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        self.share_sq: torch.Tensor | None = None
        self.samples = self.forwards = self.reductions = 0
        self.tokens = TokenCount()
        self.in_backward = False
        self.previous: dict[int, torch.Tensor] = {}  # one rank: each parameter's .grad after the last micro-step
        self.guest_s, self.started = 0.0, time.perf_counter()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.previous = {}

    def finish(self, guest: GuestState, step: int) -> dict:
        """This step's record; the sums start again for the next."""
        begun = time.perf_counter()
        samples = self.samples
        if guest.plan.per_device_batch_size is not None:
            samples = guest.plan.per_device_batch_size * self.forwards
        line = {"step": step, "micro": self.micro, "samples": samples, "forwards": self.forwards,
                "reductions": self.reductions,
                "local_sq": self.local_sq.item(), "share_sq": None if self.share_sq is None else self.share_sq.item(),
                "dataset_size": guest.dataset_size, **self.tokens.fields()}
        line["guest_s"] = self.guest_s + time.perf_counter() - begun
        line["step_s"] = time.perf_counter() - self.started
        self.reset()
        return line


@state.guarded("reading a local gradient")
def _observe(guest: GuestState, gradient: torch.Tensor) -> None:
    measurement = guest.measurement
    if measurement is None:
        return
    begun = time.perf_counter()
    _backward_started(measurement)
    measurement.local_sq += squared_norm(gradient.detach())
    measurement.guest_s += time.perf_counter() - begun


@state.guarded("reading a micro-step's gradient")
def _micro_gradient(guest: GuestState, param: torch.Tensor) -> None:
    measurement = guest.measurement
    if measurement is None:
        return
    begun = time.perf_counter()
    _backward_started(measurement)
    grad, previous = param.grad.detach(), measurement.previous.get(id(param))
    measurement.local_sq += squared_norm(grad if previous is None else grad - previous)
    measurement.previous[id(param)] = grad.clone()
    measurement.guest_s += time.perf_counter() - begun


def _backward_started(measurement: Measurement) -> None:
    if measurement.in_backward:
        return
    measurement.in_backward = True
    measurement.reductions += 1
    if not compat.queue_backward_callback(_after_backward):
        raise RuntimeError("this torch cannot run a callback at the end of backward")


def _after_backward() -> None:
    # Queued again from inside the engine's callbacks: it runs after every callback queued before it (the reducer's).
    compat.queue_backward_callback(_read_reduced)


@state.guarded("reading the reduced gradient")
def _read_reduced(guest: GuestState) -> None:
    measurement, model = guest.measurement, guest.model()
    if measurement is None or model is None:
        return
    begun = time.perf_counter()
    total = torch.zeros((), dtype=torch.float64, device=measurement.device)
    params = guest.params()
    # One rank holds the whole gradient (accumulated over the micro-steps); ranks of a group their shares of it.
    shares = (p.grad for p in params if p.grad is not None) if guest.micro else \
        guest.strategy.reduced_gradient_share(model, params)
    for share in shares:
        total += squared_norm(share.detach())
    measurement.share_sq, measurement.in_backward = total, False
    measurement.guest_s += time.perf_counter() - begun


@state.guarded("counting a training forward's samples")
def _count(guest: GuestState, module, args, kwargs) -> None:
    measurement = guest.measurement
    if measurement is None or not torch.is_grad_enabled():
        return  # evaluation forwards are no part of a training step
    if getattr(guest.strategy, "all_reduces", False) and not all(group.all_reduce_grads
                                                                   for group in param_groups(module)):
        # The local gradient is then partly reduce-scattered already: the tap would refuse inside backward.
        guest.disarm("HSDP's set_requires_all_reduce(False) leaves no whole local gradient to read; accumulate "
                     "with set_requires_gradient_sync(False) to measure")
        return
    measurement.forwards += 1
    measurement.samples += tensors.first_dim((args, kwargs)) or 0
