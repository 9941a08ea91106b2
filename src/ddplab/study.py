"""``ddplab study``: steps to a target versus global batch, per lr rule, many runs trained at once.

A global batch B trains the same on W DDP ranks as in one process with B (DDP averages the
ranks' mean gradients), so the whole grid runs in one process: every run of one batch size is a
slice of stacked parameters, trained together through ``torch.func.vmap`` over
``functional_call`` — one forward and backward per step for all of them, never a loop over runs.
Each run's data order is DistributedSampler's (seed + epoch permutation, full batches only),
so :func:`verify_ddp` can replay any grid point on real DDP ranks and compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.func import functional_call, vmap

from ddplab import noise_estimators, study_fit

Rule = Literal["constant", "linear", "sqrt", "tuned"]
RULES: tuple[Rule, ...] = ("constant", "linear", "sqrt", "tuned")
DEFAULT_BATCHES = (8, 16, 32, 64, 128, 256, 512, 1024)
# A run whose training loss is not finite (or explodes past this) has diverged.
DIVERGED_LOSS = 1e6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """When a run has arrived."""

    kind: Literal["accuracy", "loss"]
    """accuracy: the metric must reach ``value`` from below; loss: from above."""
    value: float

    def __post_init__(self):
        if self.kind == "accuracy" and not 0 < self.value <= 1:
            raise ValueError(f"--target-accuracy must be in (0, 1], got {self.value}")
        if self.kind == "loss" and not self.value > 0:
            raise ValueError(f"--target-loss must be positive, got {self.value}")

    def reached(self, metric: float) -> bool:
        return metric >= self.value if self.kind == "accuracy" else metric <= self.value

    def to_json(self) -> dict:
        return {"kind": self.kind, "value": self.value}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What the study trains: a model, its data as tensors, a loss and how to evaluate."""

    name: str
    model: Callable[[], torch.nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor] | None = None
    """Validation inputs and targets, evaluated vectorized (accuracy or loss)."""
    evaluate: Callable[[torch.nn.Module, Any], float] | None = None
    """The spec's evaluate(model, dataset): called per run at each evaluation (slower)."""
    eval_dataset: Any = None

    @property
    def train_size(self) -> int:
        return int(self.train[0].shape[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """The grid and how each run is trained."""

    target: Target
    """When a run has reached the result (--target-accuracy / --target-loss)."""
    global_batch_sizes: tuple[int, ...] = DEFAULT_BATCHES
    """Global batch sizes (--batch-sizes)."""
    rules: tuple[Rule, ...] = RULES
    """lr rules to run (--rules)."""
    ref_batch_size: int = 32
    """Reference global batch the rules scale from (--ref-batch-size)."""
    ref_lr: float = 0.1
    """Learning rate at the reference batch (--ref-lr)."""
    seeds: int = 3
    """Seeds per grid point: model init and data order (--seeds)."""
    momentum: float = 0.9
    """SGD momentum (--momentum)."""
    max_steps: int = 3000
    """Step budget per run; a run that has not reached the target by then is 'not reached' (--max-steps)."""
    eval_every: int = 5
    """Evaluate every k optimizer steps (--eval-every)."""
    sweep_factor: float = 2.0
    """Spacing of the tuned sweep (--sweep-factor)."""
    sweep_margin: float = 4.0
    """The tuned sweep spans the constant and linear rules' lrs, widened by this factor (--sweep-margin)."""
    dtype: Literal["float32", "float64"] = "float32"
    """Training precision (--dtype)."""

    def __post_init__(self):
        if not self.global_batch_sizes or any(b < 1 for b in self.global_batch_sizes):
            raise ValueError("--batch-sizes must be positive integers")
        if len(set(self.global_batch_sizes)) < 2 and "tuned" in self.rules:
            raise ValueError("--batch-sizes needs at least two sizes for a fit")
        if not self.rules or any(r not in RULES for r in self.rules):
            raise ValueError(f"--rules must be among {', '.join(RULES)}")
        for flag, value in (("--ref-batch-size", self.ref_batch_size), ("--seeds", self.seeds),
                            ("--max-steps", self.max_steps), ("--eval-every", self.eval_every)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if not self.ref_lr > 0:
            raise ValueError(f"--ref-lr must be positive, got {self.ref_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not self.sweep_factor > 1 or not self.sweep_margin >= 1:
            raise ValueError("--sweep-factor must be above 1 and --sweep-margin at least 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == "float64" else torch.float32

    def rule_lr(self, rule: Rule, global_batch: int) -> float:
        """The lr a fixed rule gives at ``global_batch`` from the reference (batch, lr)."""
        k = global_batch / self.ref_batch_size
        return self.ref_lr * {"constant": 1.0, "linear": k, "sqrt": math.sqrt(k)}[rule]

    def sweep(self, global_batch: int) -> list[float]:
        """The tuned rule's lrs at ``global_batch``: a log grid through the reference lr, spanning both rules."""
        k = global_batch / self.ref_batch_size
        low, high = min(1.0, k) / self.sweep_margin, max(1.0, k) * self.sweep_margin
        step = math.log(self.sweep_factor)
        first, last = math.ceil(math.log(low) / step - 1e-9), math.floor(math.log(high) / step + 1e-9)
        return [_round_lr(self.ref_lr * self.sweep_factor ** i) for i in range(first, last + 1)]

    def lrs(self, global_batch: int) -> dict[float, list[Rule]]:
        """Every lr trained at ``global_batch`` and the rules it serves (one run serves several)."""
        out: dict[float, list[Rule]] = {}
        for rule in self.rules:
            for lr in self.sweep(global_batch) if rule == "tuned" else [_round_lr(self.rule_lr(rule, global_batch))]:
                out.setdefault(lr, []).append(rule)
        return out

    def fingerprint(self, workload_name: str) -> str:
        """What a cached run depends on: a changed setting invalidates the cache."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("global_batch_sizes", "rules")}
        return hashlib.sha256(
            json.dumps([workload_name, fields], sort_keys=True, default=str).encode()).hexdigest()[:16]


def _round_lr(lr: float) -> float:
    # Twelve significant digits: the same lr reached by two rules is one run.
    return float(f"{lr:.12g}")


# ---------------------------------------------------------------------------------------------
# Workloads


def digits_workload() -> Workload:
    """sklearn's digits (1797 × 64, 10 classes), 80/20 split, an MLP with one hidden layer of 64."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ValueError("the built-in workload needs scikit-learn: pip install 'ddplab[study]'") from None
    data = load_digits()
    inputs = torch.tensor(data.data, dtype=torch.float32) / 16.0
    targets = torch.tensor(data.target, dtype=torch.long)
    # A fixed split, independent of the run seeds.
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(1234))
    n_val = len(targets) // 5
    val, train = order[:n_val], order[n_val:]
    return Workload(name="digits-mlp", model=_digits_mlp, loss=torch.nn.functional.cross_entropy,
                    train=(inputs[train], targets[train]), val=(inputs[val], targets[val]))


def _digits_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def regression_workload(*, dim: int = 16, n_train: int = 4096, n_val: int = 4096, seed: int = 0) -> Workload:
    """Noiseless linear regression with x ~ N(0, I): the problem whose answers are known exactly.

    With MSE loss and error e = w − w*, the per-sample gradient 2x(x·e) has mean 2e and covariance
    4(e eᵀ + |e|² I): B_simple = tr Σ/|G|² = dim + 1 at every step, and the expected |e|² after a
    step of SGD (no momentum) at lr η with batch B is |e|²·((1 − 2η)² + 4η²(dim + 1)/B).
    """
    generator = torch.Generator().manual_seed(seed)
    w_star = torch.randn(dim, 1, generator=generator) / math.sqrt(dim)
    inputs = torch.randn(n_train + n_val, dim, generator=generator)
    targets = inputs @ w_star
    return Workload(name=f"gaussian-regression-{dim}", model=lambda: _zero_linear(dim),
                    loss=torch.nn.functional.mse_loss,
                    train=(inputs[:n_train], targets[:n_train]), val=(inputs[n_train:], targets[n_train:]))


def _zero_linear(dim: int) -> torch.nn.Module:
    layer = torch.nn.Linear(dim, 1, bias=False)
    torch.nn.init.zeros_(layer.weight)
    return layer


def regression_expected_steps(*, dim: int, global_batch: int, lr: float, start: float, target: float,
                              eval_every: int = 1, max_steps: int = 100_000) -> int | None:
    """Steps until E|e|² first falls to ``target`` (checked every ``eval_every``), from the exact recursion."""
    factor = (1 - 2 * lr) ** 2 + 4 * lr ** 2 * (dim + 1) / global_batch
    if factor >= 1:
        return None
    steps = math.ceil(math.log(target / start) / math.log(factor))
    steps = -(-steps // eval_every) * eval_every
    return steps if steps <= max_steps else None


def spec_workload(path: str) -> Workload:
    """A spec file (see ddplab.spec) plus val_dataset() or evaluate(model, dataset)."""
    from ddplab import spec as spec_module

    spec = spec_module.load_spec(path)
    module = _spec_module(spec)
    evaluate = getattr(module, "evaluate", None)
    val_dataset = getattr(module, "val_dataset", None)
    if not callable(evaluate) and not callable(val_dataset):
        raise ValueError(f"spec file {path!r} defines neither evaluate(model, dataset) nor val_dataset(): "  # noqa: TRY004 (a user error: exit 2)
                         "the study needs one to know when a run reaches the target")
    if getattr(spec.step, "__wrapped__", spec.step) is not spec_module._default_step:
        raise ValueError(f"spec file {path!r} defines step(): the study vectorizes loss(model(x), y) and cannot "
                         "replay a custom step")
    train = _as_tensors(spec.dataset(), "dataset()")
    eval_dataset = val_dataset() if callable(val_dataset) else spec.dataset()
    if callable(evaluate):
        return Workload(name=os.path.basename(path), model=spec.model, loss=spec.loss, train=train,
                        evaluate=evaluate, eval_dataset=eval_dataset)
    return Workload(name=os.path.basename(path), model=spec.model, loss=spec.loss, train=train,
                    val=_as_tensors(eval_dataset, "val_dataset()"))


def _spec_module(spec):
    import sys

    return next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) and
                os.path.abspath(m.__file__) == spec.path)


def _as_tensors(dataset, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.utils.data import default_collate

    try:
        inputs, targets = default_collate([dataset[i] for i in range(len(dataset))])
    except (TypeError, RuntimeError, IndexError, ValueError) as exc:
        raise ValueError(f"{what} must hold (input, target) tensor pairs of one shape ({exc})") from None
    return inputs, targets


# ---------------------------------------------------------------------------------------------
# Data order: DistributedSampler's permutation, full global batches only


def epoch_permutation(dataset_size: int, seed: int, epoch: int) -> torch.Tensor:
    """What the DistributedSampler of the run with ``seed`` permutes in ``epoch``, before padding and sharding."""
    from ddplab.training import sampler_seed

    # The same mixed seed as check and noise, so --verify-ddp replays exactly these batches.
    return torch.randperm(dataset_size, generator=torch.Generator().manual_seed(sampler_seed(seed) + epoch))


class _Batches:
    """Global batch ``step`` of each seed: positions step·B … step·B+B−1 of the epoch's permutation.

    DistributedSampler gives rank r the positions r, r+W, r+2W, …; rank r's j-th loader batch of
    B/W samples, over all ranks, covers exactly those B positions. Full batches only, so padding never enters.
    """

    def __init__(self, dataset_size: int, global_batch: int, seeds: list[int]):
        self.size, self.global_batch, self.seeds = dataset_size, global_batch, seeds
        self.per_epoch = dataset_size // global_batch
        self._epoch, self._perms = -1, None

    def indices(self, step: int) -> torch.Tensor:
        """(len(seeds), B) sample indices for optimizer ``step`` (0-based)."""
        epoch, within = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._perms = torch.stack([epoch_permutation(self.size, s, epoch) for s in self.seeds])
            self._epoch = epoch
        return self._perms[:, within * self.global_batch:(within + 1) * self.global_batch]


# ---------------------------------------------------------------------------------------------
# The vectorized engine


@dataclasses.dataclass
class RunResult:
    """One (batch, lr, seed) run."""

    global_batch_size: int
    lr: float
    seed: int
    steps_to_target: int | None = None
    diverged: bool = False
    pruned: bool = False
    """Stopped early: a tuned-sweep lr that can no longer be the best at its batch size."""
    history: list = dataclasses.field(default_factory=list)
    """[step, training loss, metric] at each evaluation."""
    noise_g2: list = dataclasses.field(default_factory=list)
    noise_trace: list = dataclasses.field(default_factory=list)
    """Per-evaluation |G|² and tr Σ (noise_estimators.unbiased_estimates) up to the target."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def seeded_params(workload: Workload, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's parameters as built under ``seed`` (as every DDP rank builds them)."""
    torch.manual_seed(seed)
    model = workload.model().to(dtype)
    if any(True for _ in model.buffers()):
        raise ValueError("the study trains models without buffers (no BatchNorm running statistics): "
                         "vmap over stacked parameters cannot update them")
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class Group:
    """All runs of one global batch size, as stacked parameters trained together."""

    def __init__(self, workload: Workload, config: StudyConfig, global_batch: int, runs: list[tuple[float, int]]):
        self.workload, self.config, self.global_batch = workload, config, global_batch
        dtype = config.torch_dtype
        self.model = workload.model().to(dtype)
        seeds = sorted({seed for _, seed in runs})
        init = {seed: seeded_params(workload, seed, dtype) for seed in seeds}
        self.params = {name: torch.stack([init[seed][name] for _, seed in runs]) for name in init[seeds[0]]}
        self.momentum = {name: torch.zeros_like(p) for name, p in self.params.items()}
        self.lr = torch.tensor([lr for lr, _ in runs], dtype=dtype)
        self.seed_row = torch.tensor([seeds.index(seed) for _, seed in runs])
        self.active = list(range(len(runs)))
        self.results = [RunResult(global_batch_size=global_batch, lr=lr, seed=seed) for lr, seed in runs]
        self.batches = _Batches(workload.train_size, global_batch, seeds)
        self.inputs = _cast(workload.train[0], dtype)
        self.targets = _cast(workload.train[1], dtype)
        self._forward = vmap(lambda params, inputs: functional_call(self.model, params, (inputs,)))
        self._losses = vmap(workload.loss)

    def _grad_and_loss(self, params, inputs, targets):
        # Runs share no parameters, so one backward of the summed losses gives each run its own gradient
        # (cheaper than vmap over torch.func.grad, and bit-identical).
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        try:
            losses = self._losses(self._forward(leaves, inputs), targets)
        except RuntimeError as exc:
            if "randomness" not in str(exc):
                raise
            raise ValueError("the model draws random numbers in training (dropout?): the vectorized study cannot "
                             "replay them run by run; remove them for the study") from None
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
        return dict(zip(leaves, grads)), losses.detach()

    def _grad(self, params, inputs, targets):
        return self._grad_and_loss(params, inputs, targets)[0]

    def step(self, step: int, *, measure: bool) -> torch.Tensor:
        """One optimizer step of every active run (SGD with momentum, torch.optim.SGD's formula); returns losses."""
        indices = self.batches.indices(step)[self.seed_row]
        inputs, targets = self.inputs[indices], self.targets[indices]
        grads, losses = self._grad_and_loss(self.params, inputs, targets)
        if measure and self.global_batch >= 2:
            self._measure(grads, inputs, targets)
        names = list(grads)
        buffers, params = [self.momentum[n] for n in names], [self.params[n] for n in names]
        lrs = [self.lr.view(-1, *[1] * (self.params[n].dim() - 1)) for n in names]
        # torch.optim.SGD: buf ← μ·buf + g (buf starts at 0, so the first step sets buf = g), p ← p − lr·buf.
        torch._foreach_mul_(buffers, self.config.momentum)
        torch._foreach_add_(buffers, [grads[n] for n in names])
        torch._foreach_addcmul_(params, lrs, buffers, value=-1)
        return losses

    def _measure(self, grads, inputs, targets) -> None:
        # The gradient of the first half of each batch beside the whole batch's: McCandlish's two sizes.
        half = self.global_batch // 2
        small = self._grad(self.params, inputs[:, :half], targets[:, :half])
        big_sq = sum(g.flatten(1).pow(2).sum(1) for g in grads.values())
        small_sq = sum(g.flatten(1).pow(2).sum(1) for g in small.values())
        for row, run in enumerate(self.active):
            g2, trace = noise_estimators.unbiased_estimates(float(small_sq[row]), float(big_sq[row]), half,
                                                            self.global_batch)
            self.results[run].noise_g2.append(g2)
            self.results[run].noise_trace.append(trace)

    def metrics(self) -> list[float]:
        """Each active run's evaluation: vectorized on the validation split, or the spec's evaluate per run."""
        if self.workload.evaluate is not None:
            return self._evaluate_each()
        inputs, targets = self.workload.val
        inputs, targets = _cast(inputs, self.config.torch_dtype), _cast(targets, self.config.torch_dtype)
        with torch.no_grad(), _eval_mode(self.model):
            outputs = vmap(lambda p: functional_call(self.model, p, (inputs,)))(self.params)
            if self.config.target.kind == "accuracy":
                values = (outputs.argmax(-1) == targets).to(torch.float64).mean(-1)
            else:
                values = vmap(lambda out: self.workload.loss(out, targets))(outputs)
        return values.tolist()

    def _evaluate_each(self) -> list[float]:
        out = []
        with torch.no_grad():
            for row in range(len(self.active)):
                self.model.load_state_dict({n: p[row] for n, p in self.params.items()}, strict=False)
                out.append(float(self.workload.evaluate(self.model, self.workload.eval_dataset)))
        return out

    def keep(self, rows: list[int]) -> None:
        """Drop finished runs: only the rows in ``rows`` go on training."""
        index = torch.tensor(rows, dtype=torch.long)
        self.params = {n: p[index] for n, p in self.params.items()}
        self.momentum = {n: b[index] for n, b in self.momentum.items()}
        self.lr, self.seed_row = self.lr[index], self.seed_row[index]
        self.active = [self.active[r] for r in rows]


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    # Evaluation sees the model as inference would: eval() mode, training mode restored after.
    model.eval()
    try:
        yield
    finally:
        model.train()


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def train_group(workload: Workload, config: StudyConfig, global_batch: int, runs: list[tuple[float, int]],
                progress: Callable[[int], None] | None = None, *,
                sweep_only: set[float] = frozenset()) -> list[RunResult]:
    """Train every (lr, seed) run at ``global_batch`` until it reaches the target, diverges or runs out of steps.

    Runs of an lr in ``sweep_only`` (serving the tuned sweep alone) stop once that lr can no longer
    have the fewest median steps: they only had to lose to the best.
    """
    group = Group(workload, config, global_batch, runs)
    reported = 0
    for step in range(config.max_steps):
        evaluate = (step + 1) % config.eval_every == 0
        losses = group.step(step, measure=evaluate)
        finished = _finish_diverged(group, losses)
        if evaluate:
            finished |= _finish_reached(group, losses, step + 1)
            finished |= _prune(group, sweep_only, step + 1, finished)
            if progress:
                progress(step + 1 - reported)
                reported = step + 1
        rows = [row for row, run in enumerate(group.active) if run not in finished]
        if not rows:
            break
        if finished:
            group.keep(rows)
    if progress:
        progress(config.max_steps - reported)
    return group.results


def _prune(group: Group, sweep_only: set[float], steps: int, finished: set[int]) -> set[int]:
    if not sweep_only:
        return set()
    by_lr: dict[float, list[RunResult]] = {}
    for result in group.results:
        by_lr.setdefault(result.lr, []).append(result)
    best_lr, best = None, math.inf
    for lr, results in by_lr.items():
        reached = sorted(r.steps_to_target for r in results if r.steps_to_target is not None)
        # The median over n seeds is settled once n//2 + 1 of them reached (the rest can only be slower).
        if len(reached) >= len(results) // 2 + 1:
            median = study_fit.median(reached + [math.inf] * (len(results) - len(reached)))
            if median < best:
                best_lr, best = lr, median
    # With an even seed count the median averages two runs: a loser is certain only past twice the best.
    if steps <= best * (2 if group.config.seeds % 2 == 0 else 1):
        return set()
    pruned = set()
    for run in group.active:
        result = group.results[run]
        if run not in finished and result.lr in sweep_only and result.lr != best_lr:
            result.pruned = True
            pruned.add(run)
    return pruned


def _finish_diverged(group: Group, losses: torch.Tensor) -> set[int]:
    bad = ~torch.isfinite(losses) | (losses.abs() > DIVERGED_LOSS)
    finished = set()
    for row in torch.nonzero(bad).flatten().tolist():
        run = group.active[row]
        group.results[run].diverged = True
        finished.add(run)
    return finished


def _finish_reached(group: Group, losses: torch.Tensor, steps: int) -> set[int]:
    finished = set()
    for row, metric in enumerate(group.metrics()):
        run = group.active[row]
        result = group.results[run]
        if run in finished or result.diverged:
            continue
        result.history.append([steps, float(losses[row]), metric])
        if not math.isfinite(metric):
            result.diverged = True
            finished.add(run)
        elif group.config.target.reached(metric):
            result.steps_to_target = steps
            finished.add(run)
    return finished


# ---------------------------------------------------------------------------------------------
# The grid, cached per batch size


def check_grid(workload: Workload, config: StudyConfig) -> None:
    """Refuse what cannot run before training anything."""
    too_big = [b for b in config.global_batch_sizes if b > workload.train_size]
    if too_big:
        raise ValueError(f"global batch {too_big[0]} is larger than the {workload.train_size} training samples; "
                         f"use --batch-sizes up to {workload.train_size}")
    if workload.val is None and workload.evaluate is None:
        raise ValueError("the workload has no validation split and no evaluate(): "
                         "nothing tells when the target is reached")


class Cache:
    """Finished groups under ``DIR/runs/``, one JSON per batch size, written atomically."""

    def __init__(self, directory: str, fingerprint: str, *, fresh: bool):
        self.directory = directory
        self.runs_dir = os.path.join(directory, "runs")
        stamp = os.path.join(directory, "config.json")
        if fresh and os.path.isdir(self.runs_dir):
            shutil.rmtree(self.runs_dir)
        if os.path.exists(stamp) and os.path.isdir(self.runs_dir):
            with open(stamp) as fh:
                if json.load(fh).get("fingerprint") != fingerprint:
                    raise ValueError(f"--out {directory!r} holds runs of a study with other settings; "
                                     "pass --fresh to start over or choose another --out")
        os.makedirs(self.runs_dir, exist_ok=True)
        write_json_atomic(stamp, {"fingerprint": fingerprint})

    def _path(self, global_batch: int) -> str:
        return os.path.join(self.runs_dir, f"batch-{global_batch}.json")

    def load(self, global_batch: int, runs: list[tuple[float, int]]) -> list[RunResult] | None:
        if not os.path.exists(self._path(global_batch)):
            return None
        with open(self._path(global_batch)) as fh:
            cached = {(r["lr"], r["seed"]): RunResult(**r) for r in json.load(fh)}
        # A cached group serves when it holds every run asked for (a grid may shrink, not grow).
        if not all(key in cached for key in runs):
            return None
        return [cached[key] for key in runs]

    def save(self, global_batch: int, results: list[RunResult]) -> None:
        write_json_atomic(self._path(global_batch), [r.to_json() for r in results])


def write_json_atomic(path: str, obj: Any) -> None:
    """Write then rename: an interrupted study never leaves half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, default=_json_default)
    os.replace(tmp, path)


def _json_default(value):
    if hasattr(value, "to_json"):
        return value.to_json()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def grid_runs(config: StudyConfig, global_batch: int) -> list[tuple[float, int]]:
    return [(lr, seed) for lr in config.lrs(global_batch) for seed in range(config.seeds)]


def run_grid(workload: Workload, config: StudyConfig, cache: Cache | None,
             progress: Callable[[int], None] | None = None) -> dict[int, list[RunResult]]:
    """Every batch size's group, from the cache when it is there, else trained and cached at once."""
    results = {}
    for global_batch in sorted(config.global_batch_sizes):
        runs = grid_runs(config, global_batch)
        cached = cache.load(global_batch, runs) if cache else None
        if cached is None:
            sweep_only = {lr for lr, rules in config.lrs(global_batch).items() if rules == ["tuned"]}
            cached = train_group(workload, config, global_batch, runs, progress, sweep_only=sweep_only)
            if cache:
                cache.save(global_batch, cached)
        elif progress:
            progress(config.max_steps)
        results[global_batch] = cached
    return results


# ---------------------------------------------------------------------------------------------
# From runs to the study's answer


def analyze(workload: Workload, config: StudyConfig, results: dict[int, list[RunResult]]) -> dict:
    """The runs table, the tuned curve, one fit per rule and B_simple; ValueError on a study with no answer."""
    by_key = {(b, r.lr, r.seed): r for b, rs in results.items() for r in rs}
    _check_divergence(config, results)
    if not any(r.steps_to_target is not None for r in by_key.values()):
        raise ValueError(f"no run reached the target ({config.target.kind} {config.target.value:g}) within "
                         f"--max-steps {config.max_steps}: lower the target or raise --max-steps (runs are cached)")
    batches = sorted(results)
    runs, steps_by_rule, tuned = [], {rule: {} for rule in config.rules}, []
    for b in batches:
        lrs = config.lrs(b)
        best = _tuned_best(config, b, lrs, by_key) if "tuned" in config.rules else None
        if best is not None:
            tuned.append({"global_batch_size": b, "lr": best[0], "median_steps": best[1],
                          "sweep": sorted(lr for lr, rules in lrs.items() if "tuned" in rules)})
        for lr, rules in lrs.items():
            for rule in rules:
                for seed in range(config.seeds):
                    run = by_key[(b, lr, seed)]
                    runs.append({"rule": rule, "global_batch_size": b, "lr": lr, "seed": seed,
                                 "steps_to_target": run.steps_to_target, "diverged": run.diverged,
                                 "pruned": run.pruned,
                                 "best": rule == "tuned" and best is not None and lr == best[0]})
        for rule in config.rules:
            lr = best[0] if rule == "tuned" else _round_lr(config.rule_lr(rule, b))
            if rule == "tuned" and best is None:
                continue
            steps_by_rule[rule][b] = [_steps(by_key[(b, lr, s)]) for s in range(config.seeds)]
    fits, warnings = _fits(steps_by_rule)
    warnings += _edge_warnings(tuned)
    best_runs = [by_key[(p["global_batch_size"], p["lr"], s)] for p in tuned for s in range(config.seeds)]
    return {"runs": runs, "tuned_lr": tuned, "fit": fits, "b_simple": _b_simple(best_runs, fits.get("tuned")),
            "warnings": warnings, "steps_by_rule": steps_by_rule}


def _check_divergence(config: StudyConfig, results: dict[int, list[RunResult]]) -> None:
    for b, runs in sorted(results.items()):
        sweep = [r for r in runs if "tuned" in config.lrs(b).get(r.lr, [])] or runs
        if all(r.diverged for r in sweep):
            lrs = [r.lr for r in sweep]
            raise ValueError(f"every lr {'of the tuned sweep ' if 'tuned' in config.rules else ''}diverged at global "
                             f"batch {b} ({min(lrs):g} to {max(lrs):g}): lower --ref-lr (runs are cached)")


def _steps(run: RunResult) -> float:
    return float(run.steps_to_target) if run.steps_to_target is not None else math.inf


def _tuned_best(config: StudyConfig, b: int, lrs: dict, by_key: dict) -> tuple[float, float] | None:
    sweep = {lr: [_steps(by_key[(b, lr, s)]) for s in range(config.seeds)]
             for lr, rules in lrs.items() if "tuned" in rules}
    return study_fit.best_lr(sweep)


def _fits(steps_by_rule: dict) -> tuple[dict, list[str]]:
    fits, warnings = {}, []
    for rule, by_batch in steps_by_rule.items():
        reached = {b: s for b, s in by_batch.items() if math.isfinite(study_fit.median(s))}
        if len(reached) < 2:
            warnings.append(f"rule {rule}: the median run reached the target at fewer than two batch sizes; no fit")
            continue
        fit = study_fit.fit_seeds(reached)
        fits[rule] = {**fit, "median_steps": {str(b): v for b, v in fit["median_steps"].items()},
                      "batches_fitted": sorted(reached)}
        if not math.isfinite(fit["b_crit"]):
            warnings.append(f"rule {rule}: steps fall as 1/B over the whole measured range; B_crit lies above it")
    return fits, warnings


def _edge_warnings(tuned: list[dict]) -> list[str]:
    edge = [p["global_batch_size"] for p in tuned if p["lr"] in (p["sweep"][0], p["sweep"][-1]) and len(p["sweep"]) > 1]
    if not edge:
        return []
    return [(f"the best tuned lr sits at the edge of its sweep at global batch {', '.join(map(str, edge))}: "
             "widen --sweep-margin")]


def _b_simple(best_runs: list[RunResult], tuned_fit: dict | None) -> dict | None:
    g2s = [g for run in best_runs for g in run.noise_g2]
    traces = [t for run in best_runs for t in run.noise_trace]
    if not g2s:
        return None
    summary = noise_estimators.summarize(g2s, traces)
    ratio = tuned_fit["b_crit"] / summary.b_simple if tuned_fit and summary.b_simple > 0 else None
    return {"value": summary.b_simple, "ci95": list(summary.b_simple_ci95), "measurements": summary.steps,
            "b_crit_over_b_simple": ratio}


# ---------------------------------------------------------------------------------------------
# --verify-ddp: replay grid points on real DDP ranks


def verify_points(config: StudyConfig, count: int, world_size: int,
                  tuned: list[dict] | None = None) -> list[tuple[int, float, int]]:
    """``count`` (batch, lr, seed) grid points spread over the batch sizes DDP can split over ``world_size``.

    With the tuned curve, its best lrs (runs that train well, not ones on their way to diverging,
    where any rounding difference grows without bound); else any grid point.
    """
    if tuned:
        points = [(p["global_batch_size"], p["lr"], seed) for p in tuned if p["global_batch_size"] % world_size == 0
                  for seed in range(config.seeds)]
    else:
        points = [(b, lr, seed) for b in sorted(config.global_batch_sizes) if b % world_size == 0
                  for lr in config.lrs(b) for seed in range(config.seeds)]
    if not points:
        raise ValueError(f"no global batch in --batch-sizes divides evenly over {world_size} ranks")
    count = min(count, len(points))
    return [points[round(i * (len(points) - 1) / max(1, count - 1))] for i in range(count)]


def simulated_params(workload: Workload, config: StudyConfig, points: list[tuple[int, float, int]],
                     steps: int) -> list[dict[str, torch.Tensor]]:
    """Each point's parameters after ``steps`` steps of the vectorized engine (one group per batch size)."""
    out = {}
    for b in sorted({p[0] for p in points}):
        runs = [(lr, seed) for pb, lr, seed in points if pb == b]
        group = Group(workload, config, b, runs)
        for step in range(steps):
            group.step(step, measure=False)
        for row, key in enumerate(runs):
            out[(b, *key)] = {n: p[row].clone() for n, p in group.params.items()}
    return [out[p] for p in points]


def verify_ddp(workload: Workload, config: StudyConfig, count: int, *, world_size: int = 2, steps: int = 20,
               tuned: list[dict] | None = None) -> dict:
    """Re-run ``count`` grid points through real DDP ranks (ddplab.launch) and compare parameters."""
    from ddplab import launch

    points = verify_points(config, count, world_size, tuned)
    simulated = simulated_params(workload, config, points, steps)
    ranks = launch.launch(_ddp_points, launch.LaunchConfig(world_size=world_size), workload, config, points, steps)
    real = ranks[0]
    diffs = [max(float((sim[n] - ddp[n]).abs().max()) for n in sim) for sim, ddp in zip(simulated, real)]
    scales = [max(float(sim[n].abs().max()) for n in sim) for sim in simulated]
    return {"world_size": world_size, "steps": steps, "dtype": config.dtype,
            "points": [{"global_batch_size": b, "lr": lr, "seed": seed, "max_abs_diff": d}
                       for (b, lr, seed), d in zip(points, diffs)],
            "max_abs_diff": max(diffs), "max_rel_diff": max(d / max(s, 1e-30) for d, s in zip(diffs, scales))}


def _ddp_points(ctx, workload: Workload, config: StudyConfig, points, steps: int) -> list[dict[str, torch.Tensor]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab import training

    out = []
    dtype = config.torch_dtype
    inputs, targets = _cast(workload.train[0], dtype), _cast(workload.train[1], dtype)
    for global_batch, lr, seed in points:
        torch.manual_seed(seed)
        model = workload.model().to(dtype)
        ddp = DDP(model, device_ids=ctx.device_ids)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=config.momentum)
        per_device = global_batch // ctx.world_size
        per_epoch = workload.train_size // global_batch
        for step in range(steps):
            epoch, within = divmod(step, per_epoch)
            shard = training.rank_indices(workload.train_size, world_size=ctx.world_size, rank=ctx.rank,
                                          seed=seed, epoch=epoch)
            index = torch.tensor(shard[within * per_device:(within + 1) * per_device])
            optimizer.zero_grad(set_to_none=True)
            workload.loss(ddp(inputs[index]), targets[index]).backward()
            optimizer.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        del ddp, optimizer, model
    return out
