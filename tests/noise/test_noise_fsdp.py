"""The noise scale under FSDP2 and HSDP: ``ddplab noise --strategy fsdp|hsdp`` against closed forms, and
GradientNoiseScale on a model the user sharded with ``fully_shard``, against the exact norms."""

import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist

from ddplab.cli.main import main
from ddplab.errors import UsageError
from ddplab.noise.scale import GradientNoiseScale
from ddplab.runtime.launch import LaunchConfig, launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINEAR_SPEC = os.path.join(ROOT, "examples", "linear_regression_spec.py")
NOISELESS_SPEC = os.path.join(ROOT, "tests", "specs", "noiseless_regression.py")


def _module(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dataset_b_simple(module) -> float:
    """tr Σ / |G|² of the spec's own dataset at w = 0, where each example's gradient is −2·x·y (Σ with 1/N)."""
    x, y = module.dataset().tensors
    per_example = (-2 * x.double() * y.double())
    mean = per_example.mean(0)
    return ((per_example - mean).square().sum(1).mean() / mean.dot(mean)).item()


def _noise_json(capsys, spec: str, *flags: str) -> dict:
    assert main(["noise", spec, "--batch-size", "16", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_and_hsdp_measure_the_closed_form_b_simple(capsys):
    """B_simple = D + 1 (noiseless regression) and 12 (linear regression, D = 10, noise 1) under FSDP2 on 2 ranks and
    HSDP on 2 replicas × 2 shards (and FSDP2 reducing in bfloat16): each interval covers the closed form and the
    dataset's own exact value."""
    runs = [("fsdp", ("--steps", "400", "--strategy", "fsdp")),
            ("hsdp", ("--steps", "300", "--strategy", "hsdp", "--world-size", "4", "--replicate", "2")),
            # bfloat16's rounding of the averaged gradient (relative 2⁻⁹) is far inside the interval.
            ("fsdp", ("--steps", "400", "--strategy", "fsdp", "--reduce-dtype", "bfloat16"))]
    for path in (NOISELESS_SPEC, LINEAR_SPEC):
        module = _module(path)
        exact = _dataset_b_simple(module)
        assert exact == pytest.approx(module.TRUE_B_SIMPLE, rel=0.03)
        for name, flags in runs:
            out = _noise_json(capsys, path, *flags)
            low, high = out["b_simple_ci95"]
            assert low <= module.TRUE_B_SIMPLE <= high and low <= exact <= high, (path, name, out["b_simple"])
            assert high - low < 0.4 * exact, (path, name)  # an interval that says something
            world_size = 4 if name == "hsdp" else 2
            assert (out["strategy"], out["world_size"], out["data_parallel_size"], out["global_batch_size"]) == (
                name, world_size, world_size, 16 * world_size)
            assert out["skipped_steps"] == 0 and out["weights_moved"] is False
            assert out["reduce_dtype"] == ("bfloat16" if "--reduce-dtype" in flags else None)


def test_fsdp_refuses_one_rank_and_hsdp_a_replicate_that_does_not_divide(capsys):
    assert main(["noise", LINEAR_SPEC, "--batch-size", "8", "--strategy", "fsdp", "--world-size", "1",
                 "--accumulation", "2"]) == 2
    assert "--strategy fsdp measures from its reduce-scatter: it needs --world-size 2" in capsys.readouterr().err
    assert main(["noise", LINEAR_SPEC, "--batch-size", "8", "--strategy", "hsdp", "--world-size", "3",
                 "--replicate", "2"]) == 2
    assert "hsdp needs --replicate" in capsys.readouterr().err


def _one_sharded_rank(ctx) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(3, 1), mesh=init_device_mesh("cpu", (1,)))
    try:
        GradientNoiseScale(model, per_device_batch_size=4, accumulation_steps=2)
    except UsageError as exc:
        return str(exc)
    return "measured"


def test_one_sharded_rank_is_refused_not_measured_wrong():
    # The micro-step path's hooks would never fire on a sharded parameter: |g_small|² would read 0.
    assert "measure on 2 or more ranks" in launch(_one_sharded_rank, LaunchConfig(world_size=1))[0]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Uneven sizes: 7·5 + 7 and 2·7 + 2 elements do not split evenly into 2 or 4 shards.
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()


def _batches(rank: int, steps: int, batch: int):
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(batch, 5, generator=generator).double(), torch.randn(batch, 2, generator=generator).double())
            for _ in range(steps)]


def _exact_norms(rank: int, world_size: int, steps: int, batch: int, lr: float) -> list[tuple[float, float]]:
    """Per step (mean over ranks of |local gradient|², |average gradient|²), from plain modules trained by hand."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for x, y in _batches(rank, steps, batch):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        local = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        average = sum(gathered) / world_size
        out.append((sum(g.dot(g).item() for g in gathered) / world_size, average.dot(average).item()))
        # The reference steps on the average, as the sharded run does.
        offset = 0
        for p in model.parameters():
            p.grad.copy_(average[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
    return out


def _users_loop(ctx, replicate: int | None, steps: int = 4, batch: int = 6, lr: float = 0.1) -> dict:
    """A user's loop: fully_shard by hand (1-D mesh, or 2-D for HSDP), SGD, the noise scale measuring every step;
    beside it the same loop without the noise scale, and the exact norms."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if replicate is None:
        mesh = init_device_mesh("cpu", (ctx.world_size,))
    else:
        mesh = init_device_mesh("cpu", (replicate, ctx.world_size // replicate), mesh_dim_names=("replicate", "shard"))
    out = {"exact": _exact_norms(ctx.rank, ctx.world_size, steps, batch, lr)}
    for measured in (False, True):
        model = _model()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        gns = GradientNoiseScale(model, per_device_batch_size=batch, every=1) if measured else None
        for x, y in _batches(ctx.rank, steps, batch):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if gns is not None:
                gns.step()
            optimizer.step()
        out["measured" if measured else "plain"] = [p.full_tensor().clone() for p in model.parameters()]
        if gns is not None:
            out["norms"] = [(r.g_small_sq, r.g_big_sq) for r in gns.history]
            out["sizes"] = (gns.world_size, gns.b_small, gns.b_big, gns.via)
        del model, optimizer, gns
    return out


@pytest.mark.timeout(120)
def test_gradient_noise_scale_on_a_users_fully_shard_model_reads_the_exact_norms():
    """FSDP2 on 2 ranks and HSDP on 2 × 2: every measured step's two norms are the exact ones, training is
    unchanged bit for bit, and the batch sizes are the data-parallel ones."""
    for world_size, replicate in ((2, None), (4, 2)):
        results = launch(_users_loop, LaunchConfig(world_size=world_size), replicate)
        for rank, out in enumerate(results):
            assert all(torch.equal(a, b) for a, b in zip(out["plain"], out["measured"])), (replicate, rank)
            assert out["sizes"] == (world_size, 6, 6 * world_size, "grad_hooks")
            assert len(out["norms"]) == len(out["exact"]) == 4
            for (small, big), (exact_small, exact_big) in zip(out["norms"], out["exact"]):
                assert small == pytest.approx(exact_small, rel=1e-12) and big == pytest.approx(exact_big, rel=1e-12)
