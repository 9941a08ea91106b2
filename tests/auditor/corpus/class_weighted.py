"""A tabular classifier on imbalanced classes, weighted by inverse class frequency: what the weighted loss divides by.

Five classes drawn 55/22/12/7/4 %; 12 features, each class a Gaussian blob. The class weights are sklearn's
"balanced" ones, n_samples / (n_classes × count), computed once from the training labels, the same on every rank.
A small MLP (with a LayerNorm) under DDP, a Trainer class; a DistributedSampler (set_epoch every epoch) and a
collate function stacking (features, label) pairs; `--accumulation` micro-batches per optimizer step under
no_sync on all but the last; SGD with momentum; 6 optimizer steps, then an evaluation (balanced accuracy, its
counts summed by all_reduce).

`nn.CrossEntropyLoss(weight=w)`'s mean divides by the summed weight of the micro-batch's own targets, sum(w[y]):
a number that differs from rank to rank (rank 0 might hold two rare samples, rank 1 none), so DDP's average of
per-rank weighted means is not the weighted mean of the global batch.

  --loss global          correct: F.cross_entropy(weight=w, reduction="sum") × world size ÷ the step's summed
                         target weight, sum(w[y]) over its micro-batches, all-reduced over the ranks
  --accumulation K       micro-batches per optimizer step (default 1)
  --batch-size B         samples per micro-batch and rank (default 8); W=1 with 2B is the same global batch as W=2

Mistake:

  --loss mean            nn.CrossEntropyLoss(weight=w): each rank's weighted mean over its own targets (÷ the
                         accumulation steps) (LOSS_NORMALISED_PER_DEVICE; with --accumulation 2 or more,
                         LOSS_NORMALISED_PER_MICRO_BATCH)

Rank 0 prints the first step's summed target weight on each rank, the gradient norm after the first backward
(DDP's averaged .grad), each step's loss, the evaluation and a checksum of the parameters.
"""

import contextlib

import _harness
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

FEATURES, CLASSES, HIDDEN = 12, 5, 32
PRIORS = (0.55, 0.22, 0.12, 0.07, 0.04)
STEPS, LR, TRAIN_SAMPLES, EVAL_SAMPLES = 6, 0.05, 192, 64


class ImbalancedBlobs(Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(123)) * 1.5
        self.labels = torch.multinomial(torch.tensor(PRIORS), count, replacement=True, generator=generator)
        self.features = centres[self.labels] + torch.randn(count, FEATURES, generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"features": self.features[index], "label": int(self.labels[index])}


def collate(samples):
    return (torch.stack([s["features"] for s in samples]),
            torch.tensor([s["label"] for s in samples], dtype=torch.long))


def balanced_class_weights(labels):
    counts = torch.bincount(labels, minlength=CLASSES).float()
    return len(labels) / (CLASSES * counts.clamp(min=1))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.LayerNorm(HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))

    def forward(self, x):
        return self.net(x)


class Trainer:
    def __init__(self, model, train_loader, eval_loader, class_weights, args, rank, world_size):
        self.model, self.train_loader, self.eval_loader = model, train_loader, eval_loader
        self.class_weights, self.args, self.rank, self.world_size = class_weights, args, rank, world_size
        self.criterion = nn.CrossEntropyLoss(weight=class_weights)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        self.step = 0

    def compute_loss(self, logits, targets, step_weight):
        if self.args.loss == "mean":
            return self.criterion(logits, targets) / self.args.accumulation
        summed = F.cross_entropy(logits, targets, weight=self.class_weights, reduction="sum")
        return summed * self.world_size / step_weight

    def training_step(self, micro_batches):
        # The step's summed target weight: what the weighted mean of the global batch divides by.
        rank_weight = sum(self.class_weights[targets].sum() for _, targets in micro_batches)
        step_weight = rank_weight.clone()
        dist.all_reduce(step_weight)
        if self.step == 0:
            per_rank = [torch.zeros(()) for _ in range(self.world_size)]
            dist.all_gather(per_rank, rank_weight)
            weights = " ".join(f"{w.item():.4f}" for w in per_rank)
            _harness.say(self.rank, f"first step target weight per rank {weights}")
        logged = torch.zeros(2)
        for index, (features, targets) in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                logits = self.model(features)
                loss = self.compute_loss(logits, targets, step_weight)
                loss.backward()
            logged += torch.stack([F.cross_entropy(logits.detach(), targets, weight=self.class_weights,
                                                   reduction="sum"), self.class_weights[targets].sum()])
        if self.step == 0:
            norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in self.model.parameters()))
            _harness.say(self.rank, f"step 0 grad norm {norm.item():.9g}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        dist.all_reduce(logged)
        _harness.say(self.rank, f"step {self.step} weighted loss {(logged[0] / logged[1]).item():.6f}")

    def fit(self):
        epoch = 0
        while self.step < STEPS:
            self.train_loader.sampler.set_epoch(epoch)
            buffer = []
            for batch in self.train_loader:
                buffer.append(batch)
                if len(buffer) == self.args.accumulation:
                    self.training_step(buffer)
                    buffer = []
                    if self.step == STEPS:
                        break
            epoch += 1

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        hits = torch.zeros(2, CLASSES)  # per class: correct, seen
        for features, targets in self.eval_loader:
            predicted = self.model(features).argmax(dim=1)
            hits[0] += torch.bincount(targets[predicted == targets], minlength=CLASSES).float()
            hits[1] += torch.bincount(targets, minlength=CLASSES).float()
        dist.all_reduce(hits)
        self.model.train()
        recall = hits[0] / hits[1].clamp(min=1)
        _harness.say(self.rank, f"eval balanced accuracy {recall.mean().item():.4f} samples {hits[1].sum().item():.0f}")


def train(rank, world_size, args):
    train_set, eval_set = ImbalancedBlobs(TRAIN_SAMPLES, seed=0), ImbalancedBlobs(EVAL_SAMPLES, seed=1)
    class_weights = balanced_class_weights(train_set.labels)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, collate_fn=collate, drop_last=True,
                              sampler=DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=0))
    eval_loader = DataLoader(eval_set, batch_size=16, collate_fn=collate,
                             sampler=DistributedSampler(eval_set, num_replicas=world_size, rank=rank, shuffle=False))
    torch.manual_seed(0)
    model = DDP(Classifier())
    trainer = Trainer(model, train_loader, eval_loader, class_weights, args, rank, world_size)
    trainer.fit()
    trainer.evaluate()
    _harness.say(rank, _harness.checksum(model.module))


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=("global", "mean"), default="global")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    _harness.run(train, parser.parse_args())
