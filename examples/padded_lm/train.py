"""A small language model trained as people write it: torchrun, DistributedSampler, a padding collate, AdamW with
linear warmup, gradient accumulation, and the loss normalised by the global count of valid tokens.

    torchrun --nproc_per_node 2 train.py --batch-size 8 --grad-accum 2 --lr 3e-3 --seed 0
    ddplab study --target-loss 1.7 --global-batch-sizes 16,32,64 --optimizer adamw --ref-lr 1e-2 --world-size 2 \
        -- torchrun --nproc_per_node {world_size} train.py --batch-size {per_device_batch_size} \
        --grad-accum {accumulation_steps} --lr {lr} --seed {seed}

Sequences come from a fixed Markov chain over a small vocabulary, each of its own length, padded per batch with
labels -100. Prints ``step N loss L`` every --log-every steps and ``val_loss=V`` every --eval-every steps (rank 0).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VOCAB = 24
PAD = 0
IGNORE = -100


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=100000)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=0)
    return parser.parse_args()


class MarkovText(Dataset):
    """Sequences of 6 to 20 tokens from one fixed, low-entropy chain."""

    def __init__(self, size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        chain = torch.softmax(3.0 * torch.randn(VOCAB - 1, VOCAB - 1, generator=torch.Generator().manual_seed(7)), -1)
        tokens = torch.empty(size, 20, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB - 1, (size,), generator=g)
        for t in range(1, 20):
            tokens[:, t] = torch.multinomial(chain[tokens[:, t - 1]], 1, generator=g).squeeze(1)
        lengths = torch.randint(6, 21, (size,), generator=g).tolist()
        self.samples = [row[:n] + 1 for row, n in zip(tokens, lengths)]  # 0 is the padding token

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def collate(batch):
    longest = max(len(s) for s in batch)
    inputs = torch.full((len(batch), longest - 1), PAD)
    labels = torch.full((len(batch), longest - 1), IGNORE)
    for row, s in enumerate(batch):
        inputs[row, :len(s) - 1] = s[:-1]
        labels[row, :len(s) - 1] = s[1:]
    return inputs, labels


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.mix = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.embed(x))))


class Trainer:
    def __init__(self, args):
        self.args = args
        self.distributed = "RANK" in os.environ
        if self.distributed:
            dist.init_process_group("gloo")
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        torch.manual_seed(args.seed)
        model = TinyLM()
        self.model = DDP(model) if self.distributed else model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
        train = MarkovText(4096, seed=1)
        self.sampler = DistributedSampler(train, seed=args.seed) if self.distributed else None
        self.loader = DataLoader(train, batch_size=args.batch_size, sampler=self.sampler,
                                 shuffle=self.sampler is None, collate_fn=collate, drop_last=True,
                                 generator=torch.Generator().manual_seed(args.seed))
        val = MarkovText(256, seed=2)
        self.val = collate([val[i] for i in range(len(val))])

    def micro_batches(self):
        epoch = 0
        while True:
            if self.sampler is not None:
                self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def global_tokens(self, batches) -> torch.Tensor:
        count = sum((labels != IGNORE).sum() for _, labels in batches).float()
        if self.distributed:
            dist.all_reduce(count)
        return count

    def train(self):
        batches = self.micro_batches()
        for step in range(1, self.args.max_steps + 1):
            group = [next(batches) for _ in range(self.args.grad_accum)]
            tokens = self.global_tokens(group)
            total = 0.0
            for inputs, labels in group:
                logits = self.model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
                # DDP averages over ranks: × world makes the step's gradient the global token mean's.
                loss = loss * self.world / tokens
                loss.backward()
                total += float(loss.detach())
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.rank == 0 and step % self.args.log_every == 0:
                print(f"step {step} loss {total:.4f}", flush=True)
            if self.rank == 0 and self.args.eval_every and step % self.args.eval_every == 0:
                print(f"val_loss={self.validate():.4f}", flush=True)

    @torch.no_grad()
    def validate(self) -> float:
        inputs, labels = self.val
        logits = self.model(inputs)
        return float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE))


def main():
    args = parse_args()
    Trainer(args).train()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
