"""A small causal LM on documents of different lengths, trained by a DeepSpeed engine loop: how its token loss is
normalised when the engine also divides by the accumulation steps.

Documents of 5 to 32 tokens, each its own sample, are padded per micro-batch by a collate_fn (inputs with 0, labels
with -100, as Transformers' DataCollatorForLanguageModeling does), so the label tokens differ from rank to rank and
from micro-batch to micro-batch. A DistributedSampler (set_epoch every epoch) splits the documents; the loop takes an
optimizer step's gradient_accumulation_steps micro-batches from the loader first (so the step's tokens can be counted
before any backward), then runs `engine(inputs)`, `engine.backward(loss)`, `engine.step()` on each. Two epochs.

  --stage 0|1|2|3       ZeRO stage (the config's zero_optimization.stage)
  --accumulation K      the config's gradient_accumulation_steps (2 in ds_config.json)

Correct by default:

  --loss global         the summed token loss × world size ÷ the step's label tokens all-reduced over the ranks
                        and summed over its micro-batches, given to `engine.backward(loss, scale_wrt_gas=False)`
                        (the engine must not divide by the accumulation steps again: what the Transformers Trainer
                        does under DeepSpeed with num_items_in_batch)

Mistakes:

  --loss token-mean     F.cross_entropy's default mean over each micro-batch's own tokens, the engine's own
                        1/accumulation (LOSS_NORMALISED_PER_MICRO_BATCH; with --accumulation 1,
                        LOSS_NORMALISED_PER_DEVICE)
  --loss sum            the summed token loss, never divided by a count (SUM_REDUCTION)
  --loss global-gas     the global count of --loss global given to a plain `engine.backward(loss)`: the engine divides
                        it by the accumulation steps once more, the gradient is 1/K of the mean's (as
                        engine_loop.py's --loss divided-by-accum)
  --loss token-mean-gas the token mean divided by the accumulation steps before `engine.backward(loss)`, which divides
                        by them again: each micro-batch weighed by its own count, and every weight 1/K of the
                        mean's (LOSS_NORMALISED_PER_MICRO_BATCH and ACCUMULATION_DIVIDED_TWICE)

Rank 0 prints each optimizer step's token loss on rank 0's documents and a checksum of the (gathered) parameters.
"""

import _ds_harness
import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, EMBED, EPOCHS, LR, DOCUMENTS, IGNORE = 48, 32, 2, 0.01, 64, -100


class Documents(Dataset):
    """Documents of 5 to 32 tokens, the same on every rank."""

    def __init__(self, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, 33, (count,), generator=generator).tolist()
        self.documents = [torch.randint(VOCAB, (length,), generator=generator) for length in lengths]

    def __len__(self):
        return len(self.documents)

    def __getitem__(self, index):
        return self.documents[index]


def collate(documents):
    """Pad to the micro-batch's longest document: inputs with 0, labels (the next token) with -100."""
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


def token_loss(logits, labels, how: str, step_tokens, world_size: int, accumulation: int):
    """This micro-batch's loss, normalised as ``how`` says."""
    flat_logits, flat_labels = logits.flatten(0, 1), labels.flatten()
    if how in ("token-mean", "token-mean-gas"):
        mean = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE)
        return mean / accumulation if how == "token-mean-gas" else mean
    summed = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE, reduction="sum")
    if how == "sum":
        return summed
    return summed * world_size / step_tokens


def main():
    parser = _ds_harness.parser(__doc__.split("\n")[0])
    parser.add_argument("--loss", choices=("global", "token-mean", "sum", "global-gas", "token-mean-gas"),
                        default="global")
    args = parser.parse_args()
    rank, world_size = _ds_harness.start()

    net = BigramLM()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=_ds_harness.config(args))
    accumulation = engine.gradient_accumulation_steps()

    data = Documents(DOCUMENTS, seed=3)
    sampler = DistributedSampler(data, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler, drop_last=True,
                        collate_fn=collate)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        while True:
            micro_batches = [batch for _, batch in zip(range(accumulation), batches)]
            if len(micro_batches) < accumulation:
                break
            # The step's label tokens on all ranks, counted before any forward.
            step_tokens = sum(labels.ne(IGNORE).sum() for _, labels in micro_batches)
            rank_tokens = step_tokens.item()
            dist.all_reduce(step_tokens)
            summed = 0.0
            for inputs, labels in micro_batches:
                logits = engine(inputs)
                loss = token_loss(logits, labels, args.loss, step_tokens, world_size, accumulation)
                with torch.no_grad():
                    summed += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                              reduction="sum").item()
                engine.backward(loss, scale_wrt_gas=args.loss != "global")
                engine.step()
            _ds_harness.say(rank, f"step {engine.global_steps} loss {summed / rank_tokens:.6f}")
    _ds_harness.say(rank, _ds_harness.checksum(engine))
    _ds_harness.finish()


if __name__ == "__main__":
    main()
