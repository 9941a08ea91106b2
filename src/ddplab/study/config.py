"""What a study trains and when a run has arrived (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Literal, get_args

from ddplab.errors import UsageError

FIXED_RULES: tuple[str, ...] = ("constant", "linear", "sqrt", "tuned")
"""SGD's default rules: those that train at a fixed lr and batch."""
ADAM_RULES: tuple[str, ...] = ("constant", "linear", "sqrt", "adam-sqrt", "tuned")
"""Adam's and AdamW's default: ``adam-sqrt`` scales the betas and eps with the batch, as ``ddplab plan`` does."""
Family = Literal["sgd", "adam", "adamw"]
FAMILIES: tuple[Family, ...] = get_args(Family)
TargetKind = Literal["accuracy", "loss"]
Dtype = Literal["float32", "float64"]
Engine = Literal["auto", "vmap", "ddp"]
Device = Literal["auto", "cpu", "cuda"]
DEFAULT_BATCHES = (8, 16, 32, 64, 128, 256, 512, 1024)
WORKLOADS = ("digits", "mnist1d", "charlm")
"""The built-in workloads (``--workload``)."""
DEFAULT_ACCURACY = 0.95
"""The built-in workload's target, when none is given."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """When a run has arrived."""

    kind: TargetKind
    """accuracy: the metric must reach ``value`` from below; loss: from above."""
    value: float

    def __post_init__(self):
        if self.kind == "accuracy" and not 0 < self.value <= 1:
            raise UsageError(f"{{target.accuracy}} must be in (0, 1], got {self.value}")
        if self.kind == "loss" and not 0 < self.value < math.inf:
            raise UsageError(f"{{target.loss}} must be a positive number, got {self.value}")

    def reached(self, metric: float) -> bool:
        return metric >= self.value if self.kind == "accuracy" else metric <= self.value

    def to_json(self) -> dict:
        return {"kind": self.kind, "value": self.value}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer every run trains with (its lr comes from the rule): torch.optim's SGD, Adam or AdamW."""

    family: Family = "sgd"
    momentum: float = 0.9
    """SGD momentum."""
    dampening: float = 0.0
    """SGD dampening."""
    nesterov: bool = False
    """SGD Nesterov momentum."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient (SGD, Adam) or decoupled decay (AdamW), as torch.optim applies it."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW betas."""
    eps: float = 1e-8
    """Adam/AdamW epsilon."""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UsageError(f"{{optimizer.family}} must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"{{optimizer.momentum}} must be in [0, 1), got {self.momentum}")
        if not 0 <= self.dampening <= 1:
            raise UsageError(f"{{optimizer.dampening}} must be in [0, 1], got {self.dampening}")
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise UsageError("{optimizer.nesterov} needs momentum above 0 and no dampening (as torch.optim.SGD)")
        if not 0 <= self.weight_decay < math.inf:
            raise UsageError(f"{{optimizer.weight_decay}} must be zero or more, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UsageError(f"{{optimizer.betas}} must be two numbers in [0, 1), got {self.betas}")
        if not 0 < self.eps < math.inf:
            raise UsageError(f"{{optimizer.eps}} must be a positive number, got {self.eps}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    @property
    def adam(self) -> bool:
        return self.family in ("adam", "adamw")

    @property
    def name(self) -> str:
        return {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[self.family]

    def to_json(self) -> dict:
        if self.adam:
            return {"family": self.family, "name": self.name, "betas": list(self.betas), "eps": self.eps,
                    "weight_decay": self.weight_decay}
        return {"family": self.family, "name": self.name, "momentum": self.momentum, "dampening": self.dampening,
                "nesterov": self.nesterov, "weight_decay": self.weight_decay}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """The grid and how each run is trained."""

    target: Target
    """When a run has reached the result."""
    global_batch_sizes: tuple[int, ...] = DEFAULT_BATCHES
    """Global batch sizes to measure."""
    rules: tuple[str, ...] | None = None
    """lr rules to run (default: FIXED_RULES for SGD, ADAM_RULES for Adam and AdamW); ``adascale`` adds AdaScale
    runs from the reference lr at every batch from the reference up, ``ramp`` one BatchRamp run per seed from the
    smallest batch."""
    reference_global_batch_size: int = 32
    """Reference global batch the rules scale from."""
    reference_lr: float = 0.1
    """Learning rate at the reference global batch."""
    seeds: int = 3
    """Seeds per grid point: model init and data order."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer's family and hyperparameters (the lr is the rules')."""
    max_steps: int = 3000
    """Step budget per run; a run that has not reached the target by then is 'not reached'."""
    eval_every: int = 5
    """Evaluate every k optimizer steps."""
    patience: int = 100
    """Stop a run whose metric has not improved on its best for this many evaluations (0: never): a run stuck at
    chance need not spend the whole step budget. It counts as not reached, flagged ``stalled``."""
    sweep_factor: float = 2.0
    """Spacing of the tuned sweep."""
    sweep_margin: float = 4.0
    """The tuned sweep spans the constant and linear rules' lrs, widened by this factor."""
    max_runs: int = 1000
    """At most this many fixed-lr runs: the grid must fit, and a sweep whose best lr sits on its edge extends
    past it (``sweep_factor`` at a time, until the best is interior) only while they last."""
    dtype: Dtype = "float32"
    """Training precision."""

    def __post_init__(self):
        if self.rules is None:
            object.__setattr__(self, "rules", ADAM_RULES if self.optimizer.adam else FIXED_RULES)
        if not self.global_batch_sizes or any(b < 1 for b in self.global_batch_sizes):
            raise UsageError("{global_batch_sizes} must be positive integers")
        _check_rules(self)
        for field, value in (("reference_global_batch_size", self.reference_global_batch_size),
                             ("max_runs", self.max_runs),
                             ("seeds", self.seeds), ("max_steps", self.max_steps), ("eval_every", self.eval_every)):
            if not value >= 1:
                raise UsageError(f"{{{field}}} must be at least 1, got {value}")
        if not self.patience >= 0:
            raise UsageError(f"{{patience}} must be zero or more, got {self.patience}")
        if not 0 < self.reference_lr < math.inf:
            raise UsageError(f"{{reference_lr}} must be a positive number, got {self.reference_lr}")
        if not self.sweep_factor > 1 or not self.sweep_margin >= 1:
            raise UsageError("{sweep_factor} must be above 1 and {sweep_margin} at least 1")
        if self.dtype not in get_args(Dtype):
            raise UsageError(f"{{dtype}} must be float32 or float64, got {self.dtype!r}")

    def settings(self, workload_fingerprint: str) -> dict:
        """What a cached run depends on, by field: the workload (its content) and every training setting."""
        fields = {k: v for k, v in dataclasses.asdict(self).items()
                  if k not in ("global_batch_sizes", "rules", "max_runs")}
        return json.loads(json.dumps({"workload": workload_fingerprint, **fields}, sort_keys=True, default=str))

    def fingerprint(self, workload_fingerprint: str) -> str:
        """A short hash of :meth:`settings`."""
        settings = self.settings(workload_fingerprint)
        workload = settings.pop("workload")
        return hashlib.sha256(json.dumps([workload, settings], sort_keys=True).encode()).hexdigest()[:16]


def _check_rules(config: StudyConfig) -> None:
    # The registry imports this module: it is read when a config is made, not when this module loads.
    from ddplab.study import rules

    if not config.rules or any(name not in rules.REGISTRY for name in config.rules):
        raise UsageError(f"{{rules}} must be among {', '.join(rules.REGISTRY)}")
    for rule in rules.of(config):
        rule.check(config)


def round_lr(lr: float) -> float:
    # Twelve significant digits: the same lr reached by two rules is one run.
    return float(f"{lr:.12g}")


def target_for(*, spec: str | None, accuracy: float | None = None, loss: float | None = None) -> Target:
    """The target asked for: a spec must say; the built-in workload defaults to accuracy 0.95."""
    if accuracy is not None and loss is not None:
        raise UsageError("give one target: {target.accuracy} or {target.loss}")
    if loss is not None:
        return Target(kind="loss", value=loss)
    if accuracy is None and spec:
        raise UsageError("a spec needs a target: {target.accuracy} A or {target.loss} L")
    return Target(kind="accuracy", value=DEFAULT_ACCURACY if accuracy is None else accuracy)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyOptions:
    """Where a study keeps its results and what it does besides training the grid."""

    out: str = "study-out"
    """Directory for the cache, plots, study.json and report.html."""
    fresh: bool = False
    """Discard cached runs in ``out`` and start over."""
    plots: bool = True
    """Write the PNG plots and the HTML report (needs matplotlib)."""
    verify_ddp: int = 0
    """Grid points to replay on real DDP ranks after the study (0: none)."""
    verify_world_size: int = 2
    """Ranks for verify_ddp."""
    verify_steps: int = 20
    """Steps per verify_ddp point."""
    threads: int = 1
    """torch intra-op threads while training (the runs are already batched; small models lose to hand-offs)."""
    engine: Engine = "auto"
    """vmap: every run of a batch size in one process, vectorized; ddp: each run on ``world_size`` real DDP ranks
    (a spec's own step(), any optimizer, torchrun across nodes); auto: where the spec allows both, a step timed
    both ways per batch size picks the faster (a model with buffers stays vectorized), else ddp."""
    world_size: int = 2
    """Ranks of the DDP engine (under torchrun: torchrun's)."""
    max_batch_size_per_device: int | None = None
    """The DDP engine's largest loader batch per rank; larger shares accumulate (None: no cap)."""
    device: Device = "auto"
    """Where runs train: auto (CUDA when available), cpu or cuda."""
    compare: str | None = None
    """Another study's study.json (another optimizer, say): its best lr per batch is drawn beside this one's, each
    with its own rule's prediction (compare_lr.png)."""

    def __post_init__(self):
        if self.engine not in get_args(Engine):
            raise UsageError(f"{{engine}} must be one of {', '.join(get_args(Engine))}, got {self.engine!r}")
        if self.device not in get_args(Device):
            raise UsageError(f"{{device}} must be one of {', '.join(get_args(Device))}, got {self.device!r}")
        if not self.world_size >= 1 or not (self.max_batch_size_per_device or 1) >= 1:
            raise UsageError("{world_size} and {max_batch_size_per_device} must be at least 1")
        for field, value in (("verify_world_size", self.verify_world_size), ("verify_steps", self.verify_steps),
                             ("threads", self.threads)):
            if not value >= 1:
                raise UsageError(f"{{{field}}} must be at least 1, got {value}")
        if not self.verify_ddp >= 0:
            raise UsageError(f"{{verify_ddp}} must be zero or more, got {self.verify_ddp}")
