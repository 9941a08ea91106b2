"""A small causal LM trained by a Trainer class on documents of different lengths: how its token loss is normalised.

Documents of 5 to 32 tokens, each its own sample, are padded per batch by a collate_fn (inputs with 0, labels with
-100, as Transformers' DataCollatorForLanguageModeling does), so the label tokens of a batch differ from rank to rank
and from micro-batch to micro-batch. `--data packed` instead cuts one token stream into fixed windows: every batch
holds the same number of tokens. A DistributedSampler (set_epoch every epoch) splits the documents; each optimizer
step accumulates `--accumulation` micro-batches (under no_sync, or FSDP2's set_requires_gradient_sync, on all but the
last). Evaluation on every rank over a DistributedSampler(shuffle=False) of `--eval-samples` documents: token loss,
correct tokens and documents summed by all_reduce (`--eval-results rank0`: rank 0's own), printed by rank 0.

  --strategy ddp|fsdp|fsdp-tp   DistributedDataParallel, FSDP2's fully_shard on a 1-D mesh, or a ("dp", "tp")
                        mesh (4 ranks): the hidden layer and head tensor-parallel, FSDP2 over dp, the data split by dp;
                        `tp`: tensor parallelism alone, every rank fed the same batches
  --loss global         correct: the summed token loss × world size ÷ the step's label tokens all-reduced over the
                        ranks and summed over its micro-batches (torchtitan's global valid-token count)
  --loss hand-global    the same, with the token loss written by hand (log_softmax, gather, mask)
  --loss scaled-terms   the same, each token's term scaled by world size ÷ the step's tokens before the sum

Mistakes:

  --loss token-mean      F.cross_entropy's default mean over each micro-batch's own tokens, ÷ accumulation steps
                         (LOSS_NORMALISED_PER_MICRO_BATCH; with --accumulation 1, LOSS_NORMALISED_PER_DEVICE)
  --loss token-mean-undivided  the same mean, never ÷ accumulation steps (LOSS_NORMALISED_PER_MICRO_BATCH, and
                         ACCUMULATION_NOT_DIVIDED: the gradient K times the step's mean)
  --loss rank-mean       a sum over the step's micro-batches ÷ this rank's own token count (LOSS_NORMALISED_PER_DEVICE)
  --loss hand-mean       the hand-written token loss ÷ this micro-batch's mask.sum() (as token-mean)
  --loss hand-sum        the hand-written token loss summed, never divided (SUM_REDUCTION)
  --loss selected-mean   the label tokens' log-probs selected by a mask, then .mean() (TRL's), ÷ accumulation steps
                         (as token-mean)
  --loss global-no-world the global count without × world size (GLOBAL_COUNT_WITHOUT_WORLD_SIZE)
  --eval-samples 41      an evaluation set the sampler pads to 42: one document counted twice
                         (EVAL_SAMPLES_DUPLICATED)
  --zero-grad never      gradients never cleared, as pytorch/examples' 2-D FSDP + TP example (GRADIENTS_NOT_CLEARED);
                         `before-backward` clears them between the forward and backward, as the tutorials do

Rank 0 prints each step's loss, the evaluation's results and a checksum of the parameters.
"""

import contextlib

import _harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, EMBED, BATCH, EPOCHS, LR = 48, 32, 4, 2, 0.05
TRAIN_DOCUMENTS, IGNORE = 64, -100


class Documents(Dataset):
    """Documents of 5 to 32 tokens (or fixed windows of one stream, ``packed``), the same on every rank."""

    def __init__(self, count: int, seed: int, packed: bool = False):
        generator = torch.Generator().manual_seed(seed)
        lengths = [16] * count if packed else torch.randint(5, 33, (count,), generator=generator).tolist()
        self.documents = [torch.randint(VOCAB, (length,), generator=generator) for length in lengths]

    def __len__(self):
        return len(self.documents)

    def __getitem__(self, index):
        return self.documents[index]


def collate(documents):
    """Pad to the batch's longest document: inputs with 0, labels (the next token) with -100."""
    longest = max(len(d) for d in documents) - 1
    inputs = torch.zeros(len(documents), longest, dtype=torch.long)
    labels = torch.full((len(documents), longest), IGNORE, dtype=torch.long)
    for row, document in enumerate(documents):
        inputs[row, :len(document) - 1] = document[:-1]
        labels[row, :len(document) - 1] = document[1:]
    return inputs, labels


class BigramLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, EMBED)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(EMBED, EMBED), torch.nn.Tanh())
        self.head = torch.nn.Linear(EMBED, VOCAB)

    def forward(self, tokens):
        return self.head(self.mlp(self.embed(tokens)))


def token_loss(logits, labels, how: str, step_tokens, world_size: int, accumulation: int, rank_tokens):
    """This micro-batch's loss, normalised as ``how`` says."""
    flat_logits, flat_labels = logits.flatten(0, 1), labels.flatten()
    if how in ("token-mean", "token-mean-undivided"):
        mean = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE)
        return mean / accumulation if how == "token-mean" else mean
    if how == "selected-mean":
        # TRL's shape: the log-probs of the label tokens selected by a mask, then .mean(); no loss function.
        picked = F.log_softmax(flat_logits, dim=-1).gather(1, flat_labels.clamp(min=0).unsqueeze(1)).squeeze(1)
        return -picked[flat_labels.ne(IGNORE)].mean() / accumulation
    if how.startswith("hand"):
        mask = flat_labels.ne(IGNORE)
        picked = F.log_softmax(flat_logits, dim=-1).gather(1, flat_labels.clamp(min=0).unsqueeze(1)).squeeze(1)
        summed = -(picked * mask).sum()
        if how == "hand-sum":
            return summed
        if how == "hand-mean":
            return summed / mask.sum() / accumulation
        return summed * world_size / step_tokens
    if how == "scaled-terms":
        terms = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE, reduction="none")
        return (terms * (world_size / step_tokens)).sum()
    summed = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE, reduction="sum")
    if how == "rank-mean":
        return summed / rank_tokens
    if how == "global-no-world":
        return summed / step_tokens
    return summed * world_size / step_tokens


