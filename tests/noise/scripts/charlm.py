"""A small character-level GPT trained the way nanoGPT-style projects train one, on torchrun's ranks.

A synthetic corpus from a fixed Markov chain over 32 characters (learnable, so the loss falls), cut into
blocks; DistributedSampler with set_epoch; a decoder-only transformer that returns (logits, loss) with a
token-level mean cross-entropy; AdamW with weight decay on matrices only, a warmup-then-cosine LambdaLR,
gradient clipping, no_sync accumulation; rank 0 prints the loss.

    torchrun --nproc_per_node 2 charlm.py --steps 200 [--accumulation 2]
"""

import argparse
import contextlib
import gc
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, BLOCK = 32, 32


def corpus(chars: int = 120_000) -> torch.Tensor:
    """Text from a Markov chain whose next character depends on the last two (peaked, so there is much to learn)."""
    generator = torch.Generator().manual_seed(7)
    logits = 3.0 * torch.randn(VOCAB, VOCAB, VOCAB, generator=generator)
    probs = logits.softmax(-1)
    out = torch.empty(chars, dtype=torch.long)
    out[0], out[1] = 0, 1
    draws = torch.rand(chars, generator=generator)
    cumulative = probs.cumsum(-1)
    for i in range(2, chars):
        out[i] = min(int(torch.searchsorted(cumulative[out[i - 2], out[i - 1]], draws[i])), VOCAB - 1)
    return out


class Blocks(Dataset):
    def __init__(self, text: torch.Tensor):
        self.text = text

    def __len__(self):
        return (len(self.text) - 1) // BLOCK

    def __getitem__(self, i):
        chunk = self.text[i * BLOCK:(i + 1) * BLOCK + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.register_buffer("mask", torch.triu(torch.ones(BLOCK, BLOCK, dtype=torch.bool), 1), persistent=False)

    def forward(self, x):
        h = self.ln1(x)
        t = x.shape[1]
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(BLOCK, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return logits, loss


def configure_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def lr_lambda(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(GPT())
    data = Blocks(corpus())
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    optimizer = configure_optimizer(model.module, args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps // 10, args.steps))
    step, micro, epoch = 0, 0, 0
    try:
        while step < args.steps:
            sampler.set_epoch(epoch)
            for x, y in loader:
                last = (micro + 1) % args.accumulation == 0
                with contextlib.nullcontext() if last else model.no_sync():
                    _, loss = model(x, y)
                    (loss / args.accumulation).backward()
                micro += 1
                if not last:
                    continue
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if rank == 0 and step % args.log_every == 0:
                    print(f"step {step} loss {loss.item():.6f} lr {scheduler.get_last_lr()[0]:.6g}", flush=True)
                step += 1
                if step == args.steps:
                    break
            epoch += 1
    finally:
        # The DDP wrapper sits in reference cycles: collected before the group goes, or its gloo threads outlive it.
        del model, optimizer, scheduler
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
