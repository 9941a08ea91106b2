"""A small language model on documents of different lengths, trained on torchrun's ranks as people write it.

Documents of 4 to 24 tokens from a fixed chain; a collate_fn pads each batch to its longest document (inputs with 0,
labels with -100); DistributedSampler with set_epoch; an embedding and a GRU; nn.CrossEntropyLoss(ignore_index=-100),
the mean over each micro-batch's own tokens; AdamW; no_sync accumulation.

    torchrun --nproc_per_node 2 padded_lm.py --steps 40 [--accumulation 2]
"""

import argparse
import contextlib
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

VOCAB, IGNORE, DOCUMENTS, SEED = 20, -100, 400, 0


def dataset() -> list[torch.Tensor]:
    """The documents: each token mostly a fixed function of the one before."""
    generator = torch.Generator().manual_seed(3)
    documents = []
    for length in torch.randint(4, 25, (DOCUMENTS,), generator=generator).tolist():
        tokens = torch.randint(1, VOCAB, (length,), generator=generator)
        for t in range(1, length):
            if torch.rand((), generator=generator) < 0.8:
                tokens[t] = (5 * tokens[t - 1] + 2) % (VOCAB - 1) + 1
        documents.append(tokens)
    return documents


def collate(documents: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(d) for d in documents) - 1
    inputs = torch.zeros(len(documents), longest, dtype=torch.long)
    labels = torch.full((len(documents), longest), IGNORE, dtype=torch.long)
    for row, document in enumerate(documents):
        inputs[row, :len(document) - 1], labels[row, :len(document) - 1] = document[:-1], document[1:]
    return inputs, labels


class LM(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(LM())
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, collate_fn=collate, drop_last=True)
    loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step, micro, epoch = 0, 0, 0
    try:
        while step < args.steps:
            sampler.set_epoch(epoch)
            for inputs, labels in loader:
                last = (micro + 1) % args.accumulation == 0
                with contextlib.nullcontext() if last else model.no_sync():
                    logits = model(inputs)
                    loss = loss_fn(logits.reshape(-1, VOCAB), labels.reshape(-1))
                    (loss / args.accumulation).backward()
                micro += 1
                if not last:
                    continue
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step == args.steps:
                    break
            epoch += 1
        if dist.get_rank() == 0:
            print(f"trained {step} steps, last loss {loss.item():.4f}", flush=True)
    finally:
        del model, optimizer
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
