"""ddplab inside Lightning, Accelerate and the Transformers Trainer: real runs on CPU with gloo, 2 processes.

Each framework's correct script must audit clean with its output and exit code intact; each planted
mistake must give exactly its finding; each callback is checked against values computed from the data.
One launch per script (framework imports are slow); tests skip when their framework is not installed.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from ddplab.cli.main import main
from ddplab.noise import estimators as est
from ddplab.plan import scaling
from ddplab.runtime.timescale import scaled

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
# --standalone: a free port for the rendezvous, so launches never meet on torchrun's default 29500.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
LINEAR_SPEC = os.path.join(os.path.dirname(HERE), "..", "..", "examples", "linear_regression_spec.py")


def _accelerate_launch() -> list[str]:
    """`accelerate launch` on 2 CPU processes, on a free port (its default, 29500, is shared by every launch)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--main_process_port", str(port)]


@pytest.fixture
def in_scripts(monkeypatch, tmp_path):
    """Run from the scripts' folder; each script writes rank 0's numbers to the returned path."""
    monkeypatch.chdir(HERE)
    result = tmp_path / "result.json"
    monkeypatch.setenv("DDPLAB_TEST_RESULT", str(result))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return result


def _audit(tmp_path, capfd, command, *flags):
    """(exit code, report, the command's stdout) of ``ddplab audit`` on ``command``."""
    report = tmp_path / "audit.json"
    code = main(["audit", "--json-file", str(report), *flags, "--", *command])
    captured = capfd.readouterr()
    # Written again, so that a failing test shows the command's stderr in its report.
    sys.stderr.write(captured.err)
    return code, json.loads(report.read_text()), captured.out


def _serious(report):
    return {f["code"]: f["severity"] for f in report["findings"] if f["severity"] in ("error", "warning")}


def _finding(report, code):
    return next(f for f in report["findings"] if f["code"] == code)


# --- Lightning: it starts its own worker processes from `python train.py` ---

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_correct_script_is_clean_and_its_lr_scaled_by_the_callback(in_scripts, tmp_path, capfd, monkeypatch):
    pytest.importorskip("lightning")
    monkeypatch.setenv("DDPLAB_TEST_EXIT", "3")
    code, report, out = _audit(tmp_path, capfd, [sys.executable, "lightning_train.py"])
    assert code == 3 and "lightning-done steps=8" in out  # the script's own exit code and output
    assert _serious(report) == {}
    assert report["world_size"] == 2 and report["steps_audited"] == 5
    assert report["global_batch_size"] == 64  # 16 per process × 2 processes × accumulate_grad_batches 2
    result = json.loads(in_scripts.read_text())
    # ScaleLearningRate: reference global batch 32 → 64 is ×2 (linear rule for SGD), base_lrs and initial_lr too.
    assert result["lr_multiplier"] == 2.0 and result["base_lrs"] == [0.1] and result["initial_lr"] == 0.1
    expected = [0.05 * 2 / (1 + 0.1 * step) * scaling.warmup_factor(step, warmup_steps=4, lr_multiplier=2)
                for step in range(8)]
    assert result["applied"] == pytest.approx(expected, rel=1e-12)


