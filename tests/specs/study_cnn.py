"""A small CNN on sklearn's digits as 1×8×8 images, in the shape users write: Conv2d, BatchNorm, dropout, AdamW."""

import torch


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.2), torch.nn.Linear(32 * 4 * 4, 10))

    def forward(self, images):
        return self.head(self.features(images))


def model():
    return SmallCNN()


def _split():
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    return images[order], labels[order]


def dataset():
    images, labels = _split()
    return torch.utils.data.TensorDataset(images[:1400], labels[:1400])


def val_dataset():
    images, labels = _split()
    return torch.utils.data.TensorDataset(images[1400:], labels[1400:])


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
