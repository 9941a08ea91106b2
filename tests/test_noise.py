"""Gradient noise scale: training unchanged, estimates right against closed forms, the CLI."""

import importlib.util
import json
import os

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddplab import noise_estimators as est
from ddplab.cli import main
from ddplab.launch import LaunchConfig, launch
from ddplab.noise_scale import GradientNoiseScale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINEAR_SPEC = os.path.join(ROOT, "examples", "linear_regression_spec.py")
MLP_SPEC = os.path.join(ROOT, "tests", "specs", "mlp_fixed.py")


def test_estimators_recover_exact_inputs():
    g2, trace, b_small, b_big = 3.0, 50.0, 8, 32
    small, big = g2 + trace / b_small, g2 + trace / b_big
    assert est.unbiased_estimates(small, big, b_small, b_big) == pytest.approx((g2, trace))
    summary = est.summarize([g2] * 40, [trace] * 40)
    assert summary.b_simple == pytest.approx(trace / g2) and summary.b_simple_ci95 == pytest.approx((trace / g2,) * 2)
    assert summary.steps_factor(100) == pytest.approx(1 + trace / g2 / 100)
    # AdaScale: no noise → gain 1; pure noise → gain S.
    assert est.Summary(1.0, (1, 1), 1.0, 0.0, 1).adascale_gain(4, 8) == pytest.approx(1)
    assert est.Summary(1.0, (1, 1), 0.0, 1.0, 1).adascale_gain(4, 8) == pytest.approx(4)


