"""The linear regression example, whose ranks stall (asleep, not computing) in their second optimizer step: a run that
only a deadline or a signal ends, with exactly one step measured (rank 0 checkpoints its first step at once) however
slow the machine is."""

import importlib.util
import os
import time

import torch
import torch.distributed as dist

STEPS = 1
_EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "linear_regression_spec.py")
_spec = importlib.util.spec_from_file_location("linear_regression_example", _EXAMPLE)
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
model, dataset, loss = _example.model, _example.dataset, _example.loss


class _StallingSGD(torch.optim.SGD):
    taken = 0

    def step(self, closure=None):
        # Counted in the ranks only: the launching process's trial step runs without a process group.
        if dist.is_initialized():
            _StallingSGD.taken += 1
            while _StallingSGD.taken > STEPS:
                time.sleep(60)
        return super().step(closure)


def optimizer(params):
    return _StallingSGD(params, lr=0.0)
