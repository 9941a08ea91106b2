"""The gradient noise scale inside your own DDP training loop, as a complete script.

    torchrun --nproc_per_node 2 examples/noise_in_training_loop.py

Linear regression with Gaussian inputs held at fixed weights (lr 0), where B_simple is known
exactly (examples/linear_regression_spec.py): the printed estimate should land near 12.
"""

import linear_regression_spec  # beside this script: its directory is first on sys.path
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ddplab import GradientNoiseScale

BATCH, STEPS = 16, 400


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    spec = linear_regression_spec
    dataset = spec.dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    ddp_model = DistributedDataParallel(spec.model())
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.0)  # weights held fixed: B_simple stays put
    # Every step measured here; inside real training the default (every=4) costs under 1% of a step.
    gns = GradientNoiseScale(ddp_model, per_device_batch_size=BATCH, every=1, dataset_size=len(dataset))
    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            optimizer.zero_grad()
            spec.loss(ddp_model(x), y).backward()
            gns.step()  # after backward, before the optimizer touches the gradients
            optimizer.step()
            step += 1
            if step == STEPS:
                break
    summary = gns.summary()
    if dist.get_rank() == 0:
        low, high = summary.b_simple_ci95
        print(f"B_simple {summary.b_simple:.3g}, 95% interval [{low:.3g}, {high:.3g}] over {summary.steps} steps "
              f"(exact: {spec.TRUE_B_SIMPLE:g})")
    del ddp_model, gns, optimizer
    # Leave together: a rank that exits the instant its last collective returns can abort in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
