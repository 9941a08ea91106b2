"""A torchtitan-style FSDP2 run: a causal LM on padded documents, its loss divided by the global valid-token count.

A tiny decoder (token and position embeddings, pre-norm blocks of causal attention and an MLP, an untied head) trains
on documents of 6 to 24 tokens, each its own sample, padded per batch by a collate function (inputs with 0, labels
with -100). A DistributedSampler (set_epoch every epoch) splits them over a 1-D ("dp",) mesh built by
`init_device_mesh("cpu", (W,), mesh_dim_names=("dp",))`; every block is `fully_shard`ed, then the root. Each of the
6 optimizer steps accumulates `--accumulation` micro-batches, with `set_requires_gradient_sync(False)` on all but the
last. As torchtitan does, the step's label tokens are counted before any forward, summed over its micro-batches and
all-reduced over the dp ranks, and each micro-batch's loss is

    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100) / global_valid_tokens

FSDP2's reduce-scatter would average the gradients over the dp ranks; torchtitan turns that off by calling
`set_gradient_divide_factor(1.0)` on every FSDPModule (the reduction then sums; on gloo, which has no PREMUL_SUM,
with `set_force_sum_reduction_for_comms(True)` too), so the gradient is exactly the mean over the global batch's
tokens: one process fed the whole global batch gets the same gradient.

  --divide-factor one    correct: set_gradient_divide_factor(1.0) on every fully_shard'ed module
  --loss global          correct: the summed token loss ÷ the global valid-token count
  --accumulation K       micro-batches per optimizer step (default 2)
  --batch-size B         documents per micro-batch and rank (default 4); W=1 with 2B is the same global batch as W=2

Mistakes:

  --divide-factor default  no set_gradient_divide_factor: FSDP2 averages over the W dp ranks a loss that already
                           divides by the global count; the gradient is 1/W of the global mean's
                           (GLOBAL_COUNT_WITHOUT_WORLD_SIZE)
  --loss times-world       the divide factor set to 1 AND the loss × world size, as a DDP script writes it: the
                           summed gradient is W times the global mean's (DIVIDE_FACTOR)

Rank 0 prints the gradient norm after the first backward (computed from full_tensor() of the gradients, training
unchanged), each step's loss and lr, and a checksum of the full parameters.
"""

import math

import _harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, MAX_LEN, EMBED, HEADS, LAYERS = 40, 24, 32, 2, 2
STEPS, WARMUP, LR, IGNORE_INDEX = 6, 2, 3e-3, -100
DOCUMENTS = 96  # 6 steps of 2 micro-batches of 4 documents on each of 2 ranks (or of 8 on one)


class Documents(Dataset):
    """Documents of 6 to 24 tokens, the same on every rank."""

    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(6, MAX_LEN + 1, (count,), generator=generator).tolist()
        self.documents = [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]

    def __len__(self):
        return len(self.documents)

    def __getitem__(self, index):
        return self.documents[index]


def pad_collate(documents):
    """Right-pad to the batch's longest document: inputs with 0, next-token labels with -100."""
    width = max(len(d) for d in documents) - 1
    inputs = torch.zeros(len(documents), width, dtype=torch.long)
    labels = torch.full((len(documents), width), IGNORE_INDEX, dtype=torch.long)
    for row, document in enumerate(documents):
        inputs[row, :len(document) - 1] = document[:-1]
        labels[row, :len(document) - 1] = document[1:]
    return inputs, labels


class TransformerBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.LayerNorm(EMBED), torch.nn.LayerNorm(EMBED)
        self.wqkv = torch.nn.Linear(EMBED, 3 * EMBED, bias=False)
        self.wo = torch.nn.Linear(EMBED, EMBED, bias=False)
        self.feed_forward = torch.nn.Sequential(torch.nn.Linear(EMBED, 2 * EMBED), torch.nn.GELU(),
                                                torch.nn.Linear(2 * EMBED, EMBED))

    def forward(self, h):
        batch, time, _ = h.shape
        q, k, v = (t.view(batch, time, HEADS, -1).transpose(1, 2)
                   for t in self.wqkv(self.attention_norm(h)).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.wo(attended.transpose(1, 2).reshape(batch, time, EMBED))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, EMBED)
        self.pos_embeddings = torch.nn.Embedding(MAX_LEN, EMBED)
        self.layers = torch.nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = torch.nn.LayerNorm(EMBED)
        self.output = torch.nn.Linear(EMBED, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def apply_fsdp(model, dp_mesh, divide_factor):
    """fully_shard every block, then the root; torchtitan's sum reduction on request."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh)
    if divide_factor == "one":
        # The loss already divides by the global token count: the gradient reduction must sum, not average.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                # gloo has no PREMUL_SUM: reduce with a plain SUM (the divide factor 1.0 then divides by nothing).
                module.set_force_sum_reduction_for_comms(True)
    return model


def warmup_cosine(step):
    if step < WARMUP:
        return (step + 1) / (WARMUP + 1)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def full_grad_norm(model):
    """The global gradient norm: every rank gathers each gradient (a collective), none is changed."""
    squares = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        squares += grad.double().pow(2).sum()
    return squares.sqrt().item()


class TrainLoop:
    def __init__(self, model, loader, args, rank, dp_size):
        self.model, self.loader, self.args, self.rank, self.dp_size = model, loader, args, rank, dp_size
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine)
        self.step = 0

    def loss_fn(self, logits, labels, global_valid_tokens):
        summed = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                                 ignore_index=IGNORE_INDEX)
        loss = summed / global_valid_tokens
        if self.args.loss == "times-world":
            loss = loss * self.dp_size  # the DDP habit of undoing the average, on a reduction that now sums
        return loss

    def train_step(self, micro_batches):
        # torchtitan counts the step's valid tokens up front: every micro-batch, then every dp rank.
        local_valid_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in micro_batches)
        global_valid_tokens = local_valid_tokens.clone()
        dist.all_reduce(global_valid_tokens, op=dist.ReduceOp.SUM)
        accumulated = 0.0
        for index, (inputs, labels) in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            loss = self.loss_fn(self.model(inputs), labels, global_valid_tokens)
            loss.backward()
            accumulated += loss.detach()
        if self.step == 0:
            _harness.say(self.rank, f"step 0 grad norm {full_grad_norm(self.model):.9g}")
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1
        # Every rank's loss is its share of the global mean: their sum is the step's loss.
        dist.all_reduce(accumulated)
        _harness.say(self.rank, f"step {self.step} loss {accumulated.item():.6f} "
                                f"lr {self.scheduler.get_last_lr()[0]:.6g}")

    def fit(self):
        epoch = 0
        while self.step < STEPS:
            self.loader.sampler.set_epoch(epoch)
            pending = []
            for batch in self.loader:
                pending.append(batch)
                if len(pending) == self.args.accumulation:
                    self.train_step(pending)
                    pending = []
                    if self.step == STEPS:
                        break
            epoch += 1


def train(rank, world_size, args):
    dp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    dataset = Documents(DOCUMENTS, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=pad_collate,
                        drop_last=True)
    torch.manual_seed(0)
    model = apply_fsdp(TinyDecoder(), dp_mesh, args.divide_factor)
    TrainLoop(model, loader, args, rank, dp_size).fit()
    full = [p.full_tensor().double() for p in model.parameters()]
    _harness.say(rank, f"params {sum(t.sum().item() for t in full):.6f} "
                       f"{sum(t.pow(2).sum().item() for t in full):.6f}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--divide-factor", choices=("one", "default"), default="one")
    parser.add_argument("--loss", choices=("global", "times-world"), default="global")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    _harness.run(train, parser.parse_args())
