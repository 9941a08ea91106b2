"""A Lightning classifier as its users write one: a LightningModule with training_step and configure_optimizers,
the Trainer on CPU with the ddp strategy (Lightning starts the other ranks itself), automatic optimization (the
backward runs inside the optimizer's step, through a closure). ``--sampler`` says what draws the training order on
one device: ``distributed`` (a DistributedSampler of one replica, as on several) or ``random`` (the loader's
shuffle, which Lightning replaces by a DistributedSampler only on several devices).

    python lightning_classifier.py --devices 2 --batch-size 8 [--sampler random]
"""

import argparse
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Classifier(pl.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int, sampler: str):
        super().__init__()
        self.batch_size, self.sampler = batch_size, sampler
        g = torch.Generator().manual_seed(2)
        self.train = TensorDataset(torch.randn(256, 20, generator=g), torch.randint(0, 4, (256,), generator=g))

    def train_dataloader(self):
        if self.sampler == "distributed" and self.trainer.world_size == 1:
            return DataLoader(self.train, batch_size=self.batch_size,
                              sampler=DistributedSampler(self.train, num_replicas=1, rank=0, seed=0))
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sampler", choices=("distributed", "random"), default="distributed")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                         max_steps=20, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Classifier(lr=0.1), datamodule=Data(args.batch_size, args.sampler))


if __name__ == "__main__":
    main()
