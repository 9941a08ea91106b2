"""Self-distillation from an EMA teacher that is a deep copy of the DDP model's module, taken after wrapping.

The copy carries whatever the wrapped module carries. The teacher runs under no_grad on every rank and follows
the student by an exponential moving average; the distillation term is a KL divergence summed over the batch
and divided by the batch size (a mean: correct under DDP), the supervised term a per-sample loss averaged by
hand (`reduction='none'` then `.mean()`). Rank 0 saves the teacher and deep-copies the student at the end.
"""

import copy
import io

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, CLASSES, SAMPLES, MOMENTUM = 16, 5, 320, 0.9


def train(rank, world_size, args):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    data = TensorDataset(x, (x[:, :CLASSES] * torch.arange(1.0, CLASSES + 1)).argmax(dim=1))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    student = DDP(torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                      torch.nn.Dropout(0.1), torch.nn.Linear(64, CLASSES)))
    teacher = copy.deepcopy(student.module)
    teacher.requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    noise = torch.Generator().manual_seed(10 + rank)  # per-rank augmentation and dropout
    torch.manual_seed(10 + rank)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            with torch.no_grad():
                targets = teacher(inputs + 0.1 * torch.randn(inputs.shape, generator=noise)).softmax(dim=1)
            logits = student(inputs + 0.1 * torch.randn(inputs.shape, generator=noise))
            supervised = F.cross_entropy(logits, labels, reduction="none").mean()
            distill = F.kl_div(logits.log_softmax(dim=1), targets, reduction="sum") / len(inputs)
            loss = supervised + 0.5 * distill
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for teacher_param, student_param in zip(teacher.parameters(), student.module.parameters()):
                    teacher_param.lerp_(student_param, 1 - MOMENTUM)
        _harness.say(rank, f"epoch {epoch} loss {loss.item():.6f}")
    if rank == 0:
        teacher.eval()
        with torch.no_grad():
            accuracy = (teacher(x).argmax(dim=1) == data.tensors[1]).float().mean().item()
        torch.save(teacher.state_dict(), io.BytesIO())
        best = copy.deepcopy(student.module)
        _harness.emit(f"teacher accuracy {accuracy:.4f}, snapshot {_harness.checksum(best)}")
    _harness.say(rank, f"final loss {loss.item():.6f} {_harness.checksum(student.module)}")


if __name__ == "__main__":
    _harness.run(train, _harness.parser(__doc__.splitlines()[0]).parse_args())
