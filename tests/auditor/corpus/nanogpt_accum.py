"""A nanoGPT-style loop: per-rank seeded random batches, accumulation by toggling require_backward_grad_sync.

No sampler: every rank seeds `torch.manual_seed(1337 + rank)` and draws its own random windows of one token
stream, so ranks see different batches. The model (tied embeddings, causal self-attention through
scaled_dot_product_attention) has no buffers. The loop follows nanoGPT: a cosine lr with warmup written into the
param groups, loss / accumulation steps, a disabled GradScaler, gradient clipping, and `estimate_loss` under
no_grad with the model in eval mode:

  --eval all        every rank evaluates through the DDP wrapper
  --eval rank0      rank 0 alone evaluates through the DDP wrapper (nanoGPT's own choice; legal: no buffers)
  --eval rank0-raw  rank 0 alone evaluates through raw_model = model.module

Evaluation draws its batches from the same generator as training, so when rank 0 alone evaluates its training
stream runs ahead of the other ranks'.

Mistakes (`--mistake`): `same-seed` seeds every rank with 1337, so the batch streams are identical (shifted in
time under `--eval rank0*`) (SAME_DATA_ON_ALL_RANKS); `no-sync-toggle` never clears require_backward_grad_sync,
so every micro-step all-reduces (ACCUMULATION_SYNCS_EVERY_STEP).
"""

import math

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, BLOCK, EMBED, HEADS, LAYERS = 64, 16, 32, 2, 2
BATCH, ACCUMULATION, MAX_ITERS, EVAL_INTERVAL, EVAL_ITERS = 4, 4, 10, 5, 2
LEARNING_RATE, MIN_LR, WARMUP_ITERS, GRAD_CLIP = 3e-3, 3e-4, 2, 1.0


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(EMBED), torch.nn.LayerNorm(EMBED)
        self.c_attn, self.c_proj = torch.nn.Linear(EMBED, 3 * EMBED), torch.nn.Linear(EMBED, EMBED)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(EMBED, 4 * EMBED), torch.nn.GELU(),
                                       torch.nn.Linear(4 * EMBED, EMBED))

    def attention(self, x):
        batch, time, channels = x.shape
        q, k, v = self.c_attn(x).split(EMBED, dim=2)
        q, k, v = (t.view(batch, time, HEADS, channels // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, time, channels))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, EMBED), torch.nn.Embedding(BLOCK, EMBED)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(EMBED)
        self.lm_head = torch.nn.Linear(EMBED, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def token_streams():
    """A 'train.bin' and a 'val.bin': the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    return {"train": torch.randint(VOCAB, (4096,), generator=generator),
            "val": torch.randint(VOCAB, (1024,), generator=generator)}


def get_lr(it):
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    decay_ratio = (it - WARMUP_ITERS) / (MAX_ITERS - WARMUP_ITERS)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (LEARNING_RATE - MIN_LR)


def train(rank, world_size, args):
    master_process = rank == 0
    torch.manual_seed(1337 if args.mistake == "same-seed" else 1337 + rank)
    data = token_streams()

    def get_batch(split):
        ix = torch.randint(len(data[split]) - BLOCK - 1, (BATCH,))
        x = torch.stack([data[split][i:i + BLOCK] for i in ix])
        y = torch.stack([data[split][i + 1:i + 1 + BLOCK] for i in ix])
        return x, y

    model = DDP(GPT())  # ranks initialise differently; DDP broadcasts rank 0's parameters
    raw_model = model.module
    optimizer = raw_model.configure_optimizers(0.1, LEARNING_RATE, (0.9, 0.95))
    scaler = torch.amp.GradScaler("cuda", enabled=False)  # enabled only for float16 on GPUs

    @torch.no_grad()
    def estimate_loss(net):
        out = {}
        net.eval()
        for split in ("train", "val"):
            losses = torch.zeros(EVAL_ITERS)
            for k in range(EVAL_ITERS):
                _, loss = net(*get_batch(split))
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        net.train()
        return out

    evaluating = args.eval == "all" or master_process
    eval_net = raw_model if args.eval == "rank0-raw" else model
    X, Y = get_batch("train")
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % EVAL_INTERVAL == 0 and evaluating:
            losses = estimate_loss(eval_net)
            _harness.say(rank, f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        for micro_step in range(ACCUMULATION):
            if args.mistake != "no-sync-toggle":
                model.require_backward_grad_sync = micro_step == ACCUMULATION - 1
            _, loss = model(X, Y)
            loss = loss / ACCUMULATION
            X, Y = get_batch("train")  # prefetch the next batch, as nanoGPT does
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        _harness.say(rank, f"iter {iter_num}: loss {loss.item() * ACCUMULATION:.4f}, lr {lr:.6f}")
        iter_num += 1
        if iter_num > MAX_ITERS:
            break
    _harness.say(rank, f"final loss {loss.item() * ACCUMULATION:.6f} {_harness.checksum(raw_model)}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--eval", choices=("all", "rank0", "rank0-raw"), default="all")
    parser.add_argument("--mistake", choices=("none", "same-seed", "no-sync-toggle"), default="none")
    _harness.run(train, parser.parse_args())
