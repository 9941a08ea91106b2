"""Data parallelism written by hand: gradients all-reduced or reduce-scattered by the program itself.

Some programs build no DDP wrapper: every rank builds the same model from one seed, and a loop (or the optimizer's
own step, as nanochat's and Muon-style distributed optimizers do) calls ``all_reduce`` / ``reduce_scatter`` on the
parameters' gradients. That is a data-parallel run, and it is audited as DDP's is, from its second optimizer step:

- **Found by its collectives.** At each optimizer step with no wrapper, the collectives since the last step (or
  inside the step) whose tensors are the stepped parameters' ``.grad`` (or a list of them) make the parameters a
  model reduced by hand over the collective's group. Its root module is the first module whose training forward
  holds them all (a global forward hook, for the data window only); its forwards are then read as a DDP wrapper's
  are (batches, losses, what their elements weigh), and its optimizer steps are counted.
- **The divisor measured by its effect.** For a few gradients (:data:`PROBE_TENSORS`, :data:`PROBE_ELEMENTS` each)
  this rank's elements are copied before the collective and read again where the step takes them (before it, for a
  loop's collective; after it, for the optimizer's own). Across the ranks, Σ local / reduced is what the program
  divides the summed gradients by, its own scaling after the collective included (``ReduceOp.SUM`` then ``÷ W``
  averages). Where no read gives one number (an optimizer that updates its reduced buffer in place), the op says it:
  ``AVG`` divides by W; a ``SUM`` the program may still scale is left unjudged.
- **A flat buffer is not read.** Gradients copied into one buffer and reduced there are no parameter's gradient; the
  run then says nothing was audited, and why.

Nothing here issues a collective or changes a tensor: the copies are the auditor's, and only during the window.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ddplab.auditor import batches, collectives, meshes, state
from ddplab.auditor.state import AuditState, WrapperInfo
from ddplab.guest import tensors
from ddplab.guest.patches import Handles, Patches
from ddplab.runtime.reduction import Reduction

# The collectives that combine gradients; the reduce-scatters leave each rank its own shard.
REDUCING = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
PROBE_TENSORS, PROBE_ELEMENTS = 4, 16
# Tensors copied before discovery, per step: a loop that reduces its gradients one by one needs only its first few.
CANDIDATES = 32
STRATEGY = "manual"


@dataclasses.dataclass
class _Reduced:
    """One collective over one gradient (or a list of them), this step."""

    call: str  # the collective's own name (all_reduce, reduce_scatter_tensor)
    tensors: list  # the gradients it reduced (a reduce-scatter's inputs: one per shard, or the one flat input)
    output: torch.Tensor  # where the reduced values are: the gradient itself, or a reduce-scatter's output
    op: str | None  # "avg", "sum"; None for another op
    group: list[int]
    shard: int  # this rank's place in the group: a reduce-scatter's output is that shard of the inputs
    local: list[list[float]]  # the first elements of each shard of this rank's input, before the collective
    in_step: bool  # inside the optimizer's step (its own reduction), not the loop's
    params: list = dataclasses.field(default_factory=list)  # the parameters whose gradients they are
    reduced: list[float] | None = None  # the same elements where the step takes them
    read: bool = False

    @property
    def kind(self) -> str:
        """all_reduce, or reduce_scatter (whichever of its forms)."""
        return "all_reduce" if self.call == "all_reduce" else "reduce_scatter"


class _Tables:
    def __init__(self):
        self.seen: list[_Reduced] = []  # this step's collectives over tensors that may be gradients
        self.floats = 0  # floating-point elements this step's reducing collectives carried
        self.stepping = None  # the optimizer whose step runs now, with no wrapper
        self.info: WrapperInfo | None = None
        self.params: set[int] = set()  # ids of the parameters whose gradients the program reduces
        self.roots: WeakIdKeyDictionary = WeakIdKeyDictionary()  # root module → its WrapperInfo
        self.placeholder: torch.nn.Module | None = None  # the model's module until its first training forward
        self.hook = None
        self.tries = 0  # optimizer steps that looked for a reduction by hand


_TABLES = _Tables()
_PATCHES: Patches | None = None


def install(patches: Patches) -> None:
    global _TABLES, _PATCHES
    _TABLES, _PATCHES = _Tables(), patches
    collectives.watch(_collective)


def _op(value) -> str | None:
    names = {getattr(dist.ReduceOp, "AVG", None): "avg", dist.ReduceOp.SUM: "sum"}
    return names.get(value) if value is not None else "sum"


def _arguments(name: str, args: tuple, kwargs: dict):
    """(output, inputs, op, group) of a reducing collective's call, as torch names them."""
    names = ("tensor",) if name == "all_reduce" else ("output", "input")
    rest = ("op", "group", "async_op")
    bound = dict(zip((*names, *rest), args))
    bound.update(kwargs)
    op = bound.get("op", dist.ReduceOp.SUM)
    if name == "all_reduce":
        tensor = bound.get("tensor")
        return tensor, [tensor], op, bound.get("group")
    inputs = bound.get("input", bound.get("input_list"))
    inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    return bound.get("output"), inputs, op, bound.get("group")


