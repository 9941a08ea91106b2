"""Translate a reference training setup to new hardware, with a reason for every number (no torch).

>>> ref = Reference(per_device_batch_size=32, lr=0.1)
>>> p = plan(ref, Target(devices=8))
>>> p.mode, p.global_batch_size, p.lr, p.warmup_recommended
('per-device', 256, 0.8, True)
>>> plan(ref, Target(devices=8, keep="trajectory")).per_device_batch_size
4

Under a device mesh only the data-parallel ranks add samples: 16 ranks with tensor parallelism 2
are 8 data-parallel ranks, so the global batch is 32 × 8, not 32 × 16:

>>> p = plan(ref, Target(devices=8, nodes=2, tensor_parallel_size=2))
>>> p.data_parallel_size, p.global_batch_size, p.lr
(8, 256, 0.8)

Errors are :class:`~ddplab.errors.UsageError` sentences naming the field to change as the
argument holds it (``reference.lr``, ``target.devices``, ``data.dataset_size``), and so is the
plan's prose (its reasons, warnings and other mode): templates a Python caller reads with field
names and the command line with its flags (``plan(..., names=...)``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

from ddplab.errors import UsageError, render
from ddplab.plan import mesh, scaling
from ddplab.text import count
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


class _Mesh:
    """What the reference and the target share: tensor, pipeline and context-parallel sizes."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int

    @property
    def model_parallel_size(self) -> int:
        """tp × pp × cp: ranks that share one data-parallel rank's samples."""
        return mesh.model_parallel_size(tensor_parallel_size=self.tensor_parallel_size,
                                        pipeline_parallel_size=self.pipeline_parallel_size,
                                        context_parallel_size=self.context_parallel_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reference(_Mesh):
    """The setup whose results you trust: its batch as per-device batch × devices × nodes × accumulation,
    or only its global batch."""

    per_device_batch_size: int | None = None
    """Per-device loader batch (DataParallel: the loader batch DP splits across devices)."""
    lr: float
    """Its learning rate: the lr used with that setup."""
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
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW betas as B1,B2."""
    eps: float = 1e-8
    """Adam/AdamW epsilon."""
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
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UsageError(f"{{reference.betas}} must be two numbers in [0, 1), got {self.betas}")
        one_of("reference.reduction", self.reduction, get_args(Reduction))
        self._resolve_weight_decay()
        self._resolve_global_batch()

    def _check_mesh(self) -> None:
        if self.model_parallel_size == 1:
            return
        if self.wrapper == "dp":
            raise UsageError("{reference.wrapper} dp is one process, which has no device mesh: set "
                             "{reference.wrapper} ddp (one process per device), or drop the reference's tp, pp and cp")
        _check_divides("reference", self.devices, self.nodes, self.tensor_parallel_size, self.pipeline_parallel_size,
                       self.context_parallel_size)

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
        return mesh.data_parallel_size(world_size=self.world_size, tensor_parallel_size=self.tensor_parallel_size,
                                       pipeline_parallel_size=self.pipeline_parallel_size,
                                       context_parallel_size=self.context_parallel_size)

    @property
    def batch_per_device(self) -> float | None:
        """Samples each device computes per micro-step (DP splits the loader batch); None when only the
        global batch is known."""
        if self.per_device_batch_size is None:
            return None
        return self.per_device_batch_size / self.devices if self.wrapper == "dp" else self.per_device_batch_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target(_Mesh):
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
    """How the data-parallel ranks hold the model: ddp (a whole replica each), fsdp (FSDP2 shards it) or hsdp
    (FSDP2 shards within groups and replicates across them); changes no number, only how to accumulate."""
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
        _check_divides("target", self.devices, self.nodes, self.tensor_parallel_size, self.pipeline_parallel_size,
                       self.context_parallel_size)
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
            raise UsageError(f"{{target.per_device_batch_size}} {batch} × {_ranks(self)} × "
                             f"{{target.accumulation_steps}} {accumulation} = {batch * world * accumulation}, not "
                             f"{{target.global_batch_size}} "
                             f"{global_batch}: give two of the three")
        if batch and global_batch and global_batch % (batch * world):
            raise UsageError(f"{{target.global_batch_size}} {global_batch} is not a multiple of "
                             f"{{target.per_device_batch_size}} × {_ranks_noun(self)} = {batch * world}")
        if batch and self.max_batch_size_per_device and batch > self.max_batch_size_per_device:
            raise UsageError("{target.per_device_batch_size} is larger than {target.max_batch_size_per_device}")

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    @property
    def data_parallel_size(self) -> int:
        """The ranks that load distinct samples: world size ÷ (tp × pp × cp)."""
        return mesh.data_parallel_size(world_size=self.world_size, tensor_parallel_size=self.tensor_parallel_size,
                                       pipeline_parallel_size=self.pipeline_parallel_size,
                                       context_parallel_size=self.context_parallel_size)

    @property
    def notes(self) -> mesh.StrategyNotes:
        """What the plan says about the strategy."""
        return mesh.NOTES[self.strategy]


def _check_divides(prefix: str, devices: int, nodes: int, tp: int, pp: int, cp: int) -> None:
    """tp × pp × cp must divide the world, in a sentence that names its sizes."""
    world = devices * nodes
    if mesh.divides(world_size=world, tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp):
        return
    raise UsageError(f"{count(world, 'rank')} ({count(nodes, 'node')} × {count(devices, 'device')}) "
                     f"{'does' if world == 1 else 'do'} not split into tp {tp} × pp {pp} × cp {cp}: choose "
                     f"{{{prefix}.tensor_parallel_size}}, {{{prefix}.pipeline_parallel_size}} and "
                     f"{{{prefix}.context_parallel_size}} whose product divides {world}")


def _ranks(target: Target) -> str:
    """The ranks that split the global batch, counted as the prose names them ("8 ranks", "8 data-parallel ranks")."""
    return count(target.data_parallel_size, _rank(target))


def _rank(target: Target) -> str:
    return "rank" if target.model_parallel_size == 1 else "data-parallel rank"


def _ranks_noun(target: Target) -> str:
    return "world size" if target.model_parallel_size == 1 else "data-parallel degree"


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
    warmup_epochs: float = 5.0
    """Warmup length in epochs when warmup is recommended (needs ``dataset_size`` for steps)."""
    warmup_steps: int | None = None
    """Warmup length in optimizer steps (overrides ``warmup_epochs``, and needs no dataset size)."""
    warmup_threshold: float = 4.0
    """Recommend warmup when the lr grows at least this much: the lr multiplier reaches it."""
    critical_batch_size: float | None = None
    """Measured critical batch size (ddplab noise): warn when the plan is well past it (diminishing returns)."""
    seq_len: int | None = None
    """Tokens per sample (the sequence length): adds tokens per optimizer step, the reference's and the target's."""

    def __post_init__(self):
        positive("data.dataset_size", self.dataset_size, integer=True)
        positive("data.seq_len", self.seq_len, integer=True)
        for field, value in (("data.epochs", self.epochs), ("data.warmup_threshold", self.warmup_threshold),
                             ("data.critical_batch_size", self.critical_batch_size)):
            positive(field, value)
        zero_or_more("data.warmup_epochs", self.warmup_epochs)
        steps = self.warmup_steps
        if steps is not None and not (steps >= 0 and steps == int(steps)):
            raise UsageError(f"{{data.warmup_steps}} must be a whole number, zero or more, got {self.warmup_steps}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredLr:
    """An lr measured at the target's global batch (``ddplab study``), planned from in place of a rule."""

    lr: float
    reason: str
    """Where the number comes from, for the table's "why" column (a template, as a UsageError's)."""
    warnings: tuple[str, ...] = ()
    """Templates too."""


LrSource = Callable[[int], MeasuredLr]
"""Given the planned global batch, the lr to use there."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What to run on the target, and why."""

    mode: Keep
    rule: PlanRule
    world_size: int
    data_parallel_size: int
    """The ranks that load distinct samples: world size ÷ (tp × pp × cp); every batch and lr rule counts these."""
    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int
    strategy: mesh.Strategy
    data_parallel_replicate_size: int | None
    """Replicas over the data-parallel ranks (all of them under DDP, 1 under FSDP2; None for HSDP without one)."""
    data_parallel_shard_size: int | None
    """Ranks one replica is sharded over (1 under DDP, all of them under FSDP2; None for HSDP without a replicate)."""
    per_device_batch_size: int
    accumulation_steps: int
    global_batch_size: int
    tokens_per_step: int | None
    """Global batch × sequence length; None without ``data.seq_len``."""
    reference_global_batch_size: int
    reference_data_parallel_size: int
    reference_tokens_per_step: int | None
    batch_ratio: float
    lr: float
    lr_multiplier: float
    betas: tuple[float, float] | None
    eps: float | None
    weight_decay: float | None
    adamw_timescale_epochs: float | None
    """AdamW's averaging timescale B/(η·λ·N) in epochs; None without decay, for Adam or without a dataset size."""
    warmup_recommended: bool
    warmup_steps: int | None
    warmup_epochs: float | None
    samples_per_rank: int | None
    padded_samples: int | None
    dropped_samples: int | None
    loader_batches_per_rank: int | None
    steps_per_epoch: int | None
    total_steps: int | None
    samples_per_epoch: int | None
    steps_factor: float | None
    compute_factor: float | None
    other_mode: str
    warnings: tuple[str, ...]
    reasons: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["warnings"] = list(self.warnings)
        if self.betas is None:
            for key in ("betas", "eps", "weight_decay", "adamw_timescale_epochs"):
                out.pop(key)
        return out

    def lr_lambda(self, step: int) -> float:
        """LambdaLR factor on ``self.lr``: linear warmup over ``warmup_steps`` (the table's), then 1.

        Raises UsageError when warmup is recommended but its length is unknown (no dataset size or
        warmup steps): skipping the warmup silently would start at the full scaled lr.
        """
        self._require_warmup_length()
        return scaling.warmup_factor(step, warmup_steps=self.warmup_steps or 0, lr_multiplier=self.lr_multiplier)

    def scheduler(self, optimizer):
        """A ``torch.optim.lr_scheduler.LambdaLR`` for an optimizer built with ``lr=plan.lr`` (imports torch)."""
        self._require_warmup_length()
        from torch.optim.lr_scheduler import LambdaLR

        return LambdaLR(optimizer, self.lr_lambda)

    def _require_warmup_length(self) -> None:
        if self.warmup_recommended and self.warmup_steps is None:
            raise UsageError(f"warmup is recommended (lr ×{self.lr_multiplier:.4g}) but its length is unknown: "
                             "plan with {data.dataset_size} or {data.warmup_steps}")


def plan(reference: Reference, target: Target, data: Data | None = None, *, lr_source: LrSource | None = None,
         names: Mapping[str, str] | None = None) -> Plan:
    """Plan the target run; raises UsageError with a sentence naming what to change.

    ``lr_source`` replaces the lr rule with a measured lr at the planned global batch: the warmup,
    the Adam settings and the other mode are then all reasoned from that lr. The plan's prose (its
    reasons, warnings and other mode) names the fields to change as ``names`` shows them (by default
    as the arguments hold them: ``target.per_device_batch_size``; the command line passes its flags).
    """
    return in_words(_plan(reference, target, data or Data(), lr_source, describe_other=True), names)


def in_words(result: Plan, names: Mapping[str, str] | None) -> Plan:
    """``result`` with the fields its prose names shown as ``names`` says."""
    def say(text: str) -> str:
        return render(text, names)

    return dataclasses.replace(result, reasons={key: say(text) for key, text in result.reasons.items()},
                               warnings=tuple(map(say, result.warnings)), other_mode=say(result.other_mode))


def _plan(reference: Reference, target: Target, data: Data, lr_source: LrSource | None, *,
          describe_other: bool) -> Plan:
    mode = _resolve_mode(reference, target)
    batch, accumulation = _batch_for(mode, reference, target)
    reasons, warnings = {}, []
    global_batch = mesh.global_batch_size(per_device_batch_size=batch, data_parallel_size=target.data_parallel_size,
                                          accumulation_steps=accumulation)
    k = global_batch / reference.global_batch_size
    # Keep trajectory holds the reference's global batch and its lr: a measured lr would change the run it keeps.
    measured = lr_source(global_batch) if lr_source is not None and mode != "trajectory" else None
    rule = "measured" if measured else _rule(target.rule, reference.optimizer)
    lr_fields = _lr(reference, rule, k, warnings, measured)
    if lr_source is not None and measured is None:
        lr_fields["reasons"]["lr"] += "; keep trajectory holds the reference's lr, so the measured lr is not used"
    reasons.update(_batch_reasons(reference, target, mode, batch, accumulation, global_batch, k))
    reasons.update(lr_fields.pop("reasons"))
    if reference.model_parallel_size != target.model_parallel_size and rule in ("linear", "sqrt"):
        reasons["lr_multiplier"] += _world_size_overshoot(reference, target, rule, k, lr_fields["lr_multiplier"])
    steps = _steps(data, target, batch, accumulation, global_batch, lr_fields, warnings)
    reasons.update(steps.pop("reasons"))
    steps.update(_adamw_timescale(reference, data, global_batch, lr_fields, reasons))
    warnings += _semantics_warnings(reference, target, global_batch, data)
    other = _other_mode(mode, reference, target, lr_source) if describe_other else ""
    return Plan(mode=mode, rule=rule, per_device_batch_size=batch, accumulation_steps=accumulation,
                global_batch_size=global_batch, reference_global_batch_size=reference.global_batch_size,
                batch_ratio=k, other_mode=other, warnings=tuple(warnings), reasons=reasons, **_mesh_fields(target),
                **_tokens(reference, target, data, global_batch, reasons), **lr_fields, **steps)


def _mesh_fields(target: Target) -> dict[str, Any]:
    replicate, shard = target.notes.split(target.data_parallel_size, target.data_parallel_replicate_size)
    return {"world_size": target.world_size, "data_parallel_size": target.data_parallel_size,
            "tensor_parallel_size": target.tensor_parallel_size,
            "pipeline_parallel_size": target.pipeline_parallel_size,
            "context_parallel_size": target.context_parallel_size, "strategy": target.strategy,
            "data_parallel_replicate_size": replicate, "data_parallel_shard_size": shard}


def _tokens(reference: Reference, target: Target, data: Data, global_batch: int,
            reasons: dict[str, str]) -> dict[str, Any]:
    """Tokens per optimizer step, the target's and the reference's (None without a sequence length)."""
    out = {"reference_data_parallel_size": reference.data_parallel_size}
    if data.seq_len is None:
        return {**out, "tokens_per_step": None, "reference_tokens_per_step": None}
    tokens, was = (mesh.tokens_per_step(global_batch_size=batch, seq_len=data.seq_len)
                   for batch in (global_batch, reference.global_batch_size))
    reasons["tokens_per_step"] = (f"global batch {global_batch} × {{data.seq_len}} {data.seq_len}; the reference's: "
                                  f"{reference.global_batch_size} × {data.seq_len} = {was:,}"
                                  + (f"; each of the {target.context_parallel_size} context-parallel ranks holds "
                                     f"1/{target.context_parallel_size} of every sequence, adding none"
                                     if target.context_parallel_size > 1 else ""))
    return {**out, "tokens_per_step": tokens, "reference_tokens_per_step": was}


def _world_size_overshoot(reference: Reference, target: Target, rule: PlanRule, k: float, multiplier: float) -> str:
    """What counting every rank instead of the data-parallel ones would have done to the lr."""
    by_world = k * target.model_parallel_size / reference.model_parallel_size
    wrong = scaling.lr_multiplier(by_world, rule)
    direction = "too high" if wrong > multiplier else "too low"
    return (f"; k counts data-parallel ranks: counting all {count(target.world_size, 'rank')} would make k "
            f"{by_world:g} and the lr ×{wrong:.4g}, {wrong / multiplier:.4g}× {direction}")


def _resolve_mode(reference: Reference, target: Target) -> Keep:
    if target.keep:
        if target.keep == "trajectory" and target.global_batch_size not in (None, reference.global_batch_size):
            raise UsageError(f"{{target.keep}} trajectory holds the reference's global batch of "
                             f"{reference.global_batch_size}; drop {{target.global_batch_size}} "
                             f"{target.global_batch_size} or use {{target.keep}} per-device")
        return target.keep
    if target.global_batch_size is not None:
        return "trajectory" if target.global_batch_size == reference.global_batch_size else "per-device"
    if target.per_device_batch_size is not None:
        accumulation = target.accumulation_steps or reference.accumulation_steps
        new_global = target.per_device_batch_size * target.data_parallel_size * accumulation
        return "trajectory" if new_global == reference.global_batch_size else "per-device"
    return "per-device"


def _batch_for(mode: Keep, reference: Reference, target: Target) -> tuple[int, int]:
    """(per-device batch, accumulation steps) for the target."""
    wanted_global = reference.global_batch_size if mode == "trajectory" else target.global_batch_size
    if wanted_global is not None:
        return _split(wanted_global, target)
    batch = target.per_device_batch_size or _reference_device_batch(reference)
    accumulation = target.accumulation_steps or reference.accumulation_steps
    limit = target.max_batch_size_per_device
    if limit is None or batch <= limit:
        return batch, accumulation
    if target.accumulation_steps:
        raise UsageError(f"the reference's per-device batch of {batch} does not fit "
                         f"{{target.max_batch_size_per_device}} {limit}; give {{target.per_device_batch_size}} too, "
                         "or drop {target.accumulation_steps} to have it derived")
    # Same samples per rank per optimizer step, in micro-batches that fit: the global batch is unchanged.
    return scaling.split_global_batch(batch * accumulation * target.data_parallel_size,
                                      world_size=target.data_parallel_size, max_per_device=limit)


def _split(global_batch: int, target: Target) -> tuple[int, int]:
    world = target.data_parallel_size
    if target.per_device_batch_size:
        if global_batch % (target.per_device_batch_size * world):
            raise UsageError(f"{{target.per_device_batch_size}} {target.per_device_batch_size} on {_ranks(target)} "
                             f"cannot "
                             f"reach a global batch of {global_batch}: it needs a multiple of "
                             f"{target.per_device_batch_size * world}")
        return target.per_device_batch_size, global_batch // (target.per_device_batch_size * world)
    if target.accumulation_steps:
        if global_batch % (target.accumulation_steps * world):
            raise UsageError(f"{{target.accumulation_steps}} {target.accumulation_steps} on {_ranks(target)} cannot "
                             f"reach a global batch of {global_batch}: it needs a multiple of "
                             f"{target.accumulation_steps * world}")
        return global_batch // (target.accumulation_steps * world), target.accumulation_steps
    if global_batch % world and target.model_parallel_size > 1:
        options = " or ".join(map(str, scaling.nearest_divisible(global_batch, world)))
        raise UsageError(f"a data-parallel degree of {world} ({_mesh_division(target)}) cannot split a global batch "
                         f"of {global_batch} evenly; use a global batch of {options}")
    return scaling.split_global_batch(global_batch, world_size=world, max_per_device=target.max_batch_size_per_device)


def _reference_device_batch(reference: Reference) -> int:
    per_device = reference.batch_per_device
    if per_device is None:
        raise UsageError("the reference gives only its global batch: give {target.per_device_batch_size} or "
                         "{target.global_batch_size} for the target")
    if per_device != int(per_device):
        raise UsageError(f"DataParallel splits the loader batch {reference.per_device_batch_size} unevenly over "
                         f"{reference.devices} devices; give {{target.per_device_batch_size}} for the target")
    return int(per_device)


def _rule(rule: RuleChoice, optimizer: Optimizer) -> PlanRule:
    if rule != "auto":
        return rule
    return "linear" if optimizer == "sgd" else "sqrt"


def _lr(reference: Reference, rule: PlanRule, k: float, warnings: list[str],
        measured: MeasuredLr | None) -> dict[str, Any]:
    _check_rule(reference, rule)
    if measured is not None:
        return _measured_lr(reference, k, warnings, measured)
    multiplier = _rule_multiplier(reference, rule, k, warnings)
    reasons = {}
    if k == 1:
        reasons["lr"] = ("the global batch is unchanged, so the gradient is the same average over the same number "
                         "of samples: keep the reference lr (DDP averages over ranks)")
    else:
        reasons["lr"] = {
            "none": f"{{target.rule}} none: the lr stays although the global batch changed ×{k:g}",
            "linear": f"linear rule (Goyal et al. 2017): lr × k = lr × {k:g}; keeps where SGD ends up, "
                      f"multiplies the variance of each update by k",
            "sqrt": f"square-root rule: lr × √k = lr × {math.sqrt(k):.4g}; keeps the variance of each update, "
                    f"needs more epochs to travel as far",
            "surge": "surge rule (Li et al. 2024, \"Surge phenomenon in optimal learning rate and batch size "
                     "scaling\"): Adam's best lr η*(B) = η_max / (½(√(B_noise/B) + √(B/B_noise))) rises up to the "
                     f"noise scale and falls past it; lr × η*(B')/η*(B) = lr × {multiplier:.4g}",
        }[rule]
    reasons["lr_multiplier"] = _multiplier_reason(rule, k, reference)
    out = {"lr": _representable("lr", reference.lr * multiplier, "reference.lr", reference.lr, multiplier),
           "lr_multiplier": multiplier, **_adam(reference, rule, k, multiplier, reasons, warnings)}
    if reference.optimizer == "sgd" and rule == "sqrt" and k > 1:
        warnings.append("the square-root rule keeps SGD's update variance but covers less ground per epoch: "
                        "plan on more epochs than the reference")
    return {**out, "reasons": reasons}


def _check_rule(reference: Reference, rule: PlanRule) -> None:
    """The surge rule needs Adam and a noise scale; a noise scale needs the surge rule."""
    if rule == "surge" and reference.noise_scale is None:
        raise UsageError("{target.rule} surge puts the lr's peak at the gradient noise scale: give it with "
                         "{reference.noise_scale} (ddplab noise measures it) or {from_study}")
    if rule == "surge" and reference.optimizer == "sgd":
        raise UsageError("{target.rule} surge is Adam's (Li et al. 2024): SGD's best lr does not fall past the noise "
                         "scale, so use {target.rule} linear, or pass {reference.optimizer} adam or adamw")
    if rule != "surge" and reference.noise_scale is not None:
        raise UsageError("{reference.noise_scale} is read only by {target.rule} surge: add it, or drop "
                         "{reference.noise_scale}")


def _rule_multiplier(reference: Reference, rule: PlanRule, k: float, warnings: list[str]) -> float:
    if rule != "surge":
        return scaling.lr_multiplier(k, rule)
    batches, noise = (reference.global_batch_size, reference.global_batch_size * k), reference.noise_scale
    named = (("the reference's", batches[0]),) + ((("the planned", batches[1]),) if k != 1 else ())
    far = [f"{name} global batch {batch:g}" for name, batch in named if scaling.outside_surge_range(batch, noise)]
    if far:
        warnings.append(f"{' and '.join(far)} {'lie' if len(far) > 1 else 'lies'} more than "
                        f"{scaling.SURGE_RANGE:g}× from {{reference.noise_scale}} {noise:g}: the surge rule's curve "
                        "(Li et al. 2024) is trusted near B_noise, so its lr there is an extrapolation; measure the "
                        "noise scale nearer these batches")
    return scaling.surge_lr_multiplier(*batches, noise)


def _measured_lr(reference: Reference, k: float, warnings: list[str], measured: MeasuredLr) -> dict[str, Any]:
    """The lr a study measured at this global batch; everything after (warmup, other mode) follows from it."""
    multiplier = _representable("lr", measured.lr, "reference.lr", reference.lr, 1.0) / reference.lr
    warnings.extend(measured.warnings)
    reasons = {"lr": measured.reason,
               "lr_multiplier": f"measured lr / reference lr = {measured.lr:.4g} / {reference.lr:g} "
                                f"(the global batch grew ×{k:g})"}
    adam = reference.optimizer in ("adam", "adamw")
    if adam:
        reasons["weight_decay"] = "kept as given: the measured lr replaces the rules that would rescale it"
    return {"lr": measured.lr, "lr_multiplier": multiplier, "betas": reference.betas if adam else None,
            "eps": reference.eps if adam else None, "weight_decay": reference.weight_decay, "reasons": reasons}


def _multiplier_reason(rule: str, k: float, reference: Reference) -> str:
    ratio = f"k = new global batch / reference global batch = {k:g}"
    if rule == "surge":
        batch, noise = reference.global_batch_size, reference.noise_scale
        return (f"{ratio}; the surge rule multiplies the lr by η*({batch * k:g})/η*({batch}) = "
                f"{scaling.surge_lr_factor(batch * k, noise):.4g}/{scaling.surge_lr_factor(batch, noise):.4g}, each "
                f"a fraction of the peak lr at {{reference.noise_scale}} {noise:g}")
    return {"none": f"{{target.rule}} none: the lr is not scaled, although {ratio}",
            "linear": f"{ratio}; the linear rule multiplies the lr by k",
            "sqrt": f"{ratio}; the square-root rule multiplies the lr by √k = {math.sqrt(k):.4g}"}[rule]


def _representable(name: str, value: float, field: str, reference: float, factor: float) -> float:
    """``value`` when it is a positive finite float; a sentence when the scaling overflowed or underflowed."""
    if not 0 < value < math.inf:
        raise UsageError(f"the planned {name}, {{{field}}} {reference:g} × {factor:.4g}, comes out as {value:g}, "
                         f"which no optimizer can use: check {{{field}}}")
    return value


def _adam(reference: Reference, rule: PlanRule, k: float, multiplier: float, reasons: dict[str, str],
          warnings: list[str]) -> dict[str, Any]:
    """Adam's betas, eps and weight decay at k× the reference's batch (all None for SGD)."""
    if reference.optimizer == "sgd":
        return {"betas": None, "eps": None, "weight_decay": None}
    betas, eps = reference.betas, reference.eps
    if k != 1 and rule == "none":
        reasons["betas"] = reasons["eps"] = "kept as given: {target.rule} none scales nothing"
    elif k != 1:
        betas = scaling.adam_betas(k, reference.betas)
        reasons["betas"] = _betas_reason(reference, k, betas)
        reasons["eps"] = "kept as given: ε' = ε/√k goes with the square-root rule's lr (Malladi et al. 2022)"
    if k != 1 and rule == "sqrt":
        eps = _representable("Adam eps", scaling.adam_sqrt_eps(k, eps), "reference.eps", eps, 1 / math.sqrt(k))
        reasons["eps"] = f"the square-root rule's (Malladi et al. 2022): ε' = ε/√k = ε/{math.sqrt(k):.4g}"
    elif k != 1 and rule == "linear":
        warnings.append("the linear rule is derived for SGD; Adam usually scales better with {target.rule} sqrt "
                        "(Malladi et al. 2022)")
    return {"betas": betas, "eps": eps, "weight_decay": _weight_decay(reference, rule, k, multiplier, reasons)}


def _betas_reason(reference: Reference, k: float, betas: tuple[float, float]) -> str:
    (beta1, beta2), batch = reference.betas, reference.global_batch_size
    samples = scaling.half_life_steps(beta2) * batch
    return (f"β₁ kept at {beta1:g}, which works at every batch size (Marek et al. 2025, \"Small batch size training "
            f"for language models\"); β₂' = β₂^k = {beta2:g}^{k:g} = {betas[1]:.4g} keeps its half-life at "
            f"{samples:,.0f} samples (Malladi et al.'s 1 − β' = k(1 − β) to first order, never negative)")


def _weight_decay(reference: Reference, rule: PlanRule, k: float, multiplier: float, reasons: dict[str, str]) -> float:
    """λ' from the constant-timescale rule for AdamW; Adam's coupled L2 term as given."""
    decay = reference.weight_decay
    if reference.optimizer == "adam":
        reasons["weight_decay"] = ("Adam's weight decay is an L2 term in the gradient (coupled), which Adam's "
                                   "normalisation rescales: kept as given; the constant-timescale rule applies to "
                                   "AdamW's decoupled decay ({reference.optimizer} adamw)")
        return decay
    if decay == 0 or rule == "none" or k == 1:
        why = ("no decay to rescale" if decay == 0 else "{target.rule} none scales nothing" if rule == "none"
               else "the global batch and lr are unchanged")
        reasons["weight_decay"] = f"kept as given: {why}"
        return decay
    reasons["weight_decay"] = (f"AdamW's weights average over 1/(η·λ) steps; keeping that timescale constant in "
                               f"epochs (Wang & Aitchison 2024; Bergsma et al. 2025, \"Power Lines\") gives "
                               f"λ' = λ·(B'/B)·(η/η') = {decay:g} × {k:g} / {multiplier:.4g}")
    return scaling.adamw_weight_decay(decay, batch_ratio=k, lr_ratio=multiplier)


def _adamw_timescale(reference: Reference, data: Data, global_batch: int, lr_fields: dict[str, Any],
                     reasons: dict[str, str]) -> dict[str, Any]:
    """AdamW's averaging timescale in epochs, τ = B/(η·λ·N), with the reference's beside it (in steps without N)."""
    lr, decay = lr_fields["lr"], lr_fields["weight_decay"]
    if reference.optimizer != "adamw" or not decay:
        return {"adamw_timescale_epochs": None}
    steps = scaling.adamw_timescale_steps(lr=lr, weight_decay=decay)
    if data.dataset_size is None:
        reasons["weight_decay"] += (f"; the weights average over 1/(η·λ) = {steps:,.0f} steps (pass "
                                    "{data.dataset_size} for epochs)")
        return {"adamw_timescale_epochs": None}
    n = data.dataset_size
    epochs = scaling.adamw_timescale_epochs(lr=lr, weight_decay=decay, global_batch_size=global_batch, dataset_size=n)
    was = scaling.adamw_timescale_epochs(lr=reference.lr, weight_decay=reference.weight_decay,
                                         global_batch_size=reference.global_batch_size, dataset_size=n)
    same = math.isclose(epochs, was, rel_tol=1e-9)
    reasons["adamw_timescale_epochs"] = (f"B/(η·λ·N) = {global_batch}/({lr:.4g} × {decay:.4g} × {n}): the weights "
                                         f"average over the last {steps:,.0f} steps"
                                         + ("; the reference's too" if same else f"; the reference's: {was:.4g}"))
    return {"adamw_timescale_epochs": epochs}


def _batch_reasons(reference: Reference, target: Target, mode: str, batch: int, accumulation: int,
                   global_batch: int, k: float) -> dict[str, str]:
    ranks = _ranks(target) if target.model_parallel_size == 1 else f"data-parallel degree {target.data_parallel_size}"
    reasons = {
        "reference_global_batch_size": _reference_formula(reference),
        "world_size": f"{count(target.devices, 'device')} × {count(target.nodes, 'node')}, "
                      f"one {target.notes.label} process per device",
        "global_batch_size": f"{batch} per device × {ranks} × {count(accumulation, 'accumulation step')}",
    }
    if target.model_parallel_size > 1 or target.notes.accumulation:
        reasons["data_parallel_size"] = _data_parallel_reason(target)
    if mode == "trajectory":
        reasons["per_device_batch_size"] = (
            f"keep trajectory: reach the reference's global batch of {reference.global_batch_size} exactly"
            + (f" within {{target.max_batch_size_per_device}} {target.max_batch_size_per_device}"
               if target.max_batch_size_per_device else ""))
        reasons["accumulation_steps"] = (f"the fewest accumulation steps that reach {global_batch} with "
                                         f"{batch} per device on {_ranks(target)}")
    else:
        reasons.update(_per_device_reasons(reference, target, batch, accumulation, k))
    if accumulation > 1 and target.notes.accumulation:
        reasons["accumulation_steps"] += f"; {target.notes.accumulation}"
    return reasons


def _data_parallel_reason(target: Target) -> str:
    """Which ranks add samples, and what the strategy does over them."""
    dp = target.data_parallel_size
    if target.model_parallel_size == 1:
        why = f"data-parallel degree {dp} = {count(target.world_size, 'rank')}, each loading its own batch"
    else:
        roles = [role for size, role in ((target.tensor_parallel_size, "tp ranks split each layer"),
                                         (target.pipeline_parallel_size, "pp ranks hold successive stages"),
                                         (target.context_parallel_size, "cp ranks split each sequence")) if size > 1]
        why = (f"data-parallel degree {dp} = {_mesh_division(target)}: {', '.join(roles)} of the same samples, "
               "adding none to the batch")
    why += f"; {target.notes.over_data_parallel}"
    replicate, shard = target.notes.split(dp, target.data_parallel_replicate_size)
    if target.notes.takes_replicate and replicate is None:
        return why + " (pass {target.data_parallel_replicate_size} to show the split)"
    if target.notes.takes_replicate:
        return (why + f": replicate {replicate} × shard {shard} (shard degree = {dp} ÷ "
                      f"{{target.data_parallel_replicate_size}} {replicate})")
    return why


def _mesh_division(target: Target | Reference) -> str:
    """"16 ranks ÷ tp 2", "16 ranks ÷ (tp 2 × cp 2)": how the world divides into data-parallel ranks."""
    parts = [f"{name} {size}" for name, size in (("tp", target.tensor_parallel_size),
                                                 ("pp", target.pipeline_parallel_size),
                                                 ("cp", target.context_parallel_size)) if size > 1]
    shared = parts[0] if len(parts) == 1 else f"({' × '.join(parts)})"
    return f"{count(target.devices * target.nodes, 'rank')} ÷ {shared}"


def _per_device_reasons(reference: Reference, target: Target, batch: int, accumulation: int,
                        k: float) -> dict[str, str]:
    limit = target.max_batch_size_per_device
    within = f" with at most {limit} per device" if limit else ""
    grows = _growth(reference, target, accumulation, k)
    split = f"the fewest accumulation steps that reach {batch * accumulation} samples per rank{within}"
    if target.per_device_batch_size:
        batch_reason = "given by {target.per_device_batch_size}"
        accumulation_reason = split if target.global_batch_size else "kept from the reference"
    elif target.global_batch_size:
        batch_reason = f"{{target.global_batch_size}} {target.global_batch_size} over {_ranks(target)}{within}"
        accumulation_reason = split
    elif batch != reference.batch_per_device:
        batch_reason = (f"keep per-device: the reference's {batch * accumulation} samples per rank per step, in "
                        f"micro-batches that fit {{target.max_batch_size_per_device}} {limit}; the global batch "
                        f"{grows}")
        accumulation_reason = split
    else:
        batch_reason = f"keep per-device: the reference's per-device batch, so the global batch {grows}"
        accumulation_reason = "kept from the reference"
    given = "given by {target.accumulation_steps}"
    return {"per_device_batch_size": batch_reason,
            "accumulation_steps": given if target.accumulation_steps else accumulation_reason}


def _growth(reference: Reference, target: Target, accumulation: int, k: float) -> str:
    """How the global batch changes at the reference's per-device batch: with the data-parallel degree."""
    if k == 1:
        return "stays the same"
    changes = [f"{name} {was} → {now}" for name, was, now in (
        ("data-parallel degree", reference.data_parallel_size, target.data_parallel_size),
        ("accumulation steps", reference.accumulation_steps, accumulation)) if was != now]
    meshed = max(reference.model_parallel_size, target.model_parallel_size) > 1
    if not changes or (not meshed and accumulation == reference.accumulation_steps):
        return f"grows ×{k:g} with the hardware"
    return f"grows ×{k:g}: {', '.join(changes)}" + (" (not the world size)" if meshed else "")


def _reference_formula(reference: Reference) -> str:
    if reference.wrapper == "dp":
        return (f"DataParallel splits the loader batch of {reference.per_device_batch_size} across "
                f"{count(reference.devices, 'device')} and computes one loss on the gathered batch: global batch = "
                f"{reference.per_device_batch_size} × {count(reference.accumulation_steps, 'accumulation step')}")
    if reference.model_parallel_size > 1:
        return (f"{reference.per_device_batch_size} per device × data-parallel degree {reference.data_parallel_size} "
                f"({_mesh_division(reference)}) × {count(reference.accumulation_steps, 'accumulation step')}")
    return (f"{reference.per_device_batch_size} per device × {count(reference.devices * reference.nodes, 'device')} × "
            f"{count(reference.accumulation_steps, 'accumulation step')}")


def _steps(data: Data, target: Target, batch: int, accumulation: int, global_batch: int, lr_fields: dict[str, Any],
           warnings: list[str]) -> dict[str, Any]:
    multiplier = lr_fields["lr_multiplier"]
    warmup = multiplier >= data.warmup_threshold
    out: dict[str, Any] = {"warmup_recommended": warmup}
    length = count(data.warmup_steps, "step") if data.warmup_steps is not None else count(data.warmup_epochs, "epoch")
    reasons = {"warmup_recommended": (
        f"the lr grows ×{multiplier:.4g} ≥ {{data.warmup_threshold}} {data.warmup_threshold:g}: ramp linearly from the "
        f"reference lr over {length} (Goyal et al. 2017)" if warmup else
        f"the lr multiplier {multiplier:.4g} is below {{data.warmup_threshold}} {data.warmup_threshold:g}: no warmup "
        "needed")}
    keys = ("samples_per_rank", "padded_samples", "dropped_samples", "loader_batches_per_rank",
            "steps_per_epoch", "total_steps", "samples_per_epoch")
    if data.dataset_size is None:
        out.update(dict.fromkeys(keys))
        reasons["steps_per_epoch"] = "pass {data.dataset_size} for step counts"
    else:
        out.update(_epoch_arithmetic(data, target, batch, accumulation, reasons))
        if out["samples_per_rank"] < batch * accumulation:
            # One epoch's share is less than one step's: every step is short, so the global batch is not what it says.
            seen = out["samples_per_rank"] * target.data_parallel_size
            share = f"{{target.per_device_batch_size}} {batch} × {count(accumulation, 'accumulation step')}"
            warnings.append(f"each {_rank(target)} holds {out['samples_per_rank']} samples per epoch, fewer than one "
                            f"optimizer step's share ({share}): every step sees at most {seen} samples, not the "
                            f"global batch {global_batch}; lower {{target.per_device_batch_size}} or use more data")
    out.update(_warmup(data, warmup, out["steps_per_epoch"], out["total_steps"], lr_fields["lr"], reasons, warnings))
    out.update(_critical(data, global_batch, reasons))
    return {**out, "reasons": reasons}


def _warmup(data: Data, recommended: bool, steps_per_epoch: int | None, total: int | None, lr: float,
            reasons: dict[str, str], warnings: list[str]) -> dict[str, Any]:
    """The warmup length ``lr_lambda`` ramps over, in steps and epochs; never past the end of the run."""
    in_epochs = None
    if data.warmup_steps is not None:
        steps, why = int(data.warmup_steps), "given by {data.warmup_steps}"
    elif not recommended:
        return {"warmup_steps": None, "warmup_epochs": None}
    elif steps_per_epoch is None:
        reasons["warmup_steps"] = (f"pass {{data.dataset_size}} (to count {count(data.warmup_epochs, 'warmup epoch')} "
                                   "in steps) or {data.warmup_steps}")
        warnings.append("warmup is recommended but its length in steps is unknown: pass {data.dataset_size} or "
                        "{data.warmup_steps}; until then lr_lambda and scheduler() raise rather than skip the warmup")
        return {"warmup_steps": None, "warmup_epochs": data.warmup_epochs}
    else:
        steps = scaling.warmup_steps(warmup_epochs=data.warmup_epochs, steps_per_epoch=steps_per_epoch)
        in_epochs = data.warmup_epochs
        why = f"{count(data.warmup_epochs, 'warmup epoch')} × {count(steps_per_epoch, 'step')} per epoch"
    if total is not None and 0 < total <= steps:
        # A ramp that outlasts the run never reaches the planned lr: clamp it, and say so.
        warnings.append(f"a warmup of {steps:,} steps ({why}) does not end before the {total:,}-step run "
                        f"({count(data.epochs, 'epoch')}) does: clamped to {total:,} steps, so the lr climbs all run "
                        f"and never reaches {lr:.4g}; pass the run's real {{data.epochs}}, or a shorter "
                        "{data.warmup_epochs} or {data.warmup_steps}")
        why, steps, in_epochs = f"{why} = {steps:,}, clamped to the run's {total:,} steps", total, None
    reasons["warmup_steps"] = why
    if in_epochs is None and steps_per_epoch:
        in_epochs = steps / steps_per_epoch
    return {"warmup_steps": steps, "warmup_epochs": in_epochs}


def _epoch_arithmetic(data: Data, target: Target, batch: int, accumulation: int,
                      reasons: dict[str, str]) -> dict[str, Any]:
    # DistributedSampler's num_replicas is the data-parallel degree: ranks that share samples share a shard.
    n, world = data.dataset_size, target.data_parallel_size
    if n < world:
        raise UsageError(f"{{data.dataset_size}} {n} is smaller than the {_ranks_noun(target)} {world}: some ranks "
                         "would get no data")
    per_rank = scaling.samples_per_rank(n, world_size=world, drop_last=data.sampler_drop_last)
    padded = 0 if data.sampler_drop_last else scaling.padded_samples(n, world_size=world)
    dropped = scaling.sampler_dropped_samples(n, world_size=world) if data.sampler_drop_last else 0
    batches = scaling.loader_batches(per_rank, batch_size=batch, drop_last=data.drop_last)
    if batches == 0:
        raise UsageError(f"each rank gets {per_rank} samples, fewer than one batch of {batch} with {{data.drop_last}}: "
                         "lower {target.per_device_batch_size} or drop {data.drop_last}")
    loader_dropped = (per_rank - batches * batch) * world if data.drop_last else 0
    steps = scaling.optimizer_steps(loader_batches=batches, accumulation_steps=accumulation)
    total = math.ceil(steps * data.epochs)
    seen = (per_rank * world) - loader_dropped
    reasons.update({
        "samples_per_rank": (f"DistributedSampler drop_last=True gives floor({n}/{world})" if data.sampler_drop_last
                             else f"DistributedSampler gives each {_rank(target)} ceil({n}/{world}), padding by "
                                  "repetition"),
        "padded_samples": "samples repeated so every rank gets the same count (0 with {data.sampler_drop_last})",
        "dropped_samples": "samples never seen in an epoch: the sampler's tail with {data.sampler_drop_last}, "
                           "each rank's last partial batch with {data.drop_last}",
        "loader_batches_per_rank": f"{per_rank} samples in batches of {batch}"
                                   + (", the last partial batch dropped" if data.drop_last
                                      else ", the last may be partial"),
        "steps_per_epoch": f"ceil({count(batches, 'loader batch', 'loader batches')} / "
                           f"{count(accumulation, 'accumulation step')})"
                           + ("; a final partial accumulation window still makes an optimizer step, as in Lightning "
                              "and the Hugging Face Trainer" if batches % accumulation else ""),
        "total_steps": f"{count(steps, 'step')} per epoch × {count(data.epochs, 'epoch')}",
        "samples_per_epoch": "samples the ranks process per epoch, repeats included",
    })
    return {"samples_per_rank": per_rank, "padded_samples": padded, "dropped_samples": dropped + loader_dropped,
            "loader_batches_per_rank": batches, "steps_per_epoch": steps, "total_steps": total,
            "samples_per_epoch": seen}


def _critical(data: Data, global_batch: int, reasons: dict[str, str]) -> dict[str, Any]:
    if data.critical_batch_size is None:
        return {"steps_factor": None, "compute_factor": None}
    crit = data.critical_batch_size
    reasons["steps_factor"] = f"1 + B_crit/B = 1 + {crit:g}/{global_batch}: steps relative to the fewest possible"
    reasons["compute_factor"] = f"1 + B/B_crit = 1 + {global_batch}/{crit:g}: samples relative to the fewest possible"
    return {"steps_factor": scaling.steps_factor(global_batch, crit),
            "compute_factor": scaling.compute_factor(global_batch, crit)}


def _semantics_warnings(reference: Reference, target: Target, global_batch: int, data: Data) -> list[str]:
    warnings = []
    dp = target.data_parallel_size
    if reference.reduction == "sum" and dp > 1:
        # torchtitan's FSDP2 reduces over dp_shard_cp: context-parallel ranks join the average.
        with_cp = (f" (1/{dp * target.context_parallel_size} where the context-parallel ranks join the average, as in "
                   "torchtitan)" if target.context_parallel_size > 1 else "")
        warnings.append(f"reduction='sum': {target.notes.label} averages gradients over {_rank(target)}s, so its "
                        f"gradient is 1/{dp} of the single-process sum{with_cp}; multiply the loss by the "
                        f"{_ranks_noun(target)}, or use a mean-reduced loss")
    if reference.reduction == "sum" and reference.wrapper == "ddp" and reference.data_parallel_size > 1:
        warnings.append(f"the reference itself ran DDP with a summed loss: its gradients were already 1/"
                        f"{reference.data_parallel_size} of the sum")
    if data.critical_batch_size and global_batch > 2 * data.critical_batch_size:
        warnings.append(f"the global batch {global_batch} is well past the critical batch size "
                        f"{data.critical_batch_size:g}: predicted "
                        f"{scaling.steps_factor(global_batch, data.critical_batch_size):.2f}× the minimum steps and "
                        f"{scaling.compute_factor(global_batch, data.critical_batch_size):.2f}× the minimum compute; "
                        "larger batches buy little speed")
    return warnings


def _other_mode(mode: Keep, reference: Reference, target: Target, lr_source: LrSource | None) -> str:
    other = "per-device" if mode == "trajectory" else "trajectory"
    try:
        alternative = _plan(reference, dataclasses.replace(
            target, keep=other, global_batch_size=None,
            per_device_batch_size=None if other == "trajectory" else target.per_device_batch_size), Data(),
            lr_source, describe_other=False)
    except UsageError as exc:
        return f"{{target.keep}} {other} is not possible here: {exc.template}"
    return (f"{{target.keep}} {other} would give {alternative.per_device_batch_size} per device × "
            f"{alternative.accumulation_steps} accumulation (global {alternative.global_batch_size}) "
            f"at lr {alternative.lr:.4g}")
