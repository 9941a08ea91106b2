"""The auditor inside a training process: hooks that watch DDP, never change what it computes.

Installed once per process (``install``), it wraps ``DistributedDataParallel.__init__`` to
attach to every wrapper, registers global optimizer step hooks, and patches samplers, data
loaders and loss functions. Comparisons across ranks use a side gloo group created with
``use_local_synchronization=True``; no DDP communication hook is ever registered.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, DistributedSampler

from ddplab.auditor import findings as fnd

ENV_DIR, ENV_STEPS = "DDPLAB_AUDIT_DIR", "DDPLAB_AUDIT_STEPS"
SMALL_BATCH = 16
LOSS_FUNCTIONS = ("l1_loss", "mse_loss", "cross_entropy", "nll_loss", "binary_cross_entropy",
                  "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss", "kl_div",
                  "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
                  "hinge_embedding_loss", "margin_ranking_loss", "cosine_embedding_loss", "multi_margin_loss",
                  "triplet_margin_loss", "ctc_loss")


class AuditState:
    """Everything one process knows; one instance per process."""

    def __init__(self, steps: int, out_dir: str | None):
        self.steps_to_audit, self.out_dir = steps, out_dir
        self.findings: dict[str, fnd.Finding] = {}
        self.steps = 0
        self.attached = False
        self.side_group = None
        self.ddp_forward_depth = 0
        self.forwards: list[dict] = []  # DDP forwards since the last optimizer step
        self.sharding_sampler_seen = False
        self.sampler_epochs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.pending_wrappers: set[int] = set()
        self.batchnorm_layers = 0
        self.global_batch_size = None
        self.lr = None
        self.reported = False
        self.buffers_synced = False
        # Known while the process group lives; the exit report comes after it is destroyed.
        self.rank, self.world_size = 0, 1

    # --- state and reporting ---

    @property
    def armed(self) -> bool:
        """Step-level checks run for the first N optimizer steps."""
        return self.attached and self.steps < self.steps_to_audit and self.world_size > 1

    def add(self, code: str, detail: str = "", severity: str | None = None) -> None:
        if code not in self.findings:
            self.findings[code] = fnd.Finding.make(code, self.rank, detail, severity)

    def record(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "global_batch_size": self.global_batch_size,
                "lr": self.lr, "steps_audited": min(self.steps, self.steps_to_audit),
                "findings": [vars(f) for f in self._with_info()]}

    def _with_info(self) -> list[fnd.Finding]:
        info = fnd.Finding.make("RUN_INFO", self.rank, f"world size {self.world_size}, global batch "
                                f"{self.global_batch_size}, lr {self.lr}")
        return list(self.findings.values()) + [info]

    def write(self) -> None:
        """This rank's findings to its own file (no collectives: safe at exit)."""
        if not (self.out_dir and self.attached):
            return
        path = os.path.join(self.out_dir, f"rank-{self.rank}-{os.getpid()}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(self.record(), fh)
        os.replace(path + ".tmp", path)


_STATE: AuditState | None = None


def state() -> AuditState:
    if _STATE is None:
        raise RuntimeError("the ddplab auditor is not installed")
    return _STATE


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# --- installation ---

def install(steps: int = 5, out_dir: str | None = None) -> AuditState:
    """Patch this process once; later calls return the same state."""
    global _STATE
    if _STATE is not None:
        return _STATE
    _STATE = AuditState(steps, out_dir)
    _patch_ddp_init()
    register_optimizer_step_pre_hook(_before_optimizer_step)
    register_optimizer_step_post_hook(_after_optimizer_step)
    _patch_samplers_and_loaders()
    _patch_losses()
    _patch_destroy_process_group()
    atexit.register(_at_exit)
    return _STATE


def _at_exit() -> None:
    _STATE.write()
    _release_side_group()


def _release_side_group() -> None:
    # A gloo group left for interpreter shutdown can abort the process in its destructor.
    if _STATE is not None and _STATE.side_group is not None:
        _STATE.side_group = None
        gc.collect()


def _patch_destroy_process_group() -> None:
    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group=None):
        if group is None:
            _release_side_group()
        return original(group)

    dist.destroy_process_group = destroy_process_group


def install_from_env() -> AuditState | None:
    """Install when ``ddplab audit`` set the environment (called from the injected sitecustomize)."""
    if not os.environ.get(ENV_DIR):
        return None
    return install(int(os.environ.get(ENV_STEPS, "5")), os.environ[ENV_DIR])


def _patch_ddp_init() -> None:
    original = DistributedDataParallel.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        attach(self)

    DistributedDataParallel.__init__ = __init__


