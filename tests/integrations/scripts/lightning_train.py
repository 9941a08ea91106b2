"""Lightning under strategy="ddp" on CPU, 2 processes started by Lightning itself.

Correct by default: a mean loss, accumulate_grad_batches=2 (Lightning's no_sync), Lightning's own
DistributedSampler, a per-step LambdaLR, and ddplab's ScaleLearningRate callback (lr ×2 for 2 processes,
base_lrs too, with a 4-step warmup). Exits with DDPLAB_TEST_EXIT (default 0). --mistake plants mistakes:
  sum_reduction  a summed loss (Lightning divides it by accumulate_grad_batches before backward)
  lr_scaled      the lr multiplied by the world size after the scheduler was built
  no_sampler     use_distributed_sampler=False with a plain shuffled loader and one seed on every rank
"""

import argparse
import os
import sys

import _data
import lightning as L
import torch
import torch.nn.functional as F

from ddplab.integrations.lightning import ScaleLearningRate

REFERENCE_LR, WARMUP = 0.05, 4


class Regression(L.LightningModule):
    def __init__(self, mistakes: list[str]):
        super().__init__()
        self.net, self.mistakes = _data.model(), mistakes

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y, reduction="sum" if "sum_reduction" in self.mistakes else "mean")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=REFERENCE_LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
        if "lr_scaled" in self.mistakes:
            for group in optimizer.param_groups:
                group["lr"] *= self.trainer.world_size
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", choices=("none", "sum_reduction", "lr_scaled", "no_sampler"), nargs="+",
                        default=["none"], help="one or more, each independent of the others")
    args = parser.parse_args()
    correct = args.mistake == ["none"]
    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(_data.dataset(), batch_size=16, shuffle=True)
    # The trusted setup: one process, 16 samples, 2 accumulation steps (global batch 32).
    scale = ScaleLearningRate(reference_lr=REFERENCE_LR, reference_global_batch_size=32, warmup_steps=WARMUP)
    if "no_sampler" in args.mistake:
        L.seed_everything(0)  # the same shuffle on every rank, and no DistributedSampler to shard it
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=8, accumulate_grad_batches=2,
                        use_distributed_sampler="no_sampler" not in args.mistake, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[scale] if correct else [])
    module = Regression(args.mistake)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        print(f"lightning-done steps={trainer.global_step}", flush=True)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    _data.write_result(trainer.global_rank, steps=trainer.global_step, world_size=trainer.world_size,
                       applied=scale.warmups[0].applied if scale.warmups else None,
                       lr_multiplier=scale.plan.lr_multiplier if scale.plan else None,
                       base_lrs=scheduler.base_lrs, initial_lr=trainer.optimizers[0].param_groups[0]["initial_lr"])
    sys.exit(int(os.environ.get("DDPLAB_TEST_EXIT", "0")))


if __name__ == "__main__":
    main()