LIGHTNING_MISTAKES = {  # mistake → (its finding, what the finding says)
    "sum_reduction": (("SUM_REDUCTION", "warning"), "accumulate_grad_batches=2"),
    "lr_scaled": (("LR_SCALED_NOT_SCHEDULE", "warning"), "lr 0.1 is W = 2 times what LambdaLR set (0.05)"),
    "no_sampler": (("SAME_DATA_ON_ALL_RANKS", "error"), "distinct training batches"),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_mistakes_are_found(in_scripts, tmp_path, capfd):
    # Three independent mistakes in one Lightning run (each start costs ~10 s): each its own finding, nothing more.
    pytest.importorskip("lightning")
    code, report, out = _audit(tmp_path, capfd, [sys.executable, "lightning_train.py", "--mistake",
                                                 *LIGHTNING_MISTAKES])
    assert code == 0 and "lightning-done steps=8" in out
    assert _serious(report) == dict(finding for finding, _ in LIGHTNING_MISTAKES.values())
    for (code_, _), says in LIGHTNING_MISTAKES.values():
        assert says in _finding(report, code_)["message"]


def _linear_regression():
    import importlib.util

    spec = importlib.util.spec_from_file_location("linear_regression_spec", LINEAR_SPEC)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exact_norms(dataset, index: torch.Tensor):
    """Per step, (mean local |g|², |averaged g|²) at w = 0; ``index`` is steps × ranks × samples per rank and step."""
    x, y = (t.double() for t in dataset.tensors)
    # d/dw of the mean of (x·w − y)² over n samples, at w = 0: −(2/n) Σ y x.
    grads = -2.0 / index.shape[2] * (y[index] * x[index]).sum(dim=2)  # steps × ranks × D
    return grads.square().sum(dim=2).mean(dim=1).tolist(), grads.mean(dim=1).square().sum(dim=1).tolist()


def _lightning_shards(dataset, steps: int, world_size: int, batch: int) -> torch.Tensor:
    from torch.utils.data import DistributedSampler

    # Lightning's automatic sampler for training always shuffles (seed 0 without seed_everything).
    shards = [list(DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0))
              for rank in range(world_size)]
    return torch.tensor([shard[:steps * batch] for shard in shards]).reshape(world_size, steps, batch).transpose(0, 1)


def _round_robin_batches(steps: int, world_size: int, batch: int, accumulation: int) -> torch.Tensor:
    """Accelerate (and the Trainer through it) deal the loader's batches out in turn: rank r's micro-batch m is
    loader batch m·W + r."""
    micro = torch.arange(steps * accumulation).reshape(steps, 1, accumulation, 1)
    rank = torch.arange(world_size).reshape(1, world_size, 1, 1)
    first = (micro * world_size + rank) * batch
    return (first + torch.arange(batch)).reshape(steps, world_size, accumulation * batch)