def _train(ctx, variant: str, steps: int = 6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    user_hook = {"fp16": default_hooks.fp16_compress_hook, "allreduce": default_hooks.allreduce_hook}.get(variant.split("+")[0])
    gns = None
    if "+gns" in variant:
        via = "comm_hook" if variant.endswith("+gns_comm") else "auto"
        gns = GradientNoiseScale(ddp, per_device_batch_size=8, comm_hook=user_hook, state=None, every=1, via=via)
    elif user_hook:
        ddp.register_comm_hook(None, user_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(ctx.rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        if gns:
            gns.step()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], gns.history if gns else None


def _all_variants(ctx):
    return {v: _train(ctx, v) for v in ("plain", "plain+gns", "plain+gns_comm", "allreduce", "allreduce+gns",
                                        "fp16", "fp16+gns")}


def test_training_is_unchanged_by_the_measurement():
    results = launch(_all_variants, LaunchConfig(world_size=2))[0]
    equal = lambda a, b: all(torch.equal(x, y) for x, y in zip(results[a][0], results[b][0]))  # noqa: E731
    assert equal("plain", "plain+gns"), "the default path changed training"
    assert equal("plain", "plain+gns_comm"), "not bit-identical to DDP's built-in all-reduce"
    assert equal("allreduce", "allreduce+gns") and equal("fp16", "fp16+gns")
    assert not equal("plain", "fp16")  # the comparison can tell runs apart
    assert len(results["fp16+gns"][1]) == 6
    # Both ways of seeing the local gradient measure the same numbers.
    for a, b in zip(results["plain+gns"][1], results["plain+gns_comm"][1]):
        assert a.g_small_sq == pytest.approx(b.g_small_sq, rel=1e-5) and a.g_big_sq == pytest.approx(b.g_big_sq, rel=1e-5)


def _noise_json(capsys, spec, world_size, batch, steps, *flags):
    assert main(["noise", spec, "--world-size", str(world_size), "--batch-size", str(batch),
                 "--steps", str(steps), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.parametrize("world_size, steps", [(2, 800), (4, 400)])
def test_linear_regression_estimate_matches_the_closed_form(world_size, steps, capsys):
    spec = importlib.util.spec_from_file_location("linear_spec", LINEAR_SPEC)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = _noise_json(capsys, LINEAR_SPEC, world_size, 16, steps)
    truth = module.TRUE_B_SIMPLE
    assert out["b_simple"] == pytest.approx(truth, rel=0.05)
    low, high = out["b_simple_ci95"]
    assert low <= truth <= high
    assert out["g2"] == pytest.approx(4 * module.D, rel=0.1)
    for key in ("trace_sigma", "steps", "world_size", "per_device_batch_size"):
        assert key in out
    assert out["per_device_batch_size"] == 16 and len(out["per_step"]) == steps


@pytest.mark.slow
def test_estimates_from_two_and_four_ranks_agree_on_a_real_model(capsys):
    two = _noise_json(capsys, MLP_SPEC, 2, 16, 300)
    four = _noise_json(capsys, MLP_SPEC, 4, 16, 300)
    (low2, high2), (low4, high4) = two["b_simple_ci95"], four["b_simple_ci95"]
    assert low2 <= four["b_simple"] <= high2 or low4 <= two["b_simple"] <= high4
    assert max(low2, low4) <= min(high2, high4)


def _world_size_one(ctx):
    return GradientNoiseScale(DistributedDataParallel(torch.nn.Linear(2, 1)), per_device_batch_size=4)


@pytest.mark.slow
def test_measuring_every_fourth_step_keeps_the_stated_accuracy(capsys):
    assert main(["noise", LINEAR_SPEC, "--world-size", "2", "--batch-size", "16", "--steps", "1600", "--every", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = importlib.util.spec_from_file_location("linear_spec", LINEAR_SPEC)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert out["measured_steps"] == 400
    assert out["b_simple"] == pytest.approx(module.TRUE_B_SIMPLE, rel=0.05)
    assert out["b_simple_ci95"][0] <= module.TRUE_B_SIMPLE <= out["b_simple_ci95"][1]


def test_one_rank_without_accumulation_is_refused_with_a_reason():
    from ddplab.launch import LaunchError

    with pytest.raises(LaunchError, match="world size >= 2, or gradient accumulation"):
        launch(_world_size_one, LaunchConfig(world_size=1))


@pytest.mark.slow
def test_one_process_with_accumulation_matches_the_closed_form(capsys):
    out = _noise_json(capsys, LINEAR_SPEC, 1, 16, 400, "--accumulation", "4")
    spec = importlib.util.spec_from_file_location("linear_spec", LINEAR_SPEC)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (out["world_size"], out["accumulation_steps"], out["global_batch_size"]) == (1, 4, 64)
    assert out["g2"] == pytest.approx(4 * module.D, rel=0.1)
    assert out["b_simple"] == pytest.approx(module.TRUE_B_SIMPLE, rel=0.05)
    assert out["b_simple_ci95"][0] <= module.TRUE_B_SIMPLE <= out["b_simple_ci95"][1]


def test_one_process_micro_steps_need_no_process_group():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    gns = GradientNoiseScale(model, per_device_batch_size=2, accumulation_steps=2, every=1)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        (torch.nn.functional.mse_loss(model(xs), ys) / 2).backward()
    record = gns.step()
    # Contributions c_i = grad of loss_i / 2: a micro-batch's gradient is 2·c_i, the whole batch's Σ c_i.
    grads = []
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        model.zero_grad()
        (torch.nn.functional.mse_loss(model(xs), ys) / 2).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    assert record.g_small_sq == pytest.approx(sum((2 * g).dot(2 * g).item() for g in grads) / 2, rel=1e-6)
    total = grads[0] + grads[1]
    assert record.g_big_sq == pytest.approx(total.dot(total).item(), rel=1e-6)


def test_cli_plot_and_bad_input(tmp_path, capsys):
    png = tmp_path / "gns.png"
    assert main(["noise", LINEAR_SPEC, "--batch-size", "8", "--steps", "30", "--every", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "B_simple" in capsys.readouterr().out
    assert main(["noise", LINEAR_SPEC, "--batch-size", "8", "--world-size", "1"]) == 2
    assert "needs --accumulation 2" in capsys.readouterr().err
    assert main(["noise", "missing_spec.py", "--batch-size", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err


def _accumulation_pairs(ctx):
    """Per-step norms from one step of 2b vs two no_sync micro-steps of b (loss / 2), both paths."""
    out = {}
    for via in ("grad_hooks", "comm_hook"):
        for accumulation in (1, 2):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
            ddp = DistributedDataParallel(model)
            gns = GradientNoiseScale(ddp, per_device_batch_size=8 // accumulation, accumulation_steps=accumulation,
                                     every=1, via=via)
            generator = torch.Generator().manual_seed(ctx.rank)
            for _ in range(3):
                x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 1, generator=generator)
                for micro, (xs, ys) in enumerate(zip(x.chunk(accumulation), y.chunk(accumulation))):
                    sync = micro == accumulation - 1
                    with (torch.enable_grad() if sync else ddp.no_sync()):
                        (torch.nn.functional.mse_loss(ddp(xs), ys) / accumulation).backward()
                gns.step()
                ddp.zero_grad()
            out[via, accumulation] = [(r.g_small_sq, r.g_big_sq) for r in gns.history], gns.b_small
    return out


def test_accumulation_is_accounted_for():
    out = launch(_accumulation_pairs, LaunchConfig(world_size=2))[0]
    for via in ("grad_hooks", "comm_hook"):
        (whole, b_whole), (micro, b_micro) = out[via, 1], out[via, 2]
        assert b_whole == b_micro == 8
        assert len(whole) == len(micro) == 3
        for (small_a, big_a), (small_b, big_b) in zip(whole, micro):
            assert small_a == pytest.approx(small_b, rel=1e-5) and big_a == pytest.approx(big_b, rel=1e-5)
