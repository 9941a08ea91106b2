"""A causal LM over documents of different lengths, padded by collate(): each rank's token-level mean.

Documents of 5 to 32 tokens; collate() pads a batch to its longest (labels with -100), so the ranks' label tokens
differ. The loss is F.cross_entropy's default mean over the batch's own label tokens: DDP then averages means of
different sizes (LOSS_NORMALISED_PER_DEVICE), and accumulated micro-batches divided by K average means of different
sizes again (LOSS_NORMALISED_PER_MICRO_BATCH).
"""

import torch
import torch.nn.functional as F

VOCAB, EMBED, DOCUMENTS, IGNORE = 24, 16, 64, -100


def model():
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, EMBED), torch.nn.Tanh(), torch.nn.Linear(EMBED, VOCAB))


def dataset():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 33, (DOCUMENTS,), generator=generator).tolist()
    return [torch.randint(VOCAB, (length,), generator=generator) for length in lengths]


def collate(documents):
    longest = max(len(d) for d in documents) - 1
    inputs = torch.zeros(len(documents), longest, dtype=torch.long)
    labels = torch.full((len(documents), longest), IGNORE, dtype=torch.long)
    for row, document in enumerate(documents):
        inputs[row, :len(document) - 1], labels[row, :len(document) - 1] = document[:-1], document[1:]
    return inputs, labels


def loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
