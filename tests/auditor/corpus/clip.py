"""CLIP-style contrastive training as open_clip's trainer does it: two towers, a learned logit scale, ClipLoss.

Image-caption pairs are noisy linear views of one shared latent per pair (24 "pixels", 12 "tokens"). The visual
and text towers (two-layer MLPs) embed each side; the features are L2-normalised and, as in open_clip's
``gather_features``, every rank's are all-gathered so that each rank's loss sees the global batch's N×N logits
(or, with --local-loss, its own rows against all N columns). The loss is the mean of the image→text and
text→image cross-entropies, × exp(logit_scale). A DistributedSampler (set_epoch every epoch), SGD; 6 steps.

  --gather-with-grad   torch.distributed.nn.functional.all_gather: its backward sums what every rank's loss sends
                       each slice back to the rank that made it. Correct, with and without --local-loss.
  (without it)         open_clip's default: dist.all_gather into a list without autograd, this rank's own
                       features put back in their place with their graph (not with --local-loss: there every
                       gathered column stays detached, open_clip's own combination)
  --local-loss         each rank's rows of logits only, its labels offset by rank × batch
  --accum-freq K       open_clip's accumulation: the step's K micro-batches embedded once without grad and cached;
                       then each micro-batch embedded again with grad, its features put among the cached ones, the
                       loss over all of them backwarded (DDP's sync on the last only)
  --batch-size B       pairs per rank and micro-batch (default 8); W=1 with 2B is the same global batch

Mistakes:

  (default)                 no --gather-with-grad: each rank's loss reaches only its own slice, and DDP averages;
                            the towers get 1/W of the one-process gradient, the logit scale all of it
                            (GATHERED_LOSS_WITHOUT_WORLD_SIZE). With --accum-freq 2 the same.
  --local-loss --put-back   a local loss whose gather puts this rank's slice back: each rank's loss differs, and
                            what it sends the other ranks' rows is dropped: terms missing (GATHERED_TERMS_MISSING)
  --local-loss              open_clip's local loss without --gather-with-grad: every gathered column detached, this
                            rank's own too; what the loss sends them is dropped (GATHERED_TERMS_MISSING)

Rank 0 prints the towers' gradient norm, 8 of its elements and the logit scale's gradient after the first step's
backward (DDP's averaged .grad), each step's loss, and a checksum of the parameters.
"""

import contextlib

import _harness
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

PAIRS, LATENT, PIXELS, TOKENS, EMBED = 192, 6, 24, 12, 16
STEPS, LR = 6, 0.5


class Pairs(Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        latent = torch.randn(count, LATENT, generator=generator)
        self.images = latent @ torch.randn(LATENT, PIXELS, generator=generator) + \
            0.3 * torch.randn(count, PIXELS, generator=generator)
        self.captions = latent @ torch.randn(LATENT, TOKENS, generator=generator) + \
            0.3 * torch.randn(count, TOKENS, generator=generator)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], self.captions[index]


class CLIP(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(PIXELS, 32), nn.GELU(), nn.Linear(32, EMBED))
        self.text = nn.Sequential(nn.Linear(TOKENS, 32), nn.GELU(), nn.Linear(32, EMBED))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, image, text):
        return {"image_features": F.normalize(self.visual(image), dim=-1),
                "text_features": F.normalize(self.text(text), dim=-1), "logit_scale": self.logit_scale.exp()}


def gather_features(image_features, text_features, local_loss, gather_with_grad, put_back, rank, world_size):
    if world_size == 1:
        return image_features, text_features  # one process gathers nothing, as open_clip's ClipLoss
    if gather_with_grad:
        return torch.cat(dist_fn.all_gather(image_features)), torch.cat(dist_fn.all_gather(text_features))
    gathered_image = [torch.zeros_like(image_features) for _ in range(world_size)]
    gathered_text = [torch.zeros_like(text_features) for _ in range(world_size)]
    dist.all_gather(gathered_image, image_features)
    dist.all_gather(gathered_text, text_features)
    if put_back:
        # the local rank's features, with their gradient, where the gathered copies have none
        gathered_image[rank] = image_features
        gathered_text[rank] = text_features
    return torch.cat(gathered_image), torch.cat(gathered_text)


class ClipLoss(nn.Module):
    def __init__(self, local_loss, gather_with_grad, put_back, rank, world_size):
        super().__init__()
        self.local_loss, self.gather_with_grad, self.put_back = local_loss, gather_with_grad, put_back
        self.rank, self.world_size = rank, world_size

    def forward(self, image_features, text_features, logit_scale):
        all_image, all_text = gather_features(image_features, text_features, self.local_loss, self.gather_with_grad,
                                              self.put_back, self.rank, self.world_size)
        if self.local_loss:
            logits_per_image = logit_scale * image_features @ all_text.T
            logits_per_text = logit_scale * text_features @ all_image.T
            labels = torch.arange(image_features.shape[0]) + image_features.shape[0] * self.rank
        else:
            logits_per_image = logit_scale * all_image @ all_text.T
            logits_per_text = logits_per_image.T
            labels = torch.arange(all_image.shape[0])
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def first_step_report(rank, model):
    towers = [p.grad.double() for name, p in model.module.named_parameters() if name != "logit_scale"]
    norm = torch.sqrt(sum(g.pow(2).sum() for g in towers))
    _harness.say(rank, f"step 0 grad norm {norm.item():.9g}")
    _harness.say(rank, f"step 0 logit_scale grad {model.module.logit_scale.grad.item():.9g}")
    flat = torch.cat([g.reshape(-1) for g in towers])
    sample = flat[torch.linspace(0, flat.numel() - 1, 8).long()]
    _harness.say(rank, "step 0 grad sample " + " ".join(f"{value:.9g}" for value in sample.tolist()))


def train_step(model, loss_fn, micro_batches):
    """One optimizer step's backward passes: open_clip's plain step, or its cached-feature accumulation."""
    if len(micro_batches) == 1:
        loss = loss_fn(**model(*micro_batches[0]))
        loss.backward()
        return loss.item()
    with torch.no_grad():
        cached = [model(image, text) for image, text in micro_batches]
    total = 0.0
    for j, (image, text) in enumerate(micro_batches):
        last = j == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            fresh = model(image, text)
            features = {key: torch.cat([c[key] for c in cached[:j]] + [fresh[key]] + [c[key] for c in cached[j + 1:]])
                        for key in ("image_features", "text_features")}
            loss = loss_fn(**features, logit_scale=fresh["logit_scale"])
            loss.backward()
        total += loss.item()
    return total / len(micro_batches)


def train(rank, world_size, args):
    dataset = Pairs(PAIRS, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = DDP(CLIP())
    put_back = args.put_back or not args.local_loss
    loss_fn = ClipLoss(args.local_loss, args.gather_with_grad, put_back, rank, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < STEPS:
            micro_batches = [batch for _, batch in zip(range(args.accum_freq), batches)]
            if len(micro_batches) < args.accum_freq:
                break
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(model, loss_fn, micro_batches)
            if step == 0:
                first_step_report(rank, model)
            optimizer.step()
            step += 1
            _harness.say(rank, f"step {step} loss {loss:.6f}")
        epoch += 1
    _harness.say(rank, _harness.checksum(model.module))


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--gather-with-grad", action="store_true")
    parser.add_argument("--local-loss", action="store_true")
    parser.add_argument("--put-back", action="store_true", help="put this rank's slice back under --local-loss too")
    parser.add_argument("--accum-freq", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    _harness.run(train, parser.parse_args())
