"""ddplab check and study with --strategy deepspeed: DeepSpeed's engine owns the optimizer and the accumulation.

The ranks train in float32 (the engine reduces no float64), the single process in float64: a correct spec agrees at
every ZeRO stage within the float32 tolerance, 1e-5, with room to spare, and each planted mistake is named by the
reference that reproduces it, as on DDP. The study's DDP engine trains a grid point on the engine to the same steps.
"""

import json
import os

import pytest

pytest.importorskip("deepspeed")

from ddplab.cli.main import main  # noqa: E402

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specs")
# What float32 ranks leave against the float64 process on a correct spec: far below the 1e-5 they are judged by.
FLOAT32_AGREEMENT = 1e-6


def _check(capsys, name: str, stage: int, *, batch: int = 4, accumulation: int = 2, steps: int = 4) -> dict:
    assert main(["check", os.path.join(SPECS, f"{name}.py"), "--batch-size", str(batch), "--accumulation",
                 str(accumulation), "--steps", str(steps), "--strategy", "deepspeed", "--zero-stage", str(stage),
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_correct_spec_on_deepspeed_agrees_with_one_process_at_every_zero_stage(stage, capsys):
    """SGD with momentum, 2 ranks × 2 micro-batches of 4 (engine.backward divides by 2, engine.step counts them)."""
    out = _check(capsys, "correct", stage)
    assert (out["verdict"], out["cause"], out["strategy"], out["zero_stage"]) == ("EQUIVALENT", None, "deepspeed",
                                                                                  stage)
    assert out["tolerance"] == 1e-5 and out["accumulation_steps"] == 2 and out["global_batch_size"] == 16
    assert len(out["per_step"]) == 4
    assert all(0 < step["max_rel_diff"] <= FLOAT32_AGREEMENT for step in out["per_step"]), out["per_step"]


@pytest.mark.timeout(240)
def test_frozen_parameters_partitioned_by_zero3_are_compared_whole(capsys):
    """ZeRO-3 partitions every parameter here (no persistence threshold), frozen ones too, which have no fp32 master
    copy: they are gathered whole, and a frozen backbone under a trained head is equivalent."""
    out = _check(capsys, "frozen_body", 3, steps=3)
    assert (out["verdict"], out["cause"], out["zero_stage"]) == ("EQUIVALENT", None, 3)
    assert all(step["max_rel_diff"] <= FLOAT32_AGREEMENT for step in out["per_step"])


def test_a_step_the_engine_cannot_count_is_refused_before_any_rank_starts(capsys):
    """10 samples on 2 ranks in micro-batches of 2, accumulating 2: step 1 ends the epoch with one micro-batch, which
    would shift the engine's boundary for every later step."""
    assert main(["check", os.path.join(SPECS, "tiny_dataset.py"), "--batch-size", "2", "--accumulation", "2",
                 "--steps", "2", "--strategy", "deepspeed"]) == 2
    err = capsys.readouterr().err
    assert "step 1 ends an epoch with 1 samples per rank, 1 micro-batch of --batch-size 2" in err
    assert "give --steps 1 or fewer" in err and err.count("\n") == 1


@pytest.mark.timeout(240)
def test_planted_mistakes_on_deepspeed_are_named_as_on_ddp(capsys):
    """A summed loss at ZeRO-3 (1/(W·K) exactly, up to float32), a per-micro-batch token mean at ZeRO-2 with the
    engine's own recipe in its fix, and weight decay on an unused head at ZeRO-1: the engine's zero gradient."""
    summed = _check(capsys, "sum_reduction", 3, steps=2)
    assert (summed["verdict"], summed["cause"], summed["first_divergent_step"]) == ("DIVERGES", "SUM_REDUCTION", 0)
    assert "1/4 of the single-process gradient" in summed["explanation"]
    tokens = _check(capsys, "token_mean", 2, steps=2)
    assert (tokens["verdict"], tokens["cause"]) == ("DIVERGES", "LOSS_NORMALISED_PER_MICRO_BATCH")
    assert "engine.backward(loss_sum * dp_size / count, scale_wrt_gas=False)" in tokens["fix"]
    unused = _check(capsys, "unused_head", 1, accumulation=1, steps=2)
    assert (unused["verdict"], unused["cause"]) == ("DIVERGES", "UNUSED_PARAMETERS_STEPPED")
    assert unused["unused_parameters"] == ["aux_head.weight", "aux_head.bias"]
    assert "aux_head.weight, aux_head.bias" in unused["explanation"] and "requires_grad=False" in unused["fix"]


def test_the_table_names_the_engine_and_the_two_dtypes_and_deepspeeds_own_lines_stay_out(capfd):
    """The ranks are forked processes: their stderr is the file descriptor's, read whole here."""
    assert main(["check", os.path.join(SPECS, "correct.py"), "--batch-size", "4", "--steps", "1", "--strategy",
                 "deepspeed", "--zero-stage", "3"]) == 0
    out, err = capfd.readouterr()
    assert "(DeepSpeed ZeRO-3) vs one process × 8, float32 ranks, float64 reference, tolerance 1e-05" in \
        " ".join(out.split())
    assert "EQUIVALENT" in out
    for line in out.splitlines() + err.splitlines():
        assert not any(word in line for word in ("Warning", "WARNING", "INFO", "built successfully")), line


@pytest.mark.timeout(240)
def test_the_ddp_engine_trains_a_grid_point_on_deepspeed_as_on_ddp():
    """One grid point (global batch 16 on 2 ranks, 2 micro-steps each), float32: ZeRO-2's run reaches the target in
    DDP's steps and its evaluations agree to float32 rounding; the noise scale is not measured on the engine."""
    from ddplab.runtime import strategies
    from ddplab.runtime.launch import LaunchConfig
    from ddplab.study import workloads
    from ddplab.study.config import OptimizerConfig, StudyConfig, Target
    from ddplab.study.engines import ddp
    from ddplab.study.runs import grid_group

    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.05), global_batch_sizes=(16, 32), seeds=1,
                         optimizer=OptimizerConfig(family="sgd", momentum=0.9), reference_global_batch_size=16,
                         reference_lr=0.02, max_steps=60, eval_every=5)
    group = grid_group(config, 16, [(0.02, 0)])
    launch_config = LaunchConfig(world_size=2, backend="gloo")
    (on_ddp,) = ddp.train_group_ddp(workload, config, group, launch_config, max_per_device=4)
    (on_zero,) = ddp.train_group_ddp(workload, config, group, launch_config, max_per_device=4,
                                     strategy=strategies.get("deepspeed", zero_stage=2))
    assert on_ddp.steps_to_target is not None and on_zero.steps_to_target == on_ddp.steps_to_target
    assert [h[0] for h in on_zero.history] == [h[0] for h in on_ddp.history] and len(on_ddp.history) >= 3
    for mine, theirs in zip(on_zero.history, on_ddp.history):
        assert mine[1:] == pytest.approx(theirs[1:], rel=1e-4)
    assert on_ddp.noise_g2 and not on_zero.noise_g2


