"""The auditor inside a training process: it watches DDP and never changes what it computes.

A guest in someone else's program, it keeps to four rules:

- **No collectives.** Ranks never wait for each other on the auditor's behalf. Each rank records
  digests of its parameters, gradients and batches at every audited optimizer step, writes them
  to its own file as it goes, and publishes them once to the process group's key-value store
  (:mod:`ddplab.auditor.exchange`), so a rank that takes a path alone (evaluation on rank 0, a
  probe optimizer, ZeRO's per-rank inner optimizer) can never leave another waiting.
- **No state in the user's objects.** Side tables keyed weakly by the wrapper, its module and its
  parameters (:mod:`ddplab.auditor.state`); global module and optimizer hooks instead of hooks
  stored on the user's modules, so ``torch.save(ddp.module)`` pickles exactly what it would.
- **Evidence, not patterns.** A finding needs its effect: gradients stepped that DDP never
  reduced, an epoch order repeated in a second training pass, batches repeated across ranks.
- **Disarm rather than fail.** Every hook runs under a guard; an internal error turns the audit
  off for the rest of the process and is reported as AUDIT_INCOMPLETE.

The heavy work (digests, module hooks) runs only during the audited window: the first
``steps`` optimizer steps that update a DDP model's parameters.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ddplab.auditor import (
    batches,
    exchange,
    frameworks,
    grad_scaling,
    handwritten,
    losses,
    meshes,
    schedulers,
    state,
    weights,
)
from ddplab.auditor.state import AuditState, WrapperInfo
from ddplab.guest import tensors
from ddplab.guest.patches import Patches
from ddplab.runtime import compat, strategies
from ddplab.runtime.reduction import averaging


def install(patches: Patches) -> None:
    patches.replace(DistributedDataParallel, "__init__", _watched_init)
    patches.replace(DistributedDataParallel, "forward", _watched_forward)
    patches.replace(torch.optim.Optimizer, "zero_grad", _watched_zero_grad)
    patches.replace(torch.nn.Module, "zero_grad", _watched_zero_grad)
    patches.hook(register_optimizer_step_pre_hook(_before_optimizer_step))
    patches.hook(register_optimizer_step_post_hook(_after_optimizer_step))
    join_hook = compat.ddp_join_hook_class()
    if join_hook is not None:
        patches.replace(join_hook, "main_hook", _watched_join)


def _watched_zero_grad(original_zero_grad):
    @functools.wraps(original_zero_grad)
    def zero_grad(self, *args, **kwargs):
        audit = state.current()
        if audit is not None:
            audit.zero_grad_calls += 1
        return original_zero_grad(self, *args, **kwargs)

    return zero_grad


def _watched_init(original_init):
    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        attach(self)

    return __init__


def _watched_forward(original_forward):
    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        _before_ddp_forward(self, args, kwargs)
        try:
            output = original_forward(self, *args, **kwargs)
        finally:
            _leave_ddp_forward()
        _after_ddp_forward(self, output)
        return output

    return forward


@state.guarded("attaching to the DDP wrapper")
def attach(audit: AuditState, ddp: DistributedDataParallel) -> None:
    """Watch one DDP wrapper: its forwards, its inner module's forwards, its lifetime."""
    if ddp in audit.wrappers:
        return
    audit.rank, audit.world_size = dist.get_rank(), dist.get_world_size()
    strategy = strategies.of(ddp)
    # Judged by the group that averages the gradients: its ranks must see different samples.
    group = dist.get_process_group_ranks(strategy.data_parallel_group(ddp))
    key = f"ddp{audit.wrapper_count}-{'.'.join(map(str, group))}"
    audit.wrapper_count += 1
    ignored = getattr(ddp, "parameters_to_ignore", set())
    params = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
    info = audit.wrappers[ddp] = WrapperInfo(ddp.module, key, group, params)
    # DDP's own reducer averages; a comm hook registered later says otherwise (comm_hooks).
    info.reduction = averaging("ddp", len(group))
    audit.batches[key] = info.batches
    audit.modules[strategy.module(ddp)] = info
    for _, param in info.params():
        audit.owners[param] = info
    # A wrapper collected between a training forward and its backward takes its all-reduce with it.
    weakref.finalize(ddp, _wrapper_collected, info)
    audit.attached_pid = os.getpid()
    if audit.module_hook is None and audit.armed:
        audit.module_hook = register_module_forward_pre_hook(_module_pre_forward)
    frameworks.on_attach(audit)
    audit.write()


def _watched_join(original_main_hook):
    @functools.wraps(original_main_hook)
    def main_hook(self, *args, **kwargs):
        _joined_early(getattr(self, "ddp", None))
        return original_main_hook(self, *args, **kwargs)

    return main_hook


@state.guarded("watching torch's Join")
def _joined_early(audit: AuditState, ddp) -> None:
    # This rank ran out of inputs and shadows the others' all-reduces: from here its optimizer steps no
    # longer line up with theirs, so the step-by-step comparison stops at this step (findings.merge).
    info = audit.wrappers.get(ddp) if ddp is not None else None
    if info is not None and info.key not in audit.joined:
        audit.joined[info.key] = info.steps
        audit.write()


