"""A LightningModule as people write one: a small classifier, AdamW, validation every 10 batches logging val_loss
with self.log (Lightning averages it over the validation batches into callback_metrics).

    python lightning_train.py --lr 3e-3 --batch-size 32 --seed 0
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def data(seed: int, size: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 16, generator=g)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(99))
    return TensorDataset(x, (x @ w).argmax(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    L.seed_everything(args.seed, verbose=False)
    train = DataLoader(data(0, 2048), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(data(1, 256), batch_size=64)
    trainer = L.Trainer(max_epochs=50, accelerator="cpu", devices=1, val_check_interval=10, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(args.lr), train, val)


if __name__ == "__main__":
    main()
