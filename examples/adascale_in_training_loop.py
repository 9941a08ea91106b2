"""AdaScale inside your own DDP training loop, as a complete script.

    torchrun --nproc_per_node 2 examples/adascale_in_training_loop.py

A reference run was tuned at a global batch of 16: SGD at lr 0.01 for 300 steps, the lr cut 10×
at step 200. Here 2 ranks train at a global batch of 64 (S = 4) with that lr and schedule
untouched: AdaScale scales each update by the gain it measures from the gradient noise and runs
the schedule on the scale-invariant iteration τ. Rank 0 also trains the reference run itself, so
the two final losses sit side by side (the best possible loss is the label noise, 1.0).
"""

import linear_regression_spec  # beside this script: its directory is first on sys.path
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ddplab import AdaScale, GradientNoiseScale

REF_BATCH, REF_LR, REF_STEPS, MILESTONE = 16, 0.01, 300, 200
BATCH = 32  # per device: 2 ranks make a global batch of 64


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    spec = linear_regression_spec
    dataset = spec.dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    ddp_model = DistributedDataParallel(spec.model())
    optimizer, scheduler = _reference_optimizer(ddp_model)
    gns = GradientNoiseScale(ddp_model, per_device_batch_size=BATCH, every=1)
    adascale = AdaScale(optimizer, gns, reference_batch_size=REF_BATCH, scheduler=scheduler,
                        reference_steps=REF_STEPS)
    epoch = 0
    while not adascale.done:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            optimizer.zero_grad()
            spec.loss(ddp_model(x), y).backward()
            gns.step()  # after backward, before the optimizer: AdaScale reads this measurement
            optimizer.step()  # the lr of this one update is scaled by the gain
            if adascale.done:
                break
    if dist.get_rank() == 0:
        gains = [s.gain for s in adascale.history]
        reference = _reference_run(spec, dataset)
        print(f"reference, global batch {REF_BATCH}: {REF_STEPS} steps, final loss {reference:.4f}")
        print(f"AdaScale, global batch {BATCH * dist.get_world_size()} (S = {adascale.scale:g}): "
              f"{adascale.steps} steps, final loss {_loss(spec, ddp_model.module, dataset):.4f}, "
              f"gain {gains[0]:.2f} at the start → {gains[-1]:.2f} at the end")
    del ddp_model, gns, optimizer
    # Leave together: a rank that exits the instant its last collective returns can abort in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


def _reference_optimizer(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=REF_LR)
    return optimizer, torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[MILESTONE], gamma=0.1)


def _reference_run(spec, dataset) -> float:
    """The run the lr was tuned for: one process, global batch REF_BATCH, REF_STEPS steps."""
    model = spec.model()
    optimizer, scheduler = _reference_optimizer(model)
    loader = DataLoader(dataset, batch_size=REF_BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    for _, (x, y) in zip(range(REF_STEPS), loader):
        optimizer.zero_grad()
        spec.loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    return _loss(spec, model, dataset)


@torch.no_grad()
def _loss(spec, model, dataset) -> float:
    x, y = dataset.tensors
    return spec.loss(model(x), y).item()


if __name__ == "__main__":
    main()
