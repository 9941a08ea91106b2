"""ddplab check: equivalence proved where it holds, and the cause named where it breaks."""

import json
import os

import pytest

from ddplab.cli import main
from ddplab.equivalence import CheckConfig, check

SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")


def _check(name, world_size, batch=8, steps=4):
    return check(CheckConfig(spec_path=os.path.join(SPECS, f"{name}.py"), world_size=world_size,
                             per_device_batch_size=batch, steps=steps))


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_correct_spec_is_equivalent(world_size):
    result = _check("correct", world_size)
    assert result.verdict == "EQUIVALENT" and result.cause is None
    assert all(d["max_rel_diff"] <= 1e-9 for d in result.per_step) and len(result.per_step) == 4


def test_sum_reduction_diverges_with_its_cause():
    result = _check("sum_reduction", 2)
    assert (result.verdict, result.cause, result.first_divergent_step) == ("DIVERGES", "SUM_REDUCTION", 0)
    assert "1/2" in result.explanation


def test_batchnorm_diverges_and_is_confirmed_by_per_rank_statistics():
    result = _check("batchnorm", 2)
    assert (result.verdict, result.cause) == ("DIVERGES", "BATCHNORM")
    assert "SyncBatchNorm" in result.fix


def test_dropout_is_called_stochastic():
    result = _check("dropout", 2)
    assert (result.verdict, result.cause) == ("STOCHASTIC", "RANDOMNESS")


def test_adam_with_padding_is_equivalent_until_the_padded_batch():
    # 1001 samples on 3 ranks: 334 per rank, 2 repeats; batches of 167 → the 2nd batch holds the repeats.
    result = _check("adam_padding", 3, batch=167, steps=3)
    assert (result.verdict, result.cause, result.first_divergent_step) == ("DIVERGES", "PADDING", 1)
    assert result.per_step[0]["max_rel_diff"] <= 1e-9


def test_cli_json(capsys):
    assert main(["check", os.path.join(SPECS, "sum_reduction.py"), "--world-size", "2", "--batch-size", "4",
                 "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "DIVERGES" and out["cause"] == "SUM_REDUCTION" and out["tolerance"] == 1e-9
    assert len(out["per_step"]) == 2 and out["per_step"][0]["max_abs_diff"] > 0


def test_cli_bad_spec(tmp_path, capsys):
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    assert main(["check", str(empty), "--batch-size", "4"]) == 2
    assert "must define model(), dataset(), loss()" in capsys.readouterr().err


def test_gradient_ratio_is_exact_or_nothing():
    import torch

    from ddplab.equivalence import _gradient_ratio

    g = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    assert _gradient_ratio(4 * g, g) == pytest.approx(4)
    assert _gradient_ratio(g + torch.tensor([0.0, 0.0, 1e-3], dtype=torch.float64), g) is None
    assert _gradient_ratio(g, torch.zeros(3, dtype=torch.float64)) is None
