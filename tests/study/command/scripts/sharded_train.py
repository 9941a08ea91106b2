"""A small classifier trained the way each engine's tutorials write it, under torchrun: ``--engine ddp``
(DistributedDataParallel, ``no_sync`` on all but the last micro-batch), ``fsdp`` (FSDP2: ``fully_shard`` per block then
the root, ``set_requires_gradient_sync(False)`` while accumulating) or ``deepspeed`` (``deepspeed.initialize`` with the
client AdamW; ``engine.backward`` and ``engine.step`` after every micro-batch, the accumulation left to the engine).

AdamW with two parameter groups (weight decay on the matrices, none on biases), as most projects build it; a
DistributedSampler over a fixed synthetic dataset; the mean loss of each micro-batch (equal sizes: every engine then
computes the same step). It prints the step's loss on rank 0 every 10 steps.

    torchrun --nproc_per_node 2 sharded_train.py --engine fsdp --batch-size 8 --grad-accum 1 --lr 1e-2
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 12, generator=g)
    teacher = torch.randn(12, 4, generator=g)
    return TensorDataset(x, (x @ teacher + 0.5 * torch.randn(2048, 4, generator=g)).argmax(1))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh()),
                               torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()), torch.nn.Linear(32, 4))


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in module.parameters() if p.ndim >= 2]
    rest = [p for p in module.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


class Trainer:
    """One engine's wrapping, backward and step behind the same three calls."""

    def __init__(self, engine: str, net: torch.nn.Module, lr: float, micro_batch: int, accumulation: int):
        self.engine, self.accumulation = engine, accumulation
        if engine == "deepspeed":
            import deepspeed

            config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
                      "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                      "gradient_clipping": 0.0, "steps_per_print": 10**9}
            optimizer = torch.optim.AdamW(param_groups(net, 0.01), lr=lr)
            self.model, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
            return
        if engine == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in net[:2]:
                fully_shard(block)
            self.model = fully_shard(net)
        else:
            self.model = torch.nn.parallel.DistributedDataParallel(net)
        self.optimizer = torch.optim.AdamW(param_groups(net, 0.01), lr=lr)

    def accumulating(self, last: bool):
        if last or self.engine == "deepspeed":
            return contextlib.nullcontext()
        if self.engine == "fsdp":
            return _without_sync(self.model)
        return self.model.no_sync()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        if self.engine == "deepspeed":
            self.model.backward(loss)
            self.model.step()
            return
        (loss / self.accumulation).backward()
        if last:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _without_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("ddp", "fsdp", "deepspeed"), default="ddp")
    parser.add_argument("--batch-size", type=int, default=8, help="per device, per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by DeepSpeed's launcher; unused")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    trainer = Trainer(args.engine, model(), args.lr, args.batch_size, args.grad_accum)
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    step, epoch, micro = 0, 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            last = micro == args.grad_accum - 1
            with trainer.accumulating(last):
                loss = F.cross_entropy(trainer.model(x), y)
                trainer.backward(loss, last)
            micro = 0 if last else micro + 1
            if last:
                step += 1
                if step % 10 == 0 and dist.get_rank() == 0:
                    print(f"step {step} loss {loss.item():.4f}", flush=True)
                if step == args.steps:
                    break
        epoch += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
