"""A small causal language model on padded sequences of different lengths, with gradient accumulation, as people
write it: torchrun, DistributedSampler, a padding collate with labels -100, DDP with no_sync on all but the last
micro-batch, AdamW. ``--normalise`` says how the token loss is divided:

- ``global`` (correct): the summed token loss over the step's valid tokens all-reduced over the ranks, × W (DDP
  averages);
- ``micro-mean`` (planted): cross_entropy's own mean over each micro-batch's tokens, divided by the accumulation
  steps: tokens of short micro-batches weigh more.

    torchrun --nproc_per_node 2 token_lm.py --batch-size 4 --grad-accum 2 [--normalise micro-mean]
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

VOCAB, PAD, IGNORE = 32, 0, -100


def sequences(count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 25, (count,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def collate(batch):
    longest = max(len(s) for s in batch) - 1
    inputs = torch.full((len(batch), longest), PAD)
    labels = torch.full((len(batch), longest), IGNORE)
    for row, s in enumerate(batch):
        inputs[row, :len(s) - 1], labels[row, :len(s) - 1] = s[:-1], s[1:]
    return inputs, labels


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 24)
        self.block = torch.nn.GRU(24, 24, batch_first=True)
        self.head = torch.nn.Linear(24, VOCAB)

    def forward(self, tokens):
        hidden, _ = self.block(self.embed(tokens))
        return self.head(hidden)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--normalise", choices=("global", "micro-mean"), default="global")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(TinyLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = sequences(512, seed=1)
    sampler = DistributedSampler(data, seed=0)
    loader = iter(DataLoader(data, batch_size=args.batch_size, sampler=sampler, collate_fn=collate, drop_last=True))
    for step in range(args.steps):
        micro = [next(loader) for _ in range(args.grad_accum)]
        tokens = torch.tensor(float(sum((labels != IGNORE).sum() for _, labels in micro)))
        dist.all_reduce(tokens)
        for i, (inputs, labels) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                logits = model(inputs).flatten(0, 1)
                if args.normalise == "global":
                    loss = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum")
                    loss = loss * world / tokens
                else:
                    loss = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE) / args.grad_accum
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
