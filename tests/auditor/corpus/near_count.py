"""Gradient accumulation for a causal LM with a global token count, Accelerate-example style, in plain torch.

Documents of 5 to 20 tokens are padded per batch by a collate function that returns a dict (input_ids,
attention_mask, labels) with the labels already shifted to the next token and padded with -100; the model, as a
Transformers causal LM does, shifts them again inside its loss (logits[:, :-1] against labels[:, 1:]). So the
script's count, `(batch["labels"] != -100).sum()` over the step's micro-batches gathered from every process,
counts one token per sequence more than the loss sums over: a near count, off by the batch's sequences, not the
count itself. A tiny GRU language model under DDP; a DistributedSampler (set_epoch every epoch); each optimizer step
draws `--accumulation` micro-batches up front, counts their label tokens, then runs them under no_sync on all but
the last; AdamW with linear decay (LambdaLR); 6 steps.

  --mistake none          correct: the summed token loss × world size ÷ the global count (DDP's average then
                          gives the global per-token mean, up to the off-by-one of the count)
  --accumulation K        micro-batches per optimizer step (default 2)
  --batch-size B          documents per micro-batch and rank (default 4); W=1 with 2B is the same global batch

Mistake:

  --mistake no-world-size the summed token loss ÷ the global count, without × world size: DDP's average makes the
                          gradient 1/W of the global mean's (GLOBAL_COUNT_WITHOUT_WORLD_SIZE)

Rank 0 prints the gradient norm after the first backward (DDP's averaged .grad), each step's loss (the summed
token loss over the global count, summed over the processes) and lr, and a checksum of the parameters.
"""

import contextlib
import types

import _harness
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, HIDDEN, PAD_ID, IGNORE = 32, 32, 0, -100
STEPS, LR, DOCUMENTS = 6, 1e-2, 96


class TextDataset(Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, 21, (count,), generator=generator).tolist()
        self.examples = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=generator)} for n in lengths]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


def collate_fn(examples):
    """Pad to the longest; the labels are the next tokens (shifted here), -100 on padding."""
    width = max(len(e["input_ids"]) for e in examples) - 1
    batch = {"input_ids": torch.full((len(examples), width), PAD_ID, dtype=torch.long),
             "attention_mask": torch.zeros(len(examples), width, dtype=torch.long),
             "labels": torch.full((len(examples), width), IGNORE, dtype=torch.long)}
    for row, example in enumerate(examples):
        ids = example["input_ids"]
        batch["input_ids"][row, :len(ids) - 1] = ids[:-1]
        batch["attention_mask"][row, :len(ids) - 1] = 1
        batch["labels"][row, :len(ids) - 1] = ids[1:]
    return batch


class TinyCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN, padding_idx=PAD_ID)
        self.rnn = nn.GRU(HIDDEN, HIDDEN, batch_first=True)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask, labels=None):
        hidden, _ = self.rnn(self.embed_tokens(input_ids) * attention_mask.unsqueeze(-1))
        return types.SimpleNamespace(logits=self.lm_head(hidden))


def summed_causal_lm_loss(logits, labels):
    """The model family's loss, summed: it shifts the labels itself, as for unshifted input_ids."""
    shift_logits = logits[:, :-1, :].contiguous()
    shift_labels = labels[:, 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, VOCAB), shift_labels.view(-1), ignore_index=IGNORE,
                           reduction="sum")


def gather_sum(value, world_size):
    """accelerator.gather(x).sum(): every process's value, summed."""
    gathered = [torch.zeros_like(value) for _ in range(world_size)]
    dist.all_gather(gathered, value)
    return torch.stack(gathered).sum()


def train(rank, world_size, args):
    dataset = TextDataset(DOCUMENTS, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    dataloader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=collate_fn,
                            drop_last=True)
    torch.manual_seed(0)
    model = DDP(TinyCausalLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (STEPS + 1))

    completed_steps, epoch = 0, 0
    while completed_steps < STEPS:
        sampler.set_epoch(epoch)
        iterator = iter(dataloader)
        for _ in range(len(dataloader) // args.accumulation):
            batch_samples = [next(iterator) for _ in range(args.accumulation)]
            num_items_in_batch = sum((b["labels"] != IGNORE).sum() for b in batch_samples)
            num_items_in_batch = gather_sum(num_items_in_batch, world_size)
            step_loss = torch.zeros(())
            for index, batch in enumerate(batch_samples):
                last = index == len(batch_samples) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                    loss = summed_causal_lm_loss(outputs.logits, batch["labels"]) / num_items_in_batch
                    if args.mistake == "none":
                        loss = loss * world_size  # DDP averages the gradients over the processes
                    loss.backward()
                step_loss += loss.detach()
            if completed_steps == 0:
                norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
                _harness.say(rank, f"step 0 grad norm {norm.item():.9g}")
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            completed_steps += 1
            if args.mistake == "none":
                step_loss /= world_size
            dist.all_reduce(step_loss)
            _harness.say(rank, f"step {completed_steps} loss {step_loss.item():.6f} "
                               f"lr {scheduler.get_last_lr()[0]:.6g}")
            if completed_steps == STEPS:
                break
        epoch += 1
    _harness.say(rank, _harness.checksum(model.module))


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--mistake", choices=("none", "no-world-size"), default="none")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    _harness.run(train, parser.parse_args())
