"""The auditor inside a training process: it watches DDP and never changes what it computes.

A guest in someone else's program, it keeps to four rules:

- **No collectives.** Ranks never wait for each other on the auditor's behalf. Each rank records
  digests of its parameters, gradients and batches at every audited optimizer step, writes them
  to its own file as it goes, and publishes them once to the process group's key-value store;
  rank 0 reads its peers' records only once the store already holds them (a non-blocking
  check), so a rank that takes a path alone (evaluation on rank 0, a probe optimizer, ZeRO's
  per-rank inner optimizer) can never leave another waiting.
- **No state in the user's objects.** Side tables keyed weakly by the wrapper, its module and its
  parameters; global module and optimizer hooks instead of hooks stored on the user's modules,
  so ``torch.save(ddp.module)`` pickles exactly what it would without the audit.
- **Evidence, not patterns.** A finding needs its effect: gradients stepped that DDP never
  reduced, an epoch order repeated in a second training pass, batches repeated across ranks.
- **Disarm rather than fail.** Every hook runs under a guard; an internal error turns the audit
  off for the rest of the process and is reported as AUDIT_INCOMPLETE.

The heavy work (digests, module hooks) runs only during the audited window: the first
``steps`` optimizer steps that update a DDP model's parameters.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DistributedSampler
from torch.utils.weak import WeakIdKeyDictionary

from ddplab.auditor import findings as fnd
from ddplab.auditor import frameworks, guard, tensors

ENV_DIR, ENV_STEPS = "DDPLAB_AUDIT_DIR", "DDPLAB_AUDIT_STEPS"
STORE_PREFIX = "ddplab-audit/v2/"
SMALL_BATCH = 16
# Training batches fingerprinted per wrapper: longer than the step window, so streams shifted in time still meet.
DATA_WINDOW_FACTOR = 4
# Sync forwards rank 0 keeps looking for its peers' records after its own window closed.
REPORT_PATIENCE = 1000
LOSS_FUNCTIONS = ("l1_loss", "mse_loss", "cross_entropy", "nll_loss", "binary_cross_entropy",
                  "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss", "kl_div",
                  "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
                  "hinge_embedding_loss", "margin_ranking_loss", "cosine_embedding_loss", "multi_margin_loss",
                  "triplet_margin_loss", "ctc_loss")


class WrapperInfo:
    """What the auditor knows about one DDP wrapper (held weakly: it dies with the wrapper)."""

    def __init__(self, ddp: DistributedDataParallel, key: str, group: list[int]):
        self.key, self.group = key, group
        ignored = getattr(ddp, "parameters_to_ignore", set())
        # Weak: a script that builds many models must not keep their parameters alive through the audit.
        self.param_refs = [(n, weakref.ref(p)) for n, p in ddp.module.named_parameters()
                           if p.requires_grad and n not in ignored]
        self.steps = 0  # optimizer steps that updated this wrapper's parameters
        self.reductions = 0  # backward passes through a synchronising forward since the last step
        self.accumulated_reductions = 0  # of those, the ones that started on gradients already accumulated
        self.in_backward = False
        self.pending = False  # a training forward waits for its backward
        self.batches: list[str] = []
        self.forward_batch = 0  # samples per rank in this step's training forwards
        self.bypassed = False
        self.syncs_buffers = False
        self.batchnorm_layers = sum(isinstance(m, _BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
                                    for m in ddp.module.modules())

    def params(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p) for name, ref in self.param_refs if (p := ref()) is not None]


class AuditState:
    """Everything one process knows; one instance per process."""

    def __init__(self, steps: int, out_dir: str | None):
        self.steps_to_audit, self.out_dir = steps, out_dir
        self.findings: dict[str, fnd.Finding] = {}
        self.windows: list[dict] = []
        self.batches: dict[str, list[str]] = {}  # training batch fingerprints per wrapper, kept past its life
        self.wrappers: WeakIdKeyDictionary = WeakIdKeyDictionary()  # DDP wrapper → WrapperInfo
        self.modules: WeakIdKeyDictionary = WeakIdKeyDictionary()  # inner module → its newest wrapper's info
        # parameter → its wrapper's info, which outlives a temporary wrapper so its steps still count
        self.owners: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.optimizer_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer → (key, info)
        self.sampler_passes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.steps = 0  # audited optimizer steps, all wrappers together
        self.total_steps = 0
        self.wrapper_count = 0
        self.ddp_forward_depth = 0
        self.stepping: set[int] = set()
        self.global_batch_size = None
        self.lr = None
        self.optimizer = None
        self.attached_pid = None
        self.disabled = None  # the reason, once the auditor turned itself off
        self.published = False
        self.reported = False
        self.report_polls = 0
        self.peers: list[dict] = []
        self.interim = None  # the findings rank 0 printed during the run
        self.module_hook = None
        self.rank, self.world_size = 0, 1

    @property
    def armed(self) -> bool:
        """Step-level checks run for the first N optimizer steps, while the auditor is healthy."""
        return self.attached_pid is not None and self.disabled is None and self.steps < self.steps_to_audit

    def add(self, code: str, detail: str = "", severity: str | None = None) -> None:
        if code not in self.findings:
            self.findings[code] = fnd.Finding.make(code, self.rank, detail, severity)
            # Written as found: a rank that ends in os._exit, a kill or a crash loses nothing.
            self.write()

    def record(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "global_batch_size": self.global_batch_size,
                "lr": self.lr, "optimizer": self.optimizer, "steps_audited": self.steps,
                "steps_requested": self.steps_to_audit, "findings": [vars(f) for f in self._with_info()],
                "windows": self.windows, "batches": self.batches,
                "peers": self.peers, "interim": self.interim}

    def _with_info(self) -> list[fnd.Finding]:
        info = fnd.Finding.make("RUN_INFO", self.rank, f"world size {self.world_size}, global batch "
                                f"{self.global_batch_size}, lr {self.lr}")
        return list(self.findings.values()) + [info]

    def write(self) -> None:
        """This rank's record to its own file (no collectives: safe at exit, in a signal, anywhere)."""
        if not (self.out_dir and self.attached_pid == os.getpid()):
            return
        path = os.path.join(self.out_dir, f"rank-{self.rank}-{os.getpid()}.json")
        try:
            with open(path + ".tmp", "w") as fh:
                json.dump(self.record(), fh)
            os.replace(path + ".tmp", path)
        except OSError:
            pass  # the audit directory is gone: the parent already reported

    def disarm(self, reason: str) -> None:
        """Turn the audit off for the rest of this process, and say why."""
        if self.disabled is None:
            self.disabled = reason
            _remove_module_hook(self)
            self.add("AUDIT_INCOMPLETE", f"the auditor turned itself off on rank {self.rank}: {reason}")

    def report(self, timeout: float = 30.0) -> fnd.Report:
        """Every rank's record, waiting up to ``timeout`` seconds for the peers' (call from your own code)."""
        _publish(self)
        store = _store()
        records = [self.record()]
        if store is not None and self.world_size > 1:
            import datetime

            keys = [f"{STORE_PREFIX}{rank}" for rank in range(self.world_size) if rank != self.rank]
            try:
                store.wait(keys, datetime.timedelta(seconds=timeout))
                records += [json.loads(store.get(key)) for key in keys]
            except Exception as exc:  # noqa: BLE001 - a peer that never published: report what is here
                records[0]["findings"].append(vars(fnd.Finding.make(
                    "AUDIT_INCOMPLETE", self.rank, f"not every rank's record arrived within {timeout:g} s ({exc})")))
        return fnd.merge(records)


