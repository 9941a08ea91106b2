"""``ddplab noise -- COMMAND``: the noise scale of a user's own training command, through its real launcher.

Known answers: noiseless linear regression at w = 0 gives B_simple = D + 1 (and its finite dataset's exact
value) under DDP, FSDP2 and no_sync accumulation, launched by torchrun, fork and spawn; a small LM gives a finite
B_simple with its interval and a curve over samples seen that BatchSchedule takes. The guest only reads: the
script's printed losses and final weights are bit for bit those of a plain run, and its exit code stands.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ddplab.adapt import thresholds
from ddplab.adapt.schedule import BatchSchedule
from ddplab.cli.main import main
from ddplab.noise.command.merge import Merged, merge
from ddplab.noise.command.report import build
from ddplab.noise.guest.plan import StepPlan
from ddplab.runtime.timescale import scaled

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
REGRESSION = os.path.join(SCRIPTS, "regression.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _module(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dataset_b_simple(module) -> float:
    """tr Σ / |G|² of the script's own dataset at w = 0, where each example's gradient is −2·x·y (Σ with 1/N)."""
    x, y = module.dataset().tensors
    per_example = -2 * x.double() * y.double()
    mean = per_example.mean(0)
    return ((per_example - mean).square().sum(1).mean() / mean.dot(mean)).item()


def _noise(tmp_path, flags, command):
    report = tmp_path / "noise.json"
    code = main(["noise", "--json-file", str(report), *flags, "--", *command])
    return code, (json.loads(report.read_text()) if report.exists() else None)


def _regression_command(launcher: str, strategy: str, accumulation: int) -> list[str]:
    """The regression script's launch: torchrun, fork, spawn, or the same model in Lightning or Accelerate."""
    args = ["--accumulation", str(accumulation), "--steps", "60"]
    if launcher == "lightning":
        return [sys.executable, os.path.join(SCRIPTS, "regression_lightning.py"), *args]
    if launcher == "accelerate":
        return [*TORCHRUN, os.path.join(SCRIPTS, "regression_accelerate.py"), *args]
    if launcher == "none":
        return [sys.executable, REGRESSION, "--launcher", "none", "--strategy", "none", *args]
    args = [REGRESSION, "--strategy", strategy, *args, *(["--world-size", "4"] if strategy == "hsdp" else [])]
    return [*TORCHRUN, *args] if launcher == "torchrun" else [sys.executable, *args, "--launcher", launcher]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher, strategy, accumulation", [
    ("torchrun", "ddp", 1), ("fork", "fsdp", 1), ("fork", "ddp", 2), ("spawn", "fsdp", 2),
    ("fork", "hsdp", 1), ("lightning", "ddp", 2), ("accelerate", "ddp", 1), ("none", "none", 4)])
