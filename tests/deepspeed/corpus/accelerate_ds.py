"""A classifier trained by an Accelerate loop with the DeepSpeed plugin: `accelerator.accumulate(model)`,
`accelerator.backward(loss)`, `optimizer.step()`.

The shape of Accelerate's own examples (nlp_example.py with `--use_deepspeed`): a `DeepSpeedPlugin(zero_stage=N,
gradient_accumulation_steps=2, gradient_clipping=1.0)` given to the `Accelerator`, a torch AdamW with weight decay on
the weights only (two param groups), a shuffling DataLoader of micro-batches of 4 that `accelerator.prepare` shards
over the ranks, and the usual loop: `with accelerator.accumulate(model)`, the loss, `accelerator.backward(loss)`,
`optimizer.step()`, `optimizer.zero_grad()` (the last two are no-ops under DeepSpeed: the engine steps at each
accumulation boundary). `prepare` fills the config's "auto" micro-batch from the loader and calls
`deepspeed.initialize`; `accelerator.backward` gives the loss to `engine.backward`, which divides it by the
accumulation steps. Two epochs over 128 samples of 6 classes.

On CPU the Accelerator needs the gloo backend named (`InitProcessGroupKwargs(backend="gloo")`), or it sees one
process on each rank and both train on the same batches.

  --stage 1|2|3   DeepSpeedPlugin(zero_stage=...) (2 by default)

Correct by default: F.cross_entropy's mean over each micro-batch (all of the same size), the engine's own
1/accumulation.

Mistake:

  --loss sum      F.cross_entropy(..., reduction='sum') (SUM_REDUCTION)

Rank 0 prints each optimizer step's mean micro-batch loss and a checksum of the (gathered) parameters.
"""

import argparse

import _ds_harness
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES, SAMPLES, EPOCHS, LR, ACCUMULATION, MICRO_BATCH = 10, 6, 128, 2, 1e-2, 2, 4


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(CLASSES, FEATURES, generator=generator) * 2
    labels = torch.randint(CLASSES, (SAMPLES,), generator=generator)
    inputs = centres[labels] + torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(inputs, labels)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, CLASSES))


def param_groups(module: torch.nn.Module, weight_decay: float = 0.01) -> list[dict]:
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--loss", choices=("mean", "sum"), default="mean")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by DeepSpeed's launcher; unused")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, set_seed

    plugin = DeepSpeedPlugin(zero_stage=args.stage, gradient_accumulation_steps=ACCUMULATION, gradient_clipping=1.0)
    accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    set_seed(0)

    net = model()
    optimizer = torch.optim.AdamW(param_groups(net), lr=LR)
    loader = DataLoader(dataset(), batch_size=MICRO_BATCH, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(1))
    engine, optimizer, loader = accelerator.prepare(net, optimizer, loader)

    losses = []
    for _epoch in range(EPOCHS):
        engine.train()
        for inputs, labels in loader:
            with accelerator.accumulate(engine):
                logits = engine(inputs)
                loss = F.cross_entropy(logits, labels, reduction="sum" if args.loss == "sum" else "mean")
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                if accelerator.is_main_process:
                    _ds_harness.emit(f"step {engine.global_steps} loss {sum(losses) / len(losses):.6f}")
                losses = []
    line = _ds_harness.checksum(engine)
    if accelerator.is_main_process:
        _ds_harness.emit(f"engine zero{engine.zero_optimization_stage()} processes {accelerator.num_processes} "
                         f"train_batch_size {engine.train_batch_size()} micro {engine.train_micro_batch_size_per_gpu()}"
                         f" accumulation {engine.gradient_accumulation_steps()} steps {engine.global_steps}")
        _ds_harness.emit(line)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
