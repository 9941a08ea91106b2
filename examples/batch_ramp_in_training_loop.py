"""A global batch that grows with the measured noise scale, inside your own DDP training loop.

    torchrun --nproc_per_node 2 examples/batch_ramp_in_training_loop.py

Noisy linear regression (10 features, label noise 1): at weights w with d = w − w*, the noise scale
is B_simple = (D + 1) + D·s²/|d|², so it grows as training closes in on w*. Each rank loads 8
samples per micro-step; the ramp raises the accumulation steps whenever the measured B_simple
passes the global batch (from 16 up to 256), and the lr follows the linear rule with a 10-step
warmup after each jump. The script checks what must not change: every sample is drawn exactly
once per epoch over the ranks, and both ranks hold the same weights at the end. Rank 0 also trains
the same epochs at the starting batch, never growing, for the steps and the loss side by side (the
best possible loss is the label noise, 1.0).
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddplab import BatchRamp, GradientNoiseScale

D, NOISE_STD, SAMPLES, EPOCHS = 10, 1.0, 4096, 3
BATCH, LR, MAX_ACCUMULATION = 8, 0.02, 16


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, D, generator=generator)
    y = x.sum(dim=1, keepdim=True) + NOISE_STD * torch.randn(SAMPLES, 1, generator=generator)
    dataset = TensorDataset(x, y, torch.arange(SAMPLES))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = torch.nn.Linear(D, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR)
    gns = GradientNoiseScale(ddp_model, per_device_batch_size=BATCH, every=1)
    ramp = BatchRamp(ddp_model, optimizer, gns, max_accumulation_steps=MAX_ACCUMULATION, rule="linear",
                     warmup_steps=10)
    every_epoch_complete, closed_forms = True, {}
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        seen = []
        for inputs, targets, index in loader:
            seen.append(index)
            with ramp.accumulate():
                loss = torch.nn.functional.mse_loss(ddp_model(inputs), targets)
                (loss / ramp.accumulation_steps).backward()
            if ramp.should_step():
                gns.step()
                optimizer.step()
                optimizer.zero_grad()
                if ramp.changes and ramp.changes[-1].step == ramp.steps - 1:
                    closed_forms[ramp.steps - 1] = _b_simple_closed_form(model.weight)
        every_epoch_complete &= _drawn_once_over_ranks(torch.cat(seen))
    same_weights = _same_on_every_rank(model.weight.detach())
    if dist.get_rank() == 0:
        for change in ramp.changes:
            print(f"after step {change.step}: global batch {change.global_batch_size} (measured B_simple "
                  f"{change.b_simple:.1f}, closed form at these weights {closed_forms[change.step]:.1f}), "
                  f"lr ×{change.lr_factor:g}")
        fixed_steps, fixed_loss = _fixed_batch_run(x, y, global_batch=BATCH * dist.get_world_size())
        print(f"fixed global batch {BATCH * dist.get_world_size()}: {fixed_steps} steps, final loss {fixed_loss:.4f}")
        print(f"ramp: {ramp.steps} steps over the same samples, final loss {_loss(model, x, y):.4f}")
        print(f"every sample drawn exactly once per epoch over the ranks: {'yes' if every_epoch_complete else 'NO'}")
        print(f"weights identical on every rank: {'yes' if same_weights else 'NO'}")
    del ddp_model, gns, optimizer
    # Leave together: a rank that exits the instant its last collective returns can abort in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


def _fixed_batch_run(x, y, *, global_batch: int) -> tuple[int, float]:
    """The same epochs at the starting global batch and lr, never growing: one process, as DDP would train it."""
    model = torch.nn.Linear(D, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = 0
    for epoch in range(EPOCHS):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
        for start in range(0, SAMPLES, global_batch):
            index = order[start:start + global_batch]
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[index]), y[index]).backward()
            optimizer.step()
            steps += 1
    return steps, _loss(model, x, y)


@torch.no_grad()
def _loss(model, x, y) -> float:
    return torch.nn.functional.mse_loss(model(x), y).item()


def _b_simple_closed_form(weight: torch.Tensor) -> float:
    d2 = float((weight.detach() - 1).pow(2).sum())
    return (D + 1) + D * NOISE_STD ** 2 / d2


def _drawn_once_over_ranks(indices: torch.Tensor) -> bool:
    gathered = [torch.empty_like(indices) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, indices)
    return bool(torch.equal(torch.cat(gathered).sort().values, torch.arange(SAMPLES)))


def _same_on_every_rank(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


if __name__ == "__main__":
    main()
