"""What a study trains and when a run has arrived (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Literal, get_args

from ddplab.errors import UsageError
from ddplab.runtime.config import ParallelismConfig
from ddplab.study.rules import registry
from ddplab.validation import at_least, one_of, positive, within, zero_or_more

FIXED_RULES: tuple[str, ...] = registry.defaults("sgd")
"""SGD's default rules: those that train at a fixed lr and batch."""
ADAM_RULES: tuple[str, ...] = registry.defaults("adam")
"""Adam's and AdamW's default: the fixed ones and the rules that scale the betas and eps with the batch."""
Family = Literal["sgd", "adam", "adamw"]
FAMILIES: tuple[Family, ...] = get_args(Family)
TargetKind = Literal["accuracy", "loss"]
Dtype = Literal["float32", "float64"]
Engine = Literal["auto", "vmap", "ddp", "fastest"]
Device = Literal["auto", "cpu", "cuda"]
DEFAULT_BATCHES = (8, 16, 32, 64, 128, 256, 512, 1024)
WORKLOADS = ("digits", "mnist1d", "charlm", "regression")
"""The built-in workloads (``--workload``)."""
UNCACHED_FIELDS = ("global_batch_sizes", "rules", "max_runs", "noise_scale", "schedule", "rules_lr",
                   "reference_trained_for", "seeds")