def attach(ddp: DistributedDataParallel) -> None:
    """Watch one DDP wrapper: its forwards, its inner module's forwards, its lifetime."""
    audit = state()
    audit.rank, audit.world_size = _rank(), _world_size()
    if audit.side_group is None and audit.world_size > 1:
        ranks = list(range(audit.world_size))
        audit.side_group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    audit.attached = True
    key = id(ddp)
    ddp.register_forward_pre_hook(_wrapper_pre_forward, with_kwargs=True)
    ddp.register_forward_hook(functools.partial(_wrapper_post_forward, key))
    # One hook per inner module, pointing at its newest wrapper: rebuilt wrappers must not pile up hooks.
    first_wrapper = "_ddplab_wrapper" not in ddp.module.__dict__
    object.__setattr__(ddp.module, "_ddplab_wrapper", weakref.ref(ddp))
    if first_wrapper:
        ddp.module.register_forward_pre_hook(_inner_pre_forward)
    # A wrapper collected between its forward and backward takes its all-reduce with it.
    weakref.finalize(ddp, _wrapper_collected, key)
    audit.batchnorm_layers = sum(isinstance(m, _BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
                                 for m in ddp.module.modules())


# --- hooks on the wrapper and its module ---

def _wrapper_pre_forward(ddp, args, kwargs):
    audit = state()
    audit.ddp_forward_depth += 1
    # Runs before DDP's forward: whether DDP is about to broadcast rank 0's buffers.
    audit.buffers_synced = ddp.will_sync_module_buffers()
    # Evaluation forwards (no grad) take no part in a training step.
    if audit.armed and torch.is_grad_enabled():
        _record_forward(audit, (args, kwargs), synced=ddp.require_backward_grad_sync)
        _check_batchnorm(audit, audit.forwards[-1]["batch"])
    return None


def _record_forward(audit: AuditState, inputs, *, synced: bool) -> None:
    """What the cross-rank checks need from one training forward: its data and whether it all-reduces."""
    tensors = list(_tensors(inputs))
    audit.forwards.append({"fingerprint": _fingerprint(tensors), "synced": synced,
                           "batch": tensors[0].shape[0] if tensors and tensors[0].dim() else 1})


def _wrapper_post_forward(key, ddp, args, output):
    audit = state()
    audit.ddp_forward_depth -= 1
    if audit.armed and ddp.require_backward_grad_sync and torch.is_grad_enabled():
        audit.pending_wrappers.add(key)
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(_backward_reached, key))
                break
    return None


def _backward_reached(key, grad):
    state().pending_wrappers.discard(key)
    return None


def _wrapper_collected(key):
    audit = _STATE
    if audit is not None and audit.armed and key in audit.pending_wrappers:
        audit.pending_wrappers.discard(key)
        audit.add("NO_ALLREDUCE", "the DDP wrapper was garbage-collected between its forward and backward "
                                  "(a temporary wrapper such as loss_fn(DDP(model)(x), y))")


def _inner_pre_forward(module, args):
    audit = state()
    if not audit.armed:
        return None
    if audit.ddp_forward_depth == 0 and torch.is_grad_enabled():
        audit.add("NO_ALLREDUCE", "a forward reached the inner module without passing the DDP wrapper "
                                  "(ddp_model.module(x)), so DDP never prepares an all-reduce")
        _record_forward(audit, args, synced=False)
        return None
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    # DDP has just broadcast rank 0's buffers: compare here, not after the step.
    if audit.buffers_synced and buffers and audit.side_group is not None:
        if not _same_on_all_ranks(audit, buffers):
            audit.add("PARAMS_DIVERGED", "buffers differ across ranks right after DDP synchronised them")
    return None


def _check_batchnorm(audit: AuditState, per_rank_batch: int) -> None:
    if audit.batchnorm_layers and "BATCHNORM_NOT_SYNCED" not in audit.findings:
        small = per_rank_batch < SMALL_BATCH
        audit.add("BATCHNORM_NOT_SYNCED",
                  f"{audit.batchnorm_layers} BatchNorm layers, {per_rank_batch} samples per rank"
                  + (f": fewer than {SMALL_BATCH}, so the statistics are noisy" if small else ""),
                  severity=fnd.WARNING if small else fnd.INFO)


# --- optimizer step hooks: the cross-rank comparisons ---

def _before_optimizer_step(optimizer, args, kwargs):
    audit = state()
    if not audit.armed:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if grads and not _same_on_all_ranks(audit, grads):
        audit.add("NO_ALLREDUCE", "confirmed: gradients differ across ranks after backward")
    forwards, audit.forwards = audit.forwards, []
    audit.pending_wrappers.clear()
    _check_data_and_accumulation(audit, forwards)
    audit.lr = optimizer.param_groups[0].get("lr")
    if forwards:
        audit.global_batch_size = sum(f["batch"] for f in forwards) * audit.world_size
    return None


