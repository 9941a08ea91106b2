"""ddplab spec for train.py: the causal conv LM on the second-order Markov language, AdamW.

Same model, data and optimizer as train.py (global batch 32, lr 5e-3, weight decay 0.01); the target is the
validation loss train.py reaches in about 300 steps at that batch:

    ddplab study spec.py --target-loss 1.80 --ref-global-batch-size 32 --ref-lr 5e-3 ...
    ddplab study spec.py --branch-from ckpt-100.pt ckpt-200.pt ckpt-300.pt --ref-global-batch-size 32 --ref-lr 5e-3
"""

import torch
from train import CausalConvLM, lm_loss, make_split


def model():
    return CausalConvLM()


def dataset():
    return make_split(seed=0, size=4096)


def val_dataset():
    return make_split(seed=1, size=512)


def loss(output, target):
    return lm_loss(output, target)


def optimizer(params):
    return torch.optim.AdamW(params, lr=5e-3, weight_decay=0.01)
