"""The noise scale's device path without a GPU: on the meta device (shapes, no data) every tensor it makes stays
on the model's device, since one left on the CPU would raise on a GPU at the first op that mixed them.

Covered: construction and the per-parameter hooks of the one-process path (two micro-batches), which run inside
backward. Reading the estimate (``step()``) is the one thing meta cannot do, and the one place a GPU run copies
to the host. The DDP path (world size ≥ 2) cannot run here: DistributedDataParallel neither wraps meta
parameters nor reduces without a process group, so tests/gpu covers it on a CUDA device.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ddplab import GradientNoiseScale


class TensorDevices(TorchDispatchMode):
    """Which ops returned tensors on which device, while active (backward and its hooks included)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.ops.setdefault(value.device.type, set()).add(func.overloadpacket.__name__)
        return out


def test_the_recorder_sees_a_tensor_made_on_another_device():
    with TensorDevices() as devices:
        torch.zeros(2, device="meta") + torch.zeros((), device="meta")
        torch.zeros(2)
    assert devices.ops == {"meta": {"zeros", "add"}, "cpu": {"zeros"}}


def test_the_noise_scale_makes_every_tensor_on_the_models_device():
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to("meta")
    inputs, targets = torch.empty(4, 6, device="meta"), torch.empty(4, 2, device="meta")
    with TensorDevices() as devices:
        gns = GradientNoiseScale(model, per_device_batch_size=4, accumulation_steps=2, every=1)
        for _ in range(2):
            (F.mse_loss(model(inputs), targets) / 2).backward()
    assert gns.via == "micro_steps" and devices.ops.keys() == {"meta"}
    # The hooks ran: each micro-batch's gradient differenced from the last and its squared norm summed.
    assert {"linalg_vector_norm", "sub", "clone", "zeros"} <= devices.ops["meta"]
    with pytest.raises((NotImplementedError, RuntimeError), match="meta tensor"):
        gns.step()
