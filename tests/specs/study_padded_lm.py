"""A spec for ddplab study whose samples are token sequences of different lengths, padded per batch by collate().

Documents of 3 to 12 tokens from a fixed chain (the next token is mostly one function of the last); collate() pads a
batch to its longest (inputs with 0, labels with -100); the loss is the token-level mean over the batch's labels.
"""

import torch
import torch.nn.functional as F

VOCAB, EMBED, IGNORE = 16, 16, -100


def _documents(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    documents = []
    for length in torch.randint(3, 13, (count,), generator=generator).tolist():
        tokens = [int(torch.randint(VOCAB, (), generator=generator))]
        for _ in range(length - 1):
            likely = (3 * tokens[-1] + 1) % VOCAB
            tokens.append(likely if torch.rand((), generator=generator) < 0.9 else
                          int(torch.randint(VOCAB, (), generator=generator)))
        documents.append(torch.tensor(tokens))
    return documents


def model():
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, EMBED), torch.nn.Tanh(), torch.nn.Linear(EMBED, VOCAB))


def dataset():
    return _documents(512, 0)


def val_dataset():
    return _documents(128, 1)


def collate(documents):
    longest = max(len(d) for d in documents) - 1
    inputs = torch.zeros(len(documents), longest, dtype=torch.long)
    labels = torch.full((len(documents), longest), IGNORE, dtype=torch.long)
    for row, document in enumerate(documents):
        inputs[row, :len(document) - 1], labels[row, :len(document) - 1] = document[:-1], document[1:]
    return inputs, labels


def loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def optimizer(params):
    return torch.optim.Adam(params, lr=0.02)