def _check_noise(result, dataset, index, b_small: int, b_big: int, true_b_simple: float) -> None:
    steps = index.shape[0]
    assert (result["b_small"], result["b_big"]) == (b_small, b_big) and len(result["history"]) == steps
    small, big = _exact_norms(dataset, index)
    assert [r["g_small_sq"] for r in result["history"]] == pytest.approx(small, rel=1e-5)
    assert [r["g_big_sq"] for r in result["history"]] == pytest.approx(big, rel=1e-5)
    estimates = [est.unbiased_estimates(s, b, b_small, b_big) for s, b in zip(small, big)]
    exact = est.summarize([g2 for g2, _ in estimates], [trace for _, trace in estimates])
    assert result["b_simple"] == pytest.approx(exact.b_simple, rel=1e-4)
    # And the closed form of linear regression at fixed weights (within the sampling error of this many steps).
    assert result["b_simple"] == pytest.approx(true_b_simple, rel=0.1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_noise_scale_callback_matches_the_exact_norms_and_the_closed_form(in_scripts, monkeypatch):
    pytest.importorskip("lightning")
    steps = 400
    monkeypatch.setenv("DDPLAB_TEST_STEPS", str(steps))
    done = subprocess.run([sys.executable, "lightning_noise.py"], capture_output=True, text=True, timeout=scaled(280),
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(in_scripts.read_text())
    spec = _linear_regression()
    dataset = spec.dataset()
    _check_noise(result, dataset, _lightning_shards(dataset, steps, 2, 16), 16, 32, spec.TRUE_B_SIMPLE)
    # Logged through Lightning: the last measured step's values.
    last = result["history"][-1]
    assert result["logged"] == pytest.approx({k: last[k] for k in ("b_simple", "grad_sq_norm", "trace_sigma")},
                                             rel=1e-6)
    # The Audit callback audited 3 steps and found nothing.
    assert result["audit"] == {} and result["audited"] == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_batch_ramp_grows_the_accumulation_at_epoch_starts_with_the_lr_it_planned(in_scripts):
    pytest.importorskip("lightning")
    done = subprocess.run([sys.executable, "lightning_ramp.py"], capture_output=True, text=True, timeout=scaled(280),
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(in_scripts.read_text())
    accumulation, changes = result["accumulation"], result["changes"]
    # It grew, only upward, only when an epoch started, to the global batch the measured B_simple asked for.
    assert accumulation[0] == 1 and accumulation == sorted(accumulation) and accumulation[-1] > 1 and changes
    assert [c["accumulation_steps"] for c in changes] == sorted(set(accumulation) - {1})
    for change in changes:
        assert change["global_batch_size"] == min(256, 16 * math.ceil(change["b_simple"] / 16))
        assert change["lr_factor"] == change["accumulation_steps"]  # the linear rule for SGD
    # Lightning stepped once per window of each epoch (a shorter last window where the batches do not divide).
    per_epoch = result["batches_per_epoch"]
    assert result["steps"] == sum(math.ceil(per_epoch / a) for a in accumulation) == len(result["lrs"])
    # Every update ran at the planned lr: the rule's factor, warmed up over 5 steps from the previous one.
    jumps = {c["step"] + 1: c["lr_factor"] for c in changes}
    start, end, at, expected = 1.0, 1.0, 0, []
    for step in range(result["steps"]):
        if step in jumps:
            start, end, at = start + (end - start) * min(1, (step - at + 1) / 5), jumps[step], step
        expected.append(result["lr"] * (start + (end - start) * min(1, (step - at + 1) / 5)))
    assert result["lrs"] == pytest.approx(expected, rel=1e-12)
    # DDP stayed in sync, and Lightning's sampler drew every sample exactly once in every epoch.
    assert result["same_weights"] and result["complete"] == [True] * len(accumulation)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_batch_schedule_follows_the_thresholds_at_epoch_starts_with_the_schedules_lrs(in_scripts):
    pytest.importorskip("lightning")
    done = subprocess.run([sys.executable, "lightning_schedule.py"], capture_output=True, text=True,
                          timeout=scaled(280), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(in_scripts.read_text())
    # 2048 samples an epoch at 16, 32, 32, 64: the thresholds 1000 and 5000 are passed mid-epoch (at 2048 and
    # 6144 samples seen by the next epoch's start), and each takes effect there.
    assert result["accumulation"] == [1, 2, 2, 4] and result["samples_seen"] == 4 * 2048
    assert [(c["step"], c["samples_seen"], c["entry"], c["global_batch_size"], c["lr_factor"])
            for c in result["changes"]] == [(127, 2048, 1, 32, 2.0), (255, 6144, 2, 64, 3.0)]
    assert result["steps"] == 128 + 64 + 64 + 32 == len(result["lrs"]) == result["state"]["steps"]
    # Every update at 0.02 × the entry's lr over the first's (0.02, 0.04, 0.06), warmed up over 5 steps.
    expected = [0.02] * 128 + [0.02 + 0.02 * min(1, k / 5) for k in range(1, 129)] + \
        [0.04 + 0.02 * min(1, k / 5) for k in range(1, 33)]
    assert result["lrs"] == pytest.approx(expected, rel=1e-12)
    assert result["complete"] == [True] * 4 and result["same_weights"]


# --- Accelerate ---

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_correct_script_is_clean(in_scripts, tmp_path, capfd):
    pytest.importorskip("accelerate")
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "accelerate_train.py"])
    assert code == 0 and "accelerate-done steps=16 processes=2" in out
    assert _serious(report) == {}
    assert report["world_size"] == 2 and report["global_batch_size"] == 32  # 8 × 2 processes × 2 accumulation
    # Its schedule was lengthened by num_processes on purpose: it changes to the end, so nothing is said of it.
    assert "SCHEDULER_STEPS_PER_PROCESS" not in {f["code"] for f in report["findings"]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_summed_loss_is_found_through_its_division_by_the_accumulation_steps(in_scripts, tmp_path, capfd):
    pytest.importorskip("accelerate")
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "accelerate_train.py", "--mistake", "sum_reduction"])
    assert code == 0 and "accelerate-done steps=16 processes=2" in out
    assert _serious(report) == {"SUM_REDUCTION": "warning"}
    assert "Accelerator.backward" in _finding(report, "SUM_REDUCTION")["message"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_schedule_that_ends_half_way_is_a_warning(in_scripts, tmp_path, capfd):
    pytest.importorskip("accelerate")
    sys.path.insert(0, HERE)
    try:
        import accelerate_train
    finally:
        sys.path.remove(HERE)
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "accelerate_train.py", "--mistake", "schedule"])
    assert code == 0 and "accelerate-done steps=16" in out
    assert _serious(report) == {"SCHEDULER_STEPS_PER_PROCESS": "warning"}
    # Two scheduler steps per optimizer step: the first optimizer step at lr 0 is the first k with factor(2k) = 0.
    factor = accelerate_train.linear_decay(accelerate_train.STEPS, warmup=2)
    first_zero = next(k for k in range(accelerate_train.STEPS) if factor(2 * k) == 0)
    assert first_zero == 8
    assert f"reached 0 at optimizer step {first_zero}" in _finding(report, "SCHEDULER_STEPS_PER_PROCESS")["message"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_schedule_built_after_prepare_that_ends_after_the_window_is_a_warning(in_scripts, tmp_path, capfd):
    pytest.importorskip("accelerate")
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "accelerate_train.py", "--mistake", "schedule_late"])
    assert code == 0 and "accelerate-done steps=32" in out
    assert _serious(report) == {"SCHEDULER_STEPS_PER_PROCESS": "warning"}
    # A 32-step decay stepped twice per optimizer step reaches 0 at optimizer step 16; 5 steps were audited.
    assert report["steps_audited"] == 5
    assert "reached 0 at optimizer step 16" in _finding(report, "SCHEDULER_STEPS_PER_PROCESS")["message"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_processes_that_each_train_alone_are_not_distributed(in_scripts, tmp_path, capfd):
    pytest.importorskip("accelerate")
    code, report, out = _audit(tmp_path, capfd, [*_accelerate_launch(), "accelerate_train.py", "--mistake",
                                                 "not_distributed"], "--strict")
    assert out.count("accelerate-done steps=16 processes=1") == 2  # two whole runs, side by side
    assert code == 3  # --strict: the command succeeded, an error was found
    assert _serious(report) == {"NOT_DISTRIBUTED": "error"}
    assert _finding(report, "NOT_DISTRIBUTED")["ranks"] == [0, 1] and report["world_size"] == 2


# --- the Transformers Trainer ---

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_transformers_trainer_correct_script_is_clean(in_scripts, tmp_path, capfd):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "transformers_train.py"])
    assert code == 0 and "trainer-done steps=8" in out
    assert _serious(report) == {}
    assert report["world_size"] == 2 and report["steps_audited"] == 5
    assert report["global_batch_size"] == 32  # 8 per device × 2 processes × gradient_accumulation_steps 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_transformers_trainer_loss_normalised_per_device_is_found(in_scripts, tmp_path, capfd):
    import re

    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "transformers_train.py", "--mistake", "per_device"])
    assert code == 0 and "trainer-done steps=8" in out
    assert _serious(report) == {"LOSS_NORMALISED_PER_DEVICE": "warning"}
    message = _finding(report, "LOSS_NORMALISED_PER_DEVICE")["message"]
    low, high, ratio = re.search(r"had (\d+) label tokens and rank \d (\d+), so a token on rank \d weighed ([\d.]+)",
                                 message).groups()
    assert "average_tokens_across_devices=False" in message and int(low) < int(high)
    assert float(ratio) == pytest.approx(int(high) / int(low), rel=1e-2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trainer_compute_loss_override_under_accumulation_gets_the_weighting_and_the_k_times_scale(
        in_scripts, tmp_path, capfd):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "transformers_train.py", "--mistake",
                                                 "micro_mean_override"])
    assert code == 0 and "trainer-done steps=8" in out
    assert _serious(report) == {"LOSS_NORMALISED_PER_MICRO_BATCH": "warning", "ACCUMULATION_NOT_DIVIDED": "warning"}
    message = _finding(report, "ACCUMULATION_NOT_DIVIDED")["message"]
    assert "over its 2 micro-batches per rank" in message and "the gradient is 2 times that mean's" in message


