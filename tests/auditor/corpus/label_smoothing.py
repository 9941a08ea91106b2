"""An Annotated-Transformer-style seq2seq trainer: label smoothing through KLDivLoss, and what its sum is divided by.

A tiny encoder-decoder (the source mean-pooled over its real tokens, a decoder of embeddings, positions and an MLP,
a generator of log-probabilities) learns to copy sequences of 3 to 14 symbols. A collate function pads each batch
with the padding index 0 and builds a `Batch` (source, decoder input `tgt[:, :-1]`, target `tgt[:, 1:]`, its
non-pad token count `ntokens`), as the Annotated Transformer does. The criterion is a `LabelSmoothing` module:
a smoothed target distribution (confidence on the true symbol, the rest spread over the other non-pad symbols,
the padding column and the rows of padding targets zeroed) against the log-probabilities through
`nn.KLDivLoss(reduction="sum")`. A `LossCompute` object (the Annotated Transformer's SimpleLossCompute) applies the
generator and the criterion and divides the sum by a normaliser. DDP; a DistributedSampler (set_epoch every
epoch); `--accumulation` micro-batches per optimizer step, under no_sync on all but the last; Adam with a warmup
schedule (LambdaLR); 6 optimizer steps.

  --loss global          correct: the summed KL × world size ÷ the step's target tokens, summed over its
                         micro-batches and all-reduced over the ranks
  --loss ce-smoothing    correct too: F.cross_entropy(label_smoothing=0.1, ignore_index=0, reduction="sum") on the
                         log-probabilities, × world size ÷ the same global count
  --accumulation K       micro-batches per optimizer step (default 2)

Mistake:

  --loss per-batch-tokens  the summed KL ÷ the micro-batch's own `batch.ntokens`, the Annotated Transformer's line
                           (LOSS_NORMALISED_PER_MICRO_BATCH, and, never ÷ the accumulation steps,
                           ACCUMULATION_NOT_DIVIDED; with --accumulation 1, LOSS_NORMALISED_PER_DEVICE)

Rank 0 prints the gradient norm after the first backward (DDP's averaged .grad), each step's loss (per token,
summed over the ranks) and a checksum of the parameters.
"""

import contextlib

import _harness
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

PAD, BOS, VOCAB, MAX_LEN, D_MODEL = 0, 1, 20, 16, 32
STEPS, BATCH, SMOOTHING, BASE_LR, WARMUP = 6, 4, 0.1, 0.5, 3
SEQUENCES = 96  # 6 steps of 2 micro-batches of 4 on 2 ranks


class CopyTask(Dataset):
    """Sequences of 3 to 14 symbols (2 .. VOCAB-1): the source, and the same sequence after BOS as the target."""

    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, MAX_LEN - 1, (count,), generator=generator).tolist()
        self.sequences = [torch.randint(2, VOCAB, (n,), generator=generator) for n in lengths]

    def __len__(self):
        return len(self.sequences)

    def __getitem__(self, index):
        return self.sequences[index]


class Batch:
    """A padded batch: the decoder reads tgt[:, :-1] and is scored on tgt[:, 1:] where it is not padding."""

    def __init__(self, src, tgt, pad=PAD):
        self.src, self.src_mask = src, (src != pad)
        self.tgt, self.tgt_y = tgt[:, :-1], tgt[:, 1:]
        self.ntokens = (self.tgt_y != pad).sum()


