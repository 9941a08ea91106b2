"""Data parallelism written by hand: no DDP wrapper, every rank builds the same model from one seed, and the program
combines the gradients itself, in its training loop or in its optimizer's step (nanochat's shape).

The documents, their padding, the model and the token losses are token_lm.py's; each optimizer step accumulates
`--accumulation` micro-batches. `--reduce` says who combines the gradients, and how:

  loop-sum-divide   correct: the loop all-reduces every .grad with ReduceOp.SUM, then divides it by the world size
  loop-avg          correct: the loop all-reduces every .grad with ReduceOp.AVG
  loop-sum          the loop sums the gradients and never divides: correct only for a loss already divided by the
                    global token count alone (`--loss global-no-world`), W times too large for `--loss global`
                    (DIVIDE_FACTOR)
  optimizer-avg     correct: nanochat's DistAdamW shape, each .grad reduce-scattered (async_op, ReduceOp.AVG) into a
                    slice of the optimizer's own, AdamW on this rank's slice of each parameter, the slices all-gathered
                    back into the parameters; each rank's .grad stays its own
  optimizer-sum-divide  correct: the same with ReduceOp.SUM, the slice divided by the world size after it arrives
  optimizer-sum     the same, never divided (with `--loss global`: DIVIDE_FACTOR)
  flat              the gradients copied into one flat buffer, all-reduced and copied back (correct, but not read:
                    the audit says nothing was audited, and why)

`--mistake same-data`: a RandomSampler seeded alike on every rank, no DistributedSampler (SAME_DATA_ON_ALL_RANKS).

`--loss` is token_lm.py's (global: the summed token loss × W ÷ the step's all-reduced label tokens).

Rank 0 prints the first step's gradient norm as the step takes it (after the loop's reduction), each step's loss and
a checksum of the parameters.
"""

import _harness
import torch
import torch.distributed as dist
from token_lm import BATCH, IGNORE, BigramLM, Documents, collate, token_loss
from torch.utils.data import DataLoader, DistributedSampler

STEPS, DOCUMENTS, LR = 8, 160, 3e-3
OPS = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM}


class DistAdamW(torch.optim.Optimizer):
    """nanochat's shape: every gradient reduce-scattered into this rank's slice, AdamW on the slice, the parameters
    all-gathered from the slices. ``op`` "avg", "sum" (then ``divide``: the slice ÷ the world size)."""

    def __init__(self, params, lr, op="avg", divide=False, betas=(0.9, 0.95), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.op, self.divide = op, divide

    @torch.no_grad()
    def step(self, closure=None):
        rank, world = dist.get_rank(), dist.get_world_size()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        works, slices = [], []
        for p in params:
            grad_slice = torch.empty_like(p.grad[:p.shape[0] // world])
            works.append(dist.reduce_scatter_tensor(grad_slice, p.grad, op=OPS[self.op], async_op=True))
            slices.append(grad_slice)
        gathers = []
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        for p, work, grad in zip(params, works, slices):
            work.wait()
            if self.divide:
                grad.div_(world)
            size = p.shape[0] // world
            own = p[rank * size:(rank + 1) * size]
            state = self.state[p]
            if not state:
                state["step"], state["m"], state["v"] = 0, torch.zeros_like(own), torch.zeros_like(own)
            state["step"] += 1
            state["m"].lerp_(grad, 1 - beta1)
            state["v"].lerp_(grad.square(), 1 - beta2)
            m_hat = state["m"] / (1 - beta1 ** state["step"])
            v_hat = state["v"] / (1 - beta2 ** state["step"])
            updated = own - group["lr"] * m_hat / (v_hat.sqrt() + group["eps"])
            gathers.append(dist.all_gather_into_tensor(p, updated, async_op=True))
        for work in gathers:
            work.wait()


def reduce_in_loop(model, how: str, world: int) -> None:
    if how == "flat":
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        return
    for p in model.parameters():
        dist.all_reduce(p.grad, op=OPS["avg" if how == "loop-avg" else "sum"])
        if how == "loop-sum-divide":
            p.grad.div_(world)


def train(rank, world_size, args):
    model = BigramLM()
    if args.reduce.startswith("optimizer"):
        optimizer = DistAdamW(model.parameters(), lr=LR, op="avg" if args.reduce == "optimizer-avg" else "sum",
                              divide=args.reduce == "optimizer-sum-divide")
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    documents = Documents(DOCUMENTS, 0)
    if args.mistake == "same-data":
        # Shuffled alike on every rank: each trains on the same documents.
        sampler = torch.utils.data.RandomSampler(documents, generator=torch.Generator().manual_seed(0))
    else:
        sampler = DistributedSampler(documents, shuffle=True, seed=0)
        sampler.set_epoch(0)
    loader = DataLoader(documents, batch_size=args.batch_size, collate_fn=collate, sampler=sampler)
    batches, step = iter(loader), 0
    while step < STEPS:
        micro_batches = [next(batches) for _ in range(args.accumulation)]
        rank_tokens = sum(labels.ne(IGNORE).sum() for _, labels in micro_batches)
        step_tokens = rank_tokens.clone()
        dist.all_reduce(step_tokens)
        total = torch.zeros(())
        for inputs, labels in micro_batches:
            loss = token_loss(model(inputs), labels, args.loss, step_tokens, world_size, args.accumulation,
                              rank_tokens)
            loss.backward()
            total += loss.detach()
        if not args.reduce.startswith("optimizer"):
            reduce_in_loop(model, args.reduce, world_size)
            if step == 0:
                norm = sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt()
                _harness.say(rank, f"step 0 grad norm {norm.item():.10g}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        step += 1
        _harness.say(rank, f"step {step} loss {total.item() / world_size:.6f}")
    _harness.say(rank, _harness.checksum(model))
    _harness.say(rank, "done")


if __name__ == "__main__":
    parser = _harness.parser(__doc__)
    parser.add_argument("--reduce", default="loop-sum-divide",
                        choices=("loop-sum-divide", "loop-avg", "loop-sum", "optimizer-avg", "optimizer-sum-divide",
                                 "optimizer-sum", "flat"))
    parser.add_argument("--loss", default="global", choices=("global", "hand-global", "token-mean", "rank-mean",
                                                              "hand-sum", "global-no-world", "selected-mean"))
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--mistake", choices=("none", "same-data"), default="none")
    parser.add_argument("--batch-size", type=int, default=BATCH, help="documents per micro-batch and rank")
    _harness.run(train, parser.parse_args())