_STATE: AuditState | None = None


def state() -> AuditState:
    if _STATE is None:
        raise RuntimeError("the ddplab auditor is not installed")
    return _STATE


def _guarded(where: str):
    """Run a hook so that no error inside the auditor reaches the user's program."""
    return guard.guarded(lambda: _STATE, where)


# --- installation ---

def install(steps: int = 5, out_dir: str | None = None) -> AuditState:
    """Patch this process once; later calls return the same state."""
    global _STATE
    if _STATE is not None:
        return _STATE
    _STATE = AuditState(steps, out_dir)
    _patch_ddp()
    register_optimizer_step_pre_hook(_before_optimizer_step)
    register_optimizer_step_post_hook(_after_optimizer_step)
    _patch_sampler()
    _patch_losses()
    # Schedulers and the frameworks' idioms (Lightning, Accelerate, the Transformers Trainer).
    frameworks.install()
    atexit.register(_at_exit)
    return _STATE


def install_from_env() -> AuditState | None:
    """Install when ``ddplab audit`` set the environment (called from the injected sitecustomize)."""
    if not os.environ.get(ENV_DIR):
        return None
    return install(int(os.environ.get(ENV_STEPS, "5")), os.environ[ENV_DIR])


def _at_exit() -> None:
    if _STATE is not None:
        _STATE.write()


