"""Next-token prediction on a synthetic second-order Markov language, with a small causal conv LM.

The language: 16 tokens; the next token depends on the two before it, through a fixed random transition
table (each row drawn from a Dirichlet(0.2), so most contexts have a few likely successors). Every sequence
is 32 tokens. The model sees the current token and the two before it (a causal convolution of width 3)
and predicts the next one at every position. The best possible loss is the chain's entropy rate, which
the script prints.

    python train.py --batch-size 32 --lr 3e-3 --steps 300 --eval-every 25 --save-every 100 --out .
"""

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 16
SEQ_LEN = 32
CHAIN_SEED = 1234


def transition_table(seed: int = CHAIN_SEED, alpha: float = 0.2) -> torch.Tensor:
    """P(next | prev2, prev1) as a (VOCAB, VOCAB, VOCAB) table."""
    generator = torch.Generator().manual_seed(seed)
    gamma = torch.distributions.Gamma(torch.full((VOCAB,), alpha), torch.ones(VOCAB))
    # torch.distributions has no generator argument: draw through the global RNG under a fork.
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=generator)))
        draws = gamma.sample((VOCAB, VOCAB))
    draws = draws + 1e-6
    return draws / draws.sum(-1, keepdim=True)


def entropy_rate(table: torch.Tensor, burn_in: int = 200, steps: int = 20000) -> float:
    """The chain's entropy per token in nats, averaged along one long sample path."""
    generator = torch.Generator().manual_seed(0)
    a, b = 0, 1
    total = 0.0
    for t in range(burn_in + steps):
        p = table[a, b]
        if t >= burn_in:
            total += float(-(p * p.clamp_min(1e-12).log()).sum())
        c = int(torch.multinomial(p, 1, generator=generator))
        a, b = b, c
    return total / steps


def make_split(seed: int, size: int) -> TensorDataset:
    """`size` sequences of SEQ_LEN + 1 tokens, as (inputs, next tokens) pairs of SEQ_LEN each."""
    table = transition_table()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(size, SEQ_LEN + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (size,), generator=generator)
    tokens[:, 1] = torch.randint(VOCAB, (size,), generator=generator)
    for t in range(2, SEQ_LEN + 1):
        probs = table[tokens[:, t - 2], tokens[:, t - 1]]
        tokens[:, t] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class CausalConvLM(torch.nn.Module):
    """Embedding, a causal convolution over the last `context` tokens, a per-position MLP head."""

    def __init__(self, dim: int = 32, hidden: int = 128, context: int = 3):
        super().__init__()
        self.context = context
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.conv = torch.nn.Conv1d(dim, hidden, kernel_size=context)
        self.head = torch.nn.Conv1d(hidden, VOCAB, kernel_size=1)

    def forward(self, tokens):  # (batch, time) -> (batch, time, VOCAB)
        x = self.embed(tokens).transpose(1, 2)
        x = F.pad(x, (self.context - 1, 0))  # left padding only: position t sees t-2, t-1, t
        x = F.gelu(self.conv(x))
        return self.head(x).transpose(1, 2)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Trainer:
    def __init__(self, args):
        self.args = args
        torch.manual_seed(args.seed)
        self.model = CausalConvLM()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        self.train_set = make_split(seed=0, size=args.train_size)
        self.val_set = make_split(seed=1, size=args.val_size)
        self.loader = DataLoader(self.train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                 generator=torch.Generator().manual_seed(args.seed))
        self.samples_seen = 0
        self.step = 0

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        inputs, targets = self.val_set.tensors
        loss = float(lm_loss(self.model(inputs), targets))
        self.model.train()
        return loss

    def save(self):
        path = os.path.join(self.args.out, f"ckpt-{self.step}.pt")
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "samples_seen": self.samples_seen}, path)
        return path

    def train(self):
        args = self.args
        start = time.time()
        reached = None
        while self.step < args.steps:
            for inputs, targets in self.loader:
                loss = lm_loss(self.model(inputs), targets)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                self.step += 1
                self.samples_seen += inputs.shape[0]
                if self.step % args.eval_every == 0:
                    val = self.evaluate()
                    if reached is None and args.target_loss is not None and val <= args.target_loss:
                        reached = self.step
                    print(f"step {self.step:5d}  samples {self.samples_seen:6d}  train {loss.item():.4f}  "
                          f"val {val:.4f}  {time.time() - start:.1f}s", flush=True)
                if self.step % args.save_every == 0:
                    print(f"saved {self.save()}", flush=True)
                if self.step >= args.steps:
                    break
        if args.target_loss is not None:
            print(f"target val loss {args.target_loss}: "
                  + (f"reached at step {reached}" if reached else "not reached"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--val-size", type=int, default=512)
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=".")
    parser.add_argument("--entropy", action="store_true", help="print the chain's entropy rate and exit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.entropy:
        print(f"entropy rate: {entropy_rate(transition_table()):.4f} nats/token (uniform: {math.log(VOCAB):.4f})")
        return
    os.makedirs(args.out, exist_ok=True)
    Trainer(args).train()


if __name__ == "__main__":
    main()