def _clm_flags(output_dir):
    """run_clm.py's command line for a short run: TrainingArguments' own flags, parsed by HfArgumentParser."""
    return ["--output_dir", str(output_dir), "--max_steps", "8", "--per_device_train_batch_size", "4",
            "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--dataloader_num_workers", "0"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_clm_shaped_trainer_without_use_cpu_is_not_distributed(in_scripts, tmp_path, capfd):
    """transformers looks torch up before the script imports it: the auditor still loads in every worker."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "transformers_clm.py", *_clm_flags(tmp_path / "run")])
    assert code == 0 and out.count("clm-done steps=8 world_size=1") == 2  # two whole runs, side by side
    assert _serious(report) == {"NOT_DISTRIBUTED": "error"} and report["world_size"] == 2
    finding = _finding(report, "NOT_DISTRIBUTED")
    assert finding["ranks"] == [0, 1] and "TrainingArguments(use_cpu=True) (--use_cpu" in finding["message"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_clm_shaped_trainer_with_use_cpu_is_audited_as_ddp(in_scripts, tmp_path, capfd):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "transformers_clm.py", *_clm_flags(tmp_path / "run"),
                                                 "--use_cpu", "--ddp_backend", "gloo"])
    assert code == 0 and "clm-done steps=8 world_size=2" in out
    assert _serious(report) == {}
    assert report["world_size"] == 2 and report["steps_audited"] == 5
    assert report["global_batch_size"] == 8  # 4 per device × 2 processes


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["accelerate", "transformers"])
def test_noise_scale_of_accelerate_and_the_trainer_matches_the_exact_norms(framework, in_scripts, monkeypatch):
    pytest.importorskip("accelerate")
    if framework == "transformers":
        pytest.importorskip("transformers")
    steps = 200
    monkeypatch.setenv("DDPLAB_TEST_STEPS", str(steps))
    done = subprocess.run([*TORCHRUN, "noise_train.py", "--framework", framework], capture_output=True, text=True,
                          timeout=scaled(280), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    spec = _linear_regression()
    # Accumulation 2 on each rank: the small batch is 2 × 16 samples, the big one 2 ranks × 32.
    index = _round_robin_batches(steps, world_size=2, batch=16, accumulation=2)
    _check_noise(json.loads(in_scripts.read_text()), spec.dataset(), index, 32, 64, spec.TRUE_B_SIMPLE)


# --- the scheduler checks in a plain loop (no framework needed) ---

def _plain_schedules(ctx, mistake):
    from torch.nn.parallel import DistributedDataParallel

    import ddplab

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    handle = ddplab.audit(ddp, steps=3)  # before the scheduler: it is watched from its construction
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # A decay over the run's length in optimizer steps (32 when the decay ends after the audited window).
    steps = 32 if mistake == "twice_late" else 8
    if mistake == "lr_scaled_step":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.1)
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / steps))
    if mistake.startswith("lr_scaled"):
        for group in optimizer.param_groups:
            group["lr"] *= math.sqrt(ctx.world_size)
    generator = torch.Generator().manual_seed(ctx.rank)
    lrs = []
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        for _ in range(2 if mistake.startswith("twice") else 1):
            scheduler.step()
    if mistake == "lr_scaled_step":
        # StepLR multiplies the lr it finds: the scaling survives its steps (0.1414 → 0.01414 at step 3).
        assert lrs[:4] == pytest.approx([0.1 * math.sqrt(2)] * 3 + [0.01 * math.sqrt(2)])
    return {code: (f.severity, f.detail) for code, f in handle.findings.items()}


@pytest.mark.parametrize("mistake, expected", [
    ("none", {}),
    ("twice", {"SCHEDULER_STEPS_PER_PROCESS": "warning"}),
    ("twice_late", {"SCHEDULER_STEPS_PER_PROCESS": "warning"}),
    ("lr_scaled", {"LR_SCALED_NOT_SCHEDULE": "warning"}),
    ("lr_scaled_step", {"LR_SCALED_NOT_SCHEDULE": "info"}),
])
def test_scheduler_mistakes_in_a_plain_loop(mistake, expected):
    from ddplab.runtime.launch import LaunchConfig, launch

    for found in launch(_plain_schedules, LaunchConfig(world_size=2), mistake):
        assert {code: severity for code, (severity, _) in found.items()} == expected
        if mistake == "twice":
            # Stepping twice, the 8-step decay gives lr 0 at scheduler step 8 = before optimizer step 4.
            assert "reached 0 at optimizer step 4" in found["SCHEDULER_STEPS_PER_PROCESS"][1]
        if mistake == "twice_late":
            # Long after the 3 audited steps: the light watch goes on for the whole run.
            assert "reached 0 at optimizer step 16" in found["SCHEDULER_STEPS_PER_PROCESS"][1]
        if mistake == "lr_scaled":
            assert "sqrt(W) = 1.414 times" in found["LR_SCALED_NOT_SCHEDULE"][1]
            assert "brings the unscaled schedule back" in found["LR_SCALED_NOT_SCHEDULE"][1]
        if mistake == "lr_scaled_step":
            assert "the scaling is kept" in found["LR_SCALED_NOT_SCHEDULE"][1]


def test_scaling_an_optimizer_keeps_its_scheduler_and_the_warmup_composes():
    from ddplab.integrations import _lr

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    _lr.scale_optimizer(optimizer, [scheduler], 4.0)
    warmup = _lr.Warmup(optimizer, warmup_steps=2, lr_multiplier=4.0)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert scheduler.base_lrs == [pytest.approx(0.4)] and optimizer.param_groups[0]["initial_lr"] == pytest.approx(0.4)
    # During each update: the scheduled lr (from the scaled base) × the warmup factor (1/4 → 1 over 2 steps).
    assert warmup.applied == pytest.approx([0.4 * 0.25, 0.4 / 2 * 0.625, 0.4 / 3, 0.4 / 4])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 / 5)  # the scheduler's own lr, undisturbed


def test_scale_learning_rate_knows_the_reference_by_its_global_batch_and_never_warms_down():
    pytest.importorskip("lightning")
    from ddplab.errors import UsageError
    from ddplab.integrations.lightning import ScaleLearningRate

    callback = ScaleLearningRate(reference_lr=0.1, reference_global_batch_size=256, warmup_steps=4)
    assert callback.reference.global_batch_size == 256 and callback.reference.per_device_batch_size is None
    # A Python user reads the callback's own argument names, never a command-line flag.
    with pytest.raises(UsageError) as info:
        ScaleLearningRate(reference_lr=0.1, reference_global_batch_size=0)
    assert str(info.value) == "reference_global_batch_size must be a positive integer, got 0"
    # Below the reference the lr shrinks: the update starts at the planned lr, nothing to warm up from.
    plan = callback.make_plan(world_size=2, per_device_batch_size=16, accumulation_steps=2)
    assert plan.global_batch_size == 64 and plan.lr == pytest.approx(0.025)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    from ddplab.integrations import _lr

    _lr.scale_optimizer(optimizer, [], plan.lr_multiplier)
    warmup = _lr.Warmup(optimizer, warmup_steps=4, lr_multiplier=plan.lr_multiplier)
    for _ in range(6):
        optimizer.step()
    assert warmup.applied == pytest.approx([0.025] * 6)


def _scaled_with_base_lrs(ctx):
    from torch.nn.parallel import DistributedDataParallel

    import ddplab

    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    handle = ddplab.audit(ddp, steps=2)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    # Scaled by hand after the scheduler, but everywhere it keeps the lr: the schedule follows, no finding.
    for group in optimizer.param_groups:
        group["lr"] *= ctx.world_size
        group["initial_lr"] *= ctx.world_size
    scheduler.base_lrs = [lr * ctx.world_size for lr in scheduler.base_lrs]
    for _ in range(2):
        optimizer.zero_grad()
        ddp(torch.randn(4, 4)).sum().div(4).backward()
        optimizer.step()
        scheduler.step()
    return sorted(handle.findings)


def test_an_lr_scaled_with_its_base_lrs_is_no_finding():
    from ddplab.runtime.launch import LaunchConfig, launch

    assert launch(_scaled_with_base_lrs, LaunchConfig(world_size=2)) == [[], []]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_torchrun_script_that_never_joins_the_group_is_not_distributed(in_scripts, tmp_path, capfd):
    code, report, out = _audit(tmp_path, capfd, [*TORCHRUN, "plain_alone.py"])
    assert code == 0 and out.count("alone-done") == 2
    assert _serious(report) == {"NOT_DISTRIBUTED": "error"} and report["world_size"] == 2
    assert "without joining a process group" in _finding(report, "NOT_DISTRIBUTED")["message"]


def test_the_accelerate_plan_uses_the_processes_and_accumulation_accelerate_runs(monkeypatch):
    from types import SimpleNamespace

    from ddplab.integrations import accelerate
    from ddplab.plan import planner

    reference = planner.Reference(per_device_batch_size=32, lr=0.1)
    accelerator = SimpleNamespace(num_processes=4, gradient_accumulation_steps=2, distributed_type="MULTI_CPU")
    plan = accelerate.plan(accelerator, reference, per_device_batch_size=16)
    # 16 per device × 4 processes × 2 accumulation = 128 = 4 × the reference's 32: SGD's lr × 4.
    assert (plan.global_batch_size, plan.world_size, plan.accumulation_steps) == (128, 4, 2)
    assert plan.lr == pytest.approx(0.4)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    warmup_plan = accelerate.plan(accelerator, reference, per_device_batch_size=16,
                                  data=planner.Data(warmup_steps=2))
    assert warmup_plan.warmup_recommended  # × 4 reaches the default threshold
    warmup = accelerate.apply_plan(warmup_plan, optimizer, [scheduler], reference_lr=0.1)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert scheduler.base_lrs == [pytest.approx(0.4)]
    assert warmup.applied == pytest.approx([0.1, 0.25, 0.4])  # from the reference lr to the scaled one
    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = SimpleNamespace(num_processes=1, gradient_accumulation_steps=1, distributed_type="NO")
    with pytest.raises(ValueError, match="Accelerator\\(cpu=True\\)"):
        accelerate.plan(alone, reference, per_device_batch_size=16)


@pytest.mark.slow
def test_the_trainer_plan_reads_and_writes_training_arguments(tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from ddplab.integrations import transformers
    from ddplab.plan import planner

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, gradient_accumulation_steps=2,
                             learning_rate=0.1, use_cpu=True, report_to="none")
    plan = transformers.plan(args, planner.Reference(per_device_batch_size=8, lr=0.1), data=planner.Data(
        warmup_steps=10))
    # One process here: 16 × 2 = 32 = 4 × the reference's 8, so SGD's lr × 4 and a warmup is recommended.
    assert (plan.global_batch_size, plan.lr_multiplier) == (32, 4.0) and plan.warmup_recommended
    planned = transformers.apply_plan(args, plan)
    assert planned.learning_rate == pytest.approx(0.4) and planned.warmup_steps == 10
    assert (planned.per_device_train_batch_size, planned.gradient_accumulation_steps) == (16, 2)
