"""Preference tuning in the shape of TRL's DPOTrainer: pairs of sequences, both of a pair in one forward, DPO's loss.

Each sample is a pair: a prompt with a chosen and a rejected continuation (token sequences of 12, the chosen one
drawn nearer a fixed pattern). The collate function stacks the pairs' chosen and rejected sequences; the training
step concatenates them along the batch (TRL's ``concatenated_forward``: 2B rows for B pairs) and runs the policy and
a frozen reference copy of it, sums each sequence's completion log-probs, and takes DPO's mean over the pairs of
-logsigmoid(β · (policy margin − reference margin)). Every rank has the same number of pairs, so the mean is the
global batch's. A DistributedSampler over the pairs (set_epoch every epoch), AdamW, 6 steps.

  --batch-size B      pairs per rank (default 4); the global batch is B × W pairs, 2 × B × W sequences

Rank 0 prints each step's loss and reward accuracy, and a checksum of the parameters.
"""

import _harness
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, LENGTH, PROMPT, WIDTH = 32, 12, 4, 32
PAIRS, STEPS, LR, BETA = 96, 6, 1e-2, 0.1


class Preferences(Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        pattern = torch.arange(LENGTH) % VOCAB
        self.prompts = torch.randint(VOCAB, (count, PROMPT), generator=generator)
        noise = torch.randint(VOCAB, (2, count, LENGTH - PROMPT), generator=generator)
        keep = torch.rand(count, LENGTH - PROMPT, generator=generator) < 0.7
        self.chosen = torch.where(keep, pattern[PROMPT:].expand(count, -1), noise[0])
        self.rejected = noise[1]

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, index):
        prompt = self.prompts[index]
        return torch.cat([prompt, self.chosen[index]]), torch.cat([prompt, self.rejected[index]])


def collate(pairs):
    chosen, rejected = zip(*pairs)
    return {"chosen_input_ids": torch.stack(chosen), "rejected_input_ids": torch.stack(rejected)}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        # causal: each position sees the running mean of the sequence so far
        hidden = hidden.cumsum(1) / torch.arange(1, input_ids.shape[1] + 1).view(1, -1, 1)
        return self.head(self.mix(hidden))


def completion_log_probs(model, input_ids):
    """Each sequence's summed log-prob of its completion tokens (those after the prompt)."""
    logits = model(input_ids)[:, :-1]
    labels = input_ids[:, 1:]
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(-1)).squeeze(-1)
    return per_token[:, PROMPT - 1:].sum(-1)


class DPOTrainer:
    def __init__(self, rank, world_size, args):
        self.rank = rank
        dataset = Preferences(PAIRS, seed=0)
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        self.loader = DataLoader(dataset, batch_size=args.batch_size, sampler=self.sampler, collate_fn=collate,
                                 drop_last=True)
        torch.manual_seed(0)
        policy = TinyLM()
        self.reference = TinyLM()
        self.reference.load_state_dict(policy.state_dict())
        self.reference.requires_grad_(False)
        self.model = DDP(policy)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def concatenated_forward(self, model, batch):
        both = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        chosen, rejected = completion_log_probs(model, both).chunk(2)
        return chosen, rejected

    def loss(self, batch):
        policy_chosen, policy_rejected = self.concatenated_forward(self.model, batch)
        with torch.no_grad():
            reference_chosen, reference_rejected = self.concatenated_forward(self.reference, batch)
        margins = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
        return -F.logsigmoid(BETA * margins).mean(), (margins > 0).float().mean()

    def train(self):
        step, epoch = 0, 0
        while step < STEPS:
            self.sampler.set_epoch(epoch)
            for batch in self.loader:
                loss, accuracy = self.loss(batch)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                step += 1
                _harness.say(self.rank, f"step {step} loss {loss.item():.6f} reward accuracy {accuracy.item():.4f}")
                if step == STEPS:
                    break
            epoch += 1
        _harness.say(self.rank, _harness.checksum(self.model.module))


def train(rank, world_size, args):
    DPOTrainer(rank, world_size, args).train()


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    _harness.run(train, parser.parse_args())