class Trainer:
    def __init__(self, model, train_loader, eval_loader, args, rank, world_size, dp_size):
        self.model, self.train_loader, self.eval_loader = model, train_loader, eval_loader
        self.args, self.rank, self.world_size, self.dp_size = args, rank, world_size, dp_size
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        self.step = 0

    def _sync(self, enabled: bool):
        if self.args.strategy == "tp":
            return contextlib.nullcontext()  # no data-parallel reduction to defer
        if self.args.strategy != "ddp":
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if enabled else self.model.no_sync()

    def _run_step(self, micro_batches):
        # The step's label tokens, on this rank and on all ranks: counted before any forward.
        rank_tokens = sum(labels.ne(IGNORE).sum() for _, labels in micro_batches)
        step_tokens = rank_tokens.clone()
        # Summed over all ranks: tp ranks hold the same batch, so divide by the ranks that share each one.
        dist.all_reduce(step_tokens)
        step_tokens = step_tokens // (self.world_size // self.dp_size)
        total = 0.0
        for index, (inputs, labels) in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with self._sync(last):
                loss = token_loss(self.model(inputs), labels, self.args.loss, step_tokens, self.dp_size,
                                  len(micro_batches), rank_tokens)
                if index == 0 and self.args.zero_grad == "before-backward":
                    self.optimizer.zero_grad()  # the tutorials' order: between the forward and backward
                loss.backward()
            total += loss.item()
        self.optimizer.step()
        if self.args.zero_grad == "after-step":
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        _harness.say(self.rank, f"step {self.step} loss {total:.6f}")

    def _run_epoch(self, epoch):
        self.train_loader.sampler.set_epoch(epoch)
        micro_batches = []
        for batch in self.train_loader:
            micro_batches.append(batch)
            if len(micro_batches) == self.args.accumulation:
                self._run_step(micro_batches)
                micro_batches = []

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        totals = torch.zeros(4, dtype=torch.float64)
        for inputs, labels in self.eval_loader:
            logits = self.model(inputs)
            kept = labels.ne(IGNORE)
            totals += torch.stack([F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                                   reduction="sum").double(),
                                   (logits.argmax(-1).eq(labels) & kept).sum().double(), kept.sum().double(),
                                   torch.tensor(float(len(inputs)), dtype=torch.float64)])
        if self.args.eval_results == "all-reduce":
            dist.all_reduce(totals)
            totals /= self.world_size // self.dp_size
        self.model.train()
        loss, correct, tokens, documents = totals.tolist()
        _harness.say(self.rank, f"eval loss {loss / tokens:.6f} accuracy {correct / tokens:.4f} "
                                f"documents {documents:.0f}")

    def train(self):
        for epoch in range(EPOCHS):
            self._run_epoch(epoch)
            self.evaluate()


def wrap(model, strategy: str, world_size: int):
    """The model wrapped, and the data-parallel (rank, size) that splits the data and averages the gradients."""
    if strategy == "ddp":
        return DDP(model), (dist.get_rank(), world_size)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if strategy == "fsdp":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        fully_shard(model.mlp, mesh=mesh)
        return fully_shard(model, mesh=mesh), (dist.get_rank(), world_size)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if strategy == "tp":
        # Tensor parallelism alone: every rank holds a shard of each layer and trains on the same batch.
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"mlp.0": ColwiseParallel(), "head": RowwiseParallel()})
        return model, (0, 1)
    # tp × dp as torchtitan builds it: the hidden layer split column-wise, the head row-wise, then FSDP2 over dp.
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"mlp.0": ColwiseParallel(), "head": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, (mesh["dp"].get_local_rank(), mesh["dp"].size())


def train(rank, world_size, args):
    packed = args.data == "packed"
    train_set, eval_set = Documents(TRAIN_DOCUMENTS, 0, packed), Documents(args.eval_samples, 1, packed)
    model, (dp_rank, dp_size) = wrap(BigramLM(), args.strategy, world_size)
    train_loader = DataLoader(train_set, batch_size=BATCH, collate_fn=collate, sampler=DistributedSampler(
        train_set, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0))
    eval_loader = DataLoader(eval_set, batch_size=BATCH, collate_fn=collate, sampler=DistributedSampler(
        eval_set, num_replicas=dp_size, rank=dp_rank, shuffle=False))
    Trainer(model, train_loader, eval_loader, args, rank, world_size, dp_size).train()
    if args.strategy == "ddp":
        _harness.say(rank, _harness.checksum(model.module))
    _harness.say(rank, "done")


if __name__ == "__main__":
    parser = _harness.parser(__doc__)
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "fsdp-tp", "tp"), default="ddp")
    parser.add_argument("--loss", default="global", choices=("global", "hand-global", "scaled-terms", "token-mean",
                                                              "token-mean-undivided",
                                                              "rank-mean",
                                                              "hand-mean", "hand-sum", "global-no-world",
                                                              "selected-mean"))
    parser.add_argument("--data", choices=("padded", "packed"), default="padded")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--zero-grad", choices=("after-step", "before-backward", "never"), default="after-step")
    parser.add_argument("--eval-samples", type=int, default=40)
    parser.add_argument("--eval-results", choices=("all-reduce", "rank0"), default="all-reduce",
                        help="sum the evaluation's results over the ranks, or print rank 0's own")
    _harness.run(train, parser.parse_args())
