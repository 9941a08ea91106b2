"""The auditor's state in one process: one :class:`AuditState`, weak side tables, and the guard around hooks.

Every auditor module reads the state through :func:`current`; nothing else holds it, and
:func:`ddplab.auditor.install.uninstall` drops it.
"""

from __future__ import annotations

import json
import os
import weakref

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.weak import WeakIdKeyDictionary

from ddplab.auditor import findings as fnd
from ddplab.guest import guard
from ddplab.runtime.reduction import Reduction

# Training batches (and their indices) are kept for this many times the audited steps: streams shifted in time
# still meet, and the forward hooks that look for FSDP2 roots live this long.
DATA_WINDOW_FACTOR = 4


def unsynced_batchnorms(module: torch.nn.Module) -> int:
    """The BatchNorm layers in ``module`` whose statistics each rank keeps for itself (not SyncBatchNorm)."""
    return sum(isinstance(m, _BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())


class WrapperInfo:
    """What the auditor knows about one data-parallel model: a DDP wrapper, or an FSDP2 root module (held weakly:
    it dies with the model)."""

    def __init__(self, module: torch.nn.Module, key: str, group: list[int],
                 params: list[tuple[str, torch.Tensor]], layout=None):
        self.key, self.group = key, group  # group: the data-parallel ranks, which split the data and average
        # Weak: a script that builds many models must not keep their parameters alive through the audit.
        self.param_refs = [(n, weakref.ref(p)) for n, p in params]
        self.module_ref = weakref.ref(module)
        self.layout = layout  # the device mesh under FSDP2 (:class:`ddplab.auditor.meshes.Layout`); None for DDP
        self.steps = 0  # optimizer steps that updated this wrapper's parameters
        self.reductions = 0  # backward passes through a synchronising forward since the last step
        self.accumulated_reductions = 0  # of those, the ones that started on gradients already accumulated
        self.in_backward = False
        self.pending = False  # a training forward waits for its backward
        self.batches: list[str] = []
        self.forward_batch = 0  # samples per rank in this step's training forwards
        self.loader_batch = 0  # of those, the samples of forwards whose input a DataLoader returned
        self.bypassed = False
        self.syncs_buffers = False
        self.batchnorm_layers = unsynced_batchnorms(module)
        self.micro_steps = 0  # training forwards since the last optimizer step
        self.carried: tuple[str, int] | None = None  # gradients the step's first backward started from
        self.zero_grad_calls = 0  # the process's zero_grad calls as of this model's last optimizer step
        self.synced_micro_steps = 0  # of those, the ones whose backward reduces (FSDP2's gradient sync on)
        self.reduction: Reduction | None = None  # what the data-parallel reduction divides the summed gradients by
        self.by_hand = False  # the program reduces the gradients itself (:mod:`ddplab.auditor.handwritten`)
        self.engine: int | None = None  # the ZeRO stage of a DeepSpeed engine's model; None for DDP and FSDP2
        self.loss_scale = 1.0  # what the engine multiplied the loss by before backward (fp16's dynamic loss scale)
        # A comm hook's buckets this step: a linear functional of the local gradients and of the reduced ones.
        self.comm_sums: list[float] | None = None
        # The program's own scaling of the gradients between backward and the step (:mod:`.grad_scaling`): a few
        # gradient elements as the newest backward left them, the clips' factor since, and the step's factor.
        self.probe: list | None = None
        self.clip_factor: float | None = 1.0
        self.grad_scale: float | None = None

    def root(self) -> torch.nn.Module | None:
        """The model's module (the FSDP2 root, or the module DDP wraps), while it lives."""
        return self.module_ref()

    def params(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p) for name, ref in self.param_refs if (p := ref()) is not None]


