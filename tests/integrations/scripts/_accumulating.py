"""What the Lightning scripts of a changing global batch share (BatchRamp, BatchSchedule): noisy linear regression
(10 features, label noise 1) on 2 DDP processes with 8 samples per rank per micro-step, a module that checks every
sample is drawn once per epoch, and a callback that records the lr of each update and each epoch's accumulation."""

import _data
import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

D, SAMPLES, BATCH, LR = 10, 2048, 8, 0.02


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
    """The lr of each update (a pre-hook registered after the adapter's sees its factor) and each epoch's
    accumulation."""

    def __init__(self):
        self.lrs, self.accumulation = [], []

    def on_train_start(self, trainer, pl_module):
        trainer.optimizers[0].register_step_pre_hook(lambda opt, a, k: self.lrs.append(opt.param_groups[0]["lr"]))

    def on_train_epoch_start(self, trainer, pl_module):
        self.accumulation.append(trainer.accumulate_grad_batches)


def fit(callbacks: list, epochs: int, **result) -> None:
    """Train the regression for ``epochs`` with ``callbacks`` (and a Record), and write rank 0's numbers:
    ``result`` evaluated after training, with the lrs, accumulations, steps, per-epoch completeness and whether
    the ranks hold the same weights."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, D, generator=g)
    y = x.sum(dim=1, keepdim=True) + torch.randn(SAMPLES, 1, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(SAMPLES)),
                                         batch_size=BATCH, shuffle=True)
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[*callbacks, record])
    module = Regression()
    trainer.fit(module, loader)
    weight = module.layer.weight.detach()
    gathered = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weight)
    _data.write_result(trainer.global_rank, lrs=record.lrs, accumulation=record.accumulation,
                       steps=trainer.global_step, lr=LR, batches_per_epoch=SAMPLES // 2 // BATCH,
                       complete=module.complete, same_weights=all(torch.equal(gathered[0], w) for w in gathered),
                       **{key: value() for key, value in result.items()})
    _data.leave()
