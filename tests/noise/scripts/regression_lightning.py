"""The noiseless regression of regression.py as a Lightning project trains it: a LightningModule, a Trainer with
strategy="ddp" on 2 CPU processes that Lightning starts itself, its own DistributedSampler, accumulate_grad_batches.

    python regression_lightning.py [--accumulation 2] [--steps 60]
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from regression import D, dataset


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(D, 1, bias=False)
        torch.nn.init.zeros_(self.layer.weight)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulation", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16, shuffle=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, logger=False,
                        accumulate_grad_batches=args.accumulation, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), loader)


if __name__ == "__main__":
    main()