def _patch_ddp() -> None:
    original_init, original_forward = DistributedDataParallel.__init__, DistributedDataParallel.forward

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _attach_guarded(self)

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        _before_ddp_forward(self, args, kwargs)
        try:
            output = original_forward(self, *args, **kwargs)
        finally:
            _leave_ddp_forward()
        _after_ddp_forward(self, output)
        return output

    DistributedDataParallel.__init__ = __init__
    DistributedDataParallel.forward = forward


def attach(ddp: DistributedDataParallel) -> None:
    """Watch one DDP wrapper: its forwards, its inner module's forwards, its lifetime."""
    _attach_guarded(ddp)


@_guarded("attaching to the DDP wrapper")
def _attach_guarded(audit: AuditState, ddp: DistributedDataParallel) -> None:
    if ddp in audit.wrappers:
        return
    audit.rank, audit.world_size = dist.get_rank(), dist.get_world_size()
    group = dist.get_process_group_ranks(ddp.process_group)
    key = f"ddp{audit.wrapper_count}-{'.'.join(map(str, group))}"
    audit.wrapper_count += 1
    info = audit.wrappers[ddp] = WrapperInfo(ddp, key, group)
    audit.batches[key] = info.batches
    audit.modules[ddp.module] = info
    for _, param in info.params():
        audit.owners[param] = info
    # A wrapper collected between a training forward and its backward takes its all-reduce with it.
    weakref.finalize(ddp, _wrapper_collected, info)
    audit.attached_pid = os.getpid()
    if audit.module_hook is None and audit.armed:
        audit.module_hook = register_module_forward_pre_hook(_module_pre_forward)
    frameworks.on_attach(audit, ddp)
    audit.write()


def _remove_module_hook(audit: AuditState) -> None:
    if audit.module_hook is not None:
        audit.module_hook.remove()
        audit.module_hook = None


# --- the wrapper's forward ---

@_guarded("before a DDP forward")
def _before_ddp_forward(audit: AuditState, ddp, args, kwargs) -> None:
    audit.ddp_forward_depth += 1
    info = audit.wrappers.get(ddp)
    if info is None or not torch.is_grad_enabled():
        return  # evaluation forwards take no part in a training step
    # Read before DDP's own pre-forward: whether it is about to broadcast rank 0's buffers.
    info.syncs_buffers = ddp.require_backward_grad_sync and ddp.will_sync_module_buffers()
    _record_training_batch(audit, info, (args, kwargs))


def _leave_ddp_forward() -> None:
    if _STATE is not None:
        _STATE.ddp_forward_depth = max(0, _STATE.ddp_forward_depth - 1)


@_guarded("after a DDP forward")
def _after_ddp_forward(audit: AuditState, ddp, output) -> None:
    info = audit.wrappers.get(ddp)
    if info is None:
        return
    info.syncs_buffers = False
    if not (audit.armed and torch.is_grad_enabled() and ddp.require_backward_grad_sync):
        return
    nodes = {id(t.grad_fn): t.grad_fn for t in tensors.iter_tensors(output) if t.grad_fn is not None}
    for node in nodes.values():
        # Hooks on graph nodes, not on the user's tensors: one fires when backward reaches any output.
        node.register_prehook(functools.partial(_backward_reached, info))
    info.pending = info.pending or bool(nodes)


def _record_training_batch(audit: AuditState, info: WrapperInfo, inputs) -> None:
    if len(info.batches) < DATA_WINDOW_FACTOR * audit.steps_to_audit:
        fingerprint = tensors.fingerprint(inputs)
        if fingerprint is not None:
            info.batches.append(fingerprint)
            if len(info.batches) == DATA_WINDOW_FACTOR * audit.steps_to_audit:
                audit.write()
    if audit.armed:
        size = tensors.first_dim(inputs)
        info.forward_batch += size or 0
        if size is not None:
            _check_batchnorm(audit, info, size)


def _backward_reached(info: WrapperInfo, grad_outputs):
    _count_reduction(info)
    return None


@_guarded("counting DDP reductions")
def _count_reduction(audit: AuditState, info: WrapperInfo) -> None:
    info.pending = False
    if info.in_backward:
        return
    info.in_backward = True
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_backward_done, info))
    # Gradients already present when this reduction starts accumulate with it into one optimizer step.
    accumulating = any(p.grad is not None and bool(p.grad.any()) for _, p in info.params())
    info.accumulated_reductions = info.accumulated_reductions + 1 if accumulating else 1
    info.reductions += 1


