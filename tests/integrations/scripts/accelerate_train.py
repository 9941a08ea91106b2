"""Accelerate on CPU, 2 processes (torchrun or accelerate launch).

Correct by default: Accelerator(cpu=True) (distributed on CPU), accumulate() (no_sync), gather, and
a prepared scheduler whose lengths are multiplied by num_processes on purpose, as the Transformers
*_no_trainer examples do. --mistake plants one mistake:
  schedule         a 16-step linear decay given in optimizer steps: the prepared scheduler steps
                   num_processes times per optimizer step, so the lr reaches 0 half-way
  schedule_late    the same mistake as the no_trainer examples make it: the scheduler built after
                   prepare() from the sharded loader's length (2 epochs, 32 optimizer steps), then
                   prepared; its lr reaches 0 at optimizer step 16, long after the audited window
  not_distributed  a plain Accelerator() on a CPU machine: each process trains alone
  sum_reduction    a summed loss (Accelerator.backward divides it by the accumulation steps only)
"""

import argparse
import sys

import _data
import torch
import torch.nn.functional as F
from accelerate import Accelerator

STEPS, ACCUMULATION, BATCH = 16, 2, 8


def linear_decay(total: int, warmup: int = 0):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, 1.0 - (step - warmup) / max(1, total - warmup))
    return factor


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", choices=("none", "schedule", "schedule_late", "not_distributed", "sum_reduction"),
                        default="none")
    args = parser.parse_args()
    torch.set_num_threads(1)
    late = args.mistake == "schedule_late"
    accumulation = 1 if args.mistake.startswith("schedule") else ACCUMULATION
    accelerator = Accelerator(cpu=args.mistake != "not_distributed", gradient_accumulation_steps=accumulation)
    model = _data.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(_data.dataset(), batch_size=BATCH, shuffle=True)
    if late:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        total = len(loader) * 2  # two epochs of the sharded loader, in optimizer steps
        scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, linear_decay(total)))
    else:
        # Lengths in scheduler steps: a prepared scheduler steps num_processes times per optimizer step.
        per_step = 1 if args.mistake == "schedule" else accelerator.num_processes
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_decay(STEPS * per_step, warmup=2 * per_step))
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        total = STEPS
    steps, losses = 0, []
    while steps < total:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y, reduction="sum" if args.mistake == "sum_reduction" else "mean")
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps += 1
                losses.append(accelerator.gather(loss.detach()).mean().item())
            if steps == total:
                break
    if accelerator.is_main_process:
        print(f"accelerate-done steps={steps} processes={accelerator.num_processes}", flush=True)
    _data.write_result(accelerator.process_index, steps=steps, num_processes=accelerator.num_processes)
    # As Accelerate's examples end: every process here before the group goes (a process that exits the instant its
    # last gather returns can abort in gloo's teardown).
    accelerator.wait_for_everyone()
    accelerator.end_training()
    _data.leave()
    sys.exit(0)


if __name__ == "__main__":
    main()