# --- the wrapper's forward ---

@state.guarded("before a DDP forward")
def _before_ddp_forward(audit: AuditState, ddp, args, kwargs) -> None:
    audit.ddp_forward_depth += 1
    info = audit.wrappers.get(ddp)
    if info is None or not torch.is_grad_enabled():
        return  # evaluation forwards take no part in a training step
    # A backward whose end this torch could not report is over once the next forward starts.
    info.in_backward = False
    # Read before DDP's own pre-forward: whether it is about to broadcast rank 0's buffers.
    info.syncs_buffers = strategies.of(ddp).syncs_buffers(ddp)
    batches.record_training_batch(audit, info, (args, kwargs))


def _leave_ddp_forward() -> None:
    audit = state.current()
    if audit is not None:
        audit.ddp_forward_depth = max(0, audit.ddp_forward_depth - 1)


@state.guarded("after a DDP forward")
def _after_ddp_forward(audit: AuditState, ddp, output) -> None:
    info = audit.wrappers.get(ddp)
    if info is None:
        return
    info.syncs_buffers = False
    if not (audit.armed and torch.is_grad_enabled()):
        return
    losses.note_outputs(audit, output)
    batches.after_training_forward(audit, info, output)
    if not strategies.of(ddp).syncs(ddp):
        return
    nodes = {id(t.grad_fn): t.grad_fn for t in tensors.iter_tensors(output) if t.grad_fn is not None}
    for node in nodes.values():
        # Hooks on graph nodes, not on the user's tensors: one fires when backward reaches any output.
        node.register_prehook(functools.partial(_backward_reached, info))
    info.pending = info.pending or bool(nodes)


def _backward_reached(info: WrapperInfo, grad_outputs):
    _count_reduction(info)
    return None


@state.guarded("counting DDP reductions")
def _count_reduction(audit: AuditState, info: WrapperInfo) -> None:
    info.pending = False
    if info.in_backward:
        return
    info.in_backward = True
    compat.queue_backward_callback(functools.partial(_backward_done, info))
    # Gradients already present when this reduction starts accumulate with it into one optimizer step.
    accumulating = any(p.grad is not None and bool(p.grad.any()) for _, p in info.params())
    info.accumulated_reductions = info.accumulated_reductions + 1 if accumulating else 1
    info.reductions += 1


def _backward_done(info: WrapperInfo) -> None:
    info.in_backward = False


def _wrapper_collected(info: WrapperInfo) -> None:
    audit = state.current()
    if audit is not None and audit.armed and info.pending:
        audit.add("NO_ALLREDUCE", "the DDP wrapper was garbage-collected between a training forward and its "
                                  "backward (a temporary wrapper such as loss_fn(DDP(model)(x), y)), so its "
                                  "all-reduce never ran")


@state.guarded("watching module forwards")
def _module_pre_forward(audit: AuditState, module, args) -> None:
    info = audit.modules.get(module)
    if info is None or not audit.armed:
        return
    if audit.ddp_forward_depth == 0:
        if torch.is_grad_enabled():
            # A training forward that skipped the wrapper: DDP will not reduce what it computes.
            info.bypassed = True
            batches.record_training_batch(audit, info, args)
        return
    if info.syncs_buffers:
        # DDP has just broadcast rank 0's buffers: they must now be equal everywhere.
        buffers = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        audit.window(info)["buffers"] = tensors.named_digests(buffers)


# --- optimizer steps ---

@state.guarded("before an optimizer step")
def _before_optimizer_step(audit: AuditState, optimizer, args, kwargs) -> None:
    if id(optimizer) in audit.stepping:
        # Its previous step raised before finishing: nothing of that step is still running.
        audit.stepping.clear()
    # A step inside another's step (ZeRO's per-rank inner optimizer) is not a step of the model.
    outermost = not audit.stepping
    audit.stepping.add(id(optimizer))
    info = _owner(audit, optimizer) if outermost and audit.armed else None
    if outermost:
        handwritten.before_step(optimizer, info)
    if info is not None:
        # The gradients as the step takes them, against the newest backward's: the program's scaling between.
        grad_scaling.measure(audit, info)


@state.guarded("after an optimizer step")
def _after_optimizer_step(audit: AuditState, optimizer, args, kwargs) -> None:
    audit.stepping.discard(id(optimizer))
    if not audit.stepping:
        _optimizer_stepped(audit, optimizer)


def _optimizer_stepped(audit: AuditState, optimizer) -> None:
    info = _owner(audit, optimizer)
    frameworks.on_optimizer_step(audit)
    meshes.on_optimizer_step(audit)
    if info is not None and info.engine is not None:
        return  # an engine's own optimizer: the engine's step is the model's (deepspeed_engine)
    if info is None:
        # A probe or auxiliary optimizer beside a DDP model is no part of the audit; with no DDP model at all,
        # ranks that each train alone are, and so is their schedule.
        if audit.wrapper_count == 0:
            handwritten.after_alone_step(optimizer)
            meshes.note_model_parallel_only(audit, optimizer)
            frameworks.check_not_distributed(audit, optimizer)
            schedulers.check(audit, optimizer)
        return
    schedulers.check(audit, optimizer)
    audit.total_steps += 1
    if audit.armed:
        _audit_step(audit, info, optimizer)
    elif audit.disabled is None:
        exchange.poll_peers(audit)


