"""ddplab spec for train.py: the same model, data, collate and optimizer, for `ddplab study spec.py` (the spec's
runs train on ddplab's DDP engine; each micro-batch's loss is its own token mean, where train.py divides by the
all-reduced count of the step's tokens).

    ddplab study examples/padded_lm/spec.py --target-loss 1.5 --global-batch-sizes 16,32,64 --rules linear \\
        --ref-global-batch-size 16 --ref-lr 1e-2

The validation loss is train.py's `val_loss` (the token mean over the same 256 sequences), so the spec's study and
`ddplab study --metric val_loss -- torchrun ... train.py --eval-every 5 --warmup 1 ...` aim at the same target.
"""

import torch
import torch.nn.functional as F
from train import IGNORE, MarkovText, TinyLM
from train import collate as pad


def model():
    return TinyLM()


def dataset():
    return MarkovText(4096, seed=1)


def val_dataset():
    return MarkovText(256, seed=2)


def collate(items):
    return pad(items)


def loss(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