def test_noiseless_regression_gives_d_plus_one(launcher, strategy, accumulation, tmp_path):
    module = _module(REGRESSION)
    exact = _dataset_b_simple(module)
    assert exact == pytest.approx(module.D + 1, rel=0.03)
    code, out = _noise(tmp_path, ["--start-step", "3", "--steps", "50"],
                       _regression_command(launcher, strategy, accumulation))
    assert code == 0
    low, high = out["b_simple_ci95"]
    assert low <= module.D + 1 <= high and low <= exact <= high, out["b_simple"]
    assert high - low < exact  # an interval that says something
    # HSDP: 2 replicas × 2 shards, each rank its own samples; one process: its micro-steps are the small batches.
    ranks = {"hsdp": 4, "none": 1}.get(strategy, 2)
    assert (out["strategy"], out["data_parallel_size"], out["per_device_batch_size"], out["accumulation_steps"],
            out["global_batch_size"]) == (strategy.replace("none", "one process"), ranks, 16, accumulation,
                                          16 * ranks * accumulation)
    # Accelerate shards the loader itself, and one process draws from a RandomSampler: neither says the dataset's size.
    assert out["dataset_size"] == (None if launcher in ("accelerate", "none") else module.SAMPLES)
    assert out["measured_step_range"] == [3, 52] and out["measured_steps"] == 50 and out["left_out"] == {}
    assert out["stopped_early"] is None and 0 < out["guest_seconds_per_measured_step"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_training_output_and_exit_code_are_unchanged(strategy, tmp_path):
    """Moving weights (lr > 0, momentum), accumulation: every micro-step's loss and the weights, bit for bit."""
    args = [REGRESSION, "--launcher", "fork", "--strategy", strategy, "--accumulation", "2", "--steps", "25",
            "--lr", "0.01"]
    plain = subprocess.run([sys.executable, *args, "--losses", str(tmp_path / "plain.txt"), "--exit-code", "3"],
                           timeout=scaled(120))
    assert plain.returncode == 3
    code, out = _noise(tmp_path, ["--start-step", "1", "--steps", "20"],
                       [sys.executable, *args, "--losses", str(tmp_path / "measured.txt"), "--exit-code", "3"])
    assert code == 3 and out["returncode"] == 3 and out["measured_steps"] == 20
    assert (tmp_path / "plain.txt").read_text() == (tmp_path / "measured.txt").read_text()
    assert (tmp_path / "plain.txt").read_text().count("loss") == 50
    # The failure came after the planned steps: nothing was cut short. Planned past the run's end, it was.
    assert out["stopped_early"] is None
    assert out["failed_after_measuring"] == ("the command failed with exit code 3 after the last planned step was "
                                             "measured: the figures are complete")
    code, out = _noise(tmp_path, ["--start-step", "1", "--steps", "30"], [sys.executable, *args, "--exit-code", "3"])
    assert code == 3 and out["measured_steps"] == 24 and out["failed_after_measuring"] is None
    assert out["stopped_early"] == "the command failed with exit code 3"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_small_lm_gives_a_finite_b_simple_and_a_curve_a_schedule_follows(tmp_path):
    plot = tmp_path / "gns.png"
    code, out = _noise(tmp_path, ["--start-step", "2", "--every", "2", "--plot", str(plot)],
                       [*TORCHRUN, os.path.join(SCRIPTS, "charlm.py"), "--steps", "130", "--log-every", "1000"])
    assert code == 0 and plot.stat().st_size > 0
    assert out["b_simple"] is not None and out["b_simple"] > out["global_batch_size"] / 4
    assert out["b_simple_status"] in ("resolved", "g2_unresolved") and out["b_simple_ci95"][0] > 0
    assert out["measured_steps"] == 64 and out["measured_step_range"] == [2, 128] and out["every"] == 2
    points = out["by_samples"]
    assert len(points) == 6 and [p["samples_from"] for p in points] == sorted(p["samples_from"] for p in points)
    assert all(p["b_simple_ci95"] is not None for p in points)
    # The schedule is what BatchSchedule reads from a JSON file: from 0 samples, never smaller, whole micro-steps.
    entries = thresholds.parse(str(tmp_path / "noise.json"))
    assert entries[0].samples_seen == 0 and all(e.global_batch_size % 16 == 0 for e in entries)
    assert [e.global_batch_size for e in entries] == sorted(e.global_batch_size for e in entries)
    model = torch.nn.Linear(2, 1)
    schedule = BatchSchedule(model, torch.optim.SGD(model.parameters(), lr=0.1), str(tmp_path / "noise.json"),
                             per_device_batch_size=16)
    assert schedule.global_batch_size == entries[0].global_batch_size


def _exact_tokens_per_sample(module, *, start: int, steps: int, accumulation: int, batch: int, ranks: int = 2) -> float:
    """The mean valid targets per sample of the measured steps, from the script's documents in the order its
    DistributedSampler (epoch by epoch, full batches) gives each rank's micro-batches."""
    from torch.utils.data import DistributedSampler

    documents, first, last = module.dataset(), start * accumulation, (start + steps) * accumulation
    tokens = 0
    for rank in range(ranks):
        stream, epoch = [], 0
        while len(stream) < last:
            sampler = DistributedSampler(documents, num_replicas=ranks, rank=rank, shuffle=True, seed=module.SEED)
            sampler.set_epoch(epoch)
            order = list(sampler)
            stream += [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]
            epoch += 1
        # Each document of n tokens has n - 1 labels; the padding's are ignore_index.
        tokens += sum(len(documents[i]) - 1 for micro in stream[first:last] for i in micro)
    return tokens / (steps * accumulation * batch * ranks)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_padded_lm_gives_b_simple_in_tokens_from_the_tokens_its_loss_kept(tmp_path, capsys):
    """Documents of 4-24 tokens padded with -100 per batch, nn.CrossEntropyLoss(ignore_index=-100), accumulation under
    no_sync: B_simple in tokens is B_simple × the exact mean of valid tokens per sample of the measured steps."""
    script = os.path.join(SCRIPTS, "padded_lm.py")
    exact = _exact_tokens_per_sample(_module(script), start=3, steps=30, accumulation=2, batch=8)
    code, out = _noise(tmp_path, ["--start-step", "3", "--steps", "30"],
                       [*TORCHRUN, script, "--steps", "40", "--accumulation", "2"])
    assert code == 0 and out["measured_steps"] == 30 and out["global_batch_size"] == 32
    assert out["b_simple"] is not None and out["b_simple_status"] == "resolved"
    # Far below the padded length (up to 23 per sample): the padding is no token.
    assert out["tokens_per_sample"] == pytest.approx(exact, rel=1e-12) and 4 < exact < 20
    assert out["b_simple_tokens"] == pytest.approx(out["b_simple"] * exact, rel=1e-9)
    assert out["b_simple_tokens_ci95"] == pytest.approx([bound * exact for bound in out["b_simple_ci95"]], rel=1e-9)
    assert out["global_batch_tokens"] == pytest.approx(32 * exact, rel=1e-9)
    assert out["tokens_note"].startswith("tokens are the targets cross_entropy kept (not ignore_index)")
    printed = capsys.readouterr().out
    assert "B_simple in tokens" in printed and f"measured steps, {exact:.4g} per sample" in " ".join(printed.split())


def test_tokens_are_counted_only_from_a_token_loss_called_once_per_forward():
    """A classifier's cross_entropy (one target per sample) gives no tokens and no note; a sequence loss called once
    per forward gives the ranks' kept targets; called twice per forward, none, and the note says why."""
    model = [{"kind": "model", "rank": r, "strategy": "ddp", "world_size": 2, "group": [0, 1]} for r in (0, 1)]

    def stepped(**changes):
        return [_step(rank, 5, **{"token_losses": 1, "token_loss": "cross_entropy", **changes}) for rank in (0, 1)]

    classifier = build(("train",), merge([*model, *stepped(targets=4, tokens=4)]), start_step=5, every=None,
                       window=10, returncode=0).to_json()
    assert classifier["b_simple_tokens"] is None and classifier["tokens_note"] is None
    lm = build(("train",), merge([*model, *stepped(targets=40, tokens=30)]), start_step=5, every=None, window=10,
               returncode=0)
    assert lm.tokens_per_sample == 60 / 8 and lm.to_json()["tokens_note"].endswith("7.5 per sample")
    twice = build(("train",), merge([*model, *stepped(targets=80, tokens=60, token_losses=2)]), start_step=5,
                  every=None, window=10, returncode=0).to_json()
    assert twice["b_simple_tokens"] is None and "not once in each training forward" in twice["tokens_note"]
    plain = build(("train",), merge([*model, _step(0, 5), _step(1, 5)]), start_step=5, every=None, window=10,
                  returncode=0).to_json()
    assert plain["tokens_per_sample"] is None and plain["tokens_note"] is None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_what_cannot_be_measured_is_one_line_and_the_exit_code_stands(tmp_path, capsys):
    cases = [([sys.executable, os.path.join(SCRIPTS, "one_process.py"), "4"], ["--start-step", "1"], 4,
              "no distributed run, a world of one) without accumulation"),
             ([*TORCHRUN[:-1], "1", REGRESSION, "--steps", "20"], ["--start-step", "2"], 0,
              "a world of one) without accumulation"),
             ([sys.executable, REGRESSION, "--launcher", "fork", "--steps", "8"], ["--start-step", "10"], 0,
              "the run made 8 optimizer steps, and measuring starts at step 10"),
             ([sys.executable, REGRESSION, "--launcher", "fork", "--steps", "8", "--bucket-view"],
              ["--start-step", "2"], 0, "gradient_as_bucket_view=True")]
    for command, flags, expected_code, said in cases:
        code, out = _noise(tmp_path, flags, command)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == expected_code and out is None
        assert err[-1].startswith("ddplab noise: ") and said in err[-1], err[-1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_deadline_stops_the_command_and_keeps_what_was_measured(tmp_path):
    # The job's ranks sleep once the 12 measured steps are done, so only the deadline ends it; they are done in 4 s on
    # a quick machine (import torch 1.8 s), so 3 times that, scaled by this machine's speed and load, is the wait.
    deadline = f"{scaled(12):g}"
    code, out = _noise(tmp_path, ["--start-step", "2", "--steps", "12", "--deadline", deadline],
                       [sys.executable, REGRESSION, "--launcher", "fork", "--steps", "10000000", "--stall-after", "14"])
    assert code == 1 and out["measured_steps"] == 12 and f"--deadline {deadline}" in out["stopped_early"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_stops_the_whole_command_and_keeps_what_was_measured(tmp_path):
    losses, report = tmp_path / "losses.txt", tmp_path / "noise.json"
    noise = subprocess.Popen([sys.executable, "-m", "ddplab", "noise", "--start-step", "2", "--steps", "12",
                              "--json-file", str(report), "--", sys.executable, REGRESSION, "--launcher", "fork",
                              "--steps", "10000000", "--losses", str(losses)], stdout=subprocess.DEVNULL)
    try:
        # Rank 0 has logged step 20: the measured steps 2-13 are behind every rank (each waited for the others).
        end = time.monotonic() + scaled(180)
        while not (losses.exists() and "step 20 " in losses.read_text()):
            assert noise.poll() is None and time.monotonic() < end
            time.sleep(0.2)
        noise.send_signal(signal.SIGINT)
        assert noise.wait(timeout=scaled(120)) == -signal.SIGINT
    finally:
        noise.kill()
    out = json.loads(report.read_text())
    assert out["measured_steps"] == 12 and out["cancelled_by"] == "SIGINT" and "SIGINT" in out["stopped_early"]


@pytest.mark.timeout(60)
def test_a_ctrl_c_the_command_turns_into_exit_code_1_is_still_called_a_ctrl_c(tmp_path):
    # torchrun's agent answers SIGINT with exit code 1: the driver forwarded it, so it knows what stopped the run.
    ready = tmp_path / "ready"
    program = ("import signal, sys, time\nsignal.signal(signal.SIGINT, lambda *a: sys.exit(1))\n"
               f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)\n")
    noise = subprocess.Popen([sys.executable, "-m", "ddplab", "noise", "--", sys.executable, "-c", program],
                             stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + scaled(30)
        while not ready.exists():
            assert noise.poll() is None and time.monotonic() < end
            time.sleep(0.1)
        noise.send_signal(signal.SIGINT)
        _, err = noise.communicate(timeout=scaled(30))
    finally:
        noise.kill()
    assert noise.returncode == -signal.SIGINT and "stopped by SIGINT" in err and "exit code 1" not in err, err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_json_keeps_stdout_for_the_report_alone(capfd):
    assert main(["noise", "--json", "--start-step", "2", "--steps", "5", "--", sys.executable, REGRESSION,
                 "--launcher", "fork", "--steps", "8"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["measured_steps"] == 5 and "trained 8 steps" in err


def test_the_plan_measures_the_steps_asked_for():
    window = StepPlan(start_step=3, steps=4)
    assert [s for s in range(12) if window.measures(s)] == [3, 4, 5, 6] and window.finished(7)
    curve = StepPlan(start_step=2, every=5)
    assert [s for s in range(20) if curve.measures(s)] == [2, 7, 12, 17] and not curve.finished(10 ** 9)
    assert StepPlan.from_env() is None
    os.environ.update(StepPlan(start_step=1, every=2, per_device_batch_size=8).to_env())
    try:
        assert StepPlan.from_env() == StepPlan(start_step=1, every=2, per_device_batch_size=8)
    finally:
        for name in StepPlan(start_step=1).to_env():
            os.environ.pop(name)


def _step(rank, step, **changes):
    return {"kind": "step", "rank": rank, "step": step, "samples": 4, "forwards": 1, "reductions": 1,
            "local_sq": 10.0 + rank, "share_sq": 3.0, "dataset_size": None, "guest_s": 0.001, "step_s": 0.1,
            **changes}


def test_merging_keeps_only_complete_steps_and_says_why_others_left():
    model = [{"kind": "model", "rank": r, "strategy": "ddp", "world_size": 2, "group": [0, 1]} for r in (0, 1)]
    events = [*model, _step(0, 5), _step(1, 5), _step(0, 6), _step(0, 7, reductions=2), _step(1, 7),
              _step(0, 8, samples=3), _step(1, 8)]
    merged = merge(events)
    assert [s.step for s in merged.steps] == [5] and len(merged.left_out) == 3
    norms = merged.steps[0]
    assert (norms.b_small, norms.b_big, norms.g_small_sq, norms.g_big_sq) == (4, 8, 10.5, 6.0)
    report = build(("train",), merged, start_step=5, every=None, window=10, returncode=0)
    # |g_b|² = |G|² + tr Σ / b and |G_B|² = |G|² + tr Σ / B solved: tr Σ = 36, |G|² = 1.5.
    assert report.summary.trace_sigma == pytest.approx(36) and report.summary.g2 == pytest.approx(1.5)


def test_the_two_forms_refuse_each_others_flags(capsys):
    assert main(["noise", "--start-step", "2", "spec.py", "--batch-size", "4"]) == 2
    assert "--start-step" in capsys.readouterr().err
    assert main(["noise", "--world-size", "4", "--", sys.executable, "train.py"]) == 2
    assert "--world-size" in capsys.readouterr().err
    assert main(["noise"]) == 2
    assert "after --" in capsys.readouterr().err
    assert main(["noise", "--start-step", "0", "--", sys.executable, "train.py"]) == 2


def test_plan_takes_the_critical_batch_size_from_a_noise_report(tmp_path, capsys):
    plan = ["plan", "--ref-batch-size", "64", "--ref-lr", "0.1", "--devices", "8", "--nodes", "4", "--json"]
    report = tmp_path / "noise.json"
    report.write_text(json.dumps({"b_simple": 500.0, "b_simple_ci95": [400.0, 650.0]}))
    assert main([*plan, "--critical-batch-size", "500"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert main([*plan, "--from-noise", str(report)]) == 0
    assert json.loads(capsys.readouterr().out) == given
    assert main([*plan, "--from-noise", str(report), "--critical-batch-size", "9"]) == 2
    report.write_text(json.dumps({"b_simple": None}))
    assert main([*plan, "--from-noise", str(report)]) == 2
    assert "--from-noise" in capsys.readouterr().err


def _growing_noise(steps: int = 45) -> Merged:
    """A run whose |G|² falls window by window (B_simple 10, then 50) and is lost in its noise in the last window:
    each step's norms are the estimator's model |g_b|² = |G|² + tr Σ / b, |G_B|² = |G|² + tr Σ / B, jittered."""
    from ddplab.noise.command.merge import StepNorms

    def norms(step: int) -> StepNorms:
        g2 = (1.0, 0.2, 0.03)[step // 15]
        g2 += 0.05 * (1 if step % 2 else -1) * (1 + step % 3)  # per-step noise of the |G|² estimate
        trace = 10.0 * (1 + 0.1 * (step % 4 - 1.5))
        return StepNorms(step=step, b_small=4, b_big=8, forwards=1, g_small_sq=g2 + trace / 4,
                         g_big_sq=g2 + trace / 8, dataset_size=None)

    return Merged(strategy="ddp", world_size=2, group=[0, 1], steps=[norms(s) for s in range(steps)], left_out={},
                  notes=[], optimizer_steps=steps, guest_s=0.0, step_s=None)


def test_a_window_that_is_not_resolved_is_no_schedule_step_and_the_trend_is_said(tmp_path, monkeypatch):
    report = build(("train",), _growing_noise(), start_step=0, every=None, window=15, returncode=0)
    windows = report.to_json()["by_samples"]
    assert [w["b_simple_status"] for w in windows] == ["resolved", "resolved", "g2_unresolved"]
    out = report.to_json()
    # The schedule ends where the measurement does: nothing from the unresolved window, and it says so.
    assert len(out["schedule"]) == 2 and out["schedule"][-1]["samples_seen"] == windows[1]["samples_from"]
    assert out["schedule_note"].startswith("the schedule stops before window 3 of 3 (steps 30-44")
    assert "not resolved (|G|² within its error of 0: B_simple >" in out["schedule_note"]
    first, last = windows[0]["b_simple"], windows[1]["b_simple"]
    assert out["trend"]["ratio"] == pytest.approx(last / first) and last / first > 2
    assert out["trend_note"].startswith(f"B_simple grew {last / first:.3g}× over training, from {first:.4g} [")
    assert "2 of 3 windows resolved" in out["trend_note"] and "takes the last resolved window" in out["trend_note"]
    # The plot draws the unresolved window as a lower bound only, and the chart's range follows the resolved ones.
    import matplotlib.pyplot as plt

    from ddplab.cli.noise import _plot_by_samples

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    _plot_by_samples(report, str(tmp_path / "noise.png"))
    (ax,) = figures[0].axes
    bound = next(line for line in ax.lines if line.get_marker() == "^")
    assert list(bound.get_ydata()) == [windows[2]["b_simple_ci95"][0]]
    assert ax.get_ylim()[1] < windows[2]["b_simple"]
