"""FSDP2 (``fully_shard``) and device meshes in the user's own script, seen through torch's public objects.

An FSDP2 model has no wrapper to patch: ``fully_shard`` turns the user's module into an ``FSDPModule`` in place.
Once the program builds a ``DeviceMesh`` (every FSDP2 or tensor-parallel program does, ``fully_shard`` without a
mesh included), a global forward pre-hook watches for ``FSDPModule`` forwards; the first one is the root's (FSDP2
itself requires the root to run forward first). The root is then audited as a DDP wrapper is, with:

- **the mesh** its parameters live on (DTensors: in a tp × dp model the tensor-parallel weights are on the
  ("dp", "tp") mesh, embeddings, norms and the head on ("dp",) only), and the ranks FSDP2 averages gradients over.
  A mesh dimension whose ranks FSDP2 averages over is data-parallel, unless it is named ``cp`` (context-parallel
  ranks share a batch, each holding a slice of its sequences); ``pp`` dimensions are left out (pipeline stages
  see different inputs by design); any other is model-parallel (``tp``).
- **the data-parallel degree**: the ranks along the data-parallel dimensions, never the world size when tp > 1.
  The global batch is the per-rank loader batch times it, and SAME_DATA_ON_ALL_RANKS is judged among them.
- **tensor-parallel groups**: ranks along the model-parallel dimensions must be fed the same batches;
  :func:`ddplab.auditor.findings.merge` compares them (TP_RANKS_SEE_DIFFERENT_DATA).

Parameters are read once, when the root is found, before its first forward: they are then the sharded DTensors the
optimizer holds (after an evaluation forward without backward the root's own would be plain unsharded tensors).
The auditor never runs an operation on a DTensor, which could issue a collective: only its mesh is read.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ddplab.auditor import batches, losses, state
from ddplab.auditor.state import AuditState, WrapperInfo
from ddplab.guest import tensors
from ddplab.guest.patches import Handles, Patches
from ddplab.parallel_dims import ParallelDims
from ddplab.runtime.reduction import Reduction
from ddplab.runtime.strategies.fsdp import gradient_divide_factors

# Mesh dimension names with a meaning of their own (torch's and torchtitan's names).
CONTEXT_DIMS = ("cp",)
PIPELINE_DIMS = ("pp",)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One rank's place in an FSDP2 model's device mesh."""

    mesh: dict[str, int]
    """Every dimension of the mesh the parameters live on, name → size."""
    strategy: str
    """``fsdp`` or ``hsdp``, then the model-parallel dimensions after '+' (``fsdp+tp``)."""
    data_parallel_ranks: list[int]
    """The ranks that split the data with this one (and average its gradients)."""
    peer_ranks: list[int]
    """The ranks that must be fed this rank's batches: its tensor- (and context-) parallel group."""
    peer_dims: list[str]
    """The dimensions along which the peers lie."""
    sharded_inputs: bool
    """Whether the peers hold different slices of one batch (context parallelism), so only indices can agree."""
    dims: ParallelDims
    """The mesh's degrees by role (data-parallel, tp, pp, cp), as the plan and the runtime count them."""


# --- the mesh, as plain lists (pure) ---

def coordinates(mesh: list | int) -> dict[int, tuple[int, ...]]:
    """rank → its coordinate in a mesh given as nested lists of global ranks (``DeviceMesh.mesh.tolist()``)."""
    found: dict[int, tuple[int, ...]] = {}

    def walk(node, prefix: tuple[int, ...]) -> None:
        if isinstance(node, list):
            for index, child in enumerate(node):
                walk(child, (*prefix, index))
        else:
            found[int(node)] = prefix

    walk(mesh, ())
    return found


def ranks_along(coords: dict[int, tuple[int, ...]], rank: int, dims: set[int]) -> list[int]:
    """The ranks that differ from ``rank`` only along ``dims``, ``rank`` included.

    >>> ranks_along(coordinates([[0, 1], [2, 3]]), 1, {0})
    [1, 3]
    """
    mine = coords[rank]
    return sorted(r for r, c in coords.items() if all(c[d] == mine[d] for d in range(len(mine)) if d not in dims))


