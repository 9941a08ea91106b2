"""AdaScale: the gain against its closed form, the schedule in scale-invariant time, checkpoints, DDP ranks."""

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from ddplab.adapt.adascale import AdaScale
from ddplab.adapt.gain import Smoothed, default_smoothing, gain
from ddplab.errors import UsageError
from ddplab.noise.scale import GradientNoiseScale
from ddplab.runtime.launch import LaunchConfig, launch

ACCUMULATION, MICRO = 4, 8


def test_the_gain_lies_between_one_and_the_scale():
    assert gain(0.0, 2.0, 8) == 1  # no noise: a larger batch buys nothing
    assert gain(3.0, 0.0, 8) == pytest.approx(8)  # noise alone: the linear rule
    assert gain(2.0, 2.0, 8) == pytest.approx(4 / (2 / 8 + 2))
    assert gain(-0.1, 1.0, 8) == 1 and gain(0.0, 0.0, 8) == 1  # estimates below 0 are noise around 0
    assert default_smoothing(8) == pytest.approx(0.992) and default_smoothing(2000) == 0
    smoothed = Smoothed(0.5)
    assert smoothed.gain(4) == 1  # before any estimate
    for _ in range(3):
        smoothed.update(2.0, 2.0)
    assert smoothed.gain(4) == pytest.approx(gain(2.0, 2.0, 4))  # debiased: constant inputs, that value


def _one_process(noise: float, steps: int, *, reference_steps=None, state=None, seed=0, start=0.5):
    """One process with 4 micro-batches of 8 per step (S = 4 over a reference batch of 8), a LambdaLR schedule.

    ``noise`` is the targets' noise: 0 gives identical samples (no gradient noise), else y = noise·N(0,1).
    """
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.constant_(model.weight, start)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.1 * s))
    gns = GradientNoiseScale(model, per_device_batch_size=MICRO, accumulation_steps=ACCUMULATION, every=1)
    adascale = AdaScale(optimizer, gns, reference_batch_size=MICRO, scheduler=scheduler,
                        reference_steps=reference_steps)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        adascale.load_state_dict(state["adascale"])
    first = adascale.steps
    for step in range(first, first + steps):
        if adascale.done:
            break
        # Each step's batches from its own seed: a resumed run sees what an unbroken one would.
        generator = torch.Generator().manual_seed(1000 * (seed + 1) + step)
        optimizer.zero_grad()
        for _ in range(ACCUMULATION):
            x = torch.ones(MICRO, 3) if noise == 0 else torch.randn(MICRO, 3, generator=generator)
            y = x.sum(1, keepdim=True) + noise * torch.randn(MICRO, 1, generator=generator)
            (torch.nn.functional.mse_loss(model(x), y) / ACCUMULATION).backward()
        gns.step()
        optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "adascale": adascale.state_dict()}
    return adascale, model, state


def test_without_noise_the_gain_is_one_and_training_is_the_reference_run():
    adascale, model, _ = _one_process(0.0, 12)
    # Identical samples: the micro-batch gradients differ only by rounding, so tr Σ is 0 to 1e-15.
    assert [s.gain for s in adascale.history] == pytest.approx([1.0] * 12, abs=1e-12)
    assert adascale.tau == pytest.approx(12) and adascale.scheduler_steps == 12
    # The same 12 steps without AdaScale: the scheduler stepped by the loop, the same lrs and weights.
    torch.manual_seed(0)
    plain = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.constant_(plain.weight, 0.5)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.1 * s))
    lrs = []
    for _ in range(12):
        optimizer.zero_grad()
        for _ in range(ACCUMULATION):
            x = torch.ones(MICRO, 3)
            (torch.nn.functional.mse_loss(plain(x), x.sum(1, keepdim=True)) / ACCUMULATION).backward()
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [s.lr for s in adascale.history] == pytest.approx(lrs, rel=1e-12)
    assert torch.allclose(model.weight, plain.weight, rtol=1e-6, atol=0)


def test_with_noise_alone_the_gain_reaches_the_scale_and_the_schedule_runs_on_tau():
    # At the optimum (w = 1) of y = sum(x) + noise the mean gradient is 0: every gradient is noise, gain → S = 4.
    adascale, _, _ = _one_process(3.0, 300, start=1.0)
    late = [s.gain for s in adascale.history[-100:]]
    assert sum(late) / len(late) == pytest.approx(ACCUMULATION, rel=0.1)
    assert all(1 <= g <= ACCUMULATION for g in late)
    # τ is the sum of the gains, and the scheduler stepped once per whole unit of τ.
    assert adascale.tau == pytest.approx(sum(s.gain for s in adascale.history))
    assert adascale.scheduler_steps == math.floor(adascale.tau)
    # Each update ran at gain × the schedule's lr at the τ it had reached.
    for record, before in zip(adascale.history[1:], adascale.history):
        assert record.lr == pytest.approx(record.gain * 0.01 / (1 + 0.1 * math.floor(before.tau)))


