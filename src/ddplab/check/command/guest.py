"""The guest of ``ddplab check -- COMMAND`` in one process of the user's command: what each optimizer step received.

Armed from the injected sitecustomize (``DDPLAB_GUEST`` names this module; ``DDPLAB_CHECK_RUN`` holds the run's
settings as JSON). For each of the first ``steps`` steps of every optimizer, it reads, around ``Optimizer.step``
(torch's global step hooks, so any optimizer and any wrapper around it is seen):

- each parameter's gradient before the step and, where the step changed it (an optimizer that reduces the gradients
  itself, in place), after it: its exact squared norm and its count sketch (:mod:`ddplab.check.command.sketch`);
- each parameter's sketch before and after the step: the update the step made.

A DTensor (FSDP2, HSDP, a mesh) is read from its local shard by global element index, on the ranks that hold a
distinct part of it, so the ranks' numbers add up to the whole tensor; nothing is gathered and nothing the size of
the model is kept. It also records the first indices each DistributedSampler yields (the global batch's samples),
dropout (turned off for the check runs: it draws different numbers on the two sides, by design) and autocast.

At the first optimizer's step number ``steps`` every rank has recorded the same steps, and the process leaves with
exit code 0 (``os._exit``: no collective is left half-done, since ranks reach an optimizer step together). Any error
of the guest disarms it with a note; the program then runs on as it would alone.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data.distributed import DistributedSampler

from ddplab.check.command import sketch
from ddplab.check.command.config import ENV_SETTINGS
from ddplab.check.command.config import RECORD_PREFIX as PREFIX
from ddplab.guest import guard, record
from ddplab.guest.patches import Patches

DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")
FINGERPRINTED = 4096  # samples per forward at most: a larger first dimension is no batch of samples
# Prefixes wrappers put before a parameter's name: DDP, torch.compile, Lightning, activation checkpointing.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class CheckGuest:
    """What the guest knows in this process."""

    def __init__(self, settings: dict, out_dir: str):
        self.out_dir, self.steps = out_dir, int(settings["steps"])
        self.buckets = int(settings.get("buckets", sketch.BUCKETS))
        self.sample_limit = int(settings.get("samples", 0))  # sampler indices to record per sampler
        self.dropout_off = bool(settings.get("dropout_off", True))
        self.disabled: str | None = None
        self.optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer → its ordinal
        self.counts: dict[int, int] = {}  # ordinal → steps recorded
        self.pending: dict[int, dict] = {}  # ordinal → what its step under way read before it
        self.modules: weakref.WeakSet = weakref.WeakSet()  # modules that ran a training forward before a step
        self.names: dict[int, str] = {}
        self.samplers = 0
        self.dropout: float = 0.0  # the largest dropout probability the program asked for in training
        self.autocast: set[str] = set()
        self.input_module = None  # the outermost module of this step's training forwards (weakly)
        self.inputs: list[str] = []  # fingerprints of the samples this step's forwards took

    @property
    def rank(self) -> int:
        """This process's rank, read when it writes: a launcher's ranks may join their group after the guest arms."""
        if dist.is_initialized():
            return dist.get_rank()
        return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))

    def write(self, kind: str, **fields) -> None:
        record.append(self.out_dir, {"kind": kind, "rank": self.rank, "pid": os.getpid(), **fields}, PREFIX)

    def disarm(self, reason: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            self.write("note", text=reason)


_SLOT = guard.Slot()
guarded = _SLOT.guarded


def install_from_env() -> CheckGuest | None:
    """Arm the guest when ``ddplab check -- COMMAND`` set the environment; None otherwise."""
    armed = guard.armed_settings(ENV_SETTINGS)
    if armed is None or _SLOT.guest is not None:
        return _SLOT.guest
    parsed, out_dir = armed
    _SLOT.guest = guest = CheckGuest(parsed, out_dir)
    patches = Patches()
    patches.hook(register_module_forward_pre_hook(_pre_forward))
    patches.hook(register_optimizer_step_pre_hook(_before_step))
    patches.hook(register_optimizer_step_post_hook(_after_step))
    patches.replace(DistributedSampler, "__iter__", _watched_sampler)
    if guest.dropout_off:
        for name in DROPOUTS:
            patches.replace(F, name, _without_dropout)
        patches.replace(F, "scaled_dot_product_attention", _attention_without_dropout)
    if parsed.get("audit"):
        _arm_audit(guest, parsed)
    atexit.register(_at_exit)
    return guest


def _arm_audit(guest: CheckGuest, settings: dict) -> None:
    """The auditor beside the check, in the same processes: the cause the check confirms named in the audit's words.

    It audits one step more than the check lets the program take, so it never prints a report of its own mid-run."""
    try:
        from ddplab.auditor import install

        install.install(int(settings["steps"]) + 1, guest.out_dir)
    except Exception as exc:  # noqa: BLE001 - the check goes on without the audit's words
        guest.write("note", text=f"the audit could not run beside the check: {type(exc).__name__}: {exc}")


# --- what the program trains with ---

@guarded("watching a training forward")
def _pre_forward(guest: CheckGuest, module, args) -> None:
    if not torch.is_grad_enabled() or guest.counts.get(0, 0) >= guest.steps:
        return
    if not guest.names:
        guest.modules.add(module)
    for device in ("cpu", "cuda"):
        if _autocast_on(device):
            guest.autocast.add(device)
    # The first module a step's training forward reaches is its outermost: its input is the micro-batch.
    if guest.input_module is None:
        guest.input_module = weakref.ref(module)
    if guest.input_module() is module:
        guest.inputs += _fingerprints(args)


def _fingerprints(args) -> list[str]:
    """One string per sample of the forward's first tensor: its shape and its exact float64 sums."""
    tensor = _first_tensor(args)
    if tensor is None or tensor.dim() == 0 or tensor.shape[0] > FINGERPRINTED:
        return []
    rows = tensor.detach().reshape(tensor.shape[0], -1).to(torch.float64)
    sums, squares = rows.sum(1).tolist(), rows.square().sum(1).tolist()
    shape = "x".join(map(str, tensor.shape[1:]))
    return [f"{shape}:{a!r}:{b!r}" for a, b in zip(sums, squares)]


