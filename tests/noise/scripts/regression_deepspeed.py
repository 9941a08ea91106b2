"""The noiseless regression of regression.py as a DeepSpeed project trains it: deepspeed.initialize with a client
SGD at lr 0 (the weights stay at 0), a DataLoader over a DistributedSampler, engine(x), engine.backward(loss) and
engine.step() after every micro-batch, the accumulation left to the engine.

    torchrun --nproc_per_node 2 regression_deepspeed.py [--stage 2] [--accumulation 2] [--steps 60]
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from regression import D, dataset
from torch.utils.data import DataLoader, DistributedSampler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulation", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(D, 1, bias=False))
    torch.nn.init.zeros_(model[0].weight)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": args.accumulation,
              "zero_optimization": {"stage": args.stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                           config=config)
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    steps, epoch = 0, 0
    while steps < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            engine.backward(F.mse_loss(engine(x), y))
            steps += engine.is_gradient_accumulation_boundary()
            engine.step()
            if steps == args.steps:
                break
        epoch += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
