"""What a plan starts from: the reference run, the target hardware and the data (no torch).

Each is a frozen keyword-only dataclass that validates itself in ``__post_init__``, naming its fields
(``reference.lr``, ``target.devices``, ``data.dataset_size``); the mesh sizes they share are a
:class:`~ddplab.plan.mesh.ParallelDims`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from ddplab.errors import UsageError
from ddplab.plan import mesh, scaling
from ddplab.validation import one_of, positive, zero_or_more

Optimizer = Literal["sgd", "adam", "adamw"]
Keep = Literal["trajectory", "per-device"]
RuleChoice = Literal["auto", "none", "linear", "sqrt", "surge"]
PlanRule = Literal["none", "linear", "sqrt", "surge", "measured"]
Reduction = Literal["mean", "sum"]
OPTIMIZERS: tuple[Optimizer, ...] = get_args(Optimizer)
KEEPS: tuple[Keep, ...] = get_args(Keep)
RULE_CHOICES: tuple[RuleChoice, ...] = get_args(RuleChoice)


def _set(obj, name: str, value) -> None:
    # A frozen dataclass resolving a default in __post_init__.
    object.__setattr__(obj, name, value)


class _Meshed:
    """What the reference and the target share: tensor, pipeline and context-parallel sizes, as one mesh value."""

    devices: int
    nodes: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int

    @property
    def dims(self) -> mesh.ParallelDims:
        """The mesh these sizes make, which derives its sizes and checks them."""
        return mesh.ParallelDims(devices=self.devices, nodes=self.nodes, tensor_parallel_size=self.tensor_parallel_size,
                                 pipeline_parallel_size=self.pipeline_parallel_size,
                                 context_parallel_size=self.context_parallel_size)

    @property
    def model_parallel_size(self) -> int:
        """tp × pp × cp: ranks that share one data-parallel rank's samples."""
        return self.dims.model_parallel_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reference(_Meshed):
    """The setup whose results you trust: its batch as per-device batch × devices × nodes × accumulation,
    or only its global batch."""

    per_device_batch_size: int | None = None
    """Per-device loader batch (DataParallel: the loader batch DP splits across devices)."""
    lr: float | None = None
    """Its learning rate: the lr used with that setup (required)."""
    devices: int = 1
    """Devices per node."""
    nodes: int = 1
    """Nodes."""
    accumulation_steps: int = 1
    """Gradient accumulation steps."""
    tensor_parallel_size: int = 1
    """Its tensor-parallel degree (tp): ranks that split each layer of the same samples."""
    pipeline_parallel_size: int = 1
    """Its pipeline-parallel degree (pp): ranks that hold successive stages of the same samples."""
    context_parallel_size: int = 1
    """Its context-parallel degree (cp): ranks that split each sequence of the same samples."""
    wrapper: scaling.Wrapper | None = None
    """Single device, DataParallel or DDP: 'single', 'dp' or 'ddp' (default: single for one device, else ddp)."""
    global_batch_size: int | None = None
    """The reference's global batch; derived from the fields above when per_device_batch_size is given."""
    optimizer: Optimizer = "sgd"
    """The optimizer family: sgd, adam or adamw."""
    betas: tuple[float, float] | None = None
    """Adam/AdamW betas as B1,B2 (default 0.9,0.999)."""
    eps: float | None = None
    """Adam/AdamW epsilon (default 1e-08)."""
    weight_decay: float | None = None
    """Adam/AdamW weight decay λ (default 0 for adam, 0.01 for adamw, as torch's); AdamW's decoupled decay is
    rescaled to keep its averaging timescale in epochs."""
    noise_scale: float | None = None
    """Gradient noise scale B_noise measured on this setup (ddplab noise's B_simple): where the surge rule's lr
    peaks."""
    reduction: Reduction = "mean"
    """Loss reduction: how the loss reduces over the batch, 'mean' or 'sum'."""

    def __post_init__(self):
        for field, value in (("reference.per_device_batch_size", self.per_device_batch_size),
                             ("reference.devices", self.devices), ("reference.nodes", self.nodes),
                             ("reference.accumulation_steps", self.accumulation_steps),
                             ("reference.global_batch_size", self.global_batch_size),
                             ("reference.tensor_parallel_size", self.tensor_parallel_size),
                             ("reference.pipeline_parallel_size", self.pipeline_parallel_size),
                             ("reference.context_parallel_size", self.context_parallel_size)):
            positive(field, value, integer=True)
        if self.lr is None:
            raise UsageError("the reference needs its learning rate: give {reference.lr}")
        positive("reference.lr", self.lr)
        positive("reference.eps", self.eps)
        zero_or_more("reference.weight_decay", self.weight_decay)
        positive("reference.noise_scale", self.noise_scale)
        if self.wrapper is None:
            _set(self, "wrapper", "single" if self.devices * self.nodes == 1 else "ddp")
        one_of("reference.wrapper", self.wrapper, scaling.WRAPPERS)
        if self.wrapper == "single" and (self.devices > 1 or self.nodes > 1):
            raise UsageError("{reference.wrapper} single means one device: set {reference.wrapper} ddp or dp for "
                             "several")
        self._check_mesh()
        one_of("reference.optimizer", self.optimizer, OPTIMIZERS)
        self._resolve_moments()
        one_of("reference.reduction", self.reduction, get_args(Reduction))
        self._resolve_weight_decay()
        self._resolve_global_batch()

    def _check_mesh(self) -> None:
        if self.model_parallel_size == 1:
            return
        if self.wrapper == "dp":
            raise UsageError("{reference.wrapper} dp is one process, which has no device mesh: set "
                             "{reference.wrapper} ddp (one process per device), or drop the reference's tp, pp and cp")
        self.dims.check("reference")

    def _resolve_moments(self) -> None:
        """Adam's betas and eps: torch's defaults for Adam and AdamW, refused for SGD, which has no moments."""
        if self.optimizer == "sgd":
            adam_only = [f"{{reference.{name}}}" for name in ("betas", "eps") if getattr(self, name) is not None]
            if adam_only:
                raise UsageError(f"{' and '.join(adam_only)} set Adam's moments and the plan's optimizer is SGD, "
                                 "where they would change nothing: pass {reference.optimizer} adam or adamw")
            return
        if self.betas is None:
            _set(self, "betas", (0.9, 0.999))
        if self.eps is None:
            _set(self, "eps", 1e-8)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UsageError(f"{{reference.betas}} must be two numbers in [0, 1), got {self.betas}")

    def _resolve_weight_decay(self) -> None:
        if self.optimizer == "sgd":
            if self.weight_decay is not None:
                raise UsageError("{reference.weight_decay} is for Adam and AdamW: SGD's weight decay is coupled (an L2 "
                                 "term in its gradient) and the plan does not rescale it; drop it, or pass "
                                 "{reference.optimizer} adamw")
            return
        if self.weight_decay is None:
            # torch's defaults: Adam adds no L2 term, AdamW decays by 0.01.
            _set(self, "weight_decay", 0.01 if self.optimizer == "adamw" else 0.0)

    def _resolve_global_batch(self) -> None:
        if self.per_device_batch_size is None:
            if self.global_batch_size is None:
                raise UsageError("the reference needs {reference.per_device_batch_size} (with its devices, nodes and "
                                 "accumulation steps) or {reference.global_batch_size}")
            return
        derived = mesh.global_batch_size(per_device_batch_size=self.per_device_batch_size,
                                         data_parallel_size=self.data_parallel_size,
                                         accumulation_steps=self.accumulation_steps)
        if self.global_batch_size not in (None, derived):
            raise UsageError(f"{{reference.global_batch_size}} {self.global_batch_size} disagrees with "
                             f"{{reference.per_device_batch_size}} {self.per_device_batch_size} on this setup, which "
                             f"makes {derived}: give one of them")
        _set(self, "global_batch_size", derived)

    @property
    def world_size(self) -> int:
        return 1 if self.wrapper != "ddp" else self.devices * self.nodes

    @property
    def data_parallel_size(self) -> int:
        """Loader batches behind one micro-step: DDP's data-parallel ranks; DataParallel's one process per node."""
        if self.wrapper != "ddp":
            # DataParallel splits one loader batch over the devices: they add no samples.
            return self.nodes
        return self.dims.data_parallel_size

    @property
    def batch_per_device(self) -> float | None:
        """Samples each device computes per micro-step (DP splits the loader batch); None when only the
        global batch is known."""
        if self.per_device_batch_size is None:
            return None
        return self.per_device_batch_size / self.devices if self.wrapper == "dp" else self.per_device_batch_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target(_Meshed):
    """The new hardware (one process per device, in a mesh of data, tensor, pipeline and context parallel ranks) and
    what to hold fixed."""

    devices: int
    """Devices (GPUs) per node."""
    nodes: int = 1
    """Nodes."""
    tensor_parallel_size: int = 1
    """Tensor-parallel degree (tp): ranks that split each layer of the same samples; they add none to the batch."""
    pipeline_parallel_size: int = 1
    """Pipeline-parallel degree (pp): ranks that hold successive stages of the same samples; they add none."""
    context_parallel_size: int = 1
    """Context-parallel degree (cp): ranks that split each sequence of the same samples; they add none."""
    strategy: mesh.Strategy = "ddp"
    """How the data-parallel ranks hold the model: ddp (a whole replica each), fsdp (FSDP2 shards it), hsdp
    (FSDP2 shards within groups and replicates across them) or deepspeed-zero0 to deepspeed-zero3 (DeepSpeed's engine
    at that ZeRO stage); changes no number, only how to accumulate."""
    data_parallel_replicate_size: int | None = None
    """HSDP's replicate degree R (the shard degree is the data-parallel degree ÷ R); shown, changes no number."""
    per_device_batch_size: int | None = None
    """Per-device loader batch; derived when not given."""
    global_batch_size: int | None = None
    """Global (effective) batch; derived when not given."""
    accumulation_steps: int | None = None
    """Gradient accumulation steps; derived when not given."""
    max_batch_size_per_device: int | None = None
    """Most samples a device fits per micro-step (the memory limit): a larger batch becomes accumulation steps."""
    keep: Keep | None = None
    """What to hold fixed: 'trajectory' (the same global batch and lr) or 'per-device' (scale up) (default: decided
    from the batch)."""
    rule: RuleChoice = "auto"
    """LR rule: auto (linear for SGD, square root for Adam/AdamW), none, linear, sqrt, or surge (Adam/AdamW: the lr
    peaks at the noise scale, Li et al. 2024)."""
    keep_optimizer_settings: bool = False
    """Change only the batch and the lr: Adam's betas and eps and AdamW's weight decay stay as the reference has
    them, where the rules would scale them with the batch (β₂' = β₂^k, ε' = ε/√k, the constant-timescale decay)."""

    def __post_init__(self):
        for field, value in (("target.devices", self.devices), ("target.nodes", self.nodes),
                             ("target.per_device_batch_size", self.per_device_batch_size),
                             ("target.global_batch_size", self.global_batch_size),
                             ("target.accumulation_steps", self.accumulation_steps),
                             ("target.max_batch_size_per_device", self.max_batch_size_per_device),
                             ("target.tensor_parallel_size", self.tensor_parallel_size),
                             ("target.pipeline_parallel_size", self.pipeline_parallel_size),
                             ("target.context_parallel_size", self.context_parallel_size),
                             ("target.data_parallel_replicate_size", self.data_parallel_replicate_size)):
            positive(field, value, integer=True)
        self.dims.check("target")
        one_of("target.strategy", self.strategy, mesh.STRATEGIES)
        self._check_replicate()
        if self.keep is not None:
            one_of("target.keep", self.keep, KEEPS)
        one_of("target.rule", self.rule, RULE_CHOICES)
        self._check_batch_fields()

    def _check_replicate(self) -> None:
        replicate = self.data_parallel_replicate_size
        if replicate is None:
            return
        if not self.notes.takes_replicate:
            raise UsageError(f"{{target.data_parallel_replicate_size}} is HSDP's replicate degree and "
                             f"{{target.strategy}} {self.strategy} has none: pass {{target.strategy}} hsdp, or drop "
                             "{target.data_parallel_replicate_size}")
        if self.data_parallel_size % replicate:
            raise UsageError(f"{{target.data_parallel_replicate_size}} {replicate} does not divide the data-parallel "
                             f"degree {self.data_parallel_size}: HSDP's data-parallel ranks are replicate × shard")

    def _check_batch_fields(self) -> None:
        batch, accumulation, global_batch = self.per_device_batch_size, self.accumulation_steps, self.global_batch_size
        world = self.data_parallel_size
        if batch and accumulation and global_batch and batch * world * accumulation != global_batch:
            # Three explicit values that disagree: none of them may be changed silently.
            raise UsageError(f"{{target.per_device_batch_size}} {batch} × {self.dims.ranks} × "
                             f"{{target.accumulation_steps}} {accumulation} = {batch * world * accumulation}, not "
                             f"{{target.global_batch_size}} "
                             f"{global_batch}: give two of the three")
        if batch and global_batch and global_batch % (batch * world):
            raise UsageError(f"{{target.global_batch_size}} {global_batch} is not a multiple of "
                             f"{{target.per_device_batch_size}} × {self.dims.ranks_noun} = {batch * world}")
        if batch and self.max_batch_size_per_device and batch > self.max_batch_size_per_device:
            raise UsageError("{target.per_device_batch_size} is larger than {target.max_batch_size_per_device}")

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def data_parallel_size(self) -> int:
        """The ranks that load distinct samples: world size ÷ (tp × pp × cp)."""
        return self.dims.data_parallel_size

    @property
    def notes(self) -> mesh.StrategyNotes:
        """What the plan says about the strategy."""
        return mesh.NOTES[self.strategy]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Data:
    """The dataset and schedule, for step counts (optional)."""

    dataset_size: int | None = None
    """Samples in the training set."""
    epochs: float = 1.0
    """Epochs in the run; the warmup is clamped to fit in it."""
    drop_last: bool = False
    """The DataLoader's drop_last."""
    sampler_drop_last: bool = False
    """DistributedSampler's drop_last."""
    warmup_epochs: float | None = None
    """Warmup length in epochs when warmup is recommended (needs ``dataset_size`` for steps; default 5, ImageNet's,
    or a tenth of the run where 5 epochs would be more)."""
    warmup_steps: int | None = None
    """Warmup length in optimizer steps (overrides ``warmup_epochs``, and needs no dataset size)."""
    reference_steps: int | None = None
    """The reference run's length in its optimizer steps, where it is counted in steps (no ``dataset_size``): the
    target runs as many samples."""
    reference_warmup_steps: int | None = None
    """The reference's own warmup in its optimizer steps: the target warms up over as many samples (unless
    ``warmup_steps`` or ``warmup_epochs`` says otherwise)."""
    warmup_threshold: float = 4.0
    """Recommend warmup when the lr grows at least this much: the lr multiplier reaches it."""
    critical_batch_size: float | None = None
    """Measured critical batch size (ddplab noise): warn when the plan is well past it (diminishing returns)."""
    seq_len: int | None = None
    """Tokens per sample (the sequence length): adds tokens per optimizer step, the reference's and the target's."""

    def __post_init__(self):
        positive("data.dataset_size", self.dataset_size, integer=True)
        positive("data.seq_len", self.seq_len, integer=True)
        positive("data.reference_steps", self.reference_steps, integer=True)
        zero_or_more("data.reference_warmup_steps", self.reference_warmup_steps)
        for field, value in (("data.epochs", self.epochs), ("data.warmup_threshold", self.warmup_threshold),
                             ("data.critical_batch_size", self.critical_batch_size)):
            positive(field, value)
        zero_or_more("data.warmup_epochs", self.warmup_epochs)
        steps = self.warmup_steps
        if steps is not None and not (steps >= 0 and steps == int(steps)):
            raise UsageError(f"{{data.warmup_steps}} must be a whole number, zero or more, got {self.warmup_steps}")