def _first_tensor(value, depth: int = 0):
    if isinstance(value, torch.Tensor):
        return value
    if depth > 2:
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((t for t in (_first_tensor(item, depth + 1) for item in items) if t is not None), None)


def _autocast_on(device: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device))
    except (TypeError, RuntimeError):
        return False


def _without_dropout(original):
    @functools.wraps(original)
    def dropout(input, p=0.5, training=True, inplace=False):
        if training and p > 0:
            _saw_dropout(p)
            p = 0.0
        return original(input, p, training, inplace)

    return dropout


def _attention_without_dropout(original):
    @functools.wraps(original)
    def scaled_dot_product_attention(*args, **kwargs):
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if p:
            _saw_dropout(p)
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        return original(*args, **kwargs)

    return scaled_dot_product_attention


@guarded("noting dropout")
def _saw_dropout(guest: CheckGuest, p: float) -> None:
    if p > guest.dropout:
        guest.dropout = float(p)
        guest.write("dropout", p=float(p))


def _watched_sampler(original_iter):
    @functools.wraps(original_iter)
    def __iter__(self):
        iterator = original_iter(self)
        watched = _watch_indices(self, iterator)
        return iterator if watched is None else watched

    return __iter__


@guarded("reading a sampler's first indices")
def _watch_indices(guest: CheckGuest, sampler, iterator):
    if guest.sample_limit <= 0:
        return None
    order, guest.samplers = guest.samplers, guest.samplers + 1
    # The seed tells ranks that draw from one order from ranks seeded apart.
    return _recorded(guest, iterator, order, {"seed": int(sampler.seed)})


def _recorded(guest: CheckGuest, iterator, order: int, about: dict):
    seen = []
    for index in iterator:
        if len(seen) < guest.sample_limit:
            seen.append(int(index))
            if len(seen) == guest.sample_limit:
                guest.write("sampler", order=order, indices=seen, **about)
        yield index
    if len(seen) < guest.sample_limit:
        guest.write("sampler", order=order, indices=seen, **about)


# --- the optimizer steps ---

@guarded("before an optimizer step")
def _before_step(guest: CheckGuest, optimizer, args, kwargs) -> None:
    ordinal = guest.optimizers.setdefault(optimizer, len(guest.optimizers))
    step = guest.counts.setdefault(ordinal, 0)
    if ordinal == 0 and step >= guest.steps:
        _leave(guest)
    if step >= guest.steps:
        return
    if not guest.names:
        _name_parameters(guest)
    guest.pending[ordinal] = {key: _read_before(guest, key, p) for key, p in _parameters(optimizer, ordinal)}