def layout(mesh: list, names: list[str | None] | None, rank: int, averaged: set[int], replicated: bool) -> Layout:
    """``rank``'s layout in ``mesh`` (nested lists of ranks, with its dimension names), where FSDP2 averages the
    gradients over the ranks ``averaged`` and ``replicated`` says whether it replicates across some of them (HSDP).

    >>> tp_dp = layout([[0, 1], [2, 3]], ["dp", "tp"], 1, {1, 3}, False)
    >>> tp_dp.strategy, tp_dp.data_parallel_ranks, tp_dp.peer_ranks, tp_dp.dims.data_parallel_size
    ('fsdp+tp', [1, 3], [0, 1], 2)
    """
    coords = coordinates(mesh)
    shape = [max(c[d] for c in coords.values()) + 1 for d in range(len(coords[rank]))]
    names = list(names) if names else [None] * len(shape)
    data_dims, model_dims = set(), set()
    for dim, size in enumerate(shape):
        if size == 1 or names[dim] in PIPELINE_DIMS:
            continue
        along = set(ranks_along(coords, rank, {dim}))
        (data_dims if along <= averaged and names[dim] not in CONTEXT_DIMS else model_dims).add(dim)
    labels = [names[d] or ("dp" if data_dims == {d} else f"dim{d}") for d in range(len(shape))]
    peer_dims = [labels[d] for d in sorted(model_dims)]
    dims = ParallelDims.from_mesh(dict(zip(labels, shape)), data=[labels[d] for d in sorted(data_dims)],
                                  context=[labels[d] for d in model_dims if names[d] in CONTEXT_DIMS],
                                  pipeline=[labels[d] for d in range(len(shape)) if names[d] in PIPELINE_DIMS],
                                  replicated=replicated)
    return Layout(mesh=dict(zip(labels, shape)), dims=dims,
                  strategy="+".join(["hsdp" if replicated else "fsdp", *peer_dims]),
                  data_parallel_ranks=ranks_along(coords, rank, data_dims),
                  peer_ranks=ranks_along(coords, rank, model_dims) if model_dims else [rank],
                  peer_dims=peer_dims,
                  sharded_inputs=any(names[d] in CONTEXT_DIMS for d in model_dims))


# --- watching the program ---

class _Tables:
    """This process's side tables (weak: they die with the user's modules)."""

    def __init__(self):
        self.roots: WeakIdKeyDictionary = WeakIdKeyDictionary()  # root FSDPModule → its WrapperInfo
        self.inner: WeakIdKeyDictionary = WeakIdKeyDictionary()  # FSDPModule inside a root → True
        self.optimizer_steps = 0


_TABLES = _Tables()
_PATCHES: Patches | None = None


def install(patches: Patches) -> None:
    """Start watching for FSDP2 models once the program builds a device mesh."""
    global _TABLES, _PATCHES
    _TABLES, _PATCHES = _Tables(), patches
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    mesh_class = getattr(device_mesh, "DeviceMesh", None)
    if isinstance(mesh_class, type):
        patches.replace(mesh_class, "__init__", _watched_mesh_init)


def _watched_mesh_init(original_init):
    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _mesh_built()

    return __init__


@state.guarded("watching device meshes")
def _mesh_built(audit: AuditState) -> None:
    # Global module hooks are never stored on the user's modules; this one lives for the data window only.
    if audit.mesh_hook is None and _PATCHES is not None and _TABLES.optimizer_steps < audit.data_window:
        done = _forward_done_hook()
        audit.mesh_hook = _PATCHES.hook(Handles(register_module_forward_pre_hook(_module_forward), done))


def _forward_done_hook():
    """The global forward hook, with the call's keywords where this torch passes them to global hooks (2.6 on)."""
    try:
        return register_module_forward_hook(_module_forward_done, with_kwargs=True)
    except TypeError:
        return register_module_forward_hook(lambda module, args, output: _module_forward_done(module, args, {},
                                                                                               output))


def _fsdp_module_class() -> type | None:
    # Never imported here (it costs ~0.6 s): a program that has not imported it has no FSDP2 model.
    module = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(module, "FSDPModule", None)
    return cls if isinstance(cls, type) else None


