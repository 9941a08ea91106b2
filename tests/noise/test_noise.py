"""Gradient noise scale: training unchanged, estimates right against closed forms, the CLI."""

import contextlib
import gc
import importlib.util
import json
import math
import os
import sys
import weakref

import numpy
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddplab.adapt.adascale import AdaScale
from ddplab.adapt.ramp import BatchRamp
from ddplab.cli.main import main
from ddplab.errors import UsageError
from ddplab.noise import estimators as est
from ddplab.noise.report import adascale_gain
from ddplab.noise.scale import GradientNoiseScale
from ddplab.runtime.launch import LaunchConfig, launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINEAR_SPEC = os.path.join(ROOT, "examples", "linear_regression_spec.py")
MLP_SPEC = os.path.join(ROOT, "tests", "specs", "mlp_fixed.py")
STALLING_SPEC = os.path.join(ROOT, "tests", "specs", "stalls_after_one_step.py")


def test_estimators_recover_exact_inputs():
    g2, trace, b_small, b_big = 3.0, 50.0, 8, 32
    small, big = g2 + trace / b_small, g2 + trace / b_big
    assert est.unbiased_estimates(small, big, b_small, b_big) == pytest.approx((g2, trace))
    # Without replacement from N: E|G_B|² = |G|² + tr Σ·(N − B)/(B·(N − 1)).
    n = 100
    small, big = (g2 + trace * (n - b) / (b * (n - 1)) for b in (b_small, b_big))
    assert est.unbiased_estimates(small, big, b_small, b_big, dataset_size=n) == pytest.approx((g2, trace))
    # The whole dataset in one batch is the true gradient.
    assert est.unbiased_estimates(small, g2, b_small, n, dataset_size=n) == pytest.approx((g2, trace))
    with pytest.raises(ValueError, match="dataset_size"):
        est.unbiased_estimates(small, big, b_small, b_big, dataset_size=16)
    summary = est.summarize([g2] * 40, [trace] * 40)
    assert summary.b_simple == pytest.approx(trace / g2) and summary.b_simple_ci95 == pytest.approx((trace / g2,) * 2)
    assert summary.steps_factor(100) == pytest.approx(1 + trace / g2 / 100)
    # AdaScale: no noise → gain 1; pure noise → gain S.
    assert adascale_gain(est.Summary(1.0, (1, 1), 1.0, 0.0, 1), 4, 8) == pytest.approx(1)
    assert adascale_gain(est.Summary(1.0, (1, 1), 0.0, 1.0, 1), 4, 8) == pytest.approx(4)
    # Between the two: r = (σ² + μ²)/(σ²/S + μ²) with σ² = tr Σ / b.
    assert adascale_gain(est.Summary(1.0, (1, 1), 2.0, 16.0, 1), 4, 8) == pytest.approx((2 + 2) / (2 / 4 + 2))