def test_what_deepspeed_cannot_serve_is_refused_before_any_rank_starts(tmp_path, capsys):
    spec = os.path.join(SPECS, "correct.py")
    cases = [
        (["check", spec, "--batch-size", "4", "--zero-stage", "2"],
         "--zero-stage is not an option of the ddp strategy"),
        (["check", spec, "--batch-size", "4", "--strategy", "deepspeed", "--zero-stage", "4"],
         "--zero-stage must be one of 0, 1, 2, 3"),
        (["check", spec, "--batch-size", "4", "--strategy", "deepspeed", "--replicate", "2"],
         "--replicate is not an option of the deepspeed strategy"),
        (["noise", spec, "--batch-size", "4", "--strategy", "deepspeed"], "ddplab noise -- COMMAND"),
        (["study", "--workload", "regression", "--engine", "ddp", "--strategy", "deepspeed", "--dtype", "float64",
          "--out", str(tmp_path / "a")], "reduces no float64 gradients: give --dtype float32"),
    ]
    for argv, said in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, (argv, err)


@pytest.mark.timeout(120)
def test_a_rank_that_stops_answering_on_zero2_is_named_within_the_collective_timeout(capsys):
    """ZeRO-2 reduces over groups DeepSpeed creates itself (torch's 30-minute default): they get the launch's
    timeout, so rank 0 fails in its collective in seconds and rank 1 is named with where it is stuck."""
    from ddplab.runtime.timescale import scaled

    assert main(["check", os.path.join(SPECS, "hangs_on_rank_one.py"), "--batch-size", "4", "--steps", "2",
                 "--strategy", "deepspeed", "--zero-stage", "2", "--timeout", f"{scaled(5):g}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ddplab: rank 1 stopped answering: rank 0 waited in a collective"), err
    assert "hangs_on_rank_one.py" in err and "in step" in err


@pytest.mark.timeout(240)
def test_under_torchrun_the_ranks_are_torchruns_and_rank_zero_alone_reports():
    import subprocess
    import sys

    from ddplab.runtime.timescale import scaled

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "ddplab", "check", os.path.join(SPECS, "correct.py"), "--batch-size", "4",
                           "--accumulation", "2", "--steps", "3", "--strategy", "deepspeed", "--zero-stage", "3",
                           "--json"], capture_output=True, text=True, timeout=scaled(200),
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert (out["verdict"], out["world_size"], out["zero_stage"], len(out["per_step"])) == ("EQUIVALENT", 2, 3, 3)
    assert all(step["max_rel_diff"] <= FLOAT32_AGREEMENT for step in out["per_step"])
