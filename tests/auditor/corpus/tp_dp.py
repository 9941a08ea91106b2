"""Tensor parallel × FSDP2 on a 2-D mesh ("dp", "tp"), built as torchtitan and the PyTorch TP tutorial build it.

`init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))` over 4 ranks (2 × 2). Each block's attention and
MLP projections are `parallelize_module`d on `mesh["tp"]` (ColwiseParallel into the heads and the hidden layer,
RowwiseParallel out of them: the heads are split across the tp ranks), then every block and the root are
`fully_shard`ed on `mesh["dp"]`. The data is split by the data-parallel dimension only,
`DistributedSampler(num_replicas=mesh["dp"].size(), rank=mesh["dp"].get_local_rank())`, so both ranks of a tp
group load the same batch. AdamW; gradient clipping with the norm taken per mesh (the tensor-parallel weights are
DTensors on ("dp", "tp"), the embeddings, norms and head on ("dp",) only, and one norm cannot mix meshes);
evaluation on every rank, its loss summed over the dp ranks. Rank 0 prints the losses and a checksum of the full
parameters.

Mistake (`--mistake world-sampler`): `DistributedSampler(dataset)` as a DDP script writes it, split by the world
size: the two ranks of a tp group load different batches, and each parallelised layer combines shards computed on
different samples. Nothing fails; training learns less (TP_RANKS_SEE_DIFFERENT_DATA).

`--data sequences` is Lightning's Fabric tensor-parallel example's shape: each sample is one sequence of BLOCK + 1
tokens drawn once from a seeded generator, and the loop feeds the model `batch[:, :-1]` against `batch[:, 1:]`
(the model's input is a view of the loaded batch, not the batch itself).
"""

import logging

import _harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, BLOCK, EMBED, HEADS, HEAD_DIM, LAYERS = 64, 16, 32, 4, 8, 2
STEPS, EVAL_EVERY, BATCH, LR, MAX_NORM = 8, 4, 4, 3e-3, 1.0


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.LayerNorm(EMBED), torch.nn.LayerNorm(EMBED)
        self.wq, self.wk, self.wv = (torch.nn.Linear(EMBED, HEADS * HEAD_DIM, bias=False) for _ in range(3))
        self.wo = torch.nn.Linear(HEADS * HEAD_DIM, EMBED, bias=False)
        self.w1, self.w2 = torch.nn.Linear(EMBED, 4 * EMBED), torch.nn.Linear(4 * EMBED, EMBED)

    def forward(self, x):
        batch, time, _ = x.shape
        h = self.attention_norm(x)
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them.
        q, k, v = (w(h).view(batch, time, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, time, -1)
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
    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return (len(self.tokens) - 1) // BLOCK

    def __getitem__(self, index):
        start = index * BLOCK
        return self.tokens[start:start + BLOCK], self.tokens[start + 1:start + 1 + BLOCK]


class TokenSequences(Dataset):
    """Lightning's RandomTokenDataset: the sequences drawn once, from a generator seeded alike on every rank."""

    def __init__(self, count):
        self.tokens = torch.randint(VOCAB, (count, BLOCK + 1), generator=torch.Generator().manual_seed(42))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index]


def split(batch):
    """(inputs, targets) of a loaded batch: a pair as loaded, or one sequence and the same shifted by a token."""
    return batch if isinstance(batch, (list, tuple)) else (batch[:, :-1], batch[:, 1:])


def parallelize(model, mesh):
    """torchtitan's order: tensor parallelism inside each block, then FSDP2 on each block and on the root."""
    plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel(),
            "w1": ColwiseParallel(), "w2": RowwiseParallel()}
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clip_by_mesh(parameters, max_norm):
    """The total gradient norm, taken per mesh and combined (one norm cannot mix DTensors of two meshes); clips."""
    by_mesh = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh, []).append(param)
    norms = [full(torch.nn.utils.get_total_norm([p.grad for p in params])) for params in by_mesh.values()]
    total = torch.stack(norms).pow(2).sum().sqrt()
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def evaluate(model, loader, dp_group):
    model.eval()
    totals = torch.zeros(2)
    with torch.no_grad():
        for batch in loader:
            x, y = split(batch)
            totals += torch.stack([F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum"),
                                   torch.tensor(float(y.numel()))])
    model.train()
    dist.all_reduce(totals, group=dp_group)  # over the dp ranks: a tp group holds one copy of each sample
    return (totals[0] / totals[1]).item()


def train(rank, world_size, args):
    # DTensor warns at every redistribution over two mesh dimensions (the norms, the checksum): a log, not output.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    stream = torch.randint(VOCAB, (512 * BLOCK + 128 + 1,), generator=torch.Generator().manual_seed(0))
    train_set, val_set = TokenWindows(stream[:512 * BLOCK + 1]), TokenWindows(stream[512 * BLOCK:])
    if args.data == "sequences":
        train_set = TokenSequences(512)
    if args.mistake == "world-sampler":
        sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    else:
        sampler = DistributedSampler(train_set, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=BATCH,
                            sampler=DistributedSampler(val_set, num_replicas=dp.size(), rank=dp.get_local_rank(),
                                                       shuffle=False))
    torch.manual_seed(0)
    model = Transformer()
    parallelize(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sampler.set_epoch(0)
    batches = iter(loader)
    for step in range(STEPS):
        x, y = split(next(batches))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        grad_norm = clip_by_mesh(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        _harness.say(rank, f"step {step + 1} loss {loss.item():.6f} grad norm {grad_norm.item():.6f}")
        if (step + 1) % EVAL_EVERY == 0:
            _harness.say(rank, f"step {step + 1} eval loss {evaluate(model, val_loader, dp.get_group()):.6f}")
    state = get_model_state_dict(model)
    sums = [full(tensor).double() for tensor in state.values()]  # a collective for each DTensor: every rank
    _harness.say(rank, f"final params {sum(t.sum().item() for t in sums):.6f} "
                       f"{sum(t.pow(2).sum().item() for t in sums):.6f}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--mistake", choices=("none", "world-sampler"), default="none")
    parser.add_argument("--data", choices=("windows", "sequences"), default="windows")
    _harness.run(train, parser.parse_args())