def collate_batch(sequences):
    width = max(len(s) for s in sequences)
    src = torch.full((len(sequences), width), PAD, dtype=torch.long)
    tgt = torch.full((len(sequences), width + 1), PAD, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        src[row, :len(sequence)] = sequence
        tgt[row, 0] = BOS
        tgt[row, 1:len(sequence) + 1] = sequence
    return Batch(src, tgt)


class Generator(nn.Module):
    """The decoder's states to log-probabilities over the vocabulary."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        return F.log_softmax(self.proj(x), dim=-1)


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.src_embed = nn.Embedding(VOCAB, D_MODEL, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(VOCAB, D_MODEL, padding_idx=PAD)
        self.position = nn.Embedding(MAX_LEN, D_MODEL)
        self.decoder = nn.Sequential(nn.Linear(2 * D_MODEL, 2 * D_MODEL), nn.ReLU(), nn.Linear(2 * D_MODEL, D_MODEL),
                                     nn.LayerNorm(D_MODEL))
        self.generator = Generator(D_MODEL, VOCAB)

    def encode(self, src, src_mask):
        mask = src_mask.unsqueeze(-1).float()
        return (self.src_embed(src) * mask).sum(1) / mask.sum(1)

    def forward(self, src, tgt, src_mask):
        memory = self.encode(src, src_mask)
        h = self.tgt_embed(tgt) + self.position(torch.arange(tgt.shape[1]))
        return self.decoder(torch.cat([h, memory.unsqueeze(1).expand_as(h)], dim=-1))


class LabelSmoothing(nn.Module):
    """KL divergence to a smoothed one-hot target; padding gets no probability and padding rows count for nothing."""

    def __init__(self, size, padding_idx, smoothing=0.0):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.size, self.padding_idx = size, padding_idx
        self.smoothing, self.confidence = smoothing, 1.0 - smoothing

    def forward(self, log_probs, target):
        with torch.no_grad():
            smoothed = torch.full_like(log_probs, self.smoothing / (self.size - 2))  # all but the truth and pad
            smoothed.scatter_(1, target.unsqueeze(1), self.confidence)
            smoothed[:, self.padding_idx] = 0.0
            smoothed[target == self.padding_idx] = 0.0
        return self.criterion(log_probs, smoothed)


class LossCompute:
    """Generator, criterion, and the normalisation the step asks for: returns (summed loss, loss to backward)."""

    def __init__(self, generator, criterion, how, world_size):
        self.generator, self.criterion, self.how, self.world_size = generator, criterion, how, world_size

    def __call__(self, x, y, norm):
        log_probs = self.generator(x).reshape(-1, VOCAB)
        target = y.reshape(-1)
        if self.how == "ce-smoothing":
            summed = F.cross_entropy(log_probs, target, label_smoothing=SMOOTHING, ignore_index=PAD, reduction="sum")
        else:
            summed = self.criterion(log_probs, target)
        if self.how == "per-batch-tokens":
            loss = summed / norm  # norm: this micro-batch's own batch.ntokens
        else:
            loss = summed * self.world_size / norm  # norm: the step's tokens over every rank
        return summed.detach(), loss


def rate(step):
    """Linear warmup, then inverse square-root decay (a factor of BASE_LR)."""
    step = step + 1
    return D_MODEL ** -0.5 * min(step ** -0.5, step * WARMUP ** -1.5)


class Trainer:
    def __init__(self, model, loader, args, rank, world_size):
        self.model, self.loader, self.args, self.rank, self.world_size = model, loader, args, rank, world_size
        criterion = LabelSmoothing(VOCAB, PAD, SMOOTHING)
        self.loss_compute = LossCompute(model.module.generator, criterion, args.loss, world_size)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=BASE_LR, betas=(0.9, 0.98), eps=1e-9)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, rate)
        self.step = 0

    def grad_norm(self):
        return torch.sqrt(sum(p.grad.double().pow(2).sum() for p in self.model.parameters())).item()

    def train_step(self, batches):
        step_tokens = sum(batch.ntokens for batch in batches)
        dist.all_reduce(step_tokens)
        totals = torch.zeros(2, dtype=torch.float64)
        for index, batch in enumerate(batches):
            sync = index == len(batches) - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                out = self.model(batch.src, batch.tgt, batch.src_mask)
                norm = batch.ntokens if self.args.loss == "per-batch-tokens" else step_tokens
                summed, loss_node = self.loss_compute(out, batch.tgt_y, norm)
                loss_node.backward()
            totals += torch.stack([summed.double(), batch.ntokens.double()])
        if self.step == 0:
            _harness.say(self.rank, f"step 0 grad norm {self.grad_norm():.9g}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        dist.all_reduce(totals)
        _harness.say(self.rank, f"step {self.step} loss {(totals[0] / totals[1]).item():.6f} "
                                f"lr {self.scheduler.get_last_lr()[0]:.6g}")

    def run(self):
        epoch = 0
        while self.step < STEPS:
            self.loader.sampler.set_epoch(epoch)
            accumulated = []
            for batch in self.loader:
                accumulated.append(batch)
                if len(accumulated) == self.args.accumulation:
                    self.train_step(accumulated)
                    accumulated = []
                    if self.step == STEPS:
                        break
            epoch += 1


def train(rank, world_size, args):
    dataset = CopyTask(SEQUENCES, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=collate_batch,
                        drop_last=True)
    torch.manual_seed(0)
    model = DDP(EncoderDecoder())
    Trainer(model, loader, args, rank, world_size).run()
    _harness.say(rank, _harness.checksum(model.module))


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=("global", "ce-smoothing", "per-batch-tokens"), default="global")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    _harness.run(train, parser.parse_args())
