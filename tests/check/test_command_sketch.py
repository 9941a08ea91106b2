"""The count sketch check -- COMMAND compares gradients with, and the comparison built on it, against exact
computation and the estimator's theory; and the command form's bad input, refused before anything runs."""

import math

import pytest
import torch

from ddplab.check.command import compare, sketch
from ddplab.check.command.config import CommandCheckConfig
from ddplab.cli.main import main
from ddplab.errors import UsageError


def _whole(x: torch.Tensor, key: str = "k", buckets: int = sketch.BUCKETS) -> torch.Tensor:
    return sketch.sketch(x, key, tuple(x.shape), (0,) * x.dim(), buckets)


def test_a_tensor_no_larger_than_the_buckets_is_kept_whole():
    x = torch.randn(7, 9, dtype=torch.float64)
    assert torch.equal(_whole(x), x.flatten())
    assert torch.equal(_whole(torch.tensor(3.5)), torch.tensor([3.5], dtype=torch.float64))


@pytest.mark.parametrize("shape, split_dim", [((40, 30), 0), ((40, 30), 1), ((6, 10, 12), 2)])
def test_shards_sketched_by_global_index_add_up_to_the_whole_tensor(shape, split_dim):
    x = torch.randn(*shape, dtype=torch.float64)
    whole = _whole(x, buckets=64)
    total = torch.zeros_like(whole)
    start = 0
    # Uneven blocks, as FSDP2 and tensor parallelism cut them.
    for block in torch.tensor_split(x, 3, dim=split_dim):
        offset = [0] * x.dim()
        offset[split_dim] = start
        total += sketch.sketch(block, "k", shape, tuple(offset), 64)
        start += block.shape[split_dim]
    assert torch.allclose(total, whole, rtol=0, atol=1e-12)


def test_rows_are_hashed_in_bounded_blocks_with_the_same_result(monkeypatch):
    x = torch.randn(300, 7, dtype=torch.float64)
    whole = _whole(x, buckets=32)
    monkeypatch.setattr(sketch, "CHUNK", 20)
    assert torch.allclose(_whole(x, buckets=32), whole, rtol=0, atol=1e-12)


def test_the_sketch_is_linear_and_the_same_for_the_same_key_only():
    a, b = torch.randn(2000, dtype=torch.float64), torch.randn(2000, dtype=torch.float64)
    assert torch.allclose(_whole(a - 0.5 * b), _whole(a) - 0.5 * _whole(b), atol=1e-12)
    assert torch.equal(_whole(a, "w"), _whole(a, "w"))
    assert not torch.equal(_whole(a, "w"), _whole(a, "v"))


def test_the_squared_norm_estimate_is_unbiased_with_the_variance_theory_gives():
    # For a count sketch, E|Sx|² = |x|² and Var|Sx|² = 2(|x|⁴ − Σx⁴)/m over random hashes (here: random keys).
    m, x = 64, torch.randn(5000, dtype=torch.float64)
    estimates = torch.tensor([float(_whole(x, f"key{i}", m).square().sum()) for i in range(400)])
    exact = float(x.square().sum())
    predicted_sd = math.sqrt(2 * (exact ** 2 - float(x.pow(4).sum())) / m)
    # The mean of 400 estimates lies within 4 standard errors; the spread within 15% of theory.
    assert abs(float(estimates.mean()) - exact) < 4 * predicted_sd / math.sqrt(400)
    assert float(estimates.std()) == pytest.approx(predicted_sd, rel=0.15)


def _vector(x: torch.Tensor, key: str = "k") -> compare.Vector:
    return compare.Vector(sq=float(x.square().sum()), sketch=_whole(x, key).tolist())