def _dtensor_class() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls if isinstance(cls, type) else None


@state.guarded("watching FSDP2 forwards")
def _module_forward(audit: AuditState, module, args) -> None:
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None or not isinstance(module, fsdp_module):
        return
    info = _TABLES.roots.get(module)
    if info is None:
        if module in _TABLES.inner or not dist.is_initialized():
            return
        info = _attach(audit, module, fsdp_module)
    if torch.is_grad_enabled():
        # A root called with keywords only has its batch recorded when it returns (_module_forward_done).
        if tensors.first_dim(args) is not None:
            batches.record_training_batch(audit, info, args)
        if audit.armed:
            info.synced_micro_steps += _syncs_gradients(module, fsdp_module)


@state.guarded("watching FSDP2 outputs")
def _module_forward_done(audit: AuditState, module, args, kwargs, output) -> None:
    info = _TABLES.roots.get(module)
    if info is not None and torch.is_grad_enabled() and tensors.first_dim(args) is None:
        # torchtune's self._model(**batch): a global pre-hook sees no keywords, this hook does.
        batches.record_training_batch(audit, info, kwargs)
    training_output(audit, info, output)


def training_output(audit: AuditState, info: WrapperInfo | None, output) -> None:
    """A root's training output (FSDP2's, or a model reduced by hand): where a loss over its samples starts
    (losses.note_outputs), and where its backward shows whether the step's gradients were cleared."""
    if audit.armed and torch.is_grad_enabled() and info is not None:
        losses.note_outputs(audit, output)
        batches.after_training_forward(audit, info, output)


def _attach(audit: AuditState, root, fsdp_module: type) -> WrapperInfo:
    """Audit an FSDP2 root: its mesh, its parameters (the sharded ones the optimizer holds), its data-parallel group."""
    audit.rank, audit.world_size = dist.get_rank(), dist.get_world_size()
    params = [(n, p) for n, p in root.named_parameters() if p.requires_grad]
    for module in root.modules():
        if module is not root and isinstance(module, fsdp_module):
            _TABLES.inner[module] = True
    where = _layout(audit.rank, root, params, fsdp_module)
    model = f"fsdp{audit.wrapper_count}"  # the same name on every rank: models are built in one order
    key = f"{model}-{'.'.join(map(str, where.data_parallel_ranks))}"
    audit.wrapper_count += 1
    info = _TABLES.roots[root] = WrapperInfo(root, key, where.data_parallel_ranks, params, where)
    audit.batches[key] = info.batches
    for _, param in params:
        audit.owners[param] = info
    if len(where.peer_ranks) > 1:
        group = f"{model}/{'.'.join(where.peer_dims)}-{'.'.join(map(str, where.peer_ranks))}"
        audit.tp_groups[group] = {"batches": key, "dims": where.peer_dims, "sharded_inputs": where.sharded_inputs}
    # Known from here on, so a summed loss's finding can name the data-parallel degree before the first step.
    note_setting(audit, info)
    audit.attached_pid = os.getpid()
    audit.write()
    return info


def note_model_parallel_only(audit: AuditState, optimizer) -> None:
    """An optimizer stepping DTensor parameters with no FSDP2 root: model parallelism with no data-parallel
    dimension (pure tensor or sequence parallelism), whose mesh the report names."""
    dtensor = _dtensor_class()
    if audit.model_parallel_only is not None or dtensor is None:
        return
    mesh = next((p.device_mesh for group in optimizer.param_groups for p in group["params"]
                 if isinstance(p, dtensor)), None)
    if mesh is not None:
        names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
        audit.model_parallel_only = dict(zip(names, mesh.mesh.shape))
        audit.write()


def note_setting(audit: AuditState, info: WrapperInfo) -> None:
    """The run's strategy, mesh, data-parallel degree and reduction, as ``info``'s model has them now."""
    audit.data_parallel_size = info.layout.dims.data_parallel_size if info.layout is not None else len(info.group)
    audit.strategy = info.layout.strategy if info.layout is not None else (
        info.reduction.strategy if info.reduction is not None else "ddp")
    audit.mesh = info.layout.mesh if info.layout is not None else None
    if info.layout is not None:
        # Read again at every audited step: set_gradient_divide_factor may follow the first forward.
        info.reduction = fsdp_reduction(info.root(), info.layout.strategy, len(info.group))
    audit.reduction = info.reduction


