"""A fine-tuning recipe in torchtune's shape: token losses summed, the gradients scaled after backward by dp / the
step's all-reduced token count, then clipped, then stepped.

The documents, their padding and the model are token_lm.py's. Each micro-batch's loss is the token mean times the
micro-batch's own label tokens (torchtune's ``self._loss_step(batch) * current_num_tokens``), or `--loss sum`, the
same sum by ``reduction='sum'``; backward runs under no_sync (DDP) or with gradient sync off (FSDP2) on all but the
step's last micro-batch. At the step the token count and the summed loss are all-reduced, every gradient is multiplied
by dp / the count (undoing the data-parallel average: the step's gradient is the global per-token mean), then
clip_grad_norm_ clips it to `--max-norm`, then AdamW steps.

  --strategy ddp|fsdp   DistributedDataParallel, or FSDP2's fully_shard on a 1-D mesh
  --loss mean-times-count | sum
  --scale-by loop       ``p.grad.mul_(factor)`` for each parameter (torchtune's scale_grads)
  --scale-by foreach    ``torch._foreach_mul_`` over the gradients
  --scale-by divide     ``p.grad.div_(1 / factor)``
  --accumulation K      micro-batches per optimizer step (default 2)
  --max-norm M          the clip (default 0.125: about half the first step's norm, so it clips every step here)

Mistakes:

  --mistake no-world    the factor 1 / the global count, without dp (GLOBAL_COUNT_WITHOUT_WORLD_SIZE: 1/W)
  --mistake rank-count  the factor 1 / this rank's own count, not all-reduced (LOSS_NORMALISED_PER_DEVICE; under DDP
                        the ranks then step different gradients: PARAMS_DIVERGED)

Rank 0 prints the first step's gradient norm before the clip (what clip_grad_norm_ returns), each step's loss (the
summed loss over the global count) and a checksum.
"""

import contextlib

import _harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from token_lm import IGNORE, BigramLM, Documents, collate
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

BATCH, EPOCHS, LR, DOCUMENTS = 4, 1, 3e-3, 48


def scale_grads(model, factor: torch.Tensor, how: str) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if how == "foreach":
        torch._foreach_mul_(grads, factor)
    for grad in grads if how != "foreach" else ():
        if how == "divide":
            grad.div_(1 / factor)
        else:
            grad.mul_(factor)


class Recipe:
    def __init__(self, model, loader, args, rank, world_size):
        self.model, self.loader, self.args, self.rank, self.dp = model, loader, args, rank, world_size
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.step = 0

    def _loss_step(self, inputs, labels):
        logits = self.model(tokens=inputs).flatten(0, 1)  # torchtune's self._model(**batch)
        if self.args.loss == "sum":
            return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum")
        return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE)

    def _sync(self, enabled: bool):
        if self.args.strategy == "fsdp":
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if enabled else self.model.no_sync()

    def _optimizer_step(self, num_tokens, running_loss):
        rank_tokens = num_tokens.clone()
        dist.all_reduce(num_tokens)
        dist.all_reduce(running_loss)
        if self.args.mistake == "no-world":
            factor = 1 / num_tokens
        elif self.args.mistake == "rank-count":
            factor = 1 / rank_tokens
        else:
            factor = self.dp / num_tokens  # undoes the data-parallel average
        scale_grads(self.model, factor.float(), self.args.scale_by)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if self.step == 0:
            _harness.say(self.rank, f"step 0 grad norm {float(norm):.8g}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        _harness.say(self.rank, f"step {self.step} loss {float(running_loss / num_tokens):.6f}")

    def train(self):
        for epoch in range(EPOCHS):
            self.loader.sampler.set_epoch(epoch)
            num_tokens, running_loss = torch.tensor(0), torch.tensor(0.0)
            for index, (inputs, labels) in enumerate(self.loader):
                last = (index + 1) % self.args.accumulation == 0
                current_num_tokens = labels.ne(IGNORE).sum()
                num_tokens += current_num_tokens
                with self._sync(last):
                    loss = self._loss_step(inputs, labels)
                    current_loss = loss if self.args.loss == "sum" else loss * current_num_tokens
                    running_loss += current_loss.detach()
                    current_loss.backward()
                if last:
                    self._optimizer_step(num_tokens, running_loss)
                    num_tokens, running_loss = torch.tensor(0), torch.tensor(0.0)


def train(rank, world_size, args):
    model = BigramLM()
    if args.strategy == "ddp":
        model = DDP(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        fully_shard(model.mlp, mesh=mesh)
        fully_shard(model, mesh=mesh)
    documents = Documents(DOCUMENTS, 0)
    loader = DataLoader(documents, batch_size=args.batch_size, collate_fn=collate,
                        sampler=DistributedSampler(documents, shuffle=True, seed=0))
    Recipe(model, loader, args, rank, world_size).train()
    if args.strategy == "ddp":
        _harness.say(rank, _harness.checksum(model.module))
    _harness.say(rank, "done")


if __name__ == "__main__":
    parser = _harness.parser(__doc__)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--loss", choices=("mean-times-count", "sum"), default="mean-times-count")
    parser.add_argument("--scale-by", choices=("loop", "foreach", "divide"), default="loop")
    parser.add_argument("--mistake", choices=("none", "no-world", "rank-count"), default="none")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--max-norm", type=float, default=0.125)
    _harness.run(train, parser.parse_args())