def test_a_pure_scale_is_an_exact_ratio_at_cosine_one_and_a_turn_is_estimated():
    g = torch.randn(20000, dtype=torch.float64)
    scaled = compare.compare([_vector(0.5 * g)], [_vector(g)], exact=False)
    assert scaled.gradient_ratio == pytest.approx(0.5, rel=1e-12)
    assert scaled.cosine == pytest.approx(1, abs=1e-12)
    assert scaled.difference == pytest.approx(0.5, rel=0.2)
    other = torch.randn(20000, dtype=torch.float64)
    turned = 0.8 * g + 0.6 * other * g.norm() / other.norm()
    exact = float(turned @ g / (turned.norm() * g.norm()))
    result = compare.compare([_vector(turned)], [_vector(g)], exact=False)
    assert result.gradient_ratio == pytest.approx(float(turned.norm() / g.norm()), rel=1e-12)
    # 1 − cos to a few standard deviations of √(2/m).
    assert 1 - result.cosine == pytest.approx(1 - exact, rel=4 * math.sqrt(2 / sketch.BUCKETS))


def test_the_ranks_shards_are_summed_and_replicas_compared():
    g = torch.randn(1000, dtype=torch.float64)
    halves = [{"grad_sq": float(h.square().sum()), "grad": sketch.sketch(h, "0.0.0", (1000,), (i * 500,)).tolist(),
               "param_before": [0.0], "param_before_sq": 0.0, "param_after": [0.0], "param_after_sq": 0.0,
               "sharded": True, "shape": [1000], "dtype": "float64", "name": "w"} for i, h in enumerate(g.split(500))]
    merged = compare.merge_side([{"kind": "step", "optimizer": 0, "step": 0, "rank": r, "params": {"0.0.0": e}}
                                 for r, e in enumerate(halves)])
    param = merged[(0, 0)]["0.0.0"]
    assert param.grad.sq == pytest.approx(float(g.square().sum()), rel=1e-12)
    assert torch.allclose(torch.tensor(param.grad.sketch, dtype=torch.float64), _whole(g, "0.0.0"), atol=1e-12)


COMMAND = ("python", "train.py", "--nproc", "{world_size}", "--bs", "{per_device_batch_size}")


@pytest.mark.parametrize("command, fields, words", [
    (("python", "train.py", "--bs", "{per_device_batch_size}"), {}, "needs {world_size}"),
    (("python", "train.py", "--n", "{world_size}"), {}, "needs {per_device_batch_size}"),
    (COMMAND, {"global_batch_size": 15}, "does not split over 2 ranks"),
    (COMMAND, {"accumulation_steps": 2}, "needs {accumulation_steps}"),
    ((*COMMAND, "--lr", "{lr}"), {}, "holds {lr}, which check does not fill"),
    (COMMAND, {"world_size": 1}, "world_size must be at least 2"),
])
def test_a_command_check_that_cannot_run_is_refused_in_one_sentence(command, fields, words):
    with pytest.raises(UsageError) as raised:
        CommandCheckConfig(command=command, **fields)
    assert words in str(raised.value) and "\n" not in str(raised.value)


def test_the_split_of_one_global_batch_two_ways():
    ranks, one = CommandCheckConfig(command=(*COMMAND, "{accumulation_steps}"), world_size=4, global_batch_size=32,
                                    accumulation_steps=2).sides()
    assert (ranks.world_size, ranks.per_device_batch_size, ranks.accumulation_steps) == (4, 4, 2)
    assert (one.world_size, one.per_device_batch_size, one.accumulation_steps) == (1, 32, 1)
    assert ranks.global_batch_size == one.global_batch_size == 32


@pytest.mark.parametrize("argv, words", [
    (["check", "--batch-size", "8", "--", "python", "x.py"], "--batch-size belongs to the spec form"),
    (["check", "tests/specs/correct.py", "--", "python", "x.py"], "not both"),
    (["check", "tests/specs/correct.py", "--batch-size", "8", "--global-batch-size", "16"],
     "--global-batch-size belongs to the form that runs your own command"),
    (["check"], "give a SPEC.py, or your training command after --"),
    (["check", "--", "no-such-program-here", "{world_size}", "{per_device_batch_size}"], "command not found"),
])
def test_the_cli_refuses_mixed_forms_with_exit_code_2(capsys, argv, words):
    assert main(argv) == 2
    assert words in capsys.readouterr().err
