"""A learning-rate sweep in one job: ranks {0, 1} and {2, 3} train two DDP replicas on their own process groups.

World size 4. Each replica is a DDP wrapper over its own group (`process_group=`), with its own learning rate;
for a fair comparison both replicas start from the same weights and see the same data in the same order, so
rank 0 and rank 2 get identical batches, and the two replicas' parameters differ from step 1 on. Both are
correct: only ranks of one wrapper's group must agree. At the end all four ranks compare the replicas' losses.
"""

import _harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, SAMPLES, REPLICA_SIZE, LEARNING_RATES = 8, 256, 2, (0.02, 0.1)


def train(rank, world_size, args):
    if world_size != REPLICA_SIZE * len(LEARNING_RATES):
        raise SystemExit(f"sweep_groups.py needs world size {REPLICA_SIZE * len(LEARNING_RATES)}")
    # Every rank creates every group, in the same order.
    groups = [dist.new_group(list(range(i * REPLICA_SIZE, (i + 1) * REPLICA_SIZE))) for i in range(len(LEARNING_RATES))]
    replica, replica_rank = divmod(rank, REPLICA_SIZE)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    data = TensorDataset(x, torch.tanh(x[:, :4]).sum(dim=1, keepdim=True))
    sampler = DistributedSampler(data, num_replicas=REPLICA_SIZE, rank=replica_rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = DDP(model, process_group=groups[replica])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATES[replica], momentum=0.9)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
    losses = torch.zeros(len(LEARNING_RATES))
    losses[replica] = loss.item() / REPLICA_SIZE
    dist.all_reduce(losses)  # each replica's mean final loss, on every rank
    if replica_rank == 0:
        _harness.emit(f"replica {replica} lr {LEARNING_RATES[replica]} final loss {loss.item():.6f} "
                      f"{_harness.checksum(model)}")
    _harness.say(rank, f"final loss {losses.min().item():.6f} best lr {LEARNING_RATES[int(losses.argmin())]}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.set_defaults(world_size=4)
    _harness.run(train, parser.parse_args())