def _train(ctx, variant: str, steps: int = 6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    user_hook = {"fp16": default_hooks.fp16_compress_hook,
                 "allreduce": default_hooks.allreduce_hook}.get(variant.split("+")[0])
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
    out = {v: _train(ctx, v) for v in ("plain", "plain+gns", "plain+gns_comm", "allreduce", "allreduce+gns",
                                       "fp16", "fp16+gns")}
    out["let_go"] = {via: _let_go(via) for via in ("grad_hooks", "comm_hook")}
    out["let_go"]["subgroup"] = _let_go("grad_hooks", torch.distributed.new_group([0, 1]))
    try:
        GradientNoiseScale(torch.nn.Linear(2, 1), per_device_batch_size=4, process_group=torch.distributed.group.WORLD)
        out["plain_module"] = None
    except UsageError as exc:
        out["plain_module"] = str(exc)
    return out


def _let_go(via: str, group=None) -> tuple[bool, int]:
    """(whether the DDP model is freed by reference counts alone once the loop lets it go, while the noise scale
    and its adapter are still alive; the Python references to its process group then left beyond those before the
    model was built)."""
    group = group or torch.distributed.group.WORLD
    before = sys.getrefcount(group)
    gc.disable()  # a cycle through the model would only be broken by the collector, at some later time
    try:
        model = torch.nn.Linear(4, 1)
        ddp = DistributedDataParallel(model, process_group=group)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gns = GradientNoiseScale(ddp, per_device_batch_size=4, every=1, via=via)
        adapter = (BatchRamp(ddp, optimizer, gns, max_accumulation_steps=4) if via == "grad_hooks" else
                   AdaScale(optimizer, gns, reference_batch_size=4))
        for _ in range(2):
            optimizer.zero_grad()
            ddp(torch.randn(4, 4)).sum().backward()
            gns.step()
            optimizer.step()
        freed = weakref.ref(ddp)
        del ddp, model
        return freed() is None, sys.getrefcount(group) - before
    finally:
        del adapter, gns, optimizer
        gc.enable()


def test_training_is_unchanged_by_the_measurement():
    results = launch(_all_variants, LaunchConfig(world_size=2))[0]
    equal = lambda a, b: all(torch.equal(x, y) for x, y in zip(results[a][0], results[b][0]))  # noqa: E731
    assert equal("plain", "plain+gns"), "the default path changed training"
    assert equal("plain", "plain+gns_comm"), "not bit-identical to DDP's built-in all-reduce"
    assert equal("allreduce", "allreduce+gns") and equal("fp16", "fp16+gns")
    assert not equal("plain", "fp16")  # the comparison can tell runs apart
    assert len(results["fp16+gns"][1]) == 6
    # A loop that lets its model go frees it, and the group, as without the measurement: a process group kept past
    # destroy_process_group() dies at interpreter exit, where gloo's threads can abort the process.
    assert results["let_go"] == {"grad_hooks": (True, 0), "comm_hook": (True, 0), "subgroup": (True, 0)}
    # A module no strategy wrapped has no reduction to read on two processes: refused, not measured wrong.
    assert "this model is a plain module" in results["plain_module"]
    # Both ways of seeing the local gradient measure the same numbers.
    for a, b in zip(results["plain+gns"][1], results["plain+gns_comm"][1]):
        assert (a.g_small_sq == pytest.approx(b.g_small_sq, rel=1e-5)
                and a.g_big_sq == pytest.approx(b.g_big_sq, rel=1e-5))


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
    from ddplab.errors import LaunchError

    with pytest.raises(LaunchError, match="world size >= 2, or gradient accumulation") as info:
        launch(_world_size_one, LaunchConfig(world_size=1))
    # The rank's failure travels as a record: bad input, not a crash, and no collective involved.
    failure = info.value.failure
    assert (failure.rank, failure.exc_type, failure.collective) == (0, "ddplab.errors.UsageError", False)
    assert "world size >= 2" in failure.usage and info.value.kind == "raised"


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
    # A plot that cannot be written is refused before the run, so the run's figures are never lost to it.
    for bad, message in ((tmp_path / "no" / "such" / "p.png", "cannot be written"),
                         (tmp_path / "gns.txt", "matplotlib cannot write .txt files; use one of")):
        assert main(["noise", LINEAR_SPEC, "--batch-size", "8", "--plot", str(bad)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def test_a_spec_whose_every_step_overflows_is_one_line(tmp_path, capsys):
    spec = tmp_path / "overflowing.py"
    spec.write_text("import torch\nfrom torch.utils.data import TensorDataset\n"
                    "def model():\n    return torch.nn.Linear(4, 1)\n"
                    "def dataset():\n    return TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
                    "def loss(output, target):\n    return (output - target).pow(2).mean() * float('inf')\n")
    assert main(["noise", str(spec), "--batch-size", "4", "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "all 6 measured steps had non-finite gradients" in err and "overflowing.py" in err


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


# --- statistics against exact values: finite datasets, interval coverage, unresolved |G|² ---

SMALL_DATA_SPEC = os.path.join(ROOT, "tests", "specs", "noise_small_data.py")


def _per_example_gradients(spec_path: str, seed: int) -> torch.Tensor:
    """Every example's gradient at the spec's seeded initial weights, as rows (float64)."""
    from torch.func import functional_call, grad, vmap

    from ddplab.runtime.ranks import seeded_model
    from ddplab.runtime.spec import load_spec

    spec = load_spec(spec_path)
    model = seeded_model(spec, seed, dtype=torch.float64)
    x, y = spec.dataset().data.tensors  # the TensorDataset inside the guard
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p, xi, yi):
        return spec.loss(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.double(), y)
    return torch.cat([g.reshape(len(x), -1) for g in grads.values()], dim=1)


def _exact(per_example: torch.Tensor) -> tuple[float, float]:
    """|G|² and tr Σ with Σ = (1/N) Σ (g_i − G)(g_i − G)ᵀ, the convention of noise_estimators."""
    mean = per_example.mean(0)
    return mean.dot(mean).item(), (per_example - mean).square().sum(1).mean().item()


def _summarize(pairs, b_small, b_big, dataset_size):
    estimates = [est.unbiased_estimates(s, g, b_small, b_big, dataset_size) for s, g in pairs]
    return est.summarize([e[0] for e in estimates], [e[1] for e in estimates])


def test_finite_dataset_correction_against_exact_per_example_gradients():
    """Batches as ddplab noise draws them from 500 samples: the corrected estimate covers the exact B_simple."""
    from ddplab.runtime.sharding import RankOrder

    grads = _per_example_gradients(SMALL_DATA_SPEC, seed=1).numpy()
    n, world_size, b = len(grads), 2, 16
    g2, trace = _exact(torch.from_numpy(grads))
    exact = trace / g2
    pairs = []
    orders = [RankOrder(n, world_size=world_size, rank=r, per_device_batch_size=b, seed=1, drop_last=True)
              for r in range(world_size)]
    for step in range(2000):
        means = [grads[order.batch(step)].mean(0) for order in orders]
        pairs.append((sum(m @ m for m in means) / world_size, (sum(means) / world_size) @ (sum(means) / world_size)))
    # The sampling model itself: E|G_B|² = |G|² + tr Σ·(N − B)/(B·(N − 1)), within 4 standard errors.
    for column, batch in ((0, b), (1, world_size * b)):
        values = torch.tensor([p[column] for p in pairs])
        expected = g2 + trace * est.batch_factor(batch, n)
        assert abs(values.mean().item() - expected) < 4 * values.std().item() / len(values) ** 0.5
    corrected = _summarize(pairs, b, world_size * b, n)
    low, high = corrected.b_simple_ci95
    assert low <= exact <= high
    assert abs(corrected.b_simple - exact) <= high - low
    # The textbook estimator reads high by about B_simple/N (~14% here): its interval misses.
    textbook = _summarize(pairs, b, world_size * b, None)
    assert textbook.b_simple_ci95[0] > exact
    assert textbook.b_simple / corrected.b_simple - 1 == pytest.approx(exact / n, rel=0.5)


def _population(rng, n: int, dim: int, b_simple: float):
    """Heavy-tailed per-example gradients (Student t, 5 dof) with an exact B_simple."""
    noise = rng.standard_t(5, size=(n, dim)) * rng.uniform(0.2, 2.0, size=dim)
    noise -= noise.mean(0)
    mean = rng.normal(size=dim)
    mean *= (noise ** 2).sum(1).mean() ** 0.5 / b_simple ** 0.5 / (mean @ mean) ** 0.5
    return mean + noise


def _simulated_runs(rng, population, world_size: int, b: int, steps: int, repetitions: int):
    """Per-step (|g_b|² mean over ranks, |G_B|²), epoch by epoch without replacement, as DDP draws them."""
    n = len(population)
    per_epoch = n // (world_size * b)
    for _ in range(repetitions):
        epochs = -(-steps // per_epoch)
        order = [rng.permutation(n)[:per_epoch * world_size * b] for _ in range(epochs)]
        batches = population[numpy.concatenate(order).reshape(-1, world_size, b)[:steps]].mean(axis=2)
        yield list(zip((batches ** 2).sum(2).mean(1), (batches.mean(1) ** 2).sum(1)))


def _delta_interval(g2s, traces, n_batches=20):
    """The linearised (delta-method) interval the Fieller interval replaced, for comparison."""
    steps = len(g2s)
    ratio, size = sum(traces) / sum(g2s), steps // n_batches
    residuals = [(sum(traces[i * size:(i + 1) * size]) - ratio * sum(g2s[i * size:(i + 1) * size])) / size
                 for i in range(n_batches)]
    mean = sum(residuals) / n_batches
    half = est.t95(n_batches - 1) * (sum((r - mean) ** 2 for r in residuals) / (n_batches - 1) / n_batches) ** 0.5
    return ratio - half / (sum(g2s) / steps), ratio + half / (sum(g2s) / steps)


@pytest.mark.parametrize("b_simple, steps", [(200, 600), (300, 100)])
def test_interval_covers_the_exact_value_when_b_simple_is_far_above_the_batch(b_simple, steps):
    """200 simulated runs at global batch 16 (B_simple 12-19× larger): the 95% interval covers ≥ 90% of them."""
    rng = numpy.random.default_rng(b_simple)
    n, world_size, b = 4000, 2, 8
    population = _population(rng, n, 30, b_simple)
    g2, trace = _exact(torch.from_numpy(population))
    exact = trace / g2
    covered = delta_covered = bounded = 0
    for pairs in _simulated_runs(rng, population, world_size, b, steps, repetitions=200):
        estimates = [est.unbiased_estimates(s, g, b, world_size * b, n) for s, g in pairs]
        g2s, traces = [e[0] for e in estimates], [e[1] for e in estimates]
        low, high = est.summarize(g2s, traces).b_simple_ci95
        covered += low <= exact <= high
        bounded += math.isfinite(high)
        delta_low, delta_high = _delta_interval(g2s, traces)
        delta_covered += delta_low <= exact <= delta_high
    assert covered >= 180
    if steps == 600:
        assert bounded >= 190  # the interval is finite: coverage is not bought with [X, ∞)
    else:
        assert delta_covered < 170  # where |G|² is barely resolved the delta method falls short


def test_unresolved_g2_is_said_in_words_and_the_json_stays_standard(capsys, tmp_path):
    from ddplab.cli import noise as command
    from ddplab.noise.config import NoiseConfig
    from ddplab.noise.report import NoiseReport

    rng = numpy.random.default_rng(0)
    config = NoiseConfig(spec_path="x.py", world_size=2, per_device_batch_size=8, steps=40)
    # |G|² = 0.1 against per-step noise of 5: not resolved; the mean estimate happens to be ≤ 0 or not.
    for shift in (0.0, -1.0):
        g2s = list(0.1 + shift + 5 * rng.standard_normal(40))
        traces = list(50 + 5 * rng.standard_normal(40))
        summary = est.summarize(g2s, traces)
        assert summary.status == "g2_unresolved" and summary.b_simple_ci95[1] == math.inf
        assert 0 < summary.b_simple_ci95[0] < 50 / 0.1
        report = NoiseReport(config=config, summary=summary, b_small=8, b_big=16, dataset_size=500,
                             weights_moved=False, lr=[0.0], history=[{"step": 0, "b_simple_ema": math.inf}],
                             completed_steps=40)
        values = report.to_json()
        json.dumps(values, allow_nan=False)
        assert values["b_simple_ci95"][1] is None and values["b_simple_status"] == "g2_unresolved"
        assert (values["b_simple"] is None) == (sum(g2s) <= 0)
        command._print(report)
        out = capsys.readouterr().out
        assert "|G|² not resolved: B_simple >" in out and "inf" not in out
        command._plot(report, str(tmp_path / "unresolved.png"))


def _fit_no_b_simple():
    # |G|² clearly positive, tr Σ clearly negative: no B_simple ≥ 0 fits.
    return est.summarize([1.0, 1.1, 0.9, 1.0], [-5.0, -5.2, -4.8, -5.1])


def test_one_measured_step_and_impossible_estimates_have_no_interval():
    assert est.summarize([1.0], [3.0]).status == "no_interval"
    assert _fit_no_b_simple().status == "inconsistent" and "sampling model" in _fit_no_b_simple().describe()


@pytest.mark.timeout(120)
def test_small_dataset_run_matches_the_exact_value_and_reports_its_setting(capsys):
    """ddplab noise on 500 samples (2 ranks × 100): the interval covers B_simple from per-example gradients."""
    g2, trace = _exact(_per_example_gradients(SMALL_DATA_SPEC, seed=1))
    exact = trace / g2
    out = _noise_json(capsys, SMALL_DATA_SPEC, 2, 100, 200, "--seed", "1")
    json.dumps(out, allow_nan=False)
    low, high = out["b_simple_ci95"]
    assert low <= exact <= high and abs(out["b_simple"] - exact) <= high - low
    assert out["g2"] == pytest.approx(g2, rel=(high - low) / exact)
    textbook = _summarize([(r["g_small_sq"], r["g_big_sq"]) for r in out["per_step"]], 100, 200, None)
    assert textbook.b_simple_ci95[0] > exact  # without the correction the run would miss
    assert (out["dataset_size"], out["lr"], out["weights_moved"], out["skipped_steps"]) == (500, [0.0], False, 0)
    # One measured step: said in words; trained weights are reported as moving.
    assert main(["noise", os.path.join(ROOT, "tests", "specs", "correct.py"), "--batch-size", "8", "--steps", "5",
                 "--every", "1000"]) == 0
    text = capsys.readouterr().out
    assert "no interval" in text and "weights move" in text and "lr 0.1" in text and "inf" not in text


def test_a_non_finite_step_is_skipped_and_counted_on_one_process():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    gns = GradientNoiseScale(model, per_device_batch_size=2, accumulation_steps=2, every=1)
    for step in range(4):
        model.zero_grad()
        x, y = torch.randn(4, 3), torch.randn(4, 1)
        if step == 1:
            x[0, 0] = math.inf
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (torch.nn.functional.mse_loss(model(xs), ys) / 2).backward()
        assert (gns.step() is None) == (step == 1)
    assert gns.skipped_steps == 1 and [r.step for r in gns.history] == [0, 2, 3]
    assert math.isfinite(gns.b_simple) and math.isfinite(gns.summary().b_simple)


def _unpoisoned(gns) -> bool:
    # An overflow let into the averages turns them into inf or NaN for good.
    summary = gns.summary()
    return math.isfinite(summary.g2) and math.isfinite(summary.trace_sigma) and not math.isnan(gns.b_simple)


def _subgroup_runs(ctx):
    """Two DDP models over subgroups {0, 1} and {2, 3}: with and without the noise scale, one overflowing step."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[ctx.rank // 2]
    out = {}
    for variant in ("plain", "comm_hook", "grad_hooks", "overflow"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.001)
        gns = None if variant == "plain" else GradientNoiseScale(
            ddp, per_device_batch_size=8, every=1, via="grad_hooks" if variant == "overflow" else variant)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        generator = torch.Generator().manual_seed(ctx.rank)
        for step in range(5):
            x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            optimizer.zero_grad()
            # An fp16-style overflow on one rank of each group at step 2; the step is skipped, as GradScaler would.
            scale = math.inf if variant == "overflow" and step == 2 and ctx.rank % 2 == 0 else 1.0
            (scale * torch.nn.functional.cross_entropy(ddp(x), y)).backward()
            if gns:
                gns.step()
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                optimizer.step()
        out[variant] = ([p.detach().clone() for p in model.parameters()],
                        [(r.step, r.g_small_sq, r.g_big_sq) for r in gns.history] if gns else None,
                        gns and (gns.world_size, gns.skipped_steps, _unpoisoned(gns)))
        del ddp, gns, optimizer
    return out


@pytest.mark.timeout(120)
def test_a_subgroup_model_trains_identically_and_overflowing_steps_are_skipped():
    results = launch(_subgroup_runs, LaunchConfig(world_size=4))
    for rank, result in enumerate(results):
        plain = result["plain"][0]
        assert all(torch.equal(a, b) for a, b in zip(plain, result["comm_hook"][0])), f"rank {rank}: training changed"
        assert result["comm_hook"][2][:2] == result["grad_hooks"][2][:2] == (2, 0)
        for (_, small_a, big_a), (_, small_b, big_b) in zip(result["comm_hook"][1], result["grad_hooks"][1]):
            assert small_a == pytest.approx(small_b, rel=1e-5) and big_a == pytest.approx(big_b, rel=1e-5)
        assert result["overflow"][2] == (2, 1, True)
        assert [r[0] for r in result["overflow"][1]] == [0, 1, 3, 4]
        assert result["overflow"][1][:2] == result["grad_hooks"][1][:2]
    # Each subgroup measures its own pair of ranks: the two groups' numbers differ, ranks within one agree.
    assert results[0]["comm_hook"][1] == results[1]["comm_hook"][1] != results[2]["comm_hook"][1]


# --- a run stopped early keeps what it measured: Ctrl-C, SIGTERM and --deadline alike ---

def _noise_command(tmp_path, *flags, spec: str = LINEAR_SPEC) -> tuple:
    import subprocess

    import ddplab

    launches = tmp_path / "tmp"
    launches.mkdir()
    src = os.path.dirname(os.path.dirname(ddplab.__file__))
    # The launch directory (where rank 0 checkpoints) under this test's own TMPDIR, for the test to read.
    env = {**os.environ, "TMPDIR": str(launches),
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    # Its own session: the signal goes to the whole group, as Ctrl-C at a terminal does.
    command = subprocess.Popen([sys.executable, "-m", "ddplab", "noise", spec, "--batch-size", "16",
                                "--steps", "1000000", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)
    return command, launches


def _wait_for_checkpoint(command, launches, steps: int) -> None:
    """Until rank 0 has checkpointed ``steps`` completed steps (its partial result in the launch directory)."""
    import pickle
    import time

    from ddplab.runtime.timescale import scaled

    end = time.monotonic() + scaled(90)
    while True:
        for path in launches.glob("ddplab-launch-*/partial-0.pkl"):
            with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError):
                if pickle.loads(path.read_bytes())["completed_steps"] >= steps:
                    return
        assert command.poll() is None and time.monotonic() < end, command.communicate()
        time.sleep(0.05)


def _assert_partial(report: dict, least: int = 30) -> int:
    done = report["completed_steps"]
    assert least <= done < 1_000_000
    # Every step measured (--every 1), and the figures are those of exactly these steps.
    assert [r["step"] for r in report["per_step"]] == list(range(done)) and report["measured_steps"] == done
    summary = est.summarize([r["g2"] for r in report["per_step"]], [r["trace_sigma"] for r in report["per_step"]])
    assert report["b_simple"] == pytest.approx(summary.b_simple)
    return done


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum, returncode", [("SIGINT", 130), ("SIGTERM", -15)])
def test_a_signal_while_the_ranks_train_prints_and_writes_what_was_measured(tmp_path, signum, returncode):
    import signal

    from ddplab.runtime.timescale import scaled

    json_file = tmp_path / "gns.json"
    command, launches = _noise_command(tmp_path, "--json", "--json-file", str(json_file))
    # Past the first checkpoint (the first measured step) and a later one, with 30 steps or more.
    _wait_for_checkpoint(command, launches, 30)
    os.killpg(command.pid, getattr(signal, signum))
    out, err = command.communicate(timeout=scaled(60))
    # Ctrl-C exits 130 as every command does; SIGTERM ends the command by SIGTERM, as without ddplab.
    assert command.returncode == returncode, err
    report = json.loads(out)
    done = _assert_partial(report)
    assert report["cancelled_by"] == signum and report["stopped_early"] == f"launch cancelled by {signum}; stopped " \
                                                                             "every rank"
    assert json.loads(json_file.read_text()) == report
    assert err == (f"ddplab: stopped early: the figures cover the first {done} of 1000000 steps. launch cancelled "
                   f"by {signum}; stopped every rank\n")


@pytest.mark.timeout(180)
def test_the_deadline_is_said_as_asked_and_the_report_is_written(tmp_path):
    from ddplab.runtime.timescale import scaled

    json_file = tmp_path / "gns.json"
    # The ranks take one step and then sleep, so the deadline finds that step measured and the ranks asleep: the step
    # is measured within 4 s on a quick machine, so 10 s scaled by this machine's speed and load is the wait. The
    # command says the number it was given.
    deadline = f"{scaled(10):g}"
    command, _ = _noise_command(tmp_path, "--deadline", deadline, "--json-file", str(json_file), spec=STALLING_SPEC)
    out, err = command.communicate(timeout=scaled(120))
    assert command.returncode == 1, err
    report = json.loads(json_file.read_text())
    assert _assert_partial(report, least=1) == 1
    # The ranks had what was left of the deadline after loading the spec, a smaller number: the command says its own.
    assert report["stopped_early"] == f"the ranks were still running after the {deadline} s deadline; stopped"
    assert report["cancelled_by"] is None and "B_simple (critical batch)" in out
    assert err.endswith(f"the ranks were still running after the {deadline} s deadline; stopped\n")


def test_json_file_is_checked_before_the_run(tmp_path, capsys):
    for bad, message in ((tmp_path / "no" / "such" / "gns.json", "check that its folder exists and is writable"),
                         (tmp_path, "is a directory")):
        assert main(["noise", LINEAR_SPEC, "--batch-size", "8", "--json-file", str(bad)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def test_a_signal_before_anything_was_measured_acts_as_it_would_have():
    import signal

    from ddplab.runtime.signals import ReturnOnSignals

    # Recorded while active, then delivered again under Python's own handler: Ctrl-C stays KeyboardInterrupt.
    with pytest.raises(KeyboardInterrupt):
        with ReturnOnSignals() as signals:
            signal.raise_signal(signal.SIGINT)
            assert signals.received == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # Handled by the caller: nothing more happens.
    with ReturnOnSignals() as signals:
        signal.raise_signal(signal.SIGINT)
        signals.handled = True