class AuditState:
    """Everything one process knows; one instance per process."""

    def __init__(self, steps: int, out_dir: str | None):
        self.steps_to_audit, self.out_dir = steps, out_dir
        self.findings: dict[str, fnd.Finding] = {}
        self.windows: list[dict] = []
        # wrapper key → this rank's optimizer steps when it ran out of inputs and joined (torch's Join).
        self.joined: dict[str, int] = {}
        self.batches: dict[str, list[str]] = {}  # training batch fingerprints per wrapper, kept past its life
        # Fingerprints of the dataset indices behind those batches, per wrapper (:mod:`ddplab.auditor.data`).
        self.index_batches: dict[str, list[str]] = {}
        # Each DistributedSampler's first training pass: its seed, epoch, replicas and dataset (auditor.data).
        self.samplers: list[dict] = []
        self.audited_batches: dict[str, dict[str, int]] = {}  # field → wrapper → batches of the audited steps
        self.loaded: dict[str, str] = {}  # digest of a batch a DataLoader returned → its index batch's fingerprint
        self.micro_batch: int | None = None  # samples in the newest training forward of a DDP model
        self.training_info: WrapperInfo | None = None  # the model of the newest training forward
        self.loss_weights: list[tuple[float, int]] = []  # (weight per summed term, micro-batch) this step
        # SUM_REDUCTION was found at a backward of this step: the program may still normalise it before the step.
        self.summed_at_backward = False
        self.weight_records: list = []  # what a loss's elements weigh, this step (:mod:`ddplab.auditor.weights`)
        self.output_nodes: list = []  # autograd nodes of this step's training forwards' outputs
        # (rank, size, whether the features required grad) of a gather of floating-point features, this step
        # (:mod:`ddplab.auditor.gathers`).
        self.gathered: tuple[int, int, bool] | None = None
        self.gather_backwards = 0  # backward passes from a loss over gathered features, this step
        self.gather_inputs: list = []  # weak references to the features this step gathered while they required grad
        # A few elements of what each put-back slice's cat received, for the merge (:mod:`.slice_shares`), and the
        # parameters behind those slices and outside them, named once.
        self.gathered_slices: list[dict] = []
        self.gather_split: dict | None = None
        self.zero_grad_calls = 0  # Optimizer.zero_grad and Module.zero_grad calls, any optimizer or module
        self.frameworks: set[str] = set()  # the training frameworks the program imported (their fixes' words)
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
        # What the global batch counts when it is not the rows of the model's forwards (the loaders' samples).
        self.global_batch_unit: str | None = None
        self.loaded_samples: int | None = 0  # samples DataLoaders returned since the last step; None: not countable
        # The data-parallel degree (the factor from the per-rank to the global batch), the parallelism and the device
        # mesh ({dim name: size}, FSDP2 only), as of the newest audited step.
        self.data_parallel_size: int | None = None
        self.strategy: str | None = None
        self.mesh: dict[str, int] | None = None
        self.model_parallel_only: dict[str, int] | None = None  # a mesh with no data-parallel dimension
        # Groups of ranks that must be fed the same batches (one tensor-parallel group each): group key → the key
        # of this rank's batches in ``batches`` and ``index_batches``, and whether its inputs are split (cp).
        self.tp_groups: dict[str, dict] = {}
        self.reduction: Reduction | None = None  # the newest audited model's data-parallel reduction
        self.unaudited: str | None = None  # why the run's training could not be audited (an engine not read)
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
        self.mesh_hook = None  # the forward hook that looks for FSDP2 roots (ddplab.auditor.meshes)
        self.rank, self.world_size = 0, 1
        # Optimizer steps with no DDP model, and the collectives issued by the first of them (NOT_DISTRIBUTED).
        self.alone_steps, self.alone_collectives, self.synchronised = 0, None, False

    @property
    def data_window(self) -> int:
        """Optimizer steps (and training batches per model) over which the data fed to training is watched."""
        return DATA_WINDOW_FACTOR * self.steps_to_audit

    @property
    def watching_meshes(self) -> bool:
        """Whether the program built a device mesh and FSDP2 forwards are being watched for."""
        return self.mesh_hook is not None

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
                "global_batch_unit": self.global_batch_unit,
                "data_parallel_size": self.data_parallel_size, "strategy": self.strategy, "mesh": self.mesh,
                "tp_groups": self.tp_groups, "model_parallel_only": self.model_parallel_only, "lr": self.lr,
                "optimizer": self.optimizer, "steps_audited": self.steps, "unaudited": self.unaudited,
                "reduction": self.reduction.to_json() if self.reduction is not None else None,
                "steps_requested": self.steps_to_audit, "total_steps": self.total_steps,
                "findings": [vars(f) for f in self._with_info()], "windows": self.windows, "batches": self.batches,
                "index_batches": self.index_batches, "samplers": self.samplers,
                "audited_batches": self.audited_batches, "joined": self.joined,
                "gathered_slices": self.gathered_slices, "frameworks": sorted(self.frameworks),
                "peers": self.peers, "interim": self.interim}

    def _with_info(self) -> list[fnd.Finding]:
        setting = fnd.describe_setting(self.world_size, self.data_parallel_size, self.strategy, self.mesh)
        batch = fnd.describe_global_batch(self.global_batch_size, self.global_batch_unit)
        info = fnd.Finding.make("RUN_INFO", self.rank, f"{setting}, {batch}, lr {fnd.format_lr(self.lr)}")
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
            self.remove_module_hook()
            self.remove_mesh_hook()
            self.add("AUDIT_INCOMPLETE", f"the auditor turned itself off on rank {self.rank}: {reason}")

    def remove_module_hook(self) -> None:
        if self.module_hook is not None:
            self.module_hook.remove()
            self.module_hook = None

    def remove_mesh_hook(self) -> None:
        if self.mesh_hook is not None:
            self.mesh_hook.remove()
            self.mesh_hook = None

    def window(self, info: WrapperInfo) -> dict:
        """This wrapper's record for its current step, created on first use."""
        for window in reversed(self.windows):
            if window["wrapper"] == info.key and window["step"] == info.steps:
                return window
        window = {"wrapper": info.key, "group": info.group, "step": info.steps}
        self.windows.append(window)
        return window


_STATE: AuditState | None = None


def current() -> AuditState | None:
    """This process's audit state; None when the auditor is not installed."""
    return _STATE


def start(steps: int, out_dir: str | None) -> AuditState:
    global _STATE
    _STATE = AuditState(steps, out_dir)
    return _STATE


def stop() -> None:
    global _STATE
    _STATE = None


def guarded(where: str):
    """Run a hook so that no error inside the auditor reaches the user's program (see :mod:`guard`)."""
    return guard.guarded(current, where)
