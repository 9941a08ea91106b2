"""The critical batch where a training is: short branches from its checkpoints at larger global batches.

From each checkpoint (a model, its optimizer state and the samples it has seen), branches train at
the reference global batch × 1, 2, 4, … for the same number of samples, each batch with a small lr
sweep around the rule's lr and a few seeds, all runs of one batch vectorized as in the study's
engine (``torch.func.vmap`` over ``functional_call``, torch.optim's update as stacked foreach
steps). Each branch continues the data where the checkpoint left it: seed s draws DistributedSampler's
epoch permutations for s from the checkpoint's samples seen on, so at one seed every batch size
trains on the very same samples, only grouped differently. What is compared is the training loss
on the held-out split at the end of each branch; :mod:`ddplab.study.critical` judges it.

``branch_at`` first trains the reference run itself (reference batch and lr, seed 0) to the target,
then trains it again to the largest fraction, keeping its state (model and torch.optim's state) at each.

What cannot be vectorized (a spec's own ``step()``, another optimizer, a model that does not vmap), a sharding
strategy, ``--engine ddp`` and torchrun train the branches on real ranks instead
(:mod:`ddplab.study.engines.ddp_branches`), one launch per checkpoint; the reference run and B_simple stay in this
process (under torchrun: in every rank, and rank 0's checkpoints are everyone's).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch.func import functional_call, vmap

from ddplab.errors import UsageError, literal
from ddplab.noise import estimators
from ddplab.progress import Progress, silent
from ddplab.runtime.launch import LaunchConfig, RankContext, launch, world_size_for
from ddplab.runtime.launch_config import under_torchrun
from ddplab.serialize import finite, write_json_atomic
from ddplab.study import critical, optim
from ddplab.study.branch_cache import BranchCache, checkpoint_digest
from ddplab.study.config import StudyConfig, StudyOptions
from ddplab.study.critical import BranchConfig
from ddplab.study.engines.ddp import run_optimizer
from ddplab.study.engines.vmap import cast, evaluate_model, runs_that_fit, threads, torch_dtype
from ddplab.study.fit import median
from ddplab.study.orders import Stream
from ddplab.study.workloads import Workload

B_SIMPLE_BATCHES = 16
"""Batches the noise scale is measured on at each checkpoint (two halves each, as two DDP ranks would see them)."""

Runs = list[tuple[float, int]]
"""(lr, seed) of each run of one global batch."""
Groups = dict[int, tuple[Runs, set[int]]]
"""{global batch: (its runs, the steps besides the last after which each run's held-out loss is kept)}."""
Trained = dict[int, dict[int, list[float]]]
"""{global batch: {steps: each run's held-out loss after them}}."""
BranchEngine = Literal["vmap", "ddp"]


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A state to branch from: the model's state_dict, torch.optim's state_dict (None: a fresh optimizer) and the
    samples the run had seen."""

    model: dict
    optimizer: dict | None
    samples_seen: int
    source: str
    """Where it came from: a file, or a step of the reference run."""
    notes: tuple[str, ...] = ()
    """What the user should know of it (a file without optimizer state, say)."""


# ---------------------------------------------------------------------------------------------
# Checkpoints


def load_checkpoint(workload: Workload, config: StudyConfig, path: str) -> Checkpoint:
    """A checkpoint file, checked against the workload's model and optimizer before anything trains."""
    if not os.path.isfile(path):
        raise UsageError(f"{{branch_from}} {literal(path)} does not exist")
    if workload.load is not None:
        return _spec_loaded(workload, config, path)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same bad input
        raise UsageError(f"{{branch_from}} {literal(path)} cannot be read by torch.load ({literal(exc)})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise UsageError(f"{{branch_from}} {literal(path)} has no key 'model' (a state_dict): save "
                         "{{'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'samples_seen': n}}")
    if "samples_seen" in saved:
        samples = saved["samples_seen"]
    elif "step" in saved:
        samples = int(saved["step"]) * config.reference_global_batch_size
    else:
        raise UsageError(f"{{branch_from}} {literal(path)} has no key 'samples_seen' (nor 'step', counted in "
                         "{reference_global_batch_size} samples)")
    expected = workload.model().state_dict()
    checkpoint = Checkpoint(model=_unwrapped(saved["model"], set(expected)), optimizer=saved.get("optimizer"),
                            samples_seen=int(samples), source=path)
    check_checkpoint(workload, config, checkpoint, expected)
    return dataclasses.replace(checkpoint, notes=tuple(notes(config, checkpoint)))


WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""What DDP (``model.module``) and torch.compile (``model._orig_mod``) put before a state_dict's keys."""


def _unwrapped(state: dict, expected: set[str]) -> dict:
    """The state_dict as the bare model names its keys: a DDP or compiled model's (or both, in either order), saved
    wrapped, loses the prefixes every key carries; one whose keys are already the model's stays as it is."""
    while set(state) != expected:
        prefix = next((p for p in WRAPPER_PREFIXES
                       if state and all(isinstance(key, str) and key.startswith(p) for key in state)), None)
        if prefix is None:
            break
        state = {key[len(prefix):]: value for key, value in state.items()}
    return state


def _spec_loaded(workload: Workload, config: StudyConfig, path: str) -> Checkpoint:
    """What the spec's load(path, model, optimizer) puts into a fresh model and optimizer."""
    model = workload.model().to(torch_dtype(config))
    optimizer = run_optimizer(workload, config, model.parameters(), config.reference_lr)
    samples = workload.load(path, model, optimizer)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise UsageError(f"{{branch_from}} {literal(path)}: the spec's load(path, model, optimizer) must return the "
                         f"samples the run had seen, an integer ≥ 0, got {literal(repr(samples))}")
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    checkpoint = Checkpoint(model=state, optimizer=copy.deepcopy(optimizer.state_dict()), samples_seen=samples,
                            source=path)
    return dataclasses.replace(checkpoint, notes=tuple(notes(config, checkpoint)))


def check_checkpoint(workload: Workload, config: StudyConfig, checkpoint: Checkpoint, expected: dict) -> None:
    """Every key of the model's state_dict (``expected``) present with its shape, and nothing else; the optimizer's
    state of the study's family, one entry per parameter in ``model.parameters()`` order."""
    where = literal(checkpoint.source)
    for key, tensor in expected.items():
        if key not in checkpoint.model:
            raise UsageError(f"{{branch_from}} {where}: the model's state has no key {literal(repr(key))}")
        got = checkpoint.model[key]
        if not torch.is_tensor(got) or tuple(got.shape) != tuple(tensor.shape):
            shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
            raise UsageError(f"{{branch_from}} {where}: the model's key {literal(repr(key))} has shape "
                             f"{literal(shape)}, the workload's model {literal(tuple(tensor.shape))}")
    extra = [key for key in checkpoint.model if key not in expected]
    if extra:
        raise UsageError(f"{{branch_from}} {where}: the model's state has key {literal(repr(extra[0]))}, which the "
                         "workload's model lacks")
    _optimizer_state(workload, config, checkpoint)


def _optimizer_state(workload: Workload, config: StudyConfig, checkpoint: Checkpoint) -> dict[str, dict] | None:
    """{parameter name: its torch.optim state} of the checkpoint (None when it has none yet), checked."""
    saved = checkpoint.optimizer
    if not saved or not saved.get("state"):
        return None
    where = literal(checkpoint.source)
    groups = saved.get("param_groups") or []
    ids = [i for group in groups for i in group.get("params", [])]
    names = [name for name, _ in workload.model().named_parameters()]
    if len(ids) != len(names):
        raise UsageError(f"{{branch_from}} {where}: the optimizer's key 'param_groups' holds {len(ids)} parameters, "
                         f"the model has {len(names)}")
    # A spec's own optimizer (trained on ranks) keeps what it keeps: torch.optim reads its state as it is.
    needs = () if workload.make_optimizer is not None else ("exp_avg", "exp_avg_sq", "step") \
        if config.optimizer.adam else ("momentum_buffer",) if config.optimizer.momentum else ()
    out = {}
    for index, name in zip(ids, names):
        state = saved["state"].get(index, {})
        for key in needs:
            if state.get(key) is None:
                raise UsageError(f"{{branch_from}} {where}: the optimizer's state of parameter {index} "
                                 f"({literal(name)}) has no key {literal(repr(key))}, which "
                                 f"{config.optimizer.name} keeps: give the run's optimizer ({{optimizer.family}})")
        out[name] = state
    return out


def _load_optimizer(stacked: optim.StackedOptimizer, states: dict[str, dict] | None, runs: int,
                    like: dict[str, torch.Tensor]) -> None:
    """The checkpoint's torch.optim state, repeated for every run of a branch group."""
    if states is None:
        return

    def stack(key: str) -> dict[str, torch.Tensor]:
        return {name: states[name][key].to(like[name]).expand(runs, *like[name].shape[1:]).clone()
                for name in stacked.names}

    if isinstance(stacked, optim.StackedAdam):
        stacked.state = {"m": stack("exp_avg"), "v": stack("exp_avg_sq")}
        stacked.steps = int(states[stacked.names[0]]["step"])
    elif stacked.configs[0].momentum:
        # torch.optim.SGD starts its buffer from the first gradient; a saved buffer means that step was taken.
        stacked.state = {"buf": stack("momentum_buffer")}
        stacked.steps = 1


# ---------------------------------------------------------------------------------------------
# The reference run


def reference_checkpoints(workload: Workload, config: StudyConfig, fractions: tuple[float, ...],
                          device: torch.device, advance: Callable[[int], None]) -> tuple[list[Checkpoint], dict]:
    """The reference run's states at ``fractions`` of its steps to the target (or ``max_steps``), and the run."""
    steps, reached = _reference_run(workload, config, device, {}, advance)
    keep = sorted({round(f * steps) for f in fractions})
    snapshots: dict[int, Checkpoint] = {step: None for step in keep}
    _reference_run(workload, config, device, snapshots, advance)
    run = {"steps": steps, "reached": reached, "samples": steps * config.reference_global_batch_size,
           "global_batch_size": config.reference_global_batch_size, "lr": config.reference_lr}
    return [snapshots[step] for step in keep], run


def _on_host(value):
    """A copy of ``value`` with every tensor on the host: a checkpoint the same whatever device trained it, that
    ranks can be sent without touching a GPU."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_host(item) for item in value)
    return copy.deepcopy(value)


def _reference_run(workload: Workload, config: StudyConfig, device: torch.device, snapshots: dict[int, Checkpoint],
                   advance: Callable[[int], None]) -> tuple[int, bool]:
    """Train the reference run (seed 0, as the study builds it) to the target, filling ``snapshots`` (step: state
    after that many steps) and stopping after the last; (steps trained, reached)."""
    dtype = torch_dtype(config)
    torch.manual_seed(0)
    model = workload.model().to(dtype).to(device)
    optimizer = run_optimizer(workload, config, model.parameters(), config.reference_lr)
    batch = config.reference_global_batch_size
    stream = Stream(workload.train_size, batch, [0])
    inputs, targets = cast(workload.train[0], dtype).to(device), cast(workload.train[1], dtype).to(device)
    last = max(snapshots, default=None)
    for step in range(config.max_steps + 1):
        if step in snapshots:
            snapshots[step] = Checkpoint(model={k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                                         optimizer=_on_host(optimizer.state_dict()), samples_seen=step * batch,
                                         source=f"step {step} of the reference run")
            if step == last:
                return step, False
        if step == config.max_steps:
            break
        index = stream.indices(step)[0].to(device)
        optimizer.zero_grad(set_to_none=True)
        workload.step_fn(model, (inputs[index], targets[index]), workload.loss).backward()
        optimizer.step()
        advance(1)
        if (step + 1) % config.eval_every == 0:
            metric = evaluate_model(workload, config, model)
            if not math.isfinite(metric):
                raise UsageError(f"the reference run diverged by step {step + 1}: lower {{reference_lr}} "
                                 f"({config.reference_lr:g})")
            if config.target.reached(metric) and last is None:
                return step + 1, True
    return config.max_steps, False


# ---------------------------------------------------------------------------------------------
# Branches


def held_out(workload: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out split every branch is scored on: the validation tensors (a spec's val_dataset() or dataset())."""
    if workload.val is not None:
        return workload.val
    from torch.utils.data import default_collate

    dataset = workload.eval_dataset
    try:
        inputs, targets = default_collate([dataset[i] for i in range(len(dataset))])
    except (TypeError, RuntimeError, IndexError, ValueError):
        raise UsageError("branches score the loss on val_dataset(): the spec's must hold (input, target) tensor "
                         "pairs") from None
    return inputs, targets


def train_branches(workload: Workload, config: StudyConfig, checkpoint: Checkpoint, global_batch: int,
                   runs: list[tuple[float, int]], samples: int, *, device: torch.device, record: set[int] = frozenset(),
                   advance: Callable[[int], None] = lambda steps: None) -> dict[int, list[float]]:
    """Train ``runs`` (lr, seed) from ``checkpoint`` at ``global_batch`` for ``samples``: {steps: each run's held-out
    loss after them}, at the last step and at those in ``record``."""
    fit = runs_that_fit(workload, config, global_batch, device)
    if len(runs) > fit:
        # A group too large for memory trains in parts, each a group of its own.
        parts = [train_branches(workload, config, checkpoint, global_batch, runs[start:start + fit], samples,
                                device=device, record=record, advance=advance) for start in range(0, len(runs), fit)]
        return {step: [loss for part in parts for loss in part[step]] for step in parts[0]}
    return _Branches(workload, config, checkpoint, global_batch, runs, device).train(samples, record, advance)


class _Branches:
    """Runs from one checkpoint at one global batch, as stacked parameters trained together."""

    def __init__(self, workload: Workload, config: StudyConfig, checkpoint: Checkpoint, global_batch: int,
                 runs: list[tuple[float, int]], device: torch.device):
        dtype = torch_dtype(config)
        self.workload, self.global_batch, self.device = workload, global_batch, device
        self.model = workload.model().to(dtype).to(device)
        named = dict(self.model.named_parameters())
        state = {k: cast(v, dtype).to(device) for k, v in checkpoint.model.items()}
        self.params = {n: state[n].expand(len(runs), *state[n].shape).clone() for n in named}
        self.buffers = {n: state[n].expand(len(runs), *state[n].shape).clone() for n, _ in self.model.named_buffers()}
        self.optimizer = optim.stacked([config.optimizer] * len(runs), self.params)
        _load_optimizer(self.optimizer, _optimizer_state(workload, config, checkpoint), len(runs), self.params)
        # float64 on the host, as the stacked optimizers take it (torch.optim's lr is a Python float).
        self.lr = torch.tensor([lr for lr, _ in runs], dtype=torch.float64)
        seeds = sorted({seed for _, seed in runs})
        self.seed_row = torch.tensor([seeds.index(seed) for _, seed in runs])
        self.stream = Stream(workload.train_size, global_batch, seeds, start=checkpoint.samples_seen)
        self.inputs, self.targets = cast(workload.train[0], dtype).to(device), cast(workload.train[1], dtype).to(device)
        val_inputs, val_targets = held_out(workload)
        self.val = cast(val_inputs, dtype).to(device), cast(val_targets, dtype).to(device)
        self._forward = vmap(lambda p, b, x: functional_call(self.model, (p, b), (x,)), randomness="different")
        self._losses = vmap(workload.loss)

    def train(self, samples: int, record: set[int], advance: Callable[[int], None]) -> dict[int, list[float]]:
        steps = samples // self.global_batch
        # Dropout draws its own mask for every run, the same for the same checkpoint and batch.
        torch.manual_seed(self.global_batch)
        out = {0: self.held_out_losses()} if 0 in record else {}
        for step in range(steps):
            self.step(step)
            advance(1)
            if step + 1 in record or step + 1 == steps:
                out[step + 1] = self.held_out_losses()
        return out

    def step(self, step: int) -> None:
        index = self.stream.indices(step)[self.seed_row].to(self.device)
        leaves = {name: p.detach().requires_grad_() for name, p in self.params.items()}
        losses = self._losses(self._forward(leaves, self.buffers, self.inputs[index]), self.targets[index])
        # Runs share no parameters: one backward of the summed losses gives each run its own gradient.
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
        with torch.no_grad():
            self.optimizer.step(self.params, dict(zip(leaves, grads)), self.lr)

    def held_out_losses(self) -> list[float]:
        """Each run's training loss on the held-out split, in eval mode (a diverged run's is inf)."""
        inputs, targets = self.val
        self.model.eval()
        try:
            with torch.no_grad():
                outputs = vmap(lambda p, b: functional_call(self.model, (p, b), (inputs,)))(self.params, self.buffers)
                losses = vmap(lambda output: self.workload.loss(output, targets))(outputs)
        finally:
            self.model.train()
        return [x if math.isfinite(x) else math.inf for x in losses.double().tolist()]


def b_simple_at(workload: Workload, config: StudyConfig, checkpoint: Checkpoint, global_batch: int,
                device: torch.device, batches: int = B_SIMPLE_BATCHES) -> float | None:
    """The noise scale B_simple = tr Σ / |G|² at the checkpoint's weights, from ``batches`` global batches each split
    into two halves (``ddplab noise --world-size 2``'s estimator with its finite-dataset correction); None when
    |G|² is not above 0."""
    dtype = torch_dtype(config)
    torch.manual_seed(0)
    model = workload.model().to(dtype).to(device)
    model.load_state_dict({k: cast(v, dtype) for k, v in checkpoint.model.items()})
    half = min(global_batch, workload.train_size) // 2
    stream = Stream(workload.train_size, 2 * half, [0], start=checkpoint.samples_seen)
    inputs, targets = cast(workload.train[0], dtype).to(device), cast(workload.train[1], dtype).to(device)
    g2s, traces = [], []
    for step in range(batches):
        index = stream.indices(step)[0].to(device)
        grads = [_flat_grad(workload, model, inputs[index[rank::2]], targets[index[rank::2]]) for rank in (0, 1)]
        small = float((grads[0].pow(2).sum() + grads[1].pow(2).sum()) / 2)
        big = float(((grads[0] + grads[1]) / 2).pow(2).sum())
        g2, trace = estimators.unbiased_estimates(small, big, half, 2 * half, dataset_size=workload.train_size)
        g2s.append(g2)
        traces.append(trace)
    value = estimators.summarize(g2s, traces).b_simple
    return value if math.isfinite(value) else None


def _flat_grad(workload: Workload, model: torch.nn.Module, inputs, targets) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(workload.step_fn(model, (inputs, targets), workload.loss), params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().double() for g, p in zip(grads, params)])


# ---------------------------------------------------------------------------------------------
# The measurement


@dataclasses.dataclass(kw_only=True)
class BranchReport:
    """The critical batch at each checkpoint, the schedule it implies and what the measurement cost."""

    workload: str
    config: StudyConfig
    branch: BranchConfig
    lr_rule: str
    samples: int
    """Samples every branch trained."""
    branches: list[dict]
    schedule: list[dict]
    reference_run: dict | None
    """The reference run ``branch_at`` trained: its steps to the target, whether it reached it, its samples."""
    branch_samples_total: int
    out: str
    engine: BranchEngine = "vmap"
    """What trained the branches: vmap (vectorized, in this process) or ddp (real ranks)."""
    engine_reason: str = ""
    world_size: int | None = None
    """The ranks the ddp engine trained the branches on (None: vectorized)."""
    strategy: str | None = None
    """Their parallelism strategy: ddp, fsdp or hsdp (None: vectorized)."""
    own_optimizer: dict | None = None
    """The spec's own optimizer, where the branches trained with it instead of the config's (optim.describe)."""
    seconds: float = 0.0

    @property
    def reference_samples(self) -> int | None:
        """One reference run's samples: the one trained here, else the latest checkpoint's samples seen."""
        if self.reference_run is not None:
            return self.reference_run["samples"]
        return max((b["samples_seen"] for b in self.branches), default=0) or None

    def to_json(self) -> dict:
        cfg = self.config
        reference = self.reference_samples
        return finite({
            "workload": self.workload, "optimizer": self.own_optimizer or cfg.optimizer.to_json(),
            "engine": self.engine, "engine_reason": self.engine_reason, "world_size": self.world_size,
            "strategy": self.strategy,
            "reference": {"global_batch_size": cfg.reference_global_batch_size, "lr": cfg.reference_lr},
            "global_batch_sizes": list(self.branch.global_batch_sizes(cfg.reference_global_batch_size)),
            "lr_rule": self.lr_rule, "sweep_factor": cfg.sweep_factor, "seeds": cfg.seeds,
            "branch_samples": self.samples, "dtype": cfg.dtype,
            "tolerance": ("given" if self.branch.branch_tolerance is not None else
                          f"lag {self.branch.branch_lag:g}" if self.branch.branch_lag is not None else "seeds"),
            "reference_run": self.reference_run, "branches": self.branches, "schedule": self.schedule,
            "step_batch_size_schedule": critical.megatron_schedule(self.schedule),
            "cost": {"branch_samples": self.branch_samples_total, "reference_samples": reference,
                     "relative": self.branch_samples_total / reference if reference else None,
                     "per_checkpoint_relative": [b["branch_samples"] / reference if reference else None
                                                 for b in self.branches]},
            "out": self.out, "seconds": self.seconds,
        })


def engine_for(workload: Workload, options: StudyOptions) -> tuple[BranchEngine, str]:
    """(engine, why): vectorized where the spec allows it and nothing asks for ranks, else on real ranks."""
    ranks = _needs_ranks(workload, options)
    if options.engine == "ddp":
        return "ddp", "asked for"
    if ranks and options.engine == "vmap":
        raise UsageError(f"{{engine}} vmap cannot train these branches: {ranks}; use {{engine}} ddp (or auto)")
    if ranks:
        return "ddp", ranks
    return "vmap", ("asked for" if options.engine == "vmap" else
                    "the model and optimizer vectorize: every run of a batch trains at once in this process")


def _needs_ranks(workload: Workload, options: StudyOptions) -> str:
    """Why the branches must train on ranks ('' when nothing says so)."""
    if under_torchrun():
        return "under torchrun the branches train across the job's ranks"
    if not options.wraps_in_ddp:
        return f"the {options.strategy} strategy wraps the model on ranks"
    if workload.not_vectorized:
        return f"the spec cannot be vectorized: {workload.not_vectorized}"
    return ""


def check_branches(workload: Workload, config: StudyConfig, branch: BranchConfig,
                   world_size: int | None = None) -> None:
    """Refuse what the branches cannot train, before anything trains (``world_size``: the ranks they train on,
    None when vectorized)."""
    reference = config.reference_global_batch_size
    largest = branch.global_batch_sizes(reference)[-1]
    if largest > workload.train_size:
        raise UsageError(f"the largest branched global batch {largest} is larger than the {workload.train_size} "
                         "training samples: lower {branch_doublings} or {reference_global_batch_size}")
    # Every branched batch is the reference × 2^i: the reference splitting evenly is enough.
    if world_size is not None and reference % world_size:
        raise UsageError(f"the reference global batch {reference} does not split evenly over {world_size} ranks "
                         f"({{world_size}}): give a {{reference_global_batch_size}} that is a multiple of {world_size}")
    if config.seeds < 2 and branch.branch_tolerance is None and branch.branch_lag is None:
        raise UsageError("the default tolerance is the reference batch's spread over its seeds, and one seed has "
                         "none: give {seeds} 2 or more, a {branch_tolerance} or a {branch_lag}")
    branch.samples(reference)
    held_out(workload)


def notes(config: StudyConfig, checkpoint: Checkpoint) -> list[str]:
    """What the user should know of a checkpoint that loaded: a missing optimizer state, an lr unlike --ref-lr."""
    saved = checkpoint.optimizer
    where = checkpoint.source
    keeps_state = config.optimizer.adam or bool(config.optimizer.momentum)
    if saved is None or (keeps_state and not saved.get("state")):
        return [f"{where} has no optimizer state: its branches start with a fresh optimizer, as a restart would"]
    lrs = {group.get("lr") for group in saved.get("param_groups", [])}
    lr = next(iter(lrs)) if len(lrs) == 1 else None
    if isinstance(lr, int | float) and not math.isclose(lr, config.reference_lr, rel_tol=0.01):
        return [f"{where}'s optimizer ran at lr {lr:g}, and the branches scale from the reference lr "
                f"{config.reference_lr:g}: give the run's lr there as --ref-lr"]
    return []


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Setup:
    """What the branches train on, decided (and every checkpoint file read) before anything trains."""

    workload: Workload
    config: StudyConfig
    branch: BranchConfig
    options: StudyOptions
    engine: BranchEngine
    why: str
    world_size: int | None
    device: torch.device
    checkpoints: list[Checkpoint]


def measure(workload: Workload, config: StudyConfig, branch: BranchConfig, options: StudyOptions | None = None, *,
            progress: Progress = silent, launch_config: LaunchConfig | None = None) -> BranchReport:
    """Branch from each checkpoint (``branch_from``) or from the reference run (``branch_at``), judge the critical
    batch at each, and write ``branched.json`` under ``out``.

    Under torchrun every process calls this: the branches train across the job's ranks, and rank 0 alone writes
    branched.json (every rank returns the same report)."""
    from ddplab.study.run import resolve_device

    options = options or StudyOptions()
    engine, why = engine_for(workload, options)
    world_size = world_size_for(None, default=options.world_size) if engine == "ddp" else None
    check_branches(workload, config, branch, world_size)
    # Every checkpoint is read and checked before the first branch trains.
    checkpoints = [load_checkpoint(workload, config, path) for path in branch.branch_from or ()]
    setup = _Setup(workload=workload, config=config, branch=branch, options=options, engine=engine, why=why,
                   world_size=world_size, device=resolve_device(options.device), checkpoints=checkpoints)
    if under_torchrun():
        return launch(_measure_in_group, launch_config or LaunchConfig(), setup, progress)[0]
    return _measure(setup, progress, launch_config, None)


def _measure_in_group(ctx: RankContext, setup: _Setup, progress: Progress) -> BranchReport:
    # The group stays up for the whole measurement: each checkpoint's launch joins it.
    return _measure(setup, progress if ctx.is_main else silent, LaunchConfig(), ctx)


def _measure(setup: _Setup, progress: Progress, launch_config: LaunchConfig | None,
             ctx: RankContext | None) -> BranchReport:
    from ddplab.study.run import check_out

    started = time.monotonic()
    workload, config, branch, options = setup.workload, setup.config, setup.branch, setup.options
    main = ctx is None or ctx.is_main
    if main:
        check_out(options.out)
    # Under torchrun what trains in-process (the reference run, B_simple) does so on the rank's own device.
    device = ctx.device if ctx is not None and setup.device.type == "cuda" else setup.device
    samples = branch.samples(config.reference_global_batch_size)
    batches = branch.global_batch_sizes(config.reference_global_batch_size)
    rule = branch.lr_rule(config.optimizer.adam)
    per_checkpoint = sum(samples // b for b in batches)
    reference_steps = config.max_steps * 2 if branch.branch_at else 0
    total = reference_steps + per_checkpoint * (len(branch.branch_at or ()) or len(setup.checkpoints))
    advance = _Advance(progress, total)
    train = _trainer(setup, device, launch_config, advance)
    cache = BranchCache(options.out, _cache_setting(setup, samples), fresh=options.fresh,
                        by_group=setup.engine == "vmap") if main else None
    with threads(options.threads):
        checkpoints, reference_run = setup.checkpoints, None
        if branch.branch_at:
            checkpoints, reference_run = reference_checkpoints(workload, config, branch.branch_at, device, advance)
            if ctx is not None and ctx.world_size > 1:
                checkpoints, reference_run = _rank_zeros(checkpoints, reference_run)
            advance.skip_to(reference_steps)
        found = [_branch_from(workload, config, branch, checkpoint, rule, samples, device,
                              _Training(train, cache, checkpoint, samples, advance, ctx))
                 for checkpoint in checkpoints]
    advance.finish()
    steps = critical.schedule([(f["samples_seen"], f["critical_batch_size"],
                                {row["global_batch_size"]: row["lr"] for row in f["batches"]}) for f in found],
                              config.reference_global_batch_size, config.reference_lr)
    on_ranks = setup.engine == "ddp"
    report = BranchReport(workload=workload.name, config=config, branch=branch, lr_rule=rule, samples=samples,
                          branches=found, schedule=steps, reference_run=reference_run,
                          branch_samples_total=sum(f["branch_samples"] for f in found), out=options.out,
                          engine=setup.engine,
                          engine_reason=setup.why, world_size=setup.world_size,
                          strategy=options.strategy if on_ranks else None,
                          own_optimizer=workload.own_optimizer)
    report.seconds = time.monotonic() - started
    if main:
        write_json_atomic(os.path.join(options.out, "branched.json"), report.to_json())
    return report


def _rank_zeros(checkpoints: list[Checkpoint], run: dict) -> tuple[list[Checkpoint], dict]:
    """Rank 0's reference checkpoints on every rank: each trained its own, and the branches must start alike."""
    shared = [checkpoints, run]
    dist.broadcast_object_list(shared, src=0)
    return shared[0], shared[1]


Trainer = Callable[[Checkpoint, Groups, int, "Stop | None"], Trained]
"""Trains one checkpoint's branches: (checkpoint, groups, samples, stop) -> each run's held-out losses, the batches in
order and none after the first at which ``stop`` says the judgement is settled."""
Stop = Callable[[Trained], bool]


def _trainer(setup: _Setup, device: torch.device, launch_config: LaunchConfig | None, advance) -> Trainer:
    """The engine's way of training one checkpoint's branches, batch after batch."""
    workload, config = setup.workload, setup.config
    if setup.engine == "vmap":
        def vectorized(checkpoint: Checkpoint, groups: Groups, samples: int, stop: Stop | None) -> Trained:
            trained: Trained = {}
            for batch, (runs, record) in groups.items():
                trained[batch] = train_branches(workload, config, checkpoint, batch, runs, samples, device=device,
                                                record=record, advance=advance)
                if stop is not None and stop(trained):
                    break
            advance(_untrained_steps(groups, trained, samples))
            return trained

        return vectorized
    from ddplab.study.engines.ddp_branches import train_branches_ddp
    from ddplab.study.run import build_engine

    engine = build_engine("ddp", device, setup.options, launch_config)

    def on_ranks(checkpoint: Checkpoint, groups: Groups, samples: int, stop: Stop | None) -> Trained:
        return train_branches_ddp(workload, config, checkpoint, groups, samples, engine=engine, stop=stop,
                                  advance=advance)

    return on_ranks


def _untrained_steps(groups: Groups, trained: Trained, samples: int) -> int:
    """The steps of the batches the ladder left out: the progress bar counts them done."""
    return sum(samples // batch for batch in groups if batch not in trained)


def _branch_from(workload: Workload, config: StudyConfig, branch: BranchConfig, checkpoint: Checkpoint, rule: str,
                 samples: int, device: torch.device, train: _Training) -> dict:
    """One checkpoint's branches, batch after batch up the grid until the judgement is settled, each batch's sweep
    extended past an edge its best lr sits on; judged."""
    reference = config.reference_global_batch_size
    ref_steps = samples // reference
    lag_step = round((1 - branch.branch_lag) * ref_steps) if branch.branch_lag is not None else None
    groups: Groups = {}
    for batch in branch.global_batch_sizes(reference):
        lrs = critical.sweep(critical.scaled_lr(config.reference_lr, batch, reference, rule), config.sweep_factor)
        groups[batch] = ([(lr, seed) for lr in lrs for seed in range(config.seeds)],
                         {lag_step} if batch == reference and lag_step is not None else set())
    judge = Judge(groups=groups, reference=reference, samples=samples, tolerance=branch.branch_tolerance,
                  lag_step=lag_step)
    trained: Trained = {}
    while True:
        remaining = {batch: group for batch, group in groups.items() if batch not in trained}
        if remaining and (branch.branch_every_batch or not trained or not judge.settled(trained)):
            trained.update(train(remaining, None if branch.branch_every_batch else
                                 dataclasses.replace(judge, prior=dict(trained))))
        extra = _extensions(groups, trained, samples, config)
        if not extra:
            break
        # An lr past the edge may turn a miss into a match: the loop then goes on up the grid.
        train.advance.grow(sum(samples // batch for batch in extra))
        for batch, losses in train(extra, None).items():
            groups[batch] = (groups[batch][0] + extra[batch][0], groups[batch][1])
            trained[batch] = {step: trained[batch][step] + losses[step] for step in trained[batch]}
    judged = judge(trained)
    b_simple = b_simple_at(workload, config, checkpoint, branch.global_batch_sizes(reference)[-1], device)
    return {"samples_seen": checkpoint.samples_seen, "source": checkpoint.source, "notes": list(checkpoint.notes),
            "critical_batch_size": judged.critical_batch_size, "interval": list(judged.interval),
            "at_edge": judged.at_edge, "b_simple": b_simple, "reference_loss": judged.reference_loss,
            "tolerance": judged.tolerance, "batches": judged.rows,
            "untrained_global_batch_sizes": [batch for batch in groups if batch not in trained],
            "branch_samples": sum(len(groups[batch][0]) for batch in trained) * samples}


def _extensions(groups: Groups, trained: Trained, samples: int, config: StudyConfig) -> Groups:
    """Each trained batch's next lr past the edge of its sweep (:func:`critical.next_lr`), with every seed."""
    extra: Groups = {}
    for batch in trained:
        runs, record = groups[batch]
        lr = critical.next_lr(_by_lr(runs, trained[batch][samples // batch]), config.sweep_factor)
        if lr is not None:
            extra[batch] = ([(lr, seed) for seed in range(config.seeds)], record)
    return extra


@dataclasses.dataclass(frozen=True, kw_only=True)
class Judge:
    """How one checkpoint's branches are judged, from the batches trained so far (picklable: ranks call it too)."""

    groups: Groups
    reference: int
    samples: int
    tolerance: float | None
    lag_step: int | None
    prior: Trained = dataclasses.field(default_factory=dict)
    """Batches trained before: what a later call adds is judged with them."""

    def __call__(self, trained: Trained) -> critical.Judgement:
        trained = {**self.prior, **trained}
        losses = {batch: _by_lr(self.groups[batch][0], trained[batch][self.samples // batch]) for batch in trained}
        tolerance = self.tolerance
        if self.lag_step is not None:
            earlier = _by_lr(self.groups[self.reference][0], trained[self.reference][self.lag_step])
            lr, end = critical.best(losses[self.reference])
            tolerance = critical.lag_tolerance(end, median(earlier[lr])) if lr is not None else 0.0
        return critical.judge(losses, self.reference, tolerance)

    def settled(self, trained: Trained) -> bool:
        """No larger batch can change the judgement (:func:`critical.settled`)."""
        return critical.settled(self(trained))


class _Training:
    """One checkpoint's branches trained through the cache: what it holds is read (by rank 0, under torchrun, and
    shared), what it lacks is trained and kept."""

    def __init__(self, train: Trainer, cache: BranchCache | None, checkpoint: Checkpoint, samples: int,
                 advance: _Advance, ctx: RankContext | None):
        self.train, self.cache, self.checkpoint, self.samples, self.advance = train, cache, checkpoint, samples, advance
        self.shared = ctx is not None and ctx.world_size > 1
        self.digest = checkpoint_digest(checkpoint.model, checkpoint.optimizer, checkpoint.samples_seen) \
            if cache is not None else None

    def __call__(self, groups: Groups, judge: Judge | None) -> Trained:
        """The batches of ``groups`` in order, each read from the cache where it is there, none after one at which
        ``judge`` finds the judgement settled (no judge: every batch)."""
        trained: Trained = {}
        order = list(groups)
        found = {batch: self._cached(batch, *groups[batch]) for batch in order}
        while order:
            if found[order[0]] is not None:
                batch = order.pop(0)
                trained[batch] = found[batch]
                self.advance(self.samples // batch)
            else:
                # The batches up to the next cached one train together (one launch on ranks).
                block = {}
                while order and found[order[0]] is None:
                    batch = order.pop(0)
                    block[batch] = groups[batch]
                stop = dataclasses.replace(judge, prior={**judge.prior, **trained}).settled if judge else None
                fresh = self.train(self.checkpoint, block, self.samples, stop)
                for batch, losses in fresh.items():
                    if self.cache is not None:
                        self.cache.save(self.digest, batch, block[batch][0], losses)
                trained.update(fresh)
            if judge is not None and judge.settled({**judge.prior, **trained}):
                break
        return trained

    def _cached(self, batch: int, runs: Runs, record: set[int]) -> dict[int, list[float]] | None:
        found = self.cache.load(self.digest, batch, runs, record | {self.samples // batch}) \
            if self.cache is not None else None
        if self.shared:
            import torch.distributed as dist

            # Rank 0 reads the cache: every rank must take the same batches from it.
            shared = [found]
            dist.broadcast_object_list(shared, src=0)
            found = shared[0]
        return found


def _cache_setting(setup: _Setup, samples: int) -> dict:
    """What a branch's losses depend on besides its checkpoint, batch, lr and seed."""
    options, config = setup.options, setup.config
    ranks = {"world_size": setup.world_size, "strategy": options.strategy, "replicate": options.replicate,
             "reduce_dtype": options.reduce_dtype, "max_per_device": options.max_batch_size_per_device} \
        if setup.engine == "ddp" else {}
    return {"workload": setup.workload.fingerprint, "optimizer": config.optimizer.to_json(), "dtype": config.dtype,
            "own_optimizer": setup.workload.own_optimizer, "samples": samples, "engine": setup.engine,
            "device": setup.device.type, **ranks}


def _by_lr(runs: list[tuple[float, int]], losses: list[float]) -> dict[float, list[float]]:
    out: dict[float, list[float]] = {}
    for (lr, _), loss in zip(runs, losses):
        out.setdefault(lr, []).append(loss)
    return out


class _Advance:
    """The progress callback told of steps as they are trained, toward ``total``."""

    def __init__(self, progress: Progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, steps: int) -> None:
        self.done += steps
        # Lrs past a sweep's edge may still add steps: the bar reaches its end only when the measurement does.
        self.progress(min(self.done, self.total - 1), self.total, "")

    def finish(self) -> None:
        self.done = self.total
        self.progress(self.total, self.total, "")

    def grow(self, steps: int) -> None:
        """Steps the measurement adds as it goes (lrs past a sweep's edge)."""
        self.total += steps

    def skip_to(self, done: int) -> None:
        """Steps budgeted but not needed (a reference run that reached its target early) count as done."""
        if done > self.done:
            self(done - self.done)
