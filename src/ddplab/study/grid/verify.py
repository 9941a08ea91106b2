"""``--verify-ddp``: replay grid points of the vectorized engine on real DDP ranks and compare parameters."""

from __future__ import annotations

import dataclasses

import torch

from ddplab.errors import UsageError
from ddplab.runtime import strategies
from ddplab.runtime.launch import LaunchConfig, RankContext, launch
from ddplab.serialize import finite
from ddplab.study import workloads
from ddplab.study.config import StudyConfig
from ddplab.study.engines.vmap import Group, cast
from ddplab.study.optim import torch_dtype, torch_optimizer
from ddplab.study.orders import RankShards
from ddplab.study.rules import sweep
from ddplab.study.runs import grid_group
from ddplab.study.workloads import Workload

Point = tuple[int, float, int]
"""(global batch, lr, seed)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyResult:
    world_size: int
    steps: int
    dtype: str
    points: list[dict]
    """Per grid point: its global batch, lr, seed and the largest parameter difference."""
    max_abs_diff: float | None
    max_rel_diff: float | None
    nothing_to_verify: str | None = None
    """Why no point was replayed; None when some were."""

    def to_json(self) -> dict:
        return finite(dataclasses.asdict(self))


def verify_points(config: StudyConfig, count: int, world_size: int, tuned: list[dict] | None = None) -> list[Point]:
    """``count`` (batch, lr, seed) grid points spread over the batch sizes DDP can split over ``world_size``.

    With the tuned curve, its best lrs (runs that train well, not ones on their way to diverging,
    where any rounding difference grows without bound); else any grid point.
    """
    if tuned:
        points = [(p["global_batch_size"], p["lr"], seed) for p in tuned if p["global_batch_size"] % world_size == 0
                  for seed in range(config.seeds)]
    else:
        points = [(b, lr, seed) for b in sorted(config.global_batch_sizes) if b % world_size == 0
                  for lr in sweep.lrs(config, b) for seed in range(config.seeds)]
    if not points:
        raise UsageError(f"no global batch in {{global_batch_sizes}} divides evenly over {world_size} ranks "
                         "({verify_world_size})")
    count = min(count, len(points))
    return [points[round(i * (len(points) - 1) / max(1, count - 1))] for i in range(count)]


def simulated_params(workload: Workload, config: StudyConfig, points: list[Point],
                     steps: int) -> list[dict[str, torch.Tensor]]:
    """Each point's parameters after ``steps`` steps of the vectorized engine (one group per batch size)."""
    out = {}
    for b in sorted({p[0] for p in points}):
        runs = [(lr, seed) for pb, lr, seed in points if pb == b]
        group = Group(workload, config, grid_group(config, b, runs))
        for step in range(steps):
            group.step(step, measure=False)
        for row, key in enumerate(runs):
            out[(b, *key)] = {n: p[row].clone() for n, p in group.params.items()}
    return [out[p] for p in points]


def verify_ddp(workload: Workload, config: StudyConfig, count: int, *, world_size: int = 2, steps: int = 20,
               tuned: list[dict] | None = None, launch_config: LaunchConfig | None = None) -> VerifyResult:
    """Re-run ``count`` grid points through real DDP ranks (ddplab.runtime.launch) and compare parameters."""
    points = verify_points(config, count, world_size, tuned)
    simulated = simulated_params(workload, config, points, steps)
    launch_config = dataclasses.replace(launch_config or LaunchConfig(), world_size=world_size)
    real = launch(_ddp_points, launch_config, workload.source, config, points, steps)[0]
    diffs = [max(float((sim[n] - ddp[n]).abs().max()) for n in sim) for sim, ddp in zip(simulated, real)]
    scales = [max(float(sim[n].abs().max()) for n in sim) for sim in simulated]
    return VerifyResult(world_size=world_size, steps=steps, dtype=config.dtype,
                        points=[{"global_batch_size": b, "lr": lr, "seed": seed, "max_abs_diff": d}
                                for (b, lr, seed), d in zip(points, diffs)],
                        max_abs_diff=max(diffs), max_rel_diff=max(d / max(s, 1e-30) for d, s in zip(diffs, scales)))


def _ddp_points(ctx: RankContext, source: workloads.Source, config: StudyConfig, points: list[Point],
                steps: int) -> list[dict[str, torch.Tensor]]:
    # Rebuilt here: a spawned rank (NCCL) cannot receive closures or a loaded spec through pickle.
    workload = workloads.load(source)
    dtype = torch_dtype(config)
    inputs = cast(workload.train[0], dtype).to(ctx.device)
    targets = cast(workload.train[1], dtype).to(ctx.device)
    out = []
    for global_batch, lr, seed in points:
        torch.manual_seed(seed)
        model = workload.model().to(dtype).to(ctx.device)
        # The default strategy is plain DDP, the one the replay compares the vectorized runs with.
        ddp = strategies.get().wrap(model, ctx)
        optimizer = torch_optimizer(config.optimizer, ddp.parameters(), lr)
        shards = RankShards(workload.train_size, global_batch, ctx, seed)
        for step in range(steps):
            index = shards.batch(step).to(ctx.device)
            optimizer.zero_grad(set_to_none=True)
            workload.loss(ddp(inputs[index]), targets[index]).backward()
            optimizer.step()
        out.append({n: p.detach().cpu().clone() for n, p in model.named_parameters()})
        del ddp, optimizer, model
    return out
