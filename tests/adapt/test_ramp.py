"""BatchRamp: the growth policy and the lr it sets, exactly; then the example under torchrun with DDP."""

import math
import re

import pytest
import torch

from ddplab.adapt.ramp import BatchRamp
from ddplab.errors import UsageError


class _Measured:
    """A noise scale whose B_simple the test sets: the ramp reads only these attributes."""

    def __init__(self, per_device_batch_size: int, world_size: int, accumulation_steps: int):
        self.per_device_batch_size, self.world_size = per_device_batch_size, world_size
        self.history, self.b_simple = [], math.nan
        self.set_accumulation_steps(accumulation_steps)

    def set_accumulation_steps(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.b_big = self.per_device_batch_size * self.world_size * accumulation_steps

    def measure(self, b_simple: float) -> None:
        self.history.append(b_simple)
        self.b_simple = b_simple


def _step(ramp, optimizer, measured, b_simple, seen_lrs):
    """One window of micro-steps on one process, then the optimizer step the ramp scales."""
    micro = 0
    while True:
        with ramp.accumulate():
            micro += 1
        if ramp.should_step():
            break
    measured.measure(b_simple)
    optimizer.step()
    seen_lrs.append(optimizer.param_groups[0]["lr"])
    return micro


def test_the_batch_grows_with_b_simple_never_shrinks_and_the_lr_follows_with_its_warmup():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    measured = _Measured(per_device_batch_size=4, world_size=2, accumulation_steps=1)  # 8 samples per micro-step
    ramp = BatchRamp(torch.nn.Linear(1, 1), optimizer, measured, max_accumulation_steps=8, rule="linear",
                     warmup_steps=4, interval=3)
    after = []
    # Three measured steps at B_simple 5 (below the global batch 8): nothing changes.
    assert [_step(ramp, optimizer, measured, 5.0, after) for _ in range(3)] == [1, 1, 1] and ramp.changes == []
    # B_simple 20 asks for ceil(20 / 8) = 3 micro-steps; the interval makes it wait for 3 measured steps.
    _step(ramp, optimizer, measured, 20.0, after)
    assert ramp.accumulation_steps == 3 and measured.accumulation_steps == 3 and ramp.global_batch_size == 24
    assert ramp.changes[0].step == 3 and ramp.changes[0].b_simple == 20.0 and ramp.changes[0].lr_factor == 3
    # The next windows hold 3 micro-steps; the lr climbs from ×1 to ×3 over 4 steps, then stays.
    micro = [_step(ramp, optimizer, measured, 10.0, after) for _ in range(5)]
    assert micro == [3] * 5 and ramp.accumulation_steps == 3  # B_simple fell to 10: never shrinks
    # The pre-hook registered before the ramp's sees the optimizer's own lr; updates use the factor; after, restored.
    assert ramp.lr_factor() == 3
    assert after == [0.1] * 9 and seen == [0.1] * 9
    # A B_simple past the maximum: clipped to 8 micro-steps, the lr warming from where it was (×3) to ×8.
    _step(ramp, optimizer, measured, 1000.0, after)
    assert ramp.accumulation_steps == 8 and ramp.changes[-1].lr_factor == 8 and ramp.global_batch_size == 64
    # The next update is a quarter of the way, the fourth at the new factor.
    assert ramp.lr_factor() == pytest.approx(3 + 5 * 1 / 4)
    factors = []
    for _ in range(4):
        _step(ramp, optimizer, measured, 1000.0, after)
        factors.append(ramp.lr_factor())
    assert factors == pytest.approx([3 + 5 * 2 / 4, 3 + 5 * 3 / 4, 8, 8])
    # A checkpoint resumes the same batch and warmup.
    other = BatchRamp(torch.nn.Linear(1, 1), torch.optim.SGD([param], lr=0.1), _Measured(4, 2, 1),
                      max_accumulation_steps=8, warmup_steps=4)
    other.load_state_dict(ramp.state_dict())
    assert other.accumulation_steps == 8 and other.noise_scale.accumulation_steps == 8
    assert other.lr_factor() == ramp.lr_factor() and other.changes == ramp.changes
    # Resumed with a noise scale built at the grown batch, the rule still scales from the run's first batch.
    resumed = BatchRamp(torch.nn.Linear(1, 1), torch.optim.SGD([param], lr=0.1), _Measured(4, 2, 8),
                        max_accumulation_steps=16)
    resumed.load_state_dict(ramp.state_dict())
    assert resumed._rule_factor(16) == 16 and resumed.global_batch_size == 64


def test_with_the_real_noise_scale_on_one_process_and_a_tensor_lr():
    from ddplab.noise.scale import GradientNoiseScale

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05))
    gns = GradientNoiseScale(model, per_device_batch_size=8, accumulation_steps=2, every=1, dataset_size=4096)
    # The largest batch the ramp could reach must fit the noise scale's data: 8 × 1024 does not.
    with pytest.raises(UsageError, match="max_accumulation_steps 1024 makes a global batch of 8192, more than the "
                                         "noise scale's dataset_size 4096: lower it to 512 or less"):
        BatchRamp(model, optimizer, gns, max_accumulation_steps=1024)
    ramp = BatchRamp(model, optimizer, gns, max_accumulation_steps=32, interval=5)
    x = torch.randn(4096, 4)
    y = x.sum(1, keepdim=True) + torch.randn(4096, 1)
    for start in range(0, 4096, 8):
        with ramp.accumulate():
            loss = torch.nn.functional.mse_loss(model(x[start:start + 8]), y[start:start + 8])
            (loss / ramp.accumulation_steps).backward()
        if ramp.should_step():
            gns.step()
            optimizer.step()
            optimizer.zero_grad()
    # It grew as the weights approached w* (B_simple rises), and the noise scale measured each batch as it was.
    assert ramp.changes and ramp.accumulation_steps > 2 and gns.b_big == 8 * ramp.accumulation_steps
    assert len(gns.history) == ramp.steps and all(math.isfinite(h.g2) for h in gns.history)
    # The tensor lr is the optimizer's own again after every step, never scaled in place.
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.05)