def _check_data_and_accumulation(audit: AuditState, forwards: list[dict]) -> None:
    fingerprints = [f["fingerprint"] for f in forwards]
    gathered = [None] * audit.world_size
    dist.all_gather_object(gathered, (fingerprints, audit.sharding_sampler_seen), group=audit.side_group)
    identical = fingerprints and all(g[0] == fingerprints for g in gathered)
    if identical and not any(g[1] for g in gathered):
        audit.add("SAME_DATA_ON_ALL_RANKS", "every rank's batches were identical and no DistributedSampler or other "
                                            "sharding sampler was used")
    if len(forwards) > 1 and all(f["synced"] for f in forwards):
        audit.add("ACCUMULATION_SYNCS_EVERY_STEP", f"{len(forwards)} forwards per optimizer step, all outside no_sync")


def _after_optimizer_step(optimizer, args, kwargs):
    audit = state()
    if not audit.armed:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if params and not _same_on_all_ranks(audit, params):
        audit.add("PARAMS_DIVERGED", "parameters differ across ranks after an optimizer step")
    audit.steps += 1
    if audit.steps == audit.steps_to_audit:
        _interim_report(audit)
    return None


def _interim_report(audit: AuditState) -> None:
    """After N steps: merge over the side group and print on rank 0."""
    gathered = [None] * audit.world_size
    dist.all_gather_object(gathered, audit.record(), group=audit.side_group)
    audit.write()
    if audit.rank == 0 and not audit.reported:
        audit.reported = True
        print(f"[rank 0, after {audit.steps} steps] " + fnd.render_text(fnd.merge(gathered)), file=sys.stderr, flush=True)


# --- samplers, loaders and losses ---

def _patch_samplers_and_loaders() -> None:
    original_sampler_iter = DistributedSampler.__iter__
    original_loader_iter = DataLoader.__iter__

    @functools.wraps(original_sampler_iter)
    def sampler_iter(self):
        audit = state()
        audit.sharding_sampler_seen = audit.sharding_sampler_seen or self.num_replicas > 1
        if self.shuffle and self.num_replicas > 1:
            seen = audit.sampler_epochs.setdefault(self, set())
            if self.epoch in seen:
                audit.add("SET_EPOCH_MISSING", f"epoch {self.epoch} iterated twice")
            seen.add(self.epoch)
        return original_sampler_iter(self)

    @functools.wraps(original_loader_iter)
    def loader_iter(self):
        sampler = getattr(self.batch_sampler, "sampler", None) or self.sampler
        if getattr(sampler, "num_replicas", 1) > 1:
            state().sharding_sampler_seen = True
        return original_loader_iter(self)

    DistributedSampler.__iter__ = sampler_iter
    DataLoader.__iter__ = loader_iter


def _patch_losses() -> None:
    functional = torch.nn.functional
    for name in LOSS_FUNCTIONS:
        original = getattr(functional, name, None)
        if original is not None:
            setattr(functional, name, _tag_sum_reduction(original))
    original_backward = torch.Tensor.backward

    @functools.wraps(original_backward)
    def backward(self, *args, **kwargs):
        audit = _STATE
        # Dividing the summed loss by a count makes a new, untagged tensor: no finding.
        if audit is not None and getattr(self, "_ddplab_sum_reduced", False) and audit.armed:
            audit.add("SUM_REDUCTION", "loss computed with reduction='sum' reached backward as it is")
        return original_backward(self, *args, **kwargs)

    torch.Tensor.backward = backward


def _tag_sum_reduction(loss_fn):
    @functools.wraps(loss_fn)
    def wrapper(*args, **kwargs):
        out = loss_fn(*args, **kwargs)
        if kwargs.get("reduction") == "sum" and isinstance(out, torch.Tensor):
            out._ddplab_sum_reduced = True
        return out
    return wrapper


# --- comparing tensors across ranks ---

def _same_on_all_ranks(audit: AuditState, tensors: list[torch.Tensor]) -> bool:
    """Cheap checksums of the tensors, gathered over the side group and compared."""
    local = torch.stack([_checksum(t) for t in tensors]).reshape(-1)
    gathered = [torch.empty_like(local) for _ in range(audit.world_size)]
    dist.all_gather(gathered, local, group=audit.side_group)
    scale = local.abs().max().clamp_min(1e-30)
    return all(((g - local).abs().max() / scale).item() <= 1e-6 for g in gathered)


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64).remainder_(7).add_(1)
    return torch.stack([flat.sum(), flat.pow(2).sum(), (flat * weights).sum()])


def _fingerprint(tensors: list[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), tuple(_checksum(t).tolist())) for t in tensors)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
