"""DeepSpeed's engine (ZeRO stages 0-3), audited as a DDP wrapper is: its training forwards, its backward, its step.

``deepspeed.initialize`` returns a ``DeepSpeedEngine``, an ``nn.Module`` whose forward calls the user's module, whose
``backward(loss)`` divides the loss by the gradient accumulation steps (unless ``scale_wrt_gas=False``, as the
Transformers Trainer passes after dividing itself), multiplies it by the loss scale and calls ``Tensor.backward``,
and whose step, at each accumulation boundary, runs ``_take_model_step``: the client optimizer's step (once per
parameter group or ZeRO sub-group, on this rank's flat partitions), the scheduler, ``global_steps += 1``. The
Transformers Trainer and Accelerate's DeepSpeed plugin end in the same engine and the same calls.

So, once the program imports ``deepspeed.runtime.engine`` (:mod:`ddplab.guest.imports`), three methods of the
class are wrapped, each calling through unchanged:

- ``forward``: the engine is found (its ZeRO stage, its data-parallel group, what its reduction divides by: the
  data-parallel size, or 1 with ``gradient_allreduce_op: "sum"``) and each training batch recorded, as a DDP
  wrapper's is (SAME_DATA_ON_ALL_RANKS, SET_EPOCH_MISSING, the losses computed from its output);
- ``backward``: the program's loss is judged as it wrote it (:func:`ddplab.auditor.losses.engine_backward`), and the
  engine's division by the accumulation steps is recorded: a program that divides by them too divides twice
  (ACCUMULATION_DIVIDED_TWICE);
- ``_take_model_step``: the optimizer step of the model. The client optimizer's own step hooks, which fire per group
  on flat partitions, are not steps of the model (:mod:`ddplab.auditor.hooks` skips an engine's optimizer).

Parameters are compared across ranks after each audited step where they are whole on every rank: at ZeRO 0-2 all of
them, at ZeRO-3 the persistent ones only (the rest are shards). Nothing here adds a collective.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist

from ddplab.auditor import batches, exchange, frameworks, hooks, losses, schedulers, state
from ddplab.auditor.state import AuditState, WrapperInfo
from ddplab.guest import extension_builds, imports, tensors
from ddplab.guest.patches import Patches
from ddplab.runtime.reduction import Reduction

ENGINE_MODULE = "deepspeed.runtime.engine"
PIPELINE_MODULE = "deepspeed.runtime.pipe.engine"


def install(patches: Patches) -> None:
    imports.when_imported(patches, ENGINE_MODULE, functools.partial(_patch, patches))
    extension_builds.watch(patches)


@state.guarded("watching DeepSpeed's engine")
def _patch(audit: AuditState, patches: Patches, module) -> None:
    engine_class = module.DeepSpeedEngine
    patches.replace(engine_class, "forward", _watched_forward)
    patches.replace(engine_class, "backward", _watched_backward)
    patches.replace(engine_class, "_take_model_step", _watched_step)


def _watched_forward(original_forward):
    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        _before_forward(self, args, kwargs)
        output = original_forward(self, *args, **kwargs)
        _after_forward(self, output)
        return output

    return forward


def _watched_backward(original_backward):
    @functools.wraps(original_backward)
    def backward(self, loss, *args, **kwargs):
        _before_backward(self, args, kwargs)
        with losses.engine_backward(loss):
            return original_backward(self, loss, *args, **kwargs)

    return backward


def _watched_step(original_step):
    @functools.wraps(original_step)
    def _take_model_step(self, *args, **kwargs):
        result = original_step(self, *args, **kwargs)
        _stepped(self)
        return result

    return _take_model_step


# --- finding the engine ---

def _info(audit: AuditState, engine) -> WrapperInfo | None:
    """The engine's record, made the first time it forwards, backwards or steps; None for an engine not read."""
    info = audit.wrappers.get(engine)
    return info if info is not None else _attach(audit, engine)


