"""Arming the noise scale's guest in one process of the user's command (from the injected sitecustomize).

Four watchers, all read-only: a global forward pre-hook that finds the data-parallel model at its first training
forward (a DDP wrapper, or an FSDP2 root on a 1-D or HSDP mesh; in a process that trains alone, the first model
forward after an optimizer step, whose micro-steps are then the batches) and is then removed; a global
optimizer-step hook that counts the model's optimizer steps, places the measuring hooks before each planned step
and writes the step's record after it; ``DistributedSampler.__iter__``, which says the dataset's size for the
finite-data correction; and the class-index losses, whose kept targets are a language model's tokens
(:mod:`ddplab.noise.guest.tokens`). Once the last planned step is measured every patch and hook is taken out again.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing.util
import os
import weakref

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data.distributed import DistributedSampler

from ddplab.guest import extension_builds, imports
from ddplab.guest.patches import Patches
from ddplab.noise.guest import deepspeed_tap, state, tokens
from ddplab.noise.guest.plan import StepPlan
from ddplab.noise.guest.state import GuestState
from ddplab.noise.guest.tap import Measurement
from ddplab.runtime import strategies

ENV_DIR = "DDPLAB_AUDIT_DIR"

_PATCHES: Patches | None = None
_DISCOVERY = None  # the global forward pre-hook, removed once the model is found


def install_from_env() -> GuestState | None:
    """Arm the guest when ``ddplab noise`` set the environment; None otherwise."""
    global _PATCHES, _DISCOVERY
    plan, out_dir = StepPlan.from_env(), os.environ.get(ENV_DIR)
    if plan is None or not out_dir or state.current() is not None:
        return state.current()
    guest = state.start(plan, out_dir)
    _PATCHES = Patches()
    _DISCOVERY = _PATCHES.hook(register_module_forward_pre_hook(_module_pre_forward))
    _PATCHES.hook(register_optimizer_step_post_hook(_after_optimizer_step))
    _PATCHES.replace(DistributedSampler, "__iter__", _watched_sampler)
    tokens.patch(_PATCHES)
    extension_builds.watch(_PATCHES)
    imports.when_imported(_PATCHES, deepspeed_tap.ENGINE_MODULE,
                          functools.partial(_guarded_patch, functools.partial(deepspeed_tap.patch, _PATCHES,
                                                                              _model_stepped)))
    imports.when_imported(_PATCHES, deepspeed_tap.STAGE3_MODULE,
                          functools.partial(_guarded_patch, functools.partial(deepspeed_tap.patch_stage3, _PATCHES)))
    atexit.register(_at_exit)
    return guest


@state.guarded("watching DeepSpeed's engine")
def _guarded_patch(guest: GuestState, patch, module) -> None:
    patch(module)


def _watched_sampler(original_iter):
    @functools.wraps(original_iter)
    def __iter__(self):
        _sampler_started(self)
        return original_iter(self)

    return __iter__


@state.guarded("reading the sampler's dataset size")
def _sampler_started(guest: GuestState, sampler) -> None:
    guest.dataset_size = len(sampler.dataset)


@state.guarded("looking for the data-parallel model")
def _module_pre_forward(guest: GuestState, module, args) -> None:
    if guest.found or not torch.is_grad_enabled():
        return
    if guest.alone_params is not None:
        # One process: the first training forward after an optimizer step is the model's own (its outermost module).
        if any(id(p) in guest.alone_params for p in module.parameters()):
            _found_alone(guest, module)
        return
    if deepspeed_tap.is_engine(module):
        _found_engine(guest, module)
        return
    if not _maybe_data_parallel(module):
        return
    strategy = strategies.of(module)
    if strategy is None or not dist.is_initialized():
        return
    _found(guest, module, strategy)


def _maybe_data_parallel(module) -> bool:
    # Cheap first: this runs for every module's forward until the model is found.
    return isinstance(module, DistributedDataParallel) or type(module).__name__.startswith("FSDP")


def _found(guest: GuestState, model, strategy) -> None:
    ignored = getattr(model, "parameters_to_ignore", set())
    inner = strategy.module(model)
    params = [p for n, p in inner.named_parameters() if p.requires_grad and n not in ignored]
    group = _group_ranks(model, strategy)
    _take(guest, model, strategy, params, group)
    if len(group) < 2 and strategy.collective_forward:
        guest.disarm("FSDP2 on one rank writes .grad only after its reduction, so no micro-step's gradient can be "
                     "read: measure on 2 or more ranks")
    elif len(group) < 2:
        guest.micro = True  # one data-parallel rank: each micro-step is a small batch, their sum the big one
    elif getattr(model, "gradient_as_bucket_view", False):
        guest.disarm("DDP with gradient_as_bucket_view=True: .grad is the bucket the all-reduce overwrites, so the "
                     "local gradient cannot be read without a communication hook, which would change training")


def _found_engine(guest: GuestState, engine) -> None:
    """A DeepSpeed engine: its own module's parameters, its data-parallel group, its ZeRO stage."""
    stage = int(engine.zero_optimization_stage())
    params = [p for p in engine.module.parameters() if p.requires_grad]
    group = dist.get_process_group_ranks(getattr(engine, "seq_data_parallel_group", None) or
                                         engine.data_parallel_group)
    guest.engine_stage, guest.data_parallel_size = stage, len(group)
    _take(guest, engine, None, params, group, f"deepspeed-zero{stage}")
    if stage == 3 and deepspeed_tap.zero3_optimizer() is None:
        guest.disarm("this DeepSpeed's ZeRO-3 optimizer has no __reduce_and_partition_ipg_grads, where its local "
                     "gradients are read before the reduce-scatter: the noise scale is measured at ZeRO 0-2 here")
    elif stage not in deepspeed_tap.MEASURED_STAGES:
        guest.disarm(f"DeepSpeed ZeRO-{stage} is not a stage the noise scale reads: it is measured at ZeRO 0-3")
    elif len(group) < 2:
        guest.disarm("a DeepSpeed engine on one data-parallel rank: measure on 2 or more ranks")


