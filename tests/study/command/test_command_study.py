"""ddplab study -- COMMAND on a small LM script written as people write them (examples/padded_lm/train.py: torchrun,
DistributedSampler, a padding collate, AdamW with warmup, accumulation, a global token count), through the real
command line: runs stopped at the target on every rank, a driver killed half-way and started again, a driver ended by
SIGTERM ending its runs, runs that fail once retried, every executor giving the same figures, and what cannot be read
said in one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ddplab.runtime import timescale
from ddplab.study.command.job import AGAIN

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.normpath(os.path.join(HERE, "..", "..", "..", "examples", "padded_lm", "train.py"))
FLAKY = os.path.join(HERE, "scripts", "flaky_train.py")
SLOW_RAY_AGENT = os.path.join(HERE, "scripts", "slow_ray_agent")
BIN = os.path.dirname(sys.executable)
# The grid: global batches 16 and 32 from the reference 16, constant and linear: 3 runs of a few dozen steps.
GRID = ["--target-loss", "1.7", "--global-batch-sizes", "16,32", "--seeds", "1", "--rules", "constant,linear",
        "--optimizer", "adamw", "--ref-global-batch-size", "16", "--ref-lr", "1e-2", "--eval-every", "5",
        "--max-steps", "300", "--no-plots", "--json"]
ONE_PROCESS = ["--world-size", "1", "--max-batch-size-per-device", "8", "--", sys.executable, SCRIPT,
               "--batch-size", "{per_device_batch_size}", "--grad-accum", "{accumulation_steps}", "--lr", "{lr}",
               "--seed", "{seed}"]


def _study(out, *args, check: int | None = 0, env=None) -> tuple[dict | None, str]:
    done = subprocess.run([os.path.join(BIN, "ddplab"), "study", *GRID, "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timescale.scaled(600), env=env)
    if check is not None:
        assert done.returncode == check, done.stderr[-3000:]
    return (json.loads(done.stdout) if done.stdout.strip() else None), done.stderr


def _figures(report: dict) -> list:
    return sorted((r["rule"], r["global_batch_size"], r["lr"], r["steps_to_target"]) for r in report["runs"])


def _run_dirs(out) -> list[str]:
    runs = os.path.join(out, "command-runs")
    return sorted(os.path.join(runs, fp, run) for fp in os.listdir(runs) for run in os.listdir(os.path.join(runs, fp)))


def _a_run_file(driver: subprocess.Popen, out, name: str, bound_s: float) -> str:
    """The path of ``name`` in the first run folder that has it, once one has; the driver still running meanwhile."""
    deadline = time.monotonic() + bound_s
    while True:
        dirs = _run_dirs(out) if os.path.isdir(out / "command-runs") else []
        found = [os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(d, name))]
        if found:
            return found[0]
        assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()[1][-3000:]
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_driver_killed_half_way_finishes_without_repeating_a_run_and_each_failed_run_is_tried_again(tmp_path):
    """torchrun on 2 ranks; each run's command fails once at step 3 (its first try) and passes on the second."""
    out = tmp_path / "out"
    command = ["--world-size", "2", "--", os.path.join(BIN, "torchrun"), "--nproc_per_node", "{world_size}",
               "--master_port", "{master_port}", FLAKY, "--batch-size", "{per_device_batch_size}", "--grad-accum",
               "{accumulation_steps}", "--lr", "{lr}", "--seed", "{seed}", "--crash-once", "{run_dir}/crashed"]
    driver = subprocess.Popen([os.path.join(BIN, "ddplab"), "study", *GRID, "--out", str(out), *command],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _a_run_file(driver, out, "result.json", timescale.scaled(300))
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=timescale.scaled(60))
    assert driver.returncode == 130 and "ddplab: cancelled (Ctrl-C)" in err
    # Nothing of the runs outlives the driver.
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not left
    finished = {d: os.stat(os.path.join(d, "output.log")).st_mtime_ns for d in _run_dirs(out)
                if os.path.exists(os.path.join(d, "result.json"))}
    assert len(finished) == 1
    report, _ = _study(out, *command)
    for run_dir, stamp in finished.items():
        assert os.stat(os.path.join(run_dir, "output.log")).st_mtime_ns == stamp  # not started again
    runs = _run_dirs(out)
    assert len(runs) == 3 and all(os.path.exists(os.path.join(d, "crashed")) for d in runs)
    assert all(r["steps_to_target"] is not None for r in report["runs"]), report["runs"]
    assert report["fit"]["linear"]["b_crit"] is not None
    # The program's own output is kept per run, every try's; the second try stopped at the target on both ranks
    # without a traceback or torchrun's report of a failed rank.
    for run_dir in runs:
        first, again, second = open(os.path.join(run_dir, "output.log")).read().partition(AGAIN)
        assert "planted failure, once" in first and again and "Traceback" not in second and "Error" not in second


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_driver_ended_by_sigterm_or_sighup_stops_its_runs_first_and_dies_by_that_signal(tmp_path, signum):
    """A scheduler's cancel or `timeout` sends SIGTERM: by default it ended the driver alone, and each run, in a
    process group of its own, went on with nothing left to stop it."""
    out = tmp_path / "out"
    # A run that writes its pid (its process group's, as the study starts each run in one of its own), then waits.
    command = ["--", "sh", "-c", 'echo $$ > "$0.tmp"; mv "$0.tmp" "$0"; exec sleep 600', "{run_dir}/started",
               "{per_device_batch_size}", "{accumulation_steps}", "{lr}", "{seed}"]
    driver = subprocess.Popen([os.path.join(BIN, "ddplab"), "study", *GRID, "--out", str(out), *command],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = None
    try:
        run = int(open(_a_run_file(driver, out, "started", timescale.scaled(60))).read())
        assert os.getpgid(run) == run
        driver.send_signal(signum)
        driver.communicate(timeout=timescale.scaled(60))
        assert driver.returncode == -signum
        with pytest.raises(ProcessLookupError):
            os.killpg(run, 0)
    finally:
        driver.kill()
        if run is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_ctrl_c_under_submitits_local_executor_is_one_line_and_leaves_nothing_running(tmp_path):
    """The local jobs never see the terminal's Ctrl-C (as a Slurm job on its node does not): the driver cancels them,
    and submitit's controller prints no traceback of its own."""
    pytest.importorskip("submitit")
    out = tmp_path / "out"
    command = ["--executor", "slurm", "--slurm-cluster", "local", "--", "sh", "-c",
               'echo $$ > "$0.tmp"; mv "$0.tmp" "$0"; exec sleep 600', "{run_dir}/started",
               "{per_device_batch_size}", "{accumulation_steps}", "{lr}", "{seed}"]
    driver = subprocess.Popen([os.path.join(BIN, "ddplab"), "study", *GRID, "--out", str(out), *command],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _a_run_file(driver, out, "started", timescale.scaled(60))
        driver.send_signal(signal.SIGINT)
        _, err = driver.communicate(timeout=timescale.scaled(60))
    finally:
        driver.kill()
    assert driver.returncode == 130 and "ddplab: cancelled (Ctrl-C)" in err, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not left


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_executor_gives_the_same_study(tmp_path):
    """One process per run with accumulation (16 = 2 × 8, 32 = 4 × 8): local two at a time, a Ray task each on a
    local Ray cluster whose first start fails (its dashboard agent too slow), a submitit job each through its local
    executor."""
    pytest.importorskip("ray")
    pytest.importorskip("submitit")
    linear = ["--rules", "linear", *ONE_PROCESS]
    local, _ = _study(tmp_path / "local", "--parallel", "2", *linear)
    slowed = tmp_path / "agent-slowed"
    path = os.pathsep.join(p for p in (SLOW_RAY_AGENT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, RAY_ADDRESS="local", RAY_AUTH_MODE="disabled", PYTHONPATH=path,
               DDPLAB_TEST_SLOW_RAY_AGENT=str(slowed))
    ray, err = _study(tmp_path / "ray", "--executor", "ray", *linear, env=env)
    assert slowed.exists() and "ddplab: warning: Ray's local cluster did not start (" in err
    assert "starting it again (2 of 3)" in err
    slurm, _ = _study(tmp_path / "slurm", "--executor", "slurm", "--slurm-cluster", "local", *linear)
    assert _figures(local) == _figures(ray) == _figures(slurm)
    assert local["fit"] == ray["fit"] == slurm["fit"] and local["fit"]["linear"]["b_crit"] is not None
    assert all(r["steps_to_target"] is not None for r in local["runs"])
    assert local["engine"] == "command (local)" and slurm["engine"] == "command (slurm)"
    # Each run stopped at its target cleanly: its program's output and nothing of a failure.
    for run_dir in _run_dirs(tmp_path / "local"):
        log = open(os.path.join(run_dir, "output.log")).read()
        assert "Traceback" not in log and "Error" not in log


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_printed_metric_is_the_target_and_what_cannot_be_read_is_one_line(tmp_path):
    grid = ["--global-batch-sizes", "16", "--rules", "constant"]
    metric = ["--metric", "val_loss", "--target-loss", "1.6", *grid, *ONE_PROCESS, "--eval-every", "10"]
    report, _ = _study(tmp_path / "metric", *metric)
    (run,) = report["runs"]
    # The program prints val_loss every 10 steps: the step it printed it after is the step to target.
    assert run["steps_to_target"] % 10 == 0
    # Lightning's self.log("val_loss") as its trainer averages it over the validation batches (every 10 steps).
    lightning = ["--world-size", "1", "--", sys.executable, os.path.join(HERE, "scripts", "lightning_train.py"),
                 "--lr", "{lr}", "--batch-size", "{per_device_batch_size}", "--seed", "{seed}"]
    report, _ = _study(tmp_path / "lightning", "--metric", "val_loss", "--target-loss", "0.9", "--global-batch-sizes",
                       "32", "--rules", "constant", "--ref-global-batch-size", "32", "--ref-lr", "3e-3", *lightning)
    (run,) = report["runs"]
    assert run["steps_to_target"] is not None and run["steps_to_target"] % 10 == 0
    _, err = _study(tmp_path / "never", "--metric", "accuracy", *grid, *ONE_PROCESS, "--max-steps", "20", check=2)
    assert "the command printed no accuracy in 20 steps" in err and err.count("\n") == 1
    # The optimizer named is checked against the one the command steps (the example's AdamW).
    _, err = _study(tmp_path / "sgd", *grid, "--optimizer", "sgd", "--max-steps", "20", *ONE_PROCESS, check=2)
    assert ("the command steps torch's AdamW and --optimizer is sgd: the rules' lrs and settings follow the family "
            "named, so pass --optimizer adamw") in err and err.count("\n") == 1
    _, err = _study(tmp_path / "ranks", *grid, "--world-size", "2", "--max-batch-size-per-device", "8",
                    *ONE_PROCESS[4:], check=2)
    assert "the command ran 1 rank and --world-size is 2, so its batches were not the grid's" in err
    _, err = _study(tmp_path / "nothing", *grid, "--", sys.executable, "-c", "import torch; print({lr}, "
                    "{per_device_batch_size})", check=2)
    assert "the command ended (exit code 0) before its optimizer stepped 5 times after a backward" in err
    # A run that fails twice is reported with the end of its output, and counts as not reached.
    flaky = [*ONE_PROCESS[:6], FLAKY, *ONE_PROCESS[7:]]
    _, err = _study(tmp_path / "failing", *grid, *flaky, "--crash-at", "2", check=1)
    log = os.path.join(_run_dirs(tmp_path / "failing")[0], "output.log")
    assert f"failed twice (exit code 1); its error: RuntimeError: planted failure at step 2; its output is in {log}" \
        in err, err
    # Every run failed: a larger step budget would change nothing, and the advice says so.
    assert "every run failed: its error is above" in err and "raise --max-steps" not in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tuned_sweeps_losers_stop_once_they_cannot_be_the_best(tmp_path):
    """constant's lr trains first; each other lr of the sweep stops past the steps constant's run took."""
    # A sweep in factors of 4 around a quick constant lr: few runs, the smaller lrs slower than constant's.
    report, _ = _study(tmp_path / "sweep", "--rules", "constant,tuned", "--ref-lr", "4e-2", "--sweep-factor", "4",
                       *ONE_PROCESS)
    runs = {}
    for run_dir in _run_dirs(tmp_path / "sweep"):
        with open(os.path.join(run_dir, "result.json")) as fh:
            result = json.load(fh)["result"]
        runs[result["global_batch_size"], result["lr"]] = result
    pruned = [r for r in report["runs"] if r["pruned"]]
    assert pruned and all(r["rule"] == "tuned" and r["steps_to_target"] is None for r in pruned)
    for row in pruned:
        batch = row["global_batch_size"]
        constant = next(r for r in report["runs"] if r["rule"] == "constant" and r["global_batch_size"] == batch)
        # Stopped at the first evaluation past the bound: the steps constant's run took to the target.
        last = runs[batch, row["lr"]]["history"][-1][0]
        assert constant["steps_to_target"] < last <= constant["steps_to_target"] + 5
        best = next(p for p in report["tuned_lr"] if p["global_batch_size"] == batch)
        assert best["median_steps"] <= constant["steps_to_target"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_command_and_a_spec_of_the_same_model_agree_within_the_seeds_spread(tmp_path):
    """train.py as one process accumulating micro-batches of 8 (its val_loss printed every 5 steps, no warmup; the
    driver-killed test runs it under torchrun) against examples/padded_lm/spec.py (the same model, data, collate and
    optimizer on ddplab's DDP engine, 2 ranks): their seeds differ in data order and
    initialisation, and each micro-batch's token mean stands in for the global count, so the medians agree within
    the seeds' spread, not to the step."""
    grid = ["--metric", "val_loss", "--target-loss", "1.4", "--global-batch-sizes", "16,32,64", "--rules", "linear",
            "--seeds", "3", "--max-steps", "400"]
    command, _ = _study(tmp_path / "command", *grid, *ONE_PROCESS, "--eval-every", "5", "--warmup", "1")
    spec_argv = [os.path.join(BIN, "ddplab"), "study", os.path.join(os.path.dirname(SCRIPT), "spec.py"), *GRID,
                 *grid[2:], "--out", str(tmp_path / "spec")]
    spec = json.loads(subprocess.run(spec_argv, capture_output=True, text=True, check=True,
                                     timeout=timescale.scaled(600)).stdout)
    assert spec["engine"] == "ddp" and command["engine"] == "command (local)"
    ours, theirs = command["fit"]["linear"], spec["fit"]["linear"]
    for batch in ("16", "32", "64"):
        low, high = theirs["seed_range"][batch]
        assert low <= ours["median_steps"][batch] <= high or \
            max(low, ours["seed_range"][batch][0]) <= min(high, ours["seed_range"][batch][1]), (batch, ours, theirs)
    # Each B_crit falls in the other's interval, or the intervals overlap.
    assert max(ours["b_crit_ci95"][0], theirs["b_crit_ci95"][0]) <= min(ours["b_crit_ci95"][1],
                                                                      theirs["b_crit_ci95"][1])
    assert command["scorecard"] is not None


SHARDED = os.path.join(HERE, "scripts", "sharded_train.py")


def _histories(out) -> dict[tuple[int, float], list]:
    """Each run's evaluations (step, loss) from its result.json, by (global batch, lr)."""
    found = {}
    for run_dir in _run_dirs(out):
        with open(os.path.join(run_dir, "result.json")) as fh:
            result = json.load(fh)["result"]
        found[(result["global_batch_size"], result["lr"])] = [row[:2] for row in result["history"]]
    return found


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.timeout(900)
def test_a_command_study_of_an_fsdp2_and_a_deepspeed_script_under_torchrun_measures_what_ddp_does(tmp_path):
    """One classifier written for DDP, FSDP2 (fully_shard per block) and DeepSpeed ZeRO-2 (deepspeed.initialize,
    engine.backward and engine.step per micro-batch), AdamW with two parameter groups, the batch of 32 in two
    micro-batches: the guest counts each engine's optimizer steps once (ZeRO steps the client optimizer per group)
    and reads the same losses, so the three studies give the same steps to the target and the same curves."""
    pytest.importorskip("deepspeed")
    grid = ["--target-loss", "0.5", "--global-batch-sizes", "16,32", "--seeds", "1", "--rules", "constant,linear",
            "--optimizer", "adamw", "--ref-global-batch-size", "16", "--ref-lr", "1e-2", "--eval-every", "5",
            "--max-steps", "300", "--no-plots", "--json", "--world-size", "2", "--max-batch-size-per-device", "8"]
    figures, curves = {}, {}
    for engine in ("ddp", "fsdp", "deepspeed"):
        out = tmp_path / engine
        done = subprocess.run(
            [os.path.join(BIN, "ddplab"), "study", *grid, "--out", str(out), "--", os.path.join(BIN, "torchrun"),
             "--nproc_per_node", "{world_size}", "--master_port", "{master_port}", SHARDED, "--engine", engine,
             "--batch-size", "{per_device_batch_size}", "--grad-accum", "{accumulation_steps}", "--lr", "{lr}",
             "--seed", "{seed}"], capture_output=True, text=True, timeout=timescale.scaled(600),
            env=dict(os.environ, DS_ACCELERATOR="cpu"))
        assert done.returncode == 0, done.stderr[-3000:]
        figures[engine], curves[engine] = _figures(json.loads(done.stdout)), _histories(out)
    assert all(steps is not None for *_, steps in figures["ddp"]) and len(curves["ddp"]) == 3
    assert figures["fsdp"] == figures["ddp"] and figures["deepspeed"] == figures["ddp"], figures
    for engine in ("fsdp", "deepspeed"):
        for key, curve in curves["ddp"].items():
            theirs = curves[engine][key]
            assert [step for step, _ in theirs] == [step for step, _ in curve], (engine, key)
            assert [loss for _, loss in theirs] == pytest.approx([loss for _, loss in curve], rel=1e-4), (engine, key)
