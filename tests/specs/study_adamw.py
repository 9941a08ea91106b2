"""A spec for ddplab study in a transformer's style: token embeddings, LayerNorm, dropout and AdamW."""

import torch


class TokenClassifier(torch.nn.Module):
    def __init__(self, vocab=12, width=24):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.zeros(6, width))
        self.block = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width),
                                         torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(2 * width, width))
        self.norm = torch.nn.LayerNorm(6 * width)
        self.head = torch.nn.Linear(6 * width, 3)

    def forward(self, tokens):
        hidden = self.embed(tokens) + self.position
        hidden = hidden + self.block(hidden)
        return self.head(self.norm(hidden.flatten(1)))


def model():
    return TokenClassifier()


def _data(seed, n=1024):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 12, (n, 6), generator=g)
    # Which of the first and last tokens is larger, or neither.
    first, last = tokens[:, 0], tokens[:, 5]
    return torch.utils.data.TensorDataset(tokens, (first > last).long() + 2 * (first == last).long())


def dataset():
    return _data(1)


def val_dataset():
    return _data(2, 512)


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.05)
