"""The study's DDP engine against a plain DDP training loop of the same steps, per grid point.

Both run inside one launch of ``--world-size`` gloo ranks on the built-in digits MLP: for each
(lr, seed) point, the engine's own per-point code (``ddplab.study.engines.ddp._train_one``: the loss
all-reduced at every step, rank 0 evaluating every ``eval_every`` steps and broadcasting) and a
plain loop (model, DDP, torch.optim, the same shards), once without evaluation and once with rank 0
evaluating as often as the engine does. The target is out of reach
and patience off, so both train exactly ``--steps`` steps. The first point of each is start-up
(the issue's goal is judged after it): reported apart.

    PYTHONPATH=src python benchmarks/study_ddp_overhead.py [--out benchmarks/results/study_ddp_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from ddplab.runtime.launch import LaunchConfig, launch
from ddplab.study import workloads
from ddplab.study.config import StudyConfig, Target
from ddplab.study.engines import ddp
from ddplab.study.engines.vmap import cast, evaluate_model
from ddplab.study.optim import torch_optimizer
from ddplab.study.orders import RankShards
from ddplab.study.runs import RunResult


def _plain(ctx, workload, config, plan, inputs, targets, result, evaluate=False):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(result.seed)
    model = DistributedDataParallel(workload.model())
    optimizer = torch_optimizer(config.optimizer, model.parameters(), result.lr)
    shards = RankShards(workload.train_size, result.global_batch_size, ctx, result.seed)
    for step in range(config.max_steps):
        index = shards.batch(step)
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model(inputs[index]), targets[index]).backward()
        optimizer.step()
        if evaluate and (step + 1) % config.eval_every == 0:
            # As a user's loop measures: rank 0 evaluates, the others wait at the next step's all-reduce.
            if ctx.is_main:
                evaluate_model(workload, config, model.module)


def _plain_evaluating(*args):
    _plain(*args, evaluate=True)


def _timed(ctx, config, global_batch, points):
    workload = workloads.digits()
    inputs, targets = cast(workload.train[0], torch.float32), workload.train[1]
    plan = ddp.split(global_batch, ctx.world_size, None)
    times = {"engine": [], "plain": [], "plain_evaluating": []}
    for lr, seed in points:
        for name, fn in (("engine", ddp._train_one), ("plain", _plain), ("plain_evaluating", _plain_evaluating)):
            result = RunResult(global_batch_size=global_batch, lr=lr, seed=seed)
            torch.distributed.barrier()
            start = time.perf_counter()
            fn(ctx, workload, config, plan, inputs, targets, result)
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--points", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    config = StudyConfig(target=Target(kind="accuracy", value=1.0), max_steps=args.steps, patience=0,
                         global_batch_sizes=(args.global_batch_size, 2 * args.global_batch_size))
    points = [(0.01 * (1 + i % 3), i // 3) for i in range(args.points)]
    times = launch(_timed, LaunchConfig(world_size=args.world_size, backend="gloo"), config,
                   args.global_batch_size, points)[0]
    engine, plain, evaluating = (sum(times[k][1:]) for k in ("engine", "plain", "plain_evaluating"))
    out = {"world_size": args.world_size, "global_batch_size": args.global_batch_size, "steps": args.steps,
           "eval_every": config.eval_every, "points": args.points, "seconds": times,
           "overhead_after_first_point": engine / plain - 1,
           "overhead_over_evaluating_loop_after_first_point": engine / evaluating - 1,
           "first_point_overhead": times["engine"][0] / times["plain"][0] - 1,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
