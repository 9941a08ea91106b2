"""Lightning, 2 processes: BatchRamp grows accumulate_grad_batches with the measured noise scale.

Noisy linear regression (10 features, label noise 1): B_simple rises as the weights approach w*, so
the global batch must grow between epochs. Each rank records the lr of every update and each
epoch's accumulation; rank 0 writes them, the ramp's changes, and whether the ranks hold the same
weights and drew every sample exactly once per epoch.
"""

import sys

import _data
import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddplab.integrations.lightning import BatchRamp, GradientNoiseScale

D, SAMPLES, BATCH, LR, EPOCHS = 10, 2048, 8, 0.02, 6


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
    """The lr of each update (a pre-hook registered after the ramp's sees its factor) and each epoch's accumulation."""

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
    noise, record = GradientNoiseScale(every=1, log=False), Record()
    ramp = BatchRamp(noise, max_accumulation_steps=16, warmup_steps=5)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[noise, ramp, record])
    module = Regression()
    trainer.fit(module, loader)
    weight = module.layer.weight.detach()
    gathered = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weight)
    _data.write_result(trainer.global_rank, lrs=record.lrs, accumulation=record.accumulation,
                       steps=trainer.global_step, changes=[c.__dict__ for c in ramp.ramp.changes],
                       warmup_steps=5, lr=LR, batches_per_epoch=SAMPLES // 2 // BATCH,
                       complete=module.complete, same_weights=all(torch.equal(gathered[0], w) for w in gathered),
                       b_simple_history=[h["b_simple"] for h in noise.history])
    sys.exit(0)


if __name__ == "__main__":
    main()
