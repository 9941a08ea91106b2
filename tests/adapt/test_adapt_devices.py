"""AdaScale, the batch ramp and the batch schedule on the meta device: they make no tensor off the model's device.

Both hold no tensors: their state is Python numbers read from the noise scale's history, and what they do to
the device's work is scale each param group's lr during ``optimizer.step()``. On meta (shapes, no data) a
tensor made on the CPU would show here as it would raise on a GPU. The loop leaves out ``gns.step()``, the
one read of a value (covered in tests/noise/test_noise_devices.py), so the gain stays 1 and the ramp never grows:
what they compute from the estimates is tested on the CPU (test_adascale.py, test_ramp.py) and in tests/gpu.
The batch schedule reads no measurement, so here it crosses a threshold: a larger window and a warmed-up lr.
"""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ddplab import AdaScale, BatchRamp, BatchSchedule, GradientNoiseScale

STEPS = 3


class TensorDevices(TorchDispatchMode):
    """Which ops returned tensors on which device, while active (backward and optimizer steps included)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.ops.setdefault(value.device.type, set()).add(func.overloadpacket.__name__)
        return out


def _meta_loop():
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to("meta")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gns = GradientNoiseScale(model, per_device_batch_size=4, accumulation_steps=2, every=1)
    return model, optimizer, gns, (torch.empty(4, 6, device="meta"), torch.empty(4, 2, device="meta"))


def _tensors(value) -> list:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def test_adascale_keeps_the_loop_on_the_models_device():
    model, optimizer, gns, (inputs, targets) = _meta_loop()
    with TensorDevices() as devices:
        adascale = AdaScale(optimizer, gns, reference_batch_size=4,
                            scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
        for _ in range(STEPS):
            optimizer.zero_grad()
            for _ in range(2):
                (F.mse_loss(model(inputs), targets) / 2).backward()
            optimizer.step()
    assert devices.ops.keys() == {"meta"}
    state = [t for p in model.parameters() for t in optimizer.state[p].values()]
    assert len(state) == 4 and {t.device.type for t in state} == {"meta"}
    # The gain and the schedule are Python numbers: τ advanced one reference step per update, each a step of StepLR.
    assert [s.lr for s in adascale.history] == [0.1, 0.05, 0.025] and adascale.tau == STEPS
    assert isinstance(optimizer.param_groups[0]["lr"], float) and not _tensors(adascale.state_dict())


def test_the_batch_ramp_keeps_the_loop_on_the_models_device():
    model, optimizer, gns, (inputs, targets) = _meta_loop()
    with TensorDevices() as devices:
        ramp = BatchRamp(model, optimizer, gns, max_accumulation_steps=8, rule="sqrt", interval=1)
        while ramp.steps < STEPS:
            with ramp.accumulate():
                (F.mse_loss(model(inputs), targets) / ramp.accumulation_steps).backward()
            if ramp.should_step():
                optimizer.step()
                optimizer.zero_grad()
    assert devices.ops.keys() == {"meta"}
    state = [t for p in model.parameters() for t in optimizer.state[p].values()]
    assert len(state) == 4 and {t.device.type for t in state} == {"meta"}
    assert ramp.steps == STEPS and ramp.global_batch_size == 8 and ramp.lr_factor() == 1.0
    assert isinstance(optimizer.param_groups[0]["lr"], float) and not _tensors(ramp.state_dict())


def test_the_batch_schedule_keeps_the_loop_on_the_models_device_across_a_threshold():
    model, optimizer, _, (inputs, targets) = _meta_loop()
    with TensorDevices() as devices:
        schedule = BatchSchedule(model, optimizer, [{"samples_seen": 0, "global_batch_size": 4, "lr": 0.1},
                                                    {"samples_seen": 8, "global_batch_size": 8, "lr": 0.2}],
                                 per_device_batch_size=4, warmup_steps=2)
        while schedule.steps < 2 * STEPS:
            with schedule.accumulate():
                (F.mse_loss(model(inputs), targets) / schedule.accumulation_steps).backward()
            if schedule.should_step():
                optimizer.step()
                optimizer.zero_grad()
    assert devices.ops.keys() == {"meta"}
    assert schedule.samples_seen == 2 * 4 + 4 * 8 and schedule.accumulation_steps == 2 and schedule.lr_factor() == 2
    assert isinstance(optimizer.param_groups[0]["lr"], float) and not _tensors(schedule.state_dict())