def _watching(audit: AuditState) -> bool:
    # Only where no wrapper other than the program's own reduction exists, for the window (and the first steps).
    if audit.disabled is not None or audit.wrapper_count != (1 if _TABLES.info is not None else 0):
        return False
    return audit.armed if _TABLES.info is not None else _TABLES.tries < audit.data_window


@state.guarded("watching the program's own reductions")
def _collective(audit: AuditState, name: str, args: tuple, kwargs: dict, caller: str) -> None:
    if name not in REDUCING or not dist.is_initialized() or not _watching(audit):
        return
    output, inputs, op, group = _arguments(name, args, kwargs)
    if not isinstance(output, torch.Tensor) or not all(isinstance(t, torch.Tensor) and tensors.is_plain(t)
                                                       for t in inputs):
        return
    if not all(t.is_floating_point() for t in inputs):
        return
    _TABLES.floats += sum(t.numel() for t in inputs)
    info = _TABLES.info
    full = len(_TABLES.seen) >= (PROBE_TENSORS if info is not None else CANDIDATES)
    if full and (info is None or info.probe is None):
        return  # nothing left to match this step: a loop reducing each gradient pays for its first few only
    params = _params_of(inputs)
    if info is not None and params:
        # A gradient reduced in the loop changes between backward and the step: that is the reduction's, measured
        # here, not a scaling of the program's (grad_scaling's probe would read the sum as one).
        info.probe = None
    if full or (info is not None and not params):
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    shards = _shards(name, output, inputs, len(ranks))
    if shards is None:
        return
    # An all-reduce leaves every rank the one shard; a reduce-scatter leaves each its own, in the group's order.
    shard = ranks.index(dist.get_rank()) if name != "all_reduce" and dist.get_rank() in ranks else 0
    _TABLES.seen.append(_Reduced(name, inputs, output, _op(op), ranks, shard, [_first(s) for s in shards],
                                 _TABLES.stepping is not None, params))


def _shards(name: str, output: torch.Tensor, inputs: list, size: int) -> list[torch.Tensor] | None:
    """This rank's input, shard by shard as the group's ranks receive it (one shard for an all-reduce)."""
    if name == "all_reduce":
        return [inputs[0]]
    if len(inputs) == size:
        return inputs
    flat, each = inputs[0].reshape(-1), output.numel()
    if len(inputs) != 1 or each * size != flat.numel():
        return None
    return [flat[k * each:(k + 1) * each] for k in range(size)]


def _first(tensor: torch.Tensor) -> list[float]:
    return tensor.detach().reshape(-1)[:PROBE_ELEMENTS].double().tolist()


def _params_of(inputs: list) -> list:
    """The parameters whose gradients ``inputs`` are: the model's once found, else the stepping optimizer's."""
    if _TABLES.info is not None:
        pool = [p for _, p in _TABLES.info.params()]
    elif _TABLES.stepping is not None:
        pool = _optimizer_params(_TABLES.stepping)
    else:
        return []  # a loop's collective before discovery: matched at the step (:func:`before_step`)
    ids = {id(t) for t in inputs}
    return [p for p in pool if p.grad is not None and id(p.grad) in ids]


def _optimizer_params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


# --- optimizer steps (called from :mod:`ddplab.auditor.hooks`) ---

@state.guarded("before a step of the program's own reduction")
def before_step(audit: AuditState, optimizer, info: WrapperInfo | None) -> None:
    """An outermost optimizer step starts: the loop's collectives matched to its parameters, then read as it takes
    them."""
    if info is None and audit.wrapper_count == 0 and _TABLES.tries < audit.data_window:
        grads = {id(p.grad): p for p in _optimizer_params(optimizer) if p.grad is not None}
        for reduced in _TABLES.seen:
            reduced.params = [grads[id(t)] for t in reduced.tensors if id(t) in grads]
        _TABLES.stepping = optimizer
    elif info is not None and info is _TABLES.info:
        _TABLES.stepping = optimizer
        _read(info, in_step=False)


def _read(info: WrapperInfo, in_step: bool) -> None:
    """What the step takes of each probed gradient, beside this rank's copy from before its collective."""
    for reduced in _TABLES.seen:
        if reduced.in_step != in_step or not reduced.params or reduced.read:
            continue
        reduced.read = True
        # A loop's all-reduce: the step takes the parameter's gradient, whatever tensor the program left there.
        grad = reduced.params[0].grad if reduced.kind == "all_reduce" and not in_step else reduced.output
        reduced.reduced = _first(grad) if isinstance(grad, torch.Tensor) and tensors.is_plain(grad) else None