def _attach(audit: AuditState, engine) -> WrapperInfo | None:
    pipeline = getattr(sys.modules.get(PIPELINE_MODULE), "PipelineEngine", None)
    if isinstance(pipeline, type) and isinstance(engine, pipeline):
        audit.unaudited = ("a DeepSpeed pipeline engine trained the model (its stages see different inputs by design), "
                           "and the audit does not read pipeline engines")
        audit.attached_pid = os.getpid()
        audit.write()
        return None
    audit.rank, audit.world_size = dist.get_rank(), dist.get_world_size()
    stage = int(engine.zero_optimization_stage())
    group = dist.get_process_group_ranks(_data_parallel_group(engine))
    key = f"deepspeed{audit.wrapper_count}-{'.'.join(map(str, group))}"
    audit.wrapper_count += 1
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    info = audit.wrappers[engine] = WrapperInfo(engine.module, key, group, params)
    info.engine = stage
    info.reduction = _reduction(engine, stage, len(group))
    audit.batches[key] = info.batches
    for _, param in info.params():
        audit.owners[param] = info
    # The client optimizer steps once per group on flat partitions: the engine's step is the model's.
    client = getattr(engine, "basic_optimizer", None)
    if isinstance(client, torch.optim.Optimizer):
        for group_ in client.param_groups:
            for param in group_["params"]:
                audit.owners[param] = info
    audit.attached_pid = os.getpid()
    frameworks.on_attach(audit)
    audit.write()
    return info


def _data_parallel_group(engine):
    # The group ZeRO reduces over (Ulysses' sequence-data-parallel one where it is set).
    return getattr(engine, "seq_data_parallel_group", None) or engine.data_parallel_group


def _reduction(engine, stage: int, size: int) -> Reduction:
    if getattr(engine, "gradient_average", True):
        return Reduction(f"deepspeed-zero{stage}", size, float(size))
    return Reduction(f"deepspeed-zero{stage}", size, 1.0, 'gradient_allreduce_op: "sum"')


# --- the engine's calls ---

@state.guarded("before a DeepSpeed forward")
def _before_forward(audit: AuditState, engine, args, kwargs) -> None:
    info = _info(audit, engine)
    if info is not None and torch.is_grad_enabled() and engine.module.training:
        batches.record_training_batch(audit, info, (args, kwargs))


@state.guarded("after a DeepSpeed forward")
def _after_forward(audit: AuditState, engine, output) -> None:
    info = audit.wrappers.get(engine)
    if info is not None and audit.armed and torch.is_grad_enabled() and engine.module.training:
        losses.note_outputs(audit, output)
        batches.after_training_forward(audit, info, output)


@state.guarded("before a DeepSpeed backward")
def _before_backward(audit: AuditState, engine, args, kwargs) -> None:
    info = _info(audit, engine)
    if info is None or not audit.armed:
        return
    scale_wrt_gas = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
    window = audit.window(info)
    window["engine_divides_by"] = int(engine.gradient_accumulation_steps()) if scale_wrt_gas else 1
    info.loss_scale = _loss_scale(engine)


def _loss_scale(engine) -> float:
    """What the engine multiplies the loss by before backward: fp16's dynamic loss scale; 1 otherwise."""
    optimizer = getattr(engine, "optimizer", None)
    for name in ("loss_scale", "cur_scale"):
        value = getattr(optimizer, name, None)
        if isinstance(value, (int, float, torch.Tensor)) and float(value) > 0:
            return float(value)
    return 1.0


@state.guarded("after a DeepSpeed step")
def _stepped(audit: AuditState, engine) -> None:
    info = _info(audit, engine)
    if info is None:
        return
    optimizer = getattr(engine, "basic_optimizer", None) or engine.optimizer
    frameworks.on_optimizer_step(audit)
    schedulers.check(audit, optimizer)
    audit.total_steps += 1
    if not audit.armed:
        if audit.disabled is None:
            # Rank 0 prints the in-run report once its peers' records are in, as after a DDP step.
            exchange.poll_peers(audit)
        return
    # Whole on every rank after the step: every parameter at ZeRO 0-2, the persistent ones at ZeRO-3.
    whole = [(n, p) for n, p in info.params() if info.engine < 3 or getattr(p, "ds_persist", False)]
    audit.window(info)["params"] = tensors.named_digests(whole)
    # The engine's own scheduler overwrites the groups' lr from the first step: its peak is the configured lr.
    audit.lr = schedulers.scheduler_peak_lr(getattr(engine, "lr_scheduler", None)) or audit.lr
    hooks.finish_step(audit, info, optimizer, global_batch_size=int(engine.train_batch_size()),
                      loss_scale=info.loss_scale)