def _backward_done(info: WrapperInfo) -> None:
    info.in_backward = False


def _wrapper_collected(info: WrapperInfo) -> None:
    audit = _STATE
    if audit is not None and audit.armed and info.pending:
        audit.add("NO_ALLREDUCE", "the DDP wrapper was garbage-collected between a training forward and its "
                                  "backward (a temporary wrapper such as loss_fn(DDP(model)(x), y)), so its "
                                  "all-reduce never ran")


@_guarded("watching module forwards")
def _module_pre_forward(audit: AuditState, module, args) -> None:
    info = audit.modules.get(module)
    if info is None or not audit.armed:
        return
    if audit.ddp_forward_depth == 0:
        if torch.is_grad_enabled():
            # A training forward that skipped the wrapper: DDP will not reduce what it computes.
            info.bypassed = True
            _record_training_batch(audit, info, args)
        return
    if info.syncs_buffers:
        # DDP has just broadcast rank 0's buffers: they must now be equal everywhere.
        buffers = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        _window(audit, info)["buffers"] = tensors.named_digests(buffers)


def _check_batchnorm(audit: AuditState, info: WrapperInfo, per_rank_batch: int) -> None:
    if info.batchnorm_layers and "BATCHNORM_NOT_SYNCED" not in audit.findings:
        small = per_rank_batch < SMALL_BATCH
        audit.add("BATCHNORM_NOT_SYNCED",
                  f"{info.batchnorm_layers} BatchNorm layers, {per_rank_batch} samples per rank"
                  + (f": fewer than {SMALL_BATCH}, so the statistics are noisy" if small else ""),
                  severity=fnd.WARNING if small else fnd.INFO)


def _window(audit: AuditState, info: WrapperInfo) -> dict:
    """This wrapper's record for its current step, created on first use."""
    for window in reversed(audit.windows):
        if window["wrapper"] == info.key and window["step"] == info.steps:
            return window
    window = {"wrapper": info.key, "group": info.group, "step": info.steps}
    audit.windows.append(window)
    return window


# --- optimizer steps ---

def _before_optimizer_step(optimizer, args, kwargs):
    audit = _STATE
    if audit is not None:
        # A step inside another's step (ZeRO's per-rank inner optimizer) is not a step of the model.
        audit.stepping.add(id(optimizer))
    return None


def _after_optimizer_step(optimizer, args, kwargs):
    audit = _STATE
    if audit is None:
        return None
    audit.stepping.discard(id(optimizer))
    if not audit.stepping:
        _optimizer_stepped(optimizer)
    return None


@_guarded("after an optimizer step")
def _optimizer_stepped(audit: AuditState, optimizer) -> None:
    info = _owner(audit, optimizer)
    frameworks.on_optimizer_step(audit, optimizer, info)
    if info is None:
        return  # a probe or auxiliary optimizer that updates no DDP model: not part of the audit
    audit.total_steps += 1
    if audit.armed:
        _audit_step(audit, info, optimizer)
    elif audit.disabled is None:
        _poll_peers(audit)


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
    params = info.params()
    stepped = [(n, p) for n, p in params if p.grad is not None]
    if stepped and info.reductions == 0 and info.bypassed:
        # Without the bypass, differing gradient digests across ranks are the evidence (findings.merge).
        audit.add("NO_ALLREDUCE", "the optimizer stepped on gradients DDP never all-reduced: a training forward "
                                  "reached the module DDP wraps without passing through the wrapper")
    if info.accumulated_reductions >= 2:
        audit.add("ACCUMULATION_SYNCS_EVERY_STEP",
                  f"{info.accumulated_reductions} all-reduces of micro-batches accumulated into one optimizer step")
    window = _window(audit, info)
    window["grads"] = tensors.named_digests([(n, p.grad) for n, p in stepped])
    window["params"] = tensors.named_digests(params)
    audit.lr = optimizer.param_groups[0].get("lr")
    audit.optimizer = type(optimizer).__name__
    if info.forward_batch:
        audit.global_batch_size = info.forward_batch * len(info.group)
    info.steps += 1
    info.reductions = info.accumulated_reductions = info.forward_batch = 0
    info.bypassed = False
    audit.steps += 1
    audit.write()
    if audit.steps == audit.steps_to_audit:
        _remove_module_hook(audit)
        _publish(audit)
        _poll_peers(audit)


# --- rank 0's report during the run ---

def _store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - no default store: files alone carry the records
        return None