def _parameters(optimizer, ordinal: int):
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            yield f"{ordinal}.{g}.{i}", p


def _read_before(guest: CheckGuest, key: str, param) -> dict:
    entry = {"name": guest.names.get(id(param)), "shape": list(param.shape), "dtype": str(param.dtype).split(".")[-1]}
    entry.update(_read(guest, key, param, "param_before"))
    if param.grad is None:
        entry["grad"] = None
        return entry
    entry.update(_read(guest, key, param.grad, "grad"))
    return entry


def _read(guest: CheckGuest, key: str, tensor, field: str) -> dict:
    local, global_shape, offset, contributes, sharded = _block(tensor)
    if not contributes:
        return {f"{field}_sq": 0.0, field: None, "sharded": sharded}
    values = local.detach()
    return {f"{field}_sq": float(values.to(torch.float64).square().sum()), "sharded": sharded,
            field: sketch.sketch(values, key, global_shape, offset, guest.buckets).tolist()}


def _block(tensor):
    """(local values, global shape, global offset, whether this rank adds them, sharded) of a tensor or DTensor."""
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None or not hasattr(tensor, "to_local"):
        return tensor, tuple(tensor.shape), (0,) * tensor.dim(), True, False
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tensor.placements
    _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    coordinate = mesh.get_coordinate()
    # A replicated mesh dimension holds the same block on every coordinate: only the first adds it.
    contributes = coordinate is not None and all(c == 0 for c, placement in zip(coordinate, placements)
                                                 if placement.is_replicate())
    return tensor.to_local(), tuple(tensor.shape), tuple(offset), contributes, True


@guarded("after an optimizer step")
def _after_step(guest: CheckGuest, optimizer, args, kwargs) -> None:
    ordinal = guest.optimizers.get(optimizer)
    before = guest.pending.pop(ordinal, None) if ordinal is not None else None
    if before is None:
        return
    step = guest.counts[ordinal]
    params = dict(_parameters(optimizer, ordinal))
    for key, entry in before.items():
        param = params.get(key)
        if param is None:
            continue
        entry.update(_read(guest, key, param, "param_after"))
        _read_changed_gradient(guest, key, param, entry)
    guest.counts[ordinal] = step + 1
    inputs = None
    if ordinal == 0:
        inputs, guest.inputs, guest.input_module = guest.inputs, [], None
    guest.write("step", optimizer=ordinal, step=step, params=before, dropout=guest.dropout,
                autocast=sorted(guest.autocast), inputs=inputs)


def _read_changed_gradient(guest: CheckGuest, key: str, param, entry: dict) -> None:
    """The gradient after the step, where the step changed it: an optimizer that all-reduces it in place, or a
    closure that ran the backward inside the step (Lightning's)."""
    if param.grad is None:
        return
    local, _, _, contributes, _ = _block(param.grad)
    if not contributes or float(local.detach().to(torch.float64).square().sum()) == entry.get("grad_sq"):
        return
    entry.update(_read(guest, key, param.grad, "grad_after"))


def _name_parameters(guest: CheckGuest) -> None:
    """Each parameter's name in the outermost module that trained, wrapper prefixes taken off."""
    modules = sorted(guest.modules, key=lambda m: sum(1 for _ in m.parameters()), reverse=True)
    for module in modules:
        for name, param in module.named_parameters():
            guest.names.setdefault(id(param), _plain(name))
    guest.modules = weakref.WeakSet()


def _plain(name: str) -> str:
    for inner in WRAPPER_PREFIXES[1:]:
        name = name.replace(inner, "")
    while name.startswith(WRAPPER_PREFIXES[0]):
        name = name[len(WRAPPER_PREFIXES[0]):]
    return name


def _leave(guest: CheckGuest) -> None:
    """Every planned step recorded: the run ends here, on every rank at the same step."""
    guest.write("end", steps=dict(guest.counts), left=True)
    _write_audit()
    guard.leave()


def _write_audit() -> None:
    audit = sys.modules.get("ddplab.auditor.install")
    if audit is not None:
        try:
            audit.write_record()
        except Exception:  # noqa: BLE001 - the check's own record is written
            pass


def _at_exit() -> None:
    guest = _SLOT.guest
    if guest is not None and guest.counts:
        guest.write("end", steps=dict(guest.counts), left=False)
