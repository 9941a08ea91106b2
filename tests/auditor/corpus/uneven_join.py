"""Ranks with shards of different lengths, trained under torch's Join context manager (uneven inputs).

Each rank reads its own shard of a pre-split dataset, as projects do with one file per worker: rank r holds
(4 + r) batches, so the last rank takes one more optimizer step per epoch than rank 0. `with Join([ddp])` lets
the ranks that ran out shadow the others' all-reduces, and DDP broadcasts the last joiner's parameters when the
context closes, so every rank ends each epoch with the same model (plain SGD: an optimizer with state, momentum
or Adam, would keep the extra step in its buffers on one rank only). The script checks that itself.
The audit must see no mistake here: after rank 0 joins, its step 4 is the next epoch's first step while
rank 1's step 4 is the last of this one, so comparing ranks step by step past that point would compare
different steps.

Mistake (`--mistake sum`): the loss is summed over the batch (SUM_REDUCTION), with the same uneven shards.
"""

import _harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

BATCH, FEATURES, CLASSES, EPOCHS = 16, 12, 3, 2


def shard(rank: int) -> TensorDataset:
    """This rank's file of the pre-split dataset: rank r holds (4 + r) batches."""
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn((4 + rank) * BATCH, FEATURES, generator=generator)
    return TensorDataset(x, (x[:, :CLASSES] * 2).argmax(dim=1))


def train(rank, world_size, args):
    loader = DataLoader(shard(rank), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, weight_decay=1e-4)
    reduction = "sum" if args.mistake == "sum" else "mean"
    for epoch in range(EPOCHS):
        steps = 0
        with Join([ddp]):
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(x), y, reduction=reduction).backward()
                optimizer.step()
                steps += 1
        _harness.say(rank, f"epoch {epoch}: rank 0 took {steps} steps")
    checksums = [None] * world_size
    dist.all_gather_object(checksums, _harness.checksum(ddp.module))
    _harness.say(rank, f"{checksums[0]}; every rank holds the same model: {len(set(checksums)) == 1}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--mistake", choices=("none", "sum"), default="none")
    _harness.run(train, parser.parse_args())