def fsdp_reduction(root, strategy: str, data_parallel_size: int) -> Reduction | None:
    """What FSDP2 divides the ranks' summed gradients by in ``root`` (None: the model is gone)."""
    if root is None:
        return None
    factors = gradient_divide_factors(root, data_parallel_size)
    if len(factors) > 1:
        shown = ", ".join(f"{factor:g}" for factor in sorted(factors))
        return Reduction(strategy, data_parallel_size, None, f"set_gradient_divide_factor: {shown} in different "
                                                            "groups")
    divisor = factors.pop() if factors else float(data_parallel_size)
    source = "" if divisor == data_parallel_size else f"set_gradient_divide_factor({divisor:g})"
    return Reduction(strategy, data_parallel_size, divisor, source)


def _layout(rank: int, root, params, fsdp_module: type) -> Layout:
    dtensor = _dtensor_class()
    meshes = [p.device_mesh for _, p in params if dtensor is not None and isinstance(p, dtensor)]
    averaged, replicated, fsdp_meshes = _averaged_ranks(rank, root, fsdp_module)
    candidates = meshes + fsdp_meshes
    if not candidates:
        world = list(range(dist.get_world_size()))
        return layout(world, None, rank, set(world), False)
    # The mesh with the most dimensions that parameters live on: the whole of the parallelism the model uses.
    full = max(candidates, key=lambda m: m.ndim)
    if averaged is None:
        # FSDP2's own record unreadable: its mesh is the smallest the parameters live on.
        smallest = min(candidates, key=lambda m: m.ndim)
        averaged = set(coordinates(smallest.mesh.tolist()))
    return layout(full.mesh.tolist(), full.mesh_dim_names, rank, averaged, replicated)


def _averaged_ranks(rank: int, root, fsdp_module: type) -> tuple[set[int] | None, bool, list]:
    """The ranks FSDP2 reduces gradients over (shard and replicate dimensions), whether it replicates (HSDP), and its
    meshes; (None, False, []) where this torch keeps them elsewhere."""
    averaged: set[int] = set()
    replicated, meshes = False, []
    try:
        for module in root.modules():
            if not isinstance(module, fsdp_module):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                info = group.mesh_info
                dims = {d for d in (getattr(info, "shard_mesh_dim", None), getattr(info, "replicate_mesh_dim", None))
                        if d is not None}
                replicated |= getattr(info, "replicate_mesh_dim", None) is not None
                averaged |= set(ranks_along(coordinates(info.mesh.mesh.tolist()), rank, dims))
                meshes.append(info.mesh)
    except (AttributeError, TypeError, KeyError):
        return None, False, []
    return (averaged or None), replicated, meshes


def _syncs_gradients(module, fsdp_module: type) -> bool:
    """Whether a backward now reduces the gradients (set_requires_gradient_sync), read from FSDP2's param groups."""
    try:
        return any(group.reduce_grads for sub in module.modules() if isinstance(sub, fsdp_module)
                   for group in sub._get_fsdp_state()._fsdp_param_groups)
    except AttributeError:
        return True  # unreadable: no evidence of deferred reduction either way


def on_optimizer_step(audit: AuditState) -> None:
    """Every optimizer step: the forward hook goes once the data window is over."""
    _TABLES.optimizer_steps += 1
    if _TABLES.optimizer_steps >= audit.data_window:
        audit.remove_mesh_hook()


def step_evidence(audit: AuditState, info: WrapperInfo) -> None:
    """At an audited optimizer step of an FSDP2 model: its micro-steps all reduce-scattered (accumulation)."""
    if info.micro_steps >= 2 and info.synced_micro_steps == info.micro_steps:
        audit.add("ACCUMULATION_REDUCES_EVERY_STEP",
                  f"gradient sync was on for each of the {info.micro_steps} micro-batches of optimizer step "
                  f"{info.steps}, so each backward reduced the gradients over the {len(info.group)} data-parallel "
                  "ranks")
    info.micro_steps = info.synced_micro_steps = 0