@state.guarded("after a step of the program's own reduction")
def after_alone_step(audit: AuditState, optimizer) -> None:
    """A step with no wrapper ended: the gradients its collectives reduced make a model reduced by hand."""
    _TABLES.tries += 1
    found = [r for r in _TABLES.seen if r.params]
    floats, _TABLES.floats = _TABLES.floats, 0
    _TABLES.seen, _TABLES.stepping = [], None
    if not found:
        if floats and floats >= sum(p.numel() for p in _optimizer_params(optimizer)) and audit.unaudited is None:
            audit.unaudited = (f"the program reduced {floats:,} values in collectives between its optimizer steps, "
                               "as many as its parameters hold, into tensors that are not the parameters' gradients "
                               "(a flat buffer): ddplab reads a reduction written by hand on the gradients themselves")
        return
    _TABLES.params = {id(p) for r in found for p in r.params}
    audit.unaudited = None
    _attach(audit, optimizer, found)


def step_evidence(audit: AuditState, info: WrapperInfo) -> None:
    """At an audited step of a model reduced by hand: the probed gradients, before their collective and as the
    step took them (:func:`ddplab.auditor.findings.run_reduction` measures the divisor from every rank's)."""
    _read(info, in_step=True)
    probes = [{"kind": r.kind, "shard": r.shard, "local": r.local, "reduced": r.reduced, "in_step": r.in_step,
               "op": r.op} for r in _TABLES.seen if r.params and r.reduced is not None]
    if probes:
        audit.window(info)["reduced_by_hand"] = probes
    _TABLES.seen, _TABLES.stepping, _TABLES.floats = [], None, 0


def _attach(audit: AuditState, optimizer, found: list[_Reduced]) -> None:
    audit.rank, audit.world_size = dist.get_rank(), dist.get_world_size()
    group = found[0].group
    names = {id(p): f"param{i}" for i, p in enumerate(_optimizer_params(optimizer))}
    params = [(names[id(p)], p) for p in _optimizer_params(optimizer) if id(p) in _TABLES.params]
    key = f"{STRATEGY}{audit.wrapper_count}-{'.'.join(map(str, group))}"
    audit.wrapper_count += 1
    _TABLES.placeholder = torch.nn.Module()
    info = _TABLES.info = WrapperInfo(_TABLES.placeholder, key, group, params)
    info.by_hand = True
    info.reduction = _reduction(found, len(group), type(optimizer).__name__)
    audit.batches[key] = info.batches
    for _, param in params:
        audit.owners[param] = info
    if _PATCHES is not None and _TABLES.hook is None:
        _TABLES.hook = _PATCHES.hook(Handles(register_module_forward_pre_hook(_module_forward),
                                              register_module_forward_hook(_module_forward_done)))
    audit.data_parallel_size, audit.strategy, audit.reduction = len(group), STRATEGY, info.reduction
    audit.attached_pid = os.getpid()
    audit.write()


def _reduction(found: list[_Reduced], size: int, optimizer: str) -> Reduction:
    """The divisor the collectives' op implies; the measured one replaces it at the merge where there is one."""
    ops = {r.op for r in found}
    where = f"in {optimizer}.step" if any(r.in_step for r in found) else "in the training loop"
    calls = "/".join(sorted({r.call for r in found}))
    op = ops.pop() if len(ops) == 1 else None
    divisor = float(size) if op == "avg" else None
    source = f"dist.{calls} with ReduceOp.{(op or 'mixed').upper()} {where}"
    return Reduction(STRATEGY, size, divisor, source)


@state.guarded("looking for the model reduced by hand")
def _module_forward(audit: AuditState, module, args) -> None:
    info = _TABLES.info
    if info is None or not torch.is_grad_enabled():
        return
    if info.steps >= audit.data_window:
        _remove_hook()
        return
    if module not in _TABLES.roots:
        if _TABLES.placeholder is None or not _holds_all(module):
            return
        # The outermost module holding every reduced parameter starts its forward first: the model's root.
        _TABLES.roots[module], _TABLES.placeholder = info, None
        info.module_ref = weakref.ref(module)
        info.batchnorm_layers = state.unsynced_batchnorms(module)
    batches.record_training_batch(audit, info, args)


@state.guarded("reading the output of the model reduced by hand")
def _module_forward_done(audit: AuditState, module, args, output) -> None:
    meshes.training_output(audit, _TABLES.roots.get(module), output)


def _holds_all(module) -> bool:
    ids = _TABLES.params
    return len({id(p) for p in module.parameters() if id(p) in ids}) == len(ids)


def _remove_hook() -> None:
    if _TABLES.hook is not None:
        _TABLES.hook.remove()
        _TABLES.hook = None
