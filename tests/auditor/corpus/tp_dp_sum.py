"""2-D parallelism as PyTorch's FSDP + TP example builds it: tensor parallel within a host, FSDP2 across, on a toy loss.

`init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))` over 4 ranks (2 × 2). A small Llama-shaped model
(token embeddings, blocks of RMS-normed attention and a SwiGLU feed-forward, a final norm, an output projection) is
`parallelize_module`d on `mesh["tp"]`: the embedding table row-wise (its output replicated), the attention's wq,
wk, wv and the feed-forward's w1, w3 column-wise, wo and w2 row-wise, the output column-wise gathered back to a
replicated tensor; then every block and the root are `fully_shard`ed on `mesh["dp"]`. Each iteration draws its
input from the global seed, seeded by the dp rank: the ranks of a tp group get the same batch, the dp ranks
different ones. (The example's own `torch.manual_seed(iteration + dp_rank)` would hand dp rank 1 at iteration i the
batch dp rank 0 trains on at iteration i + 1; `ITERATIONS * dp_rank + iteration` never repeats a seed.) The loss is
a reduction of the model's output, backward, AdamW (foreach=True), 6 iterations.

  --loss mean   correct: `model(inp).mean()`; FSDP2 averages it over the dp ranks, the mean over the global batch

Mistake:

  --loss sum    `model(inp).sum()`, the example's line: a sum over the rank's batch, whose gradient grows with the
                batch and that FSDP2's average over dp leaves a sum over one rank's share (SUM_REDUCTION)

Rank 0 prints the gradient norm after the first backward (every gradient's full_tensor(), on every rank; training
unchanged), each iteration's loss (averaged over dp) and a checksum of the full parameters.
"""

import logging

import _harness
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

VOCAB, DIM, HEADS, HEAD_DIM, HIDDEN, LAYERS, SEQ = 64, 32, 4, 8, 64, 2, 12
ITERATIONS, BATCH, LR = 6, 4, 3e-3


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, HEADS * HEAD_DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        # -1 heads: each tp rank holds HEADS / tp of them after the column-wise split.
        q, k, v = (w(x).view(bsz, seqlen, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model, tp_mesh, dp_mesh):
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def global_grad_norm(model):
    """Every gradient gathered in full (a collective for each, on every rank), nothing changed."""
    return torch.sqrt(sum(full(p.grad).double().pow(2).sum() for p in model.parameters())).item()


def train(rank, world_size, args):
    # DTensor logs each redistribution over both mesh dimensions (the full tensors below): a log, not output.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    device_mesh = init_device_mesh("cpu", (world_size // args.tp_size, args.tp_size), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = device_mesh["tp"], device_mesh["dp"]
    dp_rank = dp_mesh.get_local_rank()

    torch.manual_seed(0)
    model = parallelize(Transformer(), tp_mesh, dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)

    for i in range(ITERATIONS):
        # Seeded by the dp rank: the ranks of one tp group see the same input, no two dp ranks the same.
        torch.manual_seed(ITERATIONS * dp_rank + i)
        inp = torch.randint(VOCAB, (BATCH, SEQ))
        output = model(inp)
        loss = output.sum() if args.loss == "sum" else output.mean()
        loss.backward()
        if i == 0:
            _harness.say(rank, f"step 0 grad norm {global_grad_norm(model):.9g}")
        optimizer.step()
        optimizer.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=dp_mesh.get_group())
        _harness.say(rank, f"step {i + 1} loss {logged.item() / dp_mesh.size():.6f}")

    full_params = [full(p).double() for p in model.parameters()]
    _harness.say(rank, f"params {sum(t.sum().item() for t in full_params):.6f} "
                       f"{sum(t.pow(2).sum().item() for t in full_params):.6f}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=("mean", "sum"), default="mean")
    parser.add_argument("--tp-size", type=int, default=2)
    _harness.run(train, parser.parse_args())
