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



def _cli_under_torchrun(*runs):
    """Each ddplab command line in ``runs``: (exit code, stdout, stderr), in this torchrun worker."""
    import contextlib
    import io

    out = []
    for argv in runs:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
        out.append((code, stdout.getvalue(), stderr.getvalue()))
    return out


def _torchrun(nproc_per_node, *runs):
    import uuid

    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    config = ElasticConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, rdzv_backend="c10d",
                           rdzv_endpoint="localhost:0", run_id=uuid.uuid4().hex, max_restarts=0,
                           monitor_interval=0.1, start_method="fork")
    return elastic_launch(config, _cli_under_torchrun)(*runs)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_and_noise_join_torchrun_and_rank_zero_alone_reports():
    # One command that starts a group per worker process, as torchrun runs it: a second one would meet stale keys.
    mismatch = ["check", os.path.join(SPECS, "correct.py"), "--batch-size", "8", "--world-size", "3"]
    check_run = ["check", os.path.join(SPECS, "correct.py"), "--batch-size", "8", "--steps", "3", "--json"]
    results = _torchrun(4, mismatch, check_run)
    for rank in range(4):
        code, stdout, stderr = results[rank][0]
        assert code == 2 and stdout == "" and stderr.count("\n") == 1
        assert "--world-size 3 disagrees with torchrun's WORLD_SIZE 4" in stderr
    assert all(results[rank][1] == (0, "", "") for rank in (1, 2, 3))  # quiet, and successful
    code, stdout, _ = results[0][1]
    report = json.loads(stdout)
    # The reference splits its global batch over torchrun's 4 ranks, not --world-size's default 2.
    assert code == 0 and (report["verdict"], report["world_size"], report["global_batch_size"]) == ("EQUIVALENT", 4, 32)
    noise_run = ["noise", os.path.join(SPECS, "mlp_fixed.py"), "--batch-size", "8", "--steps", "6", "--json"]
    results = _torchrun(2, noise_run)
    assert results[1] == [(0, "", "")]
    code, stdout, _ = results[0][0]
    report = json.loads(stdout)
    assert code == 0 and (report["world_size"], report["global_batch_size"], len(report["per_step"])) == (2, 16, 6)