def _found_alone(guest: GuestState, model) -> None:
    """The model of a process that trains alone: measured from its micro-steps."""
    params = [p for p in model.parameters() if p.requires_grad and id(p) in guest.alone_params]
    rank = dist.get_rank() if dist.is_initialized() else 0
    # The optimizer step that showed its parameters was the model's first.
    guest.steps, guest.micro = 1, True
    _take(guest, model, None, params, [rank])


def _take(guest: GuestState, model, strategy, params: list, group: list[int], name: str | None = None) -> None:
    engine = guest.engine_stage is not None
    guest.pid, guest.strategy = os.getpid(), strategy
    guest.rank = dist.get_rank() if strategy is not None or engine else group[0]
    guest.model_ref = weakref.ref(model)
    guest.param_refs = [weakref.ref(p) for p in params]
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    name = name or (strategy.name if strategy is not None else "one process")
    guest.write("model", strategy=name, world_size=world_size, group=group)
    if _DISCOVERY is not None:
        _DISCOVERY.remove()
    # A rank forked by multiprocessing ends in os._exit, past atexit: its own finalizers still run.
    multiprocessing.util.Finalize(None, _at_exit, exitpriority=0)


def _group_ranks(model, strategy) -> list[int]:
    """The data-parallel ranks, read from the model (no group is created: that would be a collective)."""
    if isinstance(model, DistributedDataParallel):
        return dist.get_process_group_ranks(model.process_group)
    param = next(p for p in model.parameters() if hasattr(p, "device_mesh"))
    return [int(r) for r in param.device_mesh.mesh.flatten().tolist()]


@state.guarded("after an optimizer step")
def _after_optimizer_step(guest: GuestState, optimizer, args, kwargs) -> None:
    if not guest.found and guest.alone_params is None and _trains_alone():
        # No data-parallel model, and no other rank: the next training forward shows the model behind these.
        guest.alone_params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not guest.found or guest.finished or guest.engine_stage is not None or not _steps_model(guest, optimizer):
        return  # an engine's optimizer steps per parameter group: the engine's own step is the model's
    _model_stepped(guest)


def _model_stepped(guest: GuestState) -> None:
    """One optimizer step of the measured model: its record written, the next step's measurement placed."""
    if guest.finished or guest.disabled is not None:
        return
    step, plan = guest.steps, guest.plan
    guest.steps += 1
    if guest.measurement is not None and plan.measures(step):
        record = guest.measurement.finish(guest, step)
        if record is None:  # the measurement disarmed the guest, saying why
            return
        guest.write("step", **record)
    if plan.finished(guest.steps):
        guest.finished = True
        guest.write("end", steps=guest.steps)
        _uninstall(guest)
    elif plan.measures(guest.steps):
        if guest.measurement is None:
            measure = deepspeed_tap.EngineMeasurement if guest.engine_stage is not None else Measurement
            guest.measurement = measure(guest)
    else:
        guest.stop_measuring()


def _trains_alone() -> bool:
    """One process with no other rank: not a rank of a launch that forgot its process group (world size > 1)."""
    if dist.is_initialized():
        return dist.get_world_size() == 1
    return int(os.environ.get("WORLD_SIZE", "1")) == 1


def _steps_model(guest: GuestState, optimizer) -> bool:
    """Whether ``optimizer`` updates the measured model; looked up once per optimizer and param-group count."""
    cached = guest.owners.get(optimizer)
    if cached is not None and cached[0] == len(optimizer.param_groups):
        return cached[1]
    mine = {id(p) for p in guest.params()}
    owns = any(id(p) in mine for group in optimizer.param_groups for p in group["params"])
    guest.owners[optimizer] = (len(optimizer.param_groups), owns)
    return owns


def _uninstall(guest: GuestState) -> None:
    global _PATCHES
    guest.stop_measuring()
    if _PATCHES is not None:
        _PATCHES.undo()
        _PATCHES = None


def _at_exit() -> None:
    guest = state.current()
    if guest is not None and guest.found and not guest.finished:
        guest.finished = True
        guest.write("end", steps=guest.steps)
