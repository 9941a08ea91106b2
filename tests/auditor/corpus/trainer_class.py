"""A Trainer class in the shape of PyTorch's DDP tutorial series.

`_run_epoch` peeks one batch to learn the batch size *before* calling `sampler.set_epoch(epoch)`, every rank
prints its own epoch line, rank 0 saves the inner module's state_dict and the whole inner module, and a step
LR scheduler and gradient clipping run every step.

Mistakes (`--mistake`): `no-set-epoch` never calls set_epoch, so epoch 1 repeats epoch 0's order (seen only at
step 9, after a 5-step audit window); `none-sum` sums per-sample losses (`reduction='none'` then `.sum()`).
"""

import os
import tempfile

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, CLASSES, SAMPLES = 20, 4, 256


class ToyClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(FEATURES, 32)
        self.out = torch.nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def load_train_objs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x[:, :CLASSES] + 0.3 * torch.randn(SAMPLES, CLASSES, generator=generator)).argmax(dim=1)
    torch.manual_seed(0)
    model = ToyClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return TensorDataset(x, y), model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


class Trainer:
    def __init__(self, model, train_data, optimizer, rank, save_every, snapshot_dir, mistake):
        self.rank = rank
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        self.save_every = save_every
        self.snapshot_dir = snapshot_dir
        self.mistake = mistake
        self.last_loss = float("nan")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        if self.mistake == "none-sum":
            loss = F.cross_entropy(output, targets, reduction="none").sum()
        else:
            loss = F.cross_entropy(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.optimizer.step()
        self.last_loss = loss.item()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        _harness.emit(f"[GPU{self.rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        if self.mistake != "no-set-epoch":
            self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)
        self.scheduler.step()

    def _save_checkpoint(self, epoch):
        state_path = os.path.join(self.snapshot_dir, "checkpoint.pt")
        module_path = os.path.join(self.snapshot_dir, "model.pt")
        torch.save(self.model.module.state_dict(), state_path)
        torch.save(self.model.module, module_path)
        reloaded = torch.load(module_path, weights_only=False)
        same = all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(),
                                                      torch.load(state_path).values()))
        _harness.emit(f"Epoch {epoch} | Training checkpoint saved, reloads equal: {same}")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def train(rank, world_size, args):
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, args.batch_size)
    with tempfile.TemporaryDirectory(prefix="trainer-class-") as snapshot_dir:
        trainer = Trainer(model, train_data, optimizer, rank, args.save_every, snapshot_dir, args.mistake)
        trainer.train(args.total_epochs)
    _harness.say(rank, f"final loss {trainer.last_loss:.6f} {_harness.checksum(trainer.model.module)}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--total-epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--mistake", choices=("none", "no-set-epoch", "none-sum"), default="none")
    _harness.run(train, parser.parse_args())
