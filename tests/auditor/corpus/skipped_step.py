"""A dynamic loss scale that skips the optimizer step on a non-finite gradient, as GradScaler does.

At step 2 rank 1 gets a batch with an infinite input; DDP's all-reduce carries the non-finite gradient to every
rank, the ranks agree by an all-reduce of their found-inf flags, and all of them skip `optimizer.step()` and
halve the scale. The model takes a keyword argument and returns a dict, as many model libraries do. Two model
configurations:

  --config unused  find_unused_parameters=True; an auxiliary head joins the loss only on every third step
  --config static  static_graph=True; the auxiliary head joins the loss every step
"""

import _harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, SAMPLES, POISONED_STEP = 8, 320, 2


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU())
        self.main_head, self.aux_head = torch.nn.Linear(32, 1), torch.nn.Linear(32, 1)

    def forward(self, x, use_aux: bool = False):
        features = self.trunk(x)
        return {"prediction": self.main_head(features), "aux": self.aux_head(features) if use_aux else None}


class LossScale:
    """Scale the loss, unscale the gradients, and skip the step on every rank when any gradient is non-finite."""

    def __init__(self, init_scale=2.0 ** 10):
        self.scale = init_scale
        self.skipped = 0

    def step(self, optimizer, parameters):
        grads = [p.grad for p in parameters if p.grad is not None]
        for grad in grads:
            grad.div_(self.scale)
        found_inf = torch.tensor([float(not all(torch.isfinite(g).all() for g in grads))])
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)  # every rank makes the same choice
        if found_inf.item():
            self.scale /= 2
            self.skipped += 1
            return False
        optimizer.step()
        return True


def train(rank, world_size, args):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    data = TensorDataset(x, x.pow(2).mean(dim=1, keepdim=True), x[:, :2].sum(dim=1, keepdim=True))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    static = args.config == "static"
    ddp = DDP(TwoHeads(), static_graph=static, find_unused_parameters=not static)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scaler = LossScale()
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for inputs, targets, aux_targets in loader:
            if step == POISONED_STEP and rank == 1:
                inputs = inputs.clone()
                inputs[0, 0] = float("inf")
            use_aux = static or step % 3 == 0
            optimizer.zero_grad(set_to_none=True)
            outputs = ddp(inputs, use_aux=use_aux)
            loss = F.mse_loss(outputs["prediction"], targets)
            if outputs["aux"] is not None:
                loss = loss + 0.5 * F.mse_loss(outputs["aux"], aux_targets)
            (loss * scaler.scale).backward()
            stepped = scaler.step(optimizer, ddp.parameters())
            if not stepped:
                _harness.say(rank, f"step {step}: non-finite gradient, step skipped, scale {scaler.scale:g}")
            step += 1
    _harness.say(rank, f"final loss {loss.item():.6f} skipped {scaler.skipped} {_harness.checksum(ddp.module)}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("unused", "static"), default="unused")
    _harness.run(train, parser.parse_args())
