"""Lightning, 2 processes: BatchSchedule follows a batch schedule of samples seen through accumulate_grad_batches.

Noisy linear regression (10 features, label noise 1), 8 samples per rank per micro-step (16 per
micro-step over both), 2048 samples an epoch. The schedule starts at global batch 16 and lr 0.02,
asks for 32 at lr 0.04 from 1000 samples and 64 at lr 0.06 from 5000: the thresholds fall
mid-epoch, so each takes effect at the next epoch's start. Each rank records the lr of every update
and each epoch's accumulation; rank 0 writes them, the schedule's changes, and whether the ranks hold
the same weights and drew every sample exactly once per epoch.
"""

import sys

import _data
import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddplab.integrations.lightning import BatchSchedule

D, SAMPLES, BATCH, LR, EPOCHS, WARMUP = 10, 2048, 8, 0.02, 4, 5
SCHEDULE = [{"samples_seen": 0, "global_batch_size": 16, "lr": 0.02},
            {"samples_seen": 1000, "global_batch_size": 32, "lr": 0.04},
            {"samples_seen": 5000, "global_batch_size": 64, "lr": 0.06}]


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(D, 1, bias=False)
        torch.nn.init.zeros_(self.layer.weight)
        self.seen, self.complete = [], []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append(index)
        return F.mse_loss(self.layer(x), y)

    def on_train_epoch_end(self):
        indices = torch.cat(self.seen)
        gathered = [torch.empty_like(indices) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, indices)
        self.complete.append(bool(torch.equal(torch.cat(gathered).sort().values, torch.arange(SAMPLES))))
        self.seen = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Record(L.Callback):
    """The lr of each update (a pre-hook registered after the schedule's sees its factor), each epoch's accumulation."""

    def __init__(self):
        self.lrs, self.accumulation = [], []

    def on_train_start(self, trainer, pl_module):
        trainer.optimizers[0].register_step_pre_hook(lambda opt, a, k: self.lrs.append(opt.param_groups[0]["lr"]))

    def on_train_epoch_start(self, trainer, pl_module):
        self.accumulation.append(trainer.accumulate_grad_batches)


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, D, generator=g)
    y = x.sum(dim=1, keepdim=True) + torch.randn(SAMPLES, 1, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(SAMPLES)),
                                         batch_size=BATCH, shuffle=True)
    schedule, record = BatchSchedule(SCHEDULE, warmup_steps=WARMUP), Record()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[schedule, record])
    module = Regression()
    trainer.fit(module, loader)
    weight = module.layer.weight.detach()
    gathered = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weight)
    _data.write_result(trainer.global_rank, lrs=record.lrs, accumulation=record.accumulation,
                       steps=trainer.global_step, changes=[c.__dict__ for c in schedule.schedule.changes],
                       samples_seen=schedule.schedule.samples_seen, state=schedule.state_dict(), warmup_steps=WARMUP,
                       lr=LR, batches_per_epoch=SAMPLES // 2 // BATCH, complete=module.complete,
                       same_weights=all(torch.equal(gathered[0], w) for w in gathered))
    sys.exit(0)


if __name__ == "__main__":
    main()
