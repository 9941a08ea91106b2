"""The guest's state in one process, and the guard every one of its hooks runs under.

One :class:`GuestState` per process, reached through :func:`current`; the model is held weakly, so the guest
never keeps the user's model, its parameters or its process group alive.
"""

from __future__ import annotations

import os
import weakref

from ddplab.guest import guard, record
from ddplab.noise.guest.plan import StepPlan


class GuestState:
    """What the guest knows in this process: its plan, the data-parallel model it measures, the steps so far."""

    def __init__(self, plan: StepPlan, out_dir: str):
        self.plan, self.out_dir = plan, out_dir
        self.disabled: str | None = None  # why the guest turned itself off
        self.model_ref = None  # weak reference to the DDP wrapper or FSDP2 root being measured
        self.strategy = None
        self.param_refs: list = []  # weak references to the parameters it trains
        self.rank = 0
        self.pid: int | None = None  # the process that found the model: a forked child starts with none
        self.steps = 0  # optimizer steps that updated the model
        self.dataset_size: int | None = None  # of the DistributedSampler iterated last
        self.owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer → whether it steps the model
        self.measurement = None  # the hooks and sums of the step being measured (:class:`tap.Measurement`)
        self.finished = False  # every planned step measured: nothing more is done
        self.micro = False  # one data-parallel rank: each micro-step's gradient is a small batch
        self.alone_params: set[int] | None = None  # ids of the parameters a lone process's optimizer steps
        self.engine_stage: int | None = None  # the ZeRO stage of a DeepSpeed engine being measured; None otherwise
        self.data_parallel_size = 1

    @property
    def found(self) -> bool:
        return self.pid == os.getpid() and self.model_ref is not None

    def model(self):
        return self.model_ref() if self.model_ref is not None else None

    def params(self) -> list:
        return [p for ref in self.param_refs if (p := ref()) is not None]

    def write(self, kind: str, **fields) -> None:
        record.append(self.out_dir, {"kind": kind, "rank": self.rank, **fields})

    def disarm(self, reason: str) -> None:
        """Stop measuring for the rest of this process, and say why; training goes on untouched."""
        if self.disabled is not None:
            return
        self.disabled = reason
        self.write("note", text=reason)
        self.stop_measuring()

    def stop_measuring(self) -> None:
        if self.measurement is not None:
            self.measurement.close()
            self.measurement = None


_STATE: GuestState | None = None


def current() -> GuestState | None:
    return _STATE


def start(plan: StepPlan, out_dir: str) -> GuestState:
    global _STATE
    _STATE = GuestState(plan, out_dir)
    return _STATE


def guarded(where: str):
    """Run a hook so that no error of the guest reaches the user's program: it disarms instead."""
    return guard.guarded(current, where)
