"""An FSDP2 trainer shaped like the PyTorch FSDP2 tutorial and torchtitan: fully_shard on each block, then the root.

A small decoder-only transformer (token and position embeddings, pre-norm blocks of causal attention and an MLP, a
final norm, an untied head) trains on windows of one token stream, split by a DistributedSampler over the
data-parallel ranks. Each block is `fully_shard`ed on the data-parallel mesh, then the root; AdamW over the sharded
DTensor parameters with torchtitan's schedule (linear warmup, cosine decay, through LambdaLR); gradient accumulation
with `model.set_requires_gradient_sync(False)` on every micro-batch but the last; gradient clipping on the DTensor
gradients; evaluation under no_grad on every rank before training and every few steps (its loss summed by an
all_reduce: gloo has no AVG); a `torch.distributed.checkpoint` save of `get_model_state_dict` at the end.

  --mesh fsdp   a 1-D mesh ("dp",) over every rank, as the tutorial builds it
  --mesh hsdp   a 2-D mesh ("dp_replicate", "dp_shard"): 2-way shards, replicated (4 ranks)

Rank 0 prints the gradient norm of the first step (before clipping), each step's loss and lr, the evaluation loss,
what the checkpoint holds and a checksum of the full parameters (DTensor.full_tensor()).

Mistake (`--loss sum`): cross_entropy(reduction='sum') divided by the accumulation steps only, still a sum over the
micro-batch's tokens. FSDP2 divides the reduced gradient by the data-parallel size, so the gradient is 1/dp of what
one process summing the global batch gets: the first step's gradient norm is exactly dp times smaller. AdamW hides
most of the scale, all but its epsilon (SUM_REDUCTION).
`--sync every-micro-batch` keeps gradient sync on for every micro-batch: FSDP2 reduce-scatters each one (a choice
that saves memory; an info, not a mistake).
"""

import math
import shutil
import tempfile

import _harness
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, BLOCK, EMBED, HEADS, LAYERS = 64, 16, 32, 2, 2
STEPS, WARMUP, EVAL_EVERY, EVAL_BATCHES, LR = 8, 2, 4, 2, 3e-3
TRAIN_TOKENS = 1024 * BLOCK  # 1024 windows: 8 steps of 2 micro-batches of 8 on 4 ranks, or of 16 on 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.LayerNorm(EMBED), torch.nn.LayerNorm(EMBED)
        self.wqkv, self.wo = torch.nn.Linear(EMBED, 3 * EMBED, bias=False), torch.nn.Linear(EMBED, EMBED, bias=False)
        self.w1, self.w2 = torch.nn.Linear(EMBED, 4 * EMBED), torch.nn.Linear(4 * EMBED, EMBED)

    def forward(self, x):
        batch, time, _ = x.shape
        qkv = self.wqkv(self.attention_norm(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, time, HEADS, -1).transpose(1, 2) for t in qkv)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, time, EMBED)
        x = x + self.wo(attended)
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings, self.pos_embeddings = torch.nn.Embedding(VOCAB, EMBED), torch.nn.Embedding(BLOCK, EMBED)
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(EMBED)
        self.output = torch.nn.Linear(EMBED, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class TokenWindows(Dataset):
    """Consecutive windows of one token stream: (input, target shifted by one)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return (len(self.tokens) - 1) // BLOCK

    def __getitem__(self, index):
        start = index * BLOCK
        return self.tokens[start:start + BLOCK], self.tokens[start + 1:start + 1 + BLOCK]


def lr_lambda(step):
    """torchtitan's warmup then cosine decay, as a factor of the peak lr."""
    if step < WARMUP:
        return (step + 1) / (WARMUP + 1)
    progress = (step - WARMUP) / max(1, STEPS - WARMUP)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def build_mesh(kind, world_size):
    if kind == "hsdp":
        return init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def evaluate(model, loader, rank):
    model.eval()
    totals = torch.zeros(2)
    with torch.no_grad():
        for index, (x, y) in enumerate(loader):
            if index == EVAL_BATCHES:
                break
            logits = model(x)
            totals += torch.stack([F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"),
                                   torch.tensor(float(y.numel()))])
    model.train()
    dist.all_reduce(totals)  # gloo has no ReduceOp.AVG: sum, then divide
    return (totals[0] / totals[1]).item()


def train(rank, world_size, args):
    mesh = build_mesh(args.mesh, world_size)
    # Every dimension of this mesh is data-parallel, and it holds the ranks in order: a rank's place among them is
    # its global rank.
    dp_size, dp_rank = mesh.size(), rank
    stream = torch.randint(VOCAB, (TRAIN_TOKENS + 1024 + 1,), generator=torch.Generator().manual_seed(0))
    train_set, val_set = TokenWindows(stream[:TRAIN_TOKENS + 1]), TokenWindows(stream[TRAIN_TOKENS:])
    sampler = DistributedSampler(train_set, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size,
                            sampler=DistributedSampler(val_set, num_replicas=dp_size, rank=dp_rank, shuffle=False))

    torch.manual_seed(0)
    model = Transformer()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    _harness.say(rank, f"step 0 eval loss {evaluate(model, val_loader, rank):.6f}")
    sampler.set_epoch(0)
    batches = iter(loader)
    for step in range(STEPS):
        for micro in range(args.accum):
            last = micro == args.accum - 1
            if args.sync == "last-micro-batch":
                model.set_requires_gradient_sync(last)
            x, y = next(batches)
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum" if args.loss == "sum" else "mean")
            (loss / args.accum).backward()
        grad_norm = full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
        if step == 0:
            _harness.say(rank, f"step 0 grad norm {grad_norm.item():.9g}")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        _harness.say(rank, f"step {step + 1} loss {loss.item():.6f} lr {scheduler.get_last_lr()[0]:.6g}")
        if (step + 1) % EVAL_EVERY == 0:
            _harness.say(rank, f"step {step + 1} eval loss {evaluate(model, val_loader, rank):.6f}")
    save(model, rank)


def save(model, rank):
    """torch.distributed.checkpoint of the sharded state dict; every rank writes its shards to one folder."""
    state = get_model_state_dict(model)
    folder = [tempfile.mkdtemp(prefix="fsdp-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(folder)
    dcp.save(state, checkpoint_id=folder[0])
    sums = [full(tensor).double() for tensor in state.values()]  # a collective for each DTensor: every rank
    _harness.say(rank, f"checkpoint holds {len(state)} tensors; params "
                       f"{sum(t.sum().item() for t in sums):.6f} {sum(t.pow(2).sum().item() for t in sums):.6f}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--mesh", choices=("fsdp", "hsdp"), default="fsdp")
    parser.add_argument("--loss", choices=("mean", "sum"), default="mean")
    parser.add_argument("--sync", choices=("last-micro-batch", "every-micro-batch"), default="last-micro-batch")
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    _harness.run(train, parser.parse_args())
