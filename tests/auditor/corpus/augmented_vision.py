"""A CIFAR-style classifier on a map-style dataset of uint8 images with random augmentation in `__getitem__`.

The augmentation (random crop after padding, horizontal flip, brightness jitter) draws from Python's `random`, as
PIL-based transforms do, seeded per rank (`random.seed(SEED + rank)`); torch is seeded the same on every rank so the
models start equal. Training uses `DistributedSampler(shuffle=True)` with set_epoch; evaluation runs on every rank
over the whole validation set (no sampler, the same indices everywhere: correct, and not training).

`--data per-rank-files`: each rank reads its own shard (a dataset of its own images) through `shuffle=True`, so every
rank draws the same indices, of different datasets: correct.

Mistake (`--mistake random-sampler`): `DataLoader(shuffle=True)` instead of the DistributedSampler. Its RandomSampler
takes its seed from torch's generator, seeded alike on every rank, so every rank draws the same indices: the same
images, which the per-rank augmentation makes differ pixel by pixel (SAME_DATA_ON_ALL_RANKS).

Mistake (`--mistake seed-per-rank`): `DistributedSampler(..., seed=SEED + rank)`, each rank shuffling a permutation of
its own: their slices overlap, a quarter of the images trained twice per epoch and a quarter never
(SAMPLER_SEEDED_PER_RANK).
"""

import random

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SEED, IMAGES, SIZE, CLASSES, PAD, BATCH, EPOCHS = 42, 256, 12, 4, 2, 16, 2


class AugmentedImages(Dataset):
    """uint8 images in memory, augmented on the fly."""

    def __init__(self, images, labels, train=True):
        self.images, self.labels, self.train = images, labels, train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index].float() / 255
        if self.train:
            padded = F.pad(image, (PAD, PAD, PAD, PAD), mode="reflect")
            top, left = random.randint(0, 2 * PAD), random.randint(0, 2 * PAD)
            image = padded[:, top:top + SIZE, left:left + SIZE]
            if random.random() < 0.5:
                image = image.flip(-1)
            image = (image * random.uniform(0.8, 1.2)).clamp(0, 1)
        return (image - 0.5) / 0.25, self.labels[index]


def make_images(count, seed):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 3, SIZE, SIZE), dtype=torch.uint8, generator=generator)
    labels = (images.float().mean(dim=(2, 3)).argmax(dim=1) + images[:, 0, 0, 0].long()) % CLASSES
    return images, labels


def small_cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(32, CLASSES))


def train(rank, world_size, args):
    random.seed(SEED + rank)  # augmentation differs per rank
    torch.manual_seed(SEED)  # the models start equal
    shard_seed = 1000 + rank if args.data == "per-rank-files" else 0
    train_set = AugmentedImages(*make_images(IMAGES, shard_seed))
    val_set = AugmentedImages(*make_images(64, 99), train=False)
    sampler = None
    if args.data == "per-rank-files" or args.mistake == "random-sampler":
        loader = DataLoader(train_set, batch_size=BATCH, shuffle=True, drop_last=True)
    else:
        seed = SEED + rank if args.mistake == "seed-per-rank" else SEED
        sampler = DistributedSampler(train_set, shuffle=True, seed=seed)
        loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=32)
    model = DDP(small_cnn())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    steps = 0
    for epoch in range(EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if steps % 4 == 0:
                model.eval()
                with torch.no_grad():
                    correct = sum((model(x).argmax(1) == y).sum().item() for x, y in val_loader)
                model.train()
                _harness.say(rank, f"step {steps}: validation accuracy {correct / len(val_set):.3f}")
    _harness.say(rank, f"trained {steps} steps")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("shared", "per-rank-files"), default="shared")
    parser.add_argument("--mistake", choices=("none", "random-sampler", "seed-per-rank"), default="none")
    _harness.run(train, parser.parse_args())
