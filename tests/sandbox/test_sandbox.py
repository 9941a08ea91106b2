"""The sandbox: exact numbers, theory within error bars, single == multi, vectorized == looped."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ddplab.cli.main import main
from ddplab.runtime.launch import LaunchConfig, launch
from ddplab.runtime.timescale import scaled
from ddplab.sandbox import data
from ddplab.sandbox import train as sandbox
from ddplab.sandbox.config import SandboxConfig


def _splitmix64_reference(state: int) -> int:
    mask = (1 << 64) - 1
    z = (state + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_splitmix64_wraps_like_the_reference():
    states = [0, 1, 2**40 + 7, -5, 2**63 - 1]
    got = data.splitmix64(torch.tensor(states, dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [_splitmix64_reference(s & ((1 << 64) - 1)) for s in states]


def test_noisy_data_is_a_function_of_seed_experiment_epoch_and_sample():
    full_x, full_y = data.noisy_samples(3, 1, torch.arange(256), torch.arange(50))
    part_x, part_y = data.noisy_samples(3, 1, torch.tensor([7, 200]), torch.tensor([42]))
    assert torch.equal(part_x[:, 0], full_x[[7, 200], 42]) and torch.equal(part_y[:, 0], full_y[[7, 200], 42])
    other_epoch, _ = data.noisy_samples(3, 2, torch.arange(256), torch.arange(50))
    other_seed, _ = data.noisy_samples(4, 1, torch.arange(256), torch.arange(50))
    assert not torch.equal(full_x, other_epoch) and not torch.equal(full_x, other_seed)
    # x = 1 + N(0,1), y = N(0,1), independent.
    big_x, big_y = data.noisy_samples(0, 0, torch.arange(256), torch.arange(2000))
    assert big_x.mean().item() == pytest.approx(1.0, abs=0.01)
    assert big_x.var().item() == pytest.approx(1.0, abs=0.01)
    assert big_y.mean().item() == pytest.approx(0.0, abs=0.01)
    assert torch.corrcoef(torch.stack([big_x.flatten(), big_y.flatten()]))[0, 1].abs().item() < 0.01


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_single_runs_land_within_four_standard_errors_of_theory(seed):
    for batch, n_epochs in ((128, 1), (16, 2)):
        result = sandbox.train(SandboxConfig(mode="single", per_device_batch_size=batch, deterministic=False,
                                             n_experiments=4000, n_epochs=n_epochs, seed=seed))
        theory = result.theory()
        assert abs(result.w - theory.w) <= 4 * result.w_stderr
        assert abs(result.update_step_variance - theory.update_step_variance) <= 4 * result.update_step_variance_stderr


def _rank_checks(ctx, per_rank_batch: int):
    """Everything one launch of W ranks proves at once."""
    noisy = SandboxConfig(mode="multi", per_device_batch_size=per_rank_batch, world_size=ctx.world_size,
                          deterministic=False, n_experiments=6, n_epochs=2, seed=11)
    vectorized = sandbox.train(noisy, ctx, keep_weights=True)
    looped = sandbox.train_looped(noisy, ctx)
    bypass = sandbox.train(dataclasses.replace(noisy, n_experiments=2000, n_epochs=1, bypass_ddp=True), ctx)
    correct = sandbox.train(dataclasses.replace(noisy, n_experiments=2000, n_epochs=1), ctx)
    return vectorized, looped, bypass, correct


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_multi_rank_runs_through_the_real_launcher(world_size):
    per_rank_batch = 32 // world_size
    results = launch(_rank_checks, LaunchConfig(world_size=world_size, deadline_s=scaled(120)), per_rank_batch)
    vectorized, looped, bypass, correct = results[0]
    # DDP keeps every rank's weights identical.
    assert all(r[0].weights == vectorized.weights for r in results)
    assert vectorized.allreduces == vectorized.config.steps
    # Vectorized experiments equal the same experiments run one at a time.
    assert vectorized.weights == pytest.approx(looped, abs=1e-6)
    # W ranks of b see exactly the global batches of one process with W·b.
    single = sandbox.train(dataclasses.replace(vectorized.config, mode="single", world_size=1,
                                               per_device_batch_size=32), keep_weights=True)
    assert vectorized.weights == pytest.approx(single.weights, abs=1e-6)
    if world_size > 1:
        # Bypassing the wrapper: no all-reduce, ranks drift apart, updates ~W× as noisy.
        assert bypass.allreduces == 0 and bypass.w_rank_spread > 1e-5
        ratio = bypass.update_step_variance / correct.update_step_variance
        assert ratio == pytest.approx(world_size, rel=0.15)
        # AdaScale's gain from the measured gradient noise matches the closed form of the noisy data.
        assert correct.adascale_gain == pytest.approx(correct.config.adascale_theory(), rel=0.02)
        assert 1 < correct.config.adascale_theory() < world_size
    else:
        assert correct.adascale_gain is None


def test_table_reproduces_the_classic_numbers_and_every_conclusion_holds(capsys):
    assert main(["sandbox", "table", "--json"]) == 0
    study = json.loads(capsys.readouterr().out)
    w = {run["run"]: run["w"] for run in study["runs"]}
    assert [round(w[i], 4) for i in (1, 2, 5, 6)] == [0.9980, 0.9980, 0.9840, 0.9840]
    assert all(run["update_step_variance"] == 0 for run in study["runs"] if run["deterministic"])
    assert all(c["holds"] for c in study["conclusions"]), study["conclusions"]
    assert study["runs"][3]["world_size"] == 8 and study["runs"][3]["allreduces"] == 2


def test_cli_single_json_has_the_documented_keys(capsys):
    assert main(["sandbox", "single", "--lr", "1e-3", "--batch_size", "16", "--deterministic", "False",
                 "--n_experiments", "100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("mode", "world_size", "per_device_batch_size", "global_batch_size", "lr", "n_experiments",
                "n_epochs", "seed", "steps", "w", "update_step_variance", "theory", "seconds"):
        assert key in out
    assert out["steps"] == 16 and out["n_experiments"] == 100 and not out["deterministic"]
    assert set(out["theory"]) == {"w", "update_step_variance"}


@pytest.mark.parametrize("argv, message", [
    (["sandbox", "single", "--batch-size", "100"], "--batch-size × world size = 100 must divide the 256 samples of "
                                                   "an epoch: use --batch-size 128 (global batch 128)"),
    (["sandbox", "multi", "--batch-size", "64"], "--batch-size × world size = 512 is more than the 256 samples"),
    (["sandbox", "single", "--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["sandbox", "multi", "--world-size", "2", "--bypass-ddp"], "--bypass-ddp needs noisy data (--noisy)"),
    (["sandbox", "single", "--deterministic", "maybe"], "True or False"),
    (["sandbox", "single", "--noisy", "--deterministic", "True"], "not allowed with argument"),
    # Refused before anything is allocated (10^10 experiments would be 640 GB of samples).
    (["sandbox", "single", "--noisy", "--n-experiments", "10000000000"], "more than this machine has free"),
    (["sandbox", "multi", "--noisy", "--n-experiments", "100000000"], "lower --n-experiments"),
])
def test_bad_input_exits_2_with_one_sentence(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def _descendants(pid):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    children.setdefault(int(fh.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return children.get(pid, [])


def _ranks_ignore_sigint(pid: int, count: int) -> bool:
    """Whether ``pid`` has ``count`` children, each ignoring SIGINT (its SigIgn mask in /proc holds bit 2)."""
    children = _descendants(pid)
    if len(children) < count:
        return False
    for child in children:
        try:
            with open(f"/proc/{child}/status") as fh:
                ignored = next(int(line.split()[1], 16) for line in fh if line.startswith("SigIgn:"))
        except (OSError, StopIteration):
            return False
        if not ignored & (1 << (signal.SIGINT - 1)):
            return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_is_one_line_and_exit_130_every_time():
    """Ctrl-C at a terminal signals the whole foreground group: the command and every rank it forked."""
    for argv in (["multi", "--noisy", "--n-experiments", "200000", "--n-epochs", "1000"],) * 3 + (["table"],):
        command = subprocess.Popen([sys.executable, "-m", "ddplab", "sandbox", *argv], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        # Ctrl-C once all 8 ranks run, each ignoring SIGINT as a rank does (its launcher owns cancellation).
        deadline = time.monotonic() + scaled(60)
        while not _ranks_ignore_sigint(command.pid, 8):
            assert command.poll() is None and time.monotonic() < deadline, "the 8 ranks never started"
            time.sleep(0.05)
        os.killpg(command.pid, signal.SIGINT)
        _, err = command.communicate(timeout=scaled(30))
        assert command.returncode == 130 and err == "ddplab: cancelled (Ctrl-C)\n", err
