"""The noiseless regression of regression.py as an Accelerate project trains it: Accelerator.prepare, its own
sharding of a shuffled DataLoader, accelerator.accumulate and accelerator.backward, under torchrun.

    torchrun --nproc_per_node 2 regression_accelerate.py [--accumulation 2] [--steps 60]
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from regression import D, dataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulation", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    set_seed(0)  # the shuffled order, drawn on rank 0 and shared: the same on every run
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulation)
    model = torch.nn.Linear(D, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    while steps < args.steps:
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            steps += accelerator.sync_gradients
            if steps == args.steps:
                break
    accelerator.end_training()


if __name__ == "__main__":
    main()