def _ddp_step_evidence(audit: AuditState, info: WrapperInfo) -> None:
    params = info.params()
    stepped = [(n, p) for n, p in params if p.grad is not None]
    if stepped and info.reductions == 0 and info.bypassed:
        # Without the bypass, differing gradient digests across ranks are the evidence (findings.merge).
        audit.add("NO_ALLREDUCE", "the optimizer stepped on gradients DDP never all-reduced: a training forward "
                                  "reached the module DDP wraps without passing through the wrapper")
    if info.accumulated_reductions >= 2:
        audit.add("ACCUMULATION_SYNCS_EVERY_STEP",
                  f"{info.accumulated_reductions} all-reduces of micro-batches accumulated into one optimizer step")
    window = audit.window(info)
    if info.by_hand:
        # Its gradients are what the program left in .grad: reduced in place, or this rank's own beside a shard.
        handwritten.step_evidence(audit, info)
    else:
        window["grads"] = tensors.named_digests([(n, p.grad) for n, p in stepped])
    window["params"] = tensors.named_digests(params)
    if info.comm_sums is not None:
        window["comm_sums"], info.comm_sums = info.comm_sums, None


def _owner(audit: AuditState, optimizer) -> WrapperInfo | None:
    """The wrapper whose parameters ``optimizer`` updates; looked up once per optimizer, not every step."""
    # Valid until a wrapper is built or a param group is added.
    key = (audit.wrapper_count, len(optimizer.param_groups))
    cached = audit.optimizer_owners.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    info = next((audit.owners[param] for group in optimizer.param_groups for param in group["params"]
                 if param in audit.owners), None)
    audit.optimizer_owners[optimizer] = (key, info)
    return info


def _audit_step(audit: AuditState, info: WrapperInfo, optimizer) -> None:
    if info.layout is None:
        _ddp_step_evidence(audit, info)
    else:
        # FSDP2's parameters and gradients are shards, different on every rank by design: nothing to compare.
        meshes.step_evidence(audit, info)
    finish_step(audit, info, optimizer)


def finish_step(audit: AuditState, info: WrapperInfo, optimizer, global_batch_size: int | None = None,
                loss_scale: float = 1.0) -> None:
    """What every audited optimizer step of a data-parallel model records, whatever wraps it: its losses' weights
    (``loss_scale``: a factor of the engine's own in them), its lr, its batch; and the report once the window is full.
    ``global_batch_size``: the engine's own, where it states one."""
    grad_scale, info.grad_scale = info.grad_scale, None
    losses.check_step(audit, info.forward_batch, grad_scale)
    batches.check_cleared(audit, info)
    info.zero_grad_calls = audit.zero_grad_calls
    # What each loss element weighed in this step's micro-batches, compared across ranks by findings.merge; the
    # program's own scaling of the gradients after backward is part of what they weigh in the step.
    window = audit.window(info)
    window["loss_weights"] = weights.flush(audit, loss_scale if grad_scale is None else loss_scale / abs(grad_scale))
    if grad_scale is not None and grad_scale != 1.0:
        window["grad_scale"] = grad_scale
    audit.lr = schedulers.configured_lr(optimizer, audit.lr)
    audit.optimizer = type(optimizer).__name__
    meshes.note_setting(audit, info)
    # Samples the loader fed: a GAN's discriminator also sees a generated batch, which is no part of the data.
    per_rank_batch = info.loader_batch or info.forward_batch
    loaded, audit.loaded_samples = audit.loaded_samples, 0
    if global_batch_size is not None:
        audit.global_batch_size = global_batch_size
    elif per_rank_batch:
        # The data-parallel ranks, not the world: tensor-parallel ranks share their batch.
        size = len(info.group)
        audit.global_batch_size, audit.global_batch_unit = per_rank_batch * size, None
        if loaded and loaded != per_rank_batch:
            # The forwards took rows the program made from its loaders' samples (a pair's two sequences, documents
            # packed into one row, in its loop or its collate_fn): the batch is counted in the samples the loaders
            # returned.
            audit.global_batch_size = loaded * size
            audit.global_batch_unit = (f"samples the DataLoaders returned; the model's forwards took "
                                       f"{info.forward_batch * size} rows")
    info.steps += 1
    info.reductions = info.accumulated_reductions = info.forward_batch = info.loader_batch = info.micro_steps = 0
    info.bypassed = False
    audit.steps += 1
    audit.write()
    if audit.steps == audit.steps_to_audit:
        # The batches the audited steps took: what the report counts, in the run and at its end alike.
        audit.audited_batches = {field: {key: len(batches) for key, batches in getattr(audit, field).items()}
                                 for field in ("batches", "index_batches")}
        audit.remove_module_hook()
        exchange.publish(audit)
        exchange.poll_peers(audit)
