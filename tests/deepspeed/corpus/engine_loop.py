"""A classifier trained by a plain DeepSpeed engine loop: `engine(batch)`, `engine.backward(loss)`, `engine.step()`.

The shape of DeepSpeed's own examples (cifar, bing_bert): `deepspeed.initialize(model=..., optimizer=AdamW(...),
config=ds_config.json)` with a client torch optimizer (weight decay on the weights, none on the biases: two param
groups), a DataLoader over a DistributedSampler (set_epoch every epoch) yielding micro-batches of
train_micro_batch_size_per_gpu, and accumulation left to the engine: `engine.backward` divides the loss by the
config's gradient_accumulation_steps and `engine.step()`, called after every micro-batch, steps the optimizer only at
each accumulation boundary. Two epochs over 128 samples of 6 classes.

  --stage 0|1|2|3       ZeRO stage (the config's zero_optimization.stage)
  --accumulation K      the config's gradient_accumulation_steps (2 in ds_config.json)
  --scheduler deepspeed the config's WarmupDecayLR, stepped by the engine at each optimizer step (correct)

Correct by default: F.cross_entropy's mean over each micro-batch of equal size, the engine's own 1/accumulation.

Mistakes:

  --loss sum              F.cross_entropy(..., reduction='sum') (SUM_REDUCTION)
  --loss divided-by-accum the user's own `loss / gradient_accumulation_steps` on top of the engine's: the loss is
                          divided twice, the gradient is 1/K of the mean's (K = accumulation steps; see the note)
  --sampler none          a shuffling DataLoader seeded alike on every rank: the same batches everywhere
                          (SAME_DATA_ON_ALL_RANKS)
  --no-set-epoch          the DistributedSampler is never given the epoch: the second epoch repeats the first's order
                          (SET_EPOCH_MISSING)

Rank 0 prints each optimizer step's mean micro-batch loss and a checksum of the (gathered) parameters.
"""

import _ds_harness
import deepspeed
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, CLASSES, SAMPLES, EPOCHS, LR = 10, 6, 128, 2, 1e-2


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(CLASSES, FEATURES, generator=generator) * 2
    labels = torch.randint(CLASSES, (SAMPLES,), generator=generator)
    inputs = centres[labels] + torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(inputs, labels)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, CLASSES))


def param_groups(module: torch.nn.Module, weight_decay: float = 0.01) -> list[dict]:
    """Weight decay on matrices only: the grouping most training recipes use."""
    decay = [p for n, p in module.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in module.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def main():
    parser = _ds_harness.parser(__doc__.split("\n")[0])
    parser.add_argument("--loss", choices=("mean", "sum", "divided-by-accum"), default="mean")
    parser.add_argument("--sampler", choices=("distributed", "none"), default="distributed")
    parser.add_argument("--no-set-epoch", action="store_true")
    parser.add_argument("--scheduler", choices=("none", "deepspeed"), default="none")
    args = parser.parse_args()
    rank, world_size = _ds_harness.start()
    cfg = _ds_harness.config(args)
    if args.scheduler == "deepspeed":
        cfg["scheduler"] = {"type": "WarmupDecayLR",
                            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4,
                                       "total_num_steps": 64}}

    net = model()
    optimizer = torch.optim.AdamW(param_groups(net), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=cfg)
    micro_batch = engine.train_micro_batch_size_per_gpu()

    data = dataset()
    if args.sampler == "distributed":
        sampler = DistributedSampler(data, shuffle=True, seed=1, drop_last=True)
        loader = DataLoader(data, batch_size=micro_batch, sampler=sampler, drop_last=True)
    else:
        sampler = None
        loader = DataLoader(data, batch_size=micro_batch, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(1))

    losses = []
    for epoch in range(EPOCHS):
        if sampler is not None and not args.no_set_epoch:
            sampler.set_epoch(epoch)
        for inputs, labels in loader:
            logits = engine(inputs)
            if args.loss == "sum":
                loss = F.cross_entropy(logits, labels, reduction="sum")
            else:
                loss = F.cross_entropy(logits, labels)
                if args.loss == "divided-by-accum":
                    loss = loss / engine.gradient_accumulation_steps()
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            losses.append(loss.item())
            if boundary:
                _ds_harness.say(rank, f"step {engine.global_steps} loss {sum(losses) / len(losses):.6f}")
                losses = []
    _ds_harness.say(rank, _ds_harness.checksum(engine))
    _ds_harness.finish()


if __name__ == "__main__":
    main()
