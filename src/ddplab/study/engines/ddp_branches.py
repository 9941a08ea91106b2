"""Branches on real ranks: from one checkpoint, every (lr, seed) run of every branched global batch trained on
``world_size`` DDP ranks (or FSDP2's, HSDP's), one launch per checkpoint.

For what the vectorized branches (:mod:`ddplab.study.engines.vmap_branches`) cannot train: a spec's own
``step()``, an optimizer outside SGD, Adam and AdamW, a model that does not vmap, a strategy that shards the model,
a study under torchrun.
Each run loads the checkpoint's model state, is wrapped by the strategy, builds its own torch optimizer (the spec's
where it has one, :func:`~ddplab.study.engines.ddp.run_optimizer`) and takes the checkpoint's torch.optim state into
it, keeping its own hyperparameters (its lr). Step k of global batch B trains on the samples the vectorized
:class:`~ddplab.study.orders.Stream` gives at that seed, each rank its DistributedSampler share (every W-th), in
micro-batches under ``no_sync`` when the per-rank batch is capped: both engines see the same samples. The held-out
loss is rank 0's (every rank's where the forward is a collective), broadcast, so every rank returns the same.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddplab.errors import UsageError
from ddplab.runtime import strategies
from ddplab.runtime.launch import LaunchConfig, RankContext, launch
from ddplab.runtime.launch_config import under_torchrun
from ddplab.runtime.ranks import rank_errors
from ddplab.study import workloads
from ddplab.study.branched.checkpoint import BranchTrainer, Checkpoint, Groups, Stop, Trained, held_out
from ddplab.study.config import StudyConfig, StudyOptions
from ddplab.study.engines.choice import build_engine
from ddplab.study.engines.ddp import DdpEngine, DdpPlan, split
from ddplab.study.engines.registry import EngineKind, register
from ddplab.study.engines.vmap import cast
from ddplab.study.optim import torch_dtype
from ddplab.study.orders import Stream
from ddplab.study.workloads import run_optimizer


def train_branches_ddp(workload: workloads.Workload, config: StudyConfig, checkpoint: Checkpoint, groups: Groups,
                       samples: int, *, engine: DdpEngine, stop: Callable[[Trained], bool] | None = None,
                       advance: Callable[[int], None] = lambda steps: None) -> Trained:
    """Train every batch's runs of ``groups`` from ``checkpoint`` for ``samples`` on the engine's ranks, in one
    launch: {global batch: {steps: each run's held-out loss after them}}, as the vectorized
    :func:`~ddplab.study.engines.vmap_branches.train_branches`. The batches train in order, and none after one at
    which ``stop`` (every rank holds the same losses, so every rank decides alike) says the judgement is settled."""
    if engine.strategy.owns_optimizer:
        raise UsageError(f"branches load the checkpoint's optimizer state into a torch optimizer, which the "
                         f"{engine.strategy.name} strategy's engine owns and partitions: use ddp, fsdp or hsdp")
    world_size = engine.launch_config.world_size
    plans = {batch: split(batch, world_size, engine.max_per_device) for batch in groups}
    # Under torchrun this process is rank 0 and moves the bar step by step; a forked rank's copy of it must not.
    in_process = under_torchrun()
    with rank_errors():
        trained = launch(_on_rank, engine.launch_config, workload.source, config, checkpoint, groups, samples, plans,
                         engine.strategy, stop, advance if in_process else None)[0]
    # Spawned ranks' steps, and the steps of batches the ladder left out, count as done here.
    advance(sum(samples // batch for batch in groups if not in_process or batch not in trained))
    return trained


def _on_rank(ctx: RankContext, source: workloads.Source, config: StudyConfig, checkpoint: Checkpoint, groups: Groups,
             samples: int, plans: dict[int, DdpPlan], strategy: strategies.Strategy,
             stop: Callable[[Trained], bool] | None, advance: Callable[[int], None] | None) -> Trained:
    # Rebuilt in the rank: a spawned rank cannot receive closures or a loaded spec through pickle.
    workload = workloads.load(source)
    dtype = torch_dtype(config)
    train = workload.batches(ctx.device, dtype)
    val_inputs, val_targets = held_out(workload)
    val = cast(val_inputs, dtype).to(ctx.device), cast(val_targets, dtype).to(ctx.device)
    out: Trained = {}
    for batch, (runs, record) in groups.items():
        branch = _Branch(ctx, workload, config, checkpoint, batch, plans[batch], strategy, train, val)
        steps, losses = samples // batch, []
        for index, (lr, seed) in enumerate(runs):
            losses.append(branch.train(lr, seed, steps, record))
            if advance is not None:
                # The bar counts a batch's steps once: each run that ends moves it by its share.
                advance((index + 1) * steps // len(runs) - index * steps // len(runs))
        out[batch] = {step: [run[step] for run in losses] for step in losses[0]}
        if stop is not None and stop(out):
            break
    return out


class _Branch:
    """One checkpoint's runs at one global batch on this rank, one after another."""

    def __init__(self, ctx: RankContext, workload: workloads.Workload, config: StudyConfig, checkpoint: Checkpoint,
                 global_batch: int, plan: DdpPlan, strategy: strategies.Strategy,
                 train: Callable[[torch.Tensor], Any], val: tuple[torch.Tensor, torch.Tensor]):
        self.ctx, self.workload, self.config, self.checkpoint = ctx, workload, config, checkpoint
        self.global_batch, self.plan, self.strategy, self.data, self.val = global_batch, plan, strategy, train, val
        self.dtype = torch_dtype(config)

    def train(self, lr: float, seed: int, steps: int, record: set[int]) -> dict[int, float]:
        """One run: {steps: its held-out loss after them}, at the last step and those in ``record``."""
        torch.manual_seed(seed)
        model = self.workload.model().to(self.dtype).to(self.ctx.device)
        model.load_state_dict({key: cast(value, self.dtype) for key, value in self.checkpoint.model.items()})
        wrapped = self.strategy.wrap(model, self.ctx)
        optimizer = run_optimizer(self.workload, self.config, wrapped.parameters(), lr)
        load_state(optimizer, self.checkpoint.optimizer)
        rank, ranks = self.strategy.data_parallel_rank(wrapped), self.strategy.data_parallel_size(wrapped)
        stream = Stream(self.workload.train_size, self.global_batch, [seed], start=self.checkpoint.samples_seen)
        # Dropout's masks differ per rank and per run, the same every time the branches train.
        torch.manual_seed(1_000_003 * seed + self.ctx.rank)
        out = {0: self.held_out(wrapped)} if 0 in record else {}
        for step in range(steps):
            # The seed's global batch as the vectorized engine takes it; this rank's share is every W-th sample.
            self.step(wrapped, stream.indices(step)[0][rank::ranks].to(self.ctx.device))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step + 1 in record or step + 1 == steps:
                out[step + 1] = self.held_out(wrapped)
        del wrapped, optimizer, model
        return out

    def step(self, wrapped: torch.nn.Module, index: torch.Tensor) -> None:
        accumulation = self.plan.accumulation_steps
        for micro, part in enumerate(index.chunk(accumulation)):
            last = micro == accumulation - 1
            with contextlib.nullcontext() if last else self.strategy.no_sync(wrapped):
                loss = self.workload.step_fn(wrapped, self.data(part), self.workload.loss)
                (loss if accumulation == 1 else loss / accumulation).backward()

    def held_out(self, wrapped: torch.nn.Module) -> float:
        """The run's training loss on the held-out split, in eval mode, the same on every rank (inf: diverged)."""
        module = self.strategy.module(wrapped)
        shared = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        if self.ctx.is_main or self.strategy.collective_forward:
            module.eval()
            try:
                with torch.no_grad():
                    shared.fill_(self.workload.loss(module(self.val[0]), self.val[1]).double())
            finally:
                module.train()
        # FSDP2's ranks all ran the forward; rank 0's number is everyone's.
        dist.broadcast(shared, src=0)
        value = float(shared)
        return value if math.isfinite(value) else math.inf


def load_state(optimizer: torch.optim.Optimizer, saved: dict | None) -> None:
    """The checkpoint's torch.optim state, parameter by parameter in order, into ``optimizer``, whose hyperparameters
    (the run's lr) stay its own; a sharded parameter (FSDP2's DTensor) gets its shard of each state tensor."""
    if not saved or not saved.get("state"):
        return
    params = [param for group in optimizer.param_groups for param in group["params"]]
    ids = [index for group in saved["param_groups"] for index in group["params"]]
    for param, index in zip(params, ids):
        if index in saved["state"]:
            # torch.optim steps its state in place: a copy keeps the checkpoint for the next run.
            optimizer.state[param] = {key: _like(param, key, value)
                                      for key, value in copy.deepcopy(saved["state"][index]).items()}


def _like(param: torch.Tensor, key: str, value):
    """A state value as torch.optim's load_state_dict casts it (floating tensors to the parameter's dtype and device,
    the step count left as it is), sharded like the parameter."""
    if not torch.is_tensor(value) or key == "step":
        return value
    value = value.to(device=param.device, dtype=param.dtype if value.is_floating_point() else value.dtype)
    if hasattr(param, "placements") and value.shape == param.shape:
        from torch.distributed.tensor import distribute_tensor

        # Every rank holds the whole checkpoint: each keeps its own shard, with no communication.
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


def branch_trainer(workload: workloads.Workload, config: StudyConfig, device: torch.device, options: StudyOptions,
                   launch_config: LaunchConfig | None, advance: Callable[[int], None]) -> BranchTrainer:
    """How this engine trains one checkpoint's branches: every batch in one launch on its ranks."""
    engine = build_engine(DdpEngine.name, device, options, launch_config)

    def on_ranks(checkpoint: Checkpoint, groups: Groups, samples: int, stop: Stop | None) -> Trained:
        return train_branches_ddp(workload, config, checkpoint, groups, samples, engine=engine, stop=stop,
                                  advance=advance)

    return on_ranks


register(EngineKind(name=DdpEngine.name, vectorized=False, branches=branch_trainer))