"""The StudyConfig fields a cached run does not depend on: the surge rule's lrs follow noise_scale and every rule's
follow rules_lr, and runs are found by lr; the schedule rule's runs are cached by the schedule's digest."""
DEFAULT_ACCURACY = 0.95
"""The built-in workload's target, when none is given."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """When a run has arrived."""

    kind: TargetKind
    """accuracy: the metric must reach ``value`` from below; loss: from above."""
    value: float

    def __post_init__(self):
        if self.kind == "accuracy":
            within("target.accuracy", self.value, "(0, 1]")
        if self.kind == "loss":
            positive("target.loss", self.value)

    def reached(self, metric: float) -> bool:
        return metric >= self.value if self.kind == "accuracy" else metric <= self.value

    def to_json(self) -> dict:
        return {"kind": self.kind, "value": self.value}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer every run trains with (its lr comes from the rule): torch.optim's SGD, Adam or AdamW."""

    family: Family = "sgd"
    """The optimizer family every run trains with (default: the spec's optimizer(), else sgd)."""
    momentum: float = 0.9
    """SGD momentum."""
    dampening: float = 0.0
    """SGD dampening."""
    nesterov: bool = False
    """SGD with Nesterov momentum."""
    weight_decay: float = 0.0
    """Weight decay as torch.optim applies it: an L2 penalty added to the gradient (SGD, Adam) or decoupled
    (AdamW)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW betas as B1,B2."""
    eps: float = 1e-8
    """Adam/AdamW epsilon."""

    def __post_init__(self):
        one_of("optimizer.family", self.family, FAMILIES)
        within("optimizer.momentum", self.momentum, "[0, 1)")
        within("optimizer.dampening", self.dampening, "[0, 1]")
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise UsageError("{optimizer.nesterov} needs momentum above 0 and no dampening (as torch.optim.SGD)")
        zero_or_more("optimizer.weight_decay", self.weight_decay)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UsageError(f"{{optimizer.betas}} must be two numbers in [0, 1), got {self.betas}")
        positive("optimizer.eps", self.eps)
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
    """Global batch sizes to measure, comma-separated."""
    rules: tuple[str, ...] | None = None
    """lr rules, comma-separated (default: the rules the optimizer's family runs by default); each rule says what it
    is in its own module under ddplab.study.rules (:func:`ddplab.study.rules.help_line` joins them)."""
    reference_global_batch_size: int = 32
    """The reference's global batch, which the rules scale from."""
    reference_lr: float = 0.1
    """Learning rate at the reference global batch, where the tuned sweep is laid out around it."""
    rules_lr: float | None = None
    """The lr the rules scale from at the reference batch (default: the tuned sweep's best lr there, which trains
    before the other batches; ``reference_lr`` where the study runs no sweep there). ``--ref-lr`` sets it too."""
    seeds: int = 3
    """Seeds per grid point: model init and data order."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer's family and hyperparameters (the lr is the rules')."""
    max_steps: int = 3000
    """Step budget per run; a run that has not reached the target by then is 'not reached'."""
    eval_every: int = 5
    """Evaluate every K optimizer steps."""
    patience: int = 100
    """Stop a run whose metric has not improved on its best for this many evaluations (0: never): a run stuck at
    chance need not spend the whole step budget. It counts as not reached, flagged ``stalled``."""
    sweep_factor: float = 2.0
    """Spacing of the tuned lr sweep (2: factors of 2)."""
    sweep_margin: float = 4.0
    """The tuned sweep spans the constant and linear rules' lrs, widened by this factor."""
    max_runs: int = 1000
    """At most this many fixed-lr runs: the grid must fit, and a sweep whose best lr sits on its edge extends
    past it (``sweep_factor`` at a time, until the best is interior) only while they last."""
    dtype: Dtype = "float32"
    """Training precision."""
    noise_scale: float | None = None
    """the surge rule's B_noise, in samples (default: the B_simple the study measures along the best tuned runs at
    the reference batch)."""
    schedule: str | None = None
    """the schedule rule's batch schedule: a branched.json or schedule.json path, or a Megatron-style string such as
    '0:32 416:64' (samples seen:global batch)."""
    reference_trained_for: tuple[str, ...] = ()
    """Set by the study, not an option: the rules that measure at the reference batch, for which it was added to
    ``global_batch_sizes``."""

    def __post_init__(self):
        if self.rules is None:
            object.__setattr__(self, "rules", registry.defaults(self.optimizer.family))
        if not self.global_batch_sizes or any(b < 1 for b in self.global_batch_sizes):
            raise UsageError("{global_batch_sizes} must be positive integers")
        _check_rules(self)
        for field in ("reference_global_batch_size", "max_runs", "seeds", "max_steps", "eval_every"):
            at_least(field, getattr(self, field))
        zero_or_more("patience", self.patience)
        positive("reference_lr", self.reference_lr)
        if self.rules_lr is not None:
            positive("rules_lr", self.rules_lr)
        if self.noise_scale is not None:
            positive("noise_scale", self.noise_scale)
        if not self.sweep_factor > 1 or not self.sweep_margin >= 1:
            raise UsageError("{sweep_factor} must be above 1 and {sweep_margin} at least 1")
        if self.dtype not in get_args(Dtype):
            raise UsageError(f"{{dtype}} must be float32 or float64, got {self.dtype!r}")

    @property
    def scale_lr(self) -> float:
        """The lr the rules scale from: ``rules_lr`` once known, else ``reference_lr``."""
        return self.reference_lr if self.rules_lr is None else self.rules_lr

    def settings(self, workload_fingerprint: str) -> dict:
        """What a cached run depends on, by field: the workload (its content) and every training setting."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in UNCACHED_FIELDS}
        return json.loads(json.dumps({"workload": workload_fingerprint, **fields}, sort_keys=True, default=str))

    def fingerprint(self, workload_fingerprint: str) -> str:
        """A short hash of :meth:`settings`."""
        settings = self.settings(workload_fingerprint)
        workload = settings.pop("workload")
        return hashlib.sha256(json.dumps([workload, settings], sort_keys=True).encode()).hexdigest()[:16]


def _check_rules(config: StudyConfig) -> None:
    if not config.rules or any(name not in registry.known() for name in config.rules):
        raise UsageError(f"{{rules}} must be among {', '.join(registry.known())}")
    _add_reference_batch(config)
    for rule in registry.of(config):
        rule.check(config)


def _add_reference_batch(config: StudyConfig) -> None:
    """The reference batch joins the grid where a rule measures there (surge's B_noise) and the grid left it out."""
    needing = tuple(rule.name for rule in registry.of(config) if rule.measures_at_reference(config))
    added = config.reference_global_batch_size not in config.global_batch_sizes
    if needing and added:
        batches = tuple(sorted((*config.global_batch_sizes, config.reference_global_batch_size)))
        object.__setattr__(config, "global_batch_sizes", batches)
    # Kept through dataclasses.replace, whose grid already holds the batch this config added.
    object.__setattr__(config, "reference_trained_for", needing if added or config.reference_trained_for else ())


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
class StudyOptions(ParallelismConfig):
    """Where a study keeps its results, what trains the grid (the engine; on the DDP engine, the ranks' parallelism
    strategy) and what it does besides."""

    out: str = "study-out"
    """Directory for the cache, plots, study.json and report.html."""
    fresh: bool = False
    """Discard cached runs in ``out`` and start over."""
    plots: bool = True
    """Write the PNG plots and the HTML report (needs matplotlib)."""
    verify_ddp: int = 0
    """Re-run K grid points through real DDP ranks after the study and report the largest difference (0: none)."""
    verify_world_size: int = 2
    """Ranks for ``verify_ddp``."""
    verify_steps: int = 20
    """Steps per ``verify_ddp`` point."""
    threads: int = 1
    """torch intra-op threads while training (the runs are already batched, and small models lose more to thread
    hand-offs than they gain)."""
    engine: Engine = "auto"
    """vmap: a batch size's runs train at once in one process, vectorized; ddp: each run on ``world_size`` real DDP
    ranks, one launch per batch size (a spec's own step(), any optimizer, torchrun across nodes); auto: vmap where the
    spec, the strategy and the launcher allow it, else ddp, a fixed choice so the same command gives the same numbers
    on any machine; fastest: where both can, a step timed both ways at each batch size picks the faster (the numbers
    then follow the machine's load: the engines agree within float32 rounding, which an unstable lr can grow into
    other steps to target); the report says which and why."""
    world_size: int = 2
    """Ranks of the DDP engine (under torchrun: torchrun's)."""
    max_batch_size_per_device: int | None = None
    """The DDP engine's largest loader batch per rank: a larger share of a global batch accumulates over
    micro-batches (default: no cap)."""
    device: Device = "auto"
    """Where runs train: auto (CUDA when torch sees it; the DDP engine then uses NCCL), cpu or cuda."""
    compare: str | None = None
    """Another study's study.json (another optimizer, say): compare_lr.png draws both best lrs per batch, each
    beside its rule's prediction (linear for SGD, square root for Adam)."""

    def __post_init__(self):
        ParallelismConfig.__post_init__(self)
        one_of("engine", self.engine, get_args(Engine))
        one_of("device", self.device, get_args(Device))
        if not self.world_size >= 1 or not (self.max_batch_size_per_device or 1) >= 1:
            raise UsageError("{world_size} and {max_batch_size_per_device} must be at least 1")
        for field in ("verify_world_size", "verify_steps", "threads"):
            at_least(field, getattr(self, field))
        zero_or_more("verify_ddp", self.verify_ddp)