def test_the_lr_the_optimizer_uses_during_its_step():
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.5)
    measured = _Measured(per_device_batch_size=2, world_size=2, accumulation_steps=1)
    ramp = BatchRamp(torch.nn.Linear(1, 1), optimizer, measured, max_accumulation_steps=4, rule="sqrt", interval=1)
    measured.measure(15.0)  # asks for ceil(15 / 4) = 4 micro-steps
    param.grad = torch.ones(1)
    optimizer.step()  # at the old factor ×1: 1 − 0.5
    assert float(param.detach()) == pytest.approx(0.5) and ramp.accumulation_steps == 4
    optimizer.step()  # square-root rule at 4× the batch, no warmup: ×2
    assert float(param.detach()) == pytest.approx(0.5 - 0.5 * 2) and optimizer.param_groups[0]["lr"] == 0.5


def test_bad_arguments_name_the_parameter():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    measured = _Measured(4, 2, 2)
    for kwargs, message in (({"max_accumulation_steps": 1}, "max_accumulation_steps must be an integer at least the "
                                                            "starting accumulation steps 2, got 1"),
                            ({"max_accumulation_steps": 4, "rule": "cubic"}, "rule must be linear, sqrt or none"),
                            ({"max_accumulation_steps": 4, "warmup_steps": -1}, "warmup_steps must be an integer"),
                            ({"max_accumulation_steps": 4, "target_ratio": 0}, "target_ratio must be a positive"),
                            ({"max_accumulation_steps": 4, "interval": 0}, "interval must be an integer ≥ 1")):
        with pytest.raises(UsageError) as info:
            BatchRamp(torch.nn.Linear(1, 1), optimizer, measured, **kwargs)
        assert message in str(info.value) and "--" not in str(info.value)
    with pytest.raises(ValueError, match="noise_scale must be a ddplab GradientNoiseScale"):
        BatchRamp(torch.nn.Linear(1, 1), optimizer, object(), max_accumulation_steps=4)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_example_under_torchrun_grows_the_batch_and_keeps_ddp_and_the_sampler_intact(torchrun_example):
    out = torchrun_example("batch_ramp_in_training_loop.py")
    batches = [int(b) for b in re.findall(r"global batch (\d+) \(measured", out)]
    # The batch changed mid-run, several times, only upward, within the maximum.
    assert len(batches) >= 2 and batches == sorted(set(batches)) and 16 < batches[0] and batches[-1] <= 256
    assert "every sample drawn exactly once per epoch over the ranks: yes" in out
    assert "weights identical on every rank: yes" in out
    fixed = re.search(r"fixed global batch 16: (\d+) steps, final loss ([\d.]+)", out)
    ramp = re.search(r"ramp: (\d+) steps over the same samples, final loss ([\d.]+)", out)
    assert fixed and ramp, out
    # Far fewer optimizer steps over the same samples, and a loss as good within 1%.
    assert int(ramp[1]) <= 0.6 * int(fixed[1]) and float(ramp[2]) <= 1.01 * float(fixed[2])