def _publish(audit: AuditState) -> None:
    """This rank's record into the store, once, for rank 0 to read without waiting."""
    if audit.published or audit.world_size == 1:
        return
    audit.published = True
    store = _store()
    if store is not None:
        store.set(f"{STORE_PREFIX}{audit.rank}", json.dumps(audit.record()))


def _poll_peers(audit: AuditState) -> None:
    """Rank 0 prints the report once every peer's record is in the store; it never waits for one."""
    if audit.rank != 0 or audit.reported or audit.report_polls >= REPORT_PATIENCE or audit.world_size == 1:
        return
    audit.report_polls += 1
    store = _store()
    keys = [f"{STORE_PREFIX}{rank}" for rank in range(1, audit.world_size)]
    if store is None or not store.check(keys):
        return
    audit.reported = True
    audit.peers = [json.loads(store.get(key)) for key in keys]
    report = fnd.merge([audit.record(), *audit.peers])
    audit.interim = report.signature()
    audit.write()
    print(f"[rank 0, after {audit.steps} steps] " + fnd.render_text(report), file=sys.stderr, flush=True)


# --- samplers and losses ---

def _patch_sampler() -> None:
    original_iter = DistributedSampler.__iter__

    @functools.wraps(original_iter)
    def sampler_iter(self):
        iterator = original_iter(self)
        audit = _STATE
        if audit is None or audit.disabled is not None or not (self.shuffle and self.num_replicas > 1):
            return iterator
        return _counted(iterator, self, self.epoch, audit.total_steps)

    DistributedSampler.__iter__ = sampler_iter


def _counted(iterator, sampler, epoch: int, steps_at_start: int):
    """Pass the indices through; past half of the shard, note a training pass over ``epoch``'s order."""
    half, drawn, counted = max(1, len(sampler) // 2), 0, False
    for index in iterator:
        drawn += 1
        if drawn >= half and not counted:
            counted = _training_pass(sampler, epoch, steps_at_start) is not False
        yield index
    # Loader workers draw indices ahead of training: the end of the pass is the last chance to see its steps.
    if drawn >= half and not counted:
        _training_pass(sampler, epoch, steps_at_start)


@_guarded("watching DistributedSampler")
def _training_pass(audit: AuditState, sampler, epoch: int, steps_at_start: int) -> bool:
    """Note a pass over ``epoch``'s order if it fed optimizer steps; True once noted."""
    # A peek at one batch or an evaluation pass is no training pass: only a pass that fed optimizer steps counts.
    if audit.total_steps == steps_at_start:
        return False
    passes = audit.sampler_passes.setdefault(sampler, [])
    if epoch in passes:
        audit.add("SET_EPOCH_MISSING", f"training pass {len(passes) + 1} drew the same order as an earlier one "
                                       f"(sampler epoch {epoch} both times): set_epoch was not called")
    passes.append(epoch)
    return True


def _patch_losses() -> None:
    functional = torch.nn.functional
    for name in LOSS_FUNCTIONS:
        original = getattr(functional, name, None)
        if original is not None:
            setattr(functional, name, _tag_reduction(original))
    original_backward = torch.Tensor.backward

    @functools.wraps(original_backward)
    def backward(self, *args, **kwargs):
        if _STATE is not None and _STATE.armed:
            _check_loss(self)
        return original_backward(self, *args, **kwargs)

    torch.Tensor.backward = backward


def _tag_reduction(loss_fn):
    @functools.wraps(loss_fn)
    def wrapper(*args, **kwargs):
        out = loss_fn(*args, **kwargs)
        reduction = kwargs.get("reduction")
        # Tagged on the autograd node, which lives and dies with this loss's graph; the tensor is untouched.
        if reduction in ("sum", "none") and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out.grad_fn.metadata["ddplab_reduction"] = reduction
        return out
    return wrapper


@_guarded("inspecting a loss")
def _check_loss(audit: AuditState, loss: torch.Tensor) -> None:
    node = loss.grad_fn
    if node is None:
        return
    if node.metadata.get("ddplab_reduction") == "sum":
        audit.add("SUM_REDUCTION", "a loss computed with reduction='sum' reached backward as it is")
    elif node.name() == "SumBackward0" and node.next_functions:
        child = node.next_functions[0][0]
        # Per-sample losses summed and never divided by a count: the same as reduction='sum'.
        if child is not None and child.metadata.get("ddplab_reduction") == "none":
            audit.add("SUM_REDUCTION", "per-sample losses (reduction='none') were summed with .sum() and reached "
                                       "backward without division by a count")