def test_done_when_tau_reaches_the_reference_run_and_a_checkpoint_resumes_exactly():
    adascale, _, _ = _one_process(3.0, 200, reference_steps=150, start=1.0)
    # Each step is worth gain ≥ 1 reference steps: the reference's 150 are covered in fewer.
    assert adascale.done and 150 <= adascale.tau < 150 + ACCUMULATION and adascale.steps < 150 / 2
    # 40 steps, a checkpoint, 30 more in fresh objects: the same as 70 steps straight, to the bit.
    _, _, halfway = _one_process(3.0, 40)
    resumed, model, _ = _one_process(3.0, 30, state=halfway)
    straight, straight_model, _ = _one_process(3.0, 70)
    assert (resumed.steps, resumed.tau, resumed.scheduler_steps) == (70, straight.tau, straight.scheduler_steps)
    assert [s.gain for s in resumed.history] == [s.gain for s in straight.history[40:]]
    assert torch.equal(model.weight, straight_model.weight)
    with pytest.raises(UsageError, match="scale 4"):
        other = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), GradientNoiseScale(
            model, per_device_batch_size=MICRO, accumulation_steps=2, every=1), reference_batch_size=MICRO)
        other.load_state_dict(halfway["adascale"])


def test_bad_arguments_name_the_parameter():
    model = torch.nn.Linear(2, 1)
    gns = GradientNoiseScale(model, per_device_batch_size=8, accumulation_steps=2, every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, message in (({"reference_batch_size": 32}, "smaller than reference_batch_size 32"),
                            ({"reference_batch_size": 0}, "reference_batch_size must be a positive integer"),
                            ({"reference_batch_size": 8, "reference_steps": 0}, "reference_steps must be at least 1"),
                            ({"reference_batch_size": 8, "smoothing": 1.0}, "smoothing must be in [0, 1)")):
        with pytest.raises(UsageError) as info:
            AdaScale(optimizer, gns, **kwargs)
        assert message in str(info.value) and "--" not in str(info.value)
    # A ValueError naming the parameter for what the adapter cannot drive, too.
    for args, message in (((model, gns), "optimizer must be a torch.optim.Optimizer"),
                          ((optimizer, 0.5), "noise_scale must be a ddplab GradientNoiseScale"),
                          ((optimizer, gns, "cosine"), "scheduler must be a torch lr scheduler")):
        with pytest.raises(ValueError, match=message):
            AdaScale(*args[:2], reference_batch_size=8, scheduler=args[2] if len(args) > 2 else None)


def _adascale_on_ranks(ctx):
    """Two DDP ranks with their own data: the same gain on both, so the same update, so the same weights."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gns = GradientNoiseScale(ddp, per_device_batch_size=MICRO, every=1)
    adascale = AdaScale(optimizer, gns, reference_batch_size=MICRO, reference_steps=40)
    generator = torch.Generator().manual_seed(ctx.rank)
    while not adascale.done:
        x = torch.randn(MICRO, 3, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True) + torch.randn(MICRO, 1, generator=generator)) \
            .backward()
        gns.step()
        optimizer.step()
    return [s.gain for s in adascale.history], [p.detach().clone() for p in ddp.parameters()]


def test_every_rank_applies_the_same_gain_and_stays_in_sync():
    (gains0, params0), (gains1, params1) = launch(_adascale_on_ranks, LaunchConfig(world_size=2))
    assert gains0 == gains1 and len(gains0) < 40  # S = 2: fewer steps than the reference's 40
    assert all(1 <= g <= 2 for g in gains0) and max(gains0) > 1.2
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_example_under_torchrun_matches_the_reference_in_fewer_steps(torchrun_example):
    import re

    out = torchrun_example("adascale_in_training_loop.py")
    reference = re.search(r"(\d+) steps, final loss ([\d.]+)\n", out)
    adaptive = re.search(r"\(S = 4\): (\d+) steps, final loss ([\d.]+), gain ([\d.]+) at the start → ([\d.]+)",
                         out)
    assert reference and adaptive, out
    assert int(reference[1]) == 300 and int(adaptive[1]) < 300  # the gain buys steps
    assert float(adaptive[2]) <= 1.01 * float(reference[2])  # and the loss is as good
    assert 1 <= float(adaptive[3]) < float(adaptive[4]) <= 4  # the gain rises as the loss falls toward the noise
