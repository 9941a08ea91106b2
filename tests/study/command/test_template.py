"""ddplab study -- COMMAND before anything runs: the placeholders a command holds, the values each run fills in, and
every study the command cannot express refused in one line (no launch: these run in this process)."""

from __future__ import annotations

import sys
import warnings

import pytest

from ddplab.cli.main import main
from ddplab.errors import UsageError
from ddplab.study.command import points
from ddplab.study.command.template import CommandTemplate
from ddplab.study.config import OptimizerConfig, StudyConfig, Target

TARGET = Target(kind="loss", value=1.0)
FULL = ("torchrun", "--nproc_per_node", "{world_size}", "--master_port={master_port}", "train.py", "--lr", "{lr}",
        "--bs", "{per_device_batch_size}", "--accum", "{accumulation_steps}", "--seed", "{seed}",
        "--out", "{run_dir}/ckpt")


def test_a_run_fills_every_placeholder_and_the_grid_splits_as_plan_splits():
    template = CommandTemplate(FULL)
    config = StudyConfig(target=TARGET, global_batch_sizes=(16, 128), rules=("linear",), seeds=2)
    values = points.values(config, 2, 32, 128, 0.05, 1, config.optimizer, "/runs/r")
    # 128 on 2 ranks under 32 per device: 2 micro-steps of 32.
    assert template.fill(values) == ["torchrun", "--nproc_per_node", "2", "--master_port={master_port}", "train.py",
                                     "--lr", "0.05", "--bs", "32", "--accum", "2", "--seed", "1", "--out",
                                     "/runs/r/ckpt"]
    points.check(template, config, 2, 32)
    adam = OptimizerConfig(family="adamw", betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    filled = CommandTemplate(("x", "{beta1},{beta2}", "{eps:.0e}", "{weight_decay}", "{{literal}}")).fill(
        points.values(config, 1, None, 16, 0.1, 0, adam, "d"))
    assert filled == ["x", "0.8,0.95", "1e-06", "0.1", "{literal}"]


@pytest.mark.parametrize("command, study, says", [
    (("python", "t.py", "--lr", "{lr}", "--bs", "{batch}"), {}, "the command holds {batch}, which ddplab does not "
                                                                "fill: the placeholders are {world_size}"),
    (("python", "t.py", "--lr", "{lr:"), {}, "is no template"),
    (("nosuchprogram", "--lr", "{lr}"), {}, "command not found: nosuchprogram (looked on PATH and in"),
    (("python", "t.py", "--bs", "{per_device_batch_size}"), {}, "the command has no {lr}"),
    (("python", "t.py", "--lr", "{lr}"), {}, "the command has no {per_device_batch_size} or {global_batch_size}"),
    (("python", "t.py", "--lr", "{lr}", "--bs", "{per_device_batch_size}"), {"seeds": 2},
     "--seeds 2 needs {seed} in the command"),
    (("python", "t.py", "--lr", "{lr}", "--bs", "{per_device_batch_size}"),
     {"global_batch_sizes": (16, 256), "max_batch_size_per_device": 64},
     "global batch 256 on 2 ranks takes 2 accumulation steps of 64 under --max-batch-size-per-device, and the command "
     "has no {accumulation_steps}"),
    (("python", "t.py", "--lr", "{lr}", "--gbs", "{global_batch_size}"), {"global_batch_sizes": (15, 32)},
     "a world size of 2 cannot split a global batch of 15 evenly"),
    (("python", "t.py", "--lr", "{lr}", "--bs", "{per_device_batch_size}"), {"rules": "tuned,adascale"},
     "the adascale rule changes the lr as a run trains, which a command's flags cannot: drop it from --rules"),
    (("python", "t.py", "--lr", "{lr}", "--bs", "{per_device_batch_size}"), {"rules": "ramp,tuned"},
     "the ramp rule changes the global batch as a run trains"),
    (("python", "t.py", "--lr", "{lr}", "--bs", "{per_device_batch_size}"), {"rules": "tuned,adam-sqrt",
                                                                            "optimizer": "adamw"},
     "the adam-sqrt rule sets {beta1}, {beta2}, {eps} at global batch 64, which the command has no placeholder for"),
    (("python", "t.py", "--lr", "{lr}", "--bs", "{per_device_batch_size}"), {"rules": "tuned,surge",
                                                                            "optimizer": "adamw"},
     "the surge rule needs B_noise, the B_simple along the best tuned runs (--noise-scale gives it instead), which a "
     "command study does not measure"),
])
def test_what_a_command_cannot_run_is_one_line_before_anything_starts(tmp_path, capsys, command, study, says):
    argv = ["study", "--target-loss", "1.0", "--seeds", str(study.get("seeds", 1)), "--out", str(tmp_path),
            "--global-batch-sizes", ",".join(map(str, study.get("global_batch_sizes", (16, 64)))),
            "--ref-global-batch-size", "16", "--ref-lr", "0.01", "--world-size", "2",
            "--optimizer", study.get("optimizer", "sgd")]
    for flag in ("rules", "max_batch_size_per_device"):
        if flag in study:
            argv += [f"--{flag.replace('_', '-')}", str(study[flag])]
    assert main([*argv, "--", *command]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_the_command_forms_flags_are_kept_apart(capsys):
    command = ["--", "python", "t.py", "--lr", "{lr}", "--bs", "{per_device_batch_size}"]
    assert main(["study", "--metric", "val_loss", "--target-loss", "1"]) == 2
    assert "--metric belongs to the study of your own command" in capsys.readouterr().err
    assert main(["study", "--target-loss", "1", "--engine", "vmap", *command]) == 2
    assert "--engine belongs to a spec's study" in capsys.readouterr().err
    assert main(["study", *command]) == 2
    assert "a command study needs a target: --target-loss L" in capsys.readouterr().err
    assert main(["study", "--target-accuracy", "0.9", *command]) == 2
    assert "--target-accuracy needs --metric NAME" in capsys.readouterr().err
    # A command's optimizer is not seen before it runs: asked for, not assumed.
    assert main(["study", "--target-loss", "1", *command]) == 2
    assert ("a command study cannot see the command's optimizer before it runs, and the rules scale from it: name its "
            "optimizer with --optimizer (sgd, adam or adamw) and the lr it trains with at the reference batch with "
            "--ref-lr") in capsys.readouterr().err
    assert main(["study", "--target-loss", "1", "--optimizer", "adamw", *command]) == 2
    assert capsys.readouterr().err.endswith("name the lr it trains with at the reference batch with --ref-lr\n")
    assert main(["study", "--target-loss", "1", "--optimizer", "sgd", "--ref-lr", "0.1", "--executor", "ray",
                 "--parallel", "2", *command]) == 2
    assert "--parallel is the local executor's" in capsys.readouterr().err
    with pytest.raises(UsageError):
        CommandTemplate(())


def test_an_executor_that_is_missing_or_cannot_be_reached_is_one_line(tmp_path, capsys, monkeypatch):
    command = ["--", "python", "t.py", "--lr", "{lr}", "--bs", "{per_device_batch_size}"]
    argv = ["study", "--target-loss", "1", "--seeds", "1", "--out", str(tmp_path), "--no-plots", "--optimizer", "sgd",
            "--ref-lr", "0.1"]
    # No Slurm on this machine (no sbatch): said before anything runs, with the way to try it here.
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main([*argv, "--executor", "slurm", *command[:1], sys.executable, *command[2:]]) == 2
    assert "--executor slurm found no Slurm here (no sbatch on PATH)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    # An extra not installed names itself.
    for module, extra in (("ray", "ray"), ("submitit", "slurm")):
        monkeypatch.setitem(sys.modules, module, None)
        executor = "slurm" if module == "submitit" else "ray"
        assert main([*argv, "--executor", executor, *command[:1], sys.executable, *command[2:]]) == 2
        assert f"pip install 'ddplab[{extra}]'" in capsys.readouterr().err


class _NeverStartingRay:
    """A ``ray`` module whose clusters never start, counting the tries."""

    def __init__(self, message="The current node timed out during startup.\nmore detail"):
        self.inits = self.shutdowns = 0
        self.message = message

    def init(self, **kwargs):
        self.inits += 1
        raise RuntimeError(self.message)

    def shutdown(self):
        self.shutdowns += 1


def _warnings_of_a_connect_that_fails(ray, address) -> list[str]:
    """What connecting to ``ray`` warns on its way to the one-line error that it could not reach the cluster."""
    from ddplab.study.command.executors import ray_tasks

    with warnings.catch_warnings(record=True) as said, pytest.raises(UsageError, match="could not reach the Ray"):
        warnings.simplefilter("always")
        ray_tasks._connect(ray, address)
    return [str(w.message) for w in said]


@pytest.mark.parametrize("address, env, tries", [(None, None, 3), ("local", None, 3), (None, "local", 3),
                                                 ("10.0.0.1:6379", None, 1), (None, "10.0.0.1:6379", 1)])
def test_a_local_ray_cluster_that_does_not_start_is_started_again_a_bounded_number_of_times(
        monkeypatch, address, env, tries):
    """Each failed start is shut down; a cluster the user named (flag or RAY_ADDRESS) is reached once."""
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    ray = _NeverStartingRay()
    said = _warnings_of_a_connect_that_fails(ray, address)
    assert ray.inits == ray.shutdowns == tries
    assert said == [
        f"Ray's local cluster did not start (The current node timed out during startup.); starting it again "
        f"({n} of 3)" for n in range(2, tries + 1)]


def test_a_failed_local_start_without_a_message_is_named_by_its_type(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _warnings_of_a_connect_that_fails(_NeverStartingRay(message=""), None) == [
        f"Ray's local cluster did not start (RuntimeError); starting it again ({n} of 3)" for n in (2, 3)]


def test_progress_counts_runs_and_without_a_terminal_says_a_line_per_run_that_ended(capsys):
    # Where a study usually runs (nohup, a Slurm log): one line per run, true counts, and what was read back.
    from ddplab.cli.render import ProgressBar
    from ddplab.study.command.study import _Runs

    config = StudyConfig(target=Target(kind="loss", value=1.7), global_batch_sizes=(16, 32), seeds=1,
                         rules=("constant", "linear"), reference_global_batch_size=16, max_steps=300)
    told: list[tuple[int, int, str]] = []
    bar = ProgressBar("ddplab study", status=True, unit="runs")

    def progress(completed, total, status=""):
        told.append((completed, total, status))
        bar(completed, total, status)

    runs = _Runs(progress, config)
    runs.advance(300)  # a run read back from an earlier driver's folder
    runs.listen(1, 1, 0)
    assert told[-1] == (1, 3, "1 run read back, trained by an earlier driver; 1 running")
    runs.listen(0, 1, 1)  # the executor: one ended, the next started
    runs.finished("global batch 32, lr 0.01, seed 0: 25 steps to the target, 3 s")
    runs.advance(300)
    # A sweep's extension: a run past the plan, and the total grows with it instead of the bar standing at its end.
    runs.listen(0, 1, 0)
    assert told[-1][:2] == (2, 3)
    runs.listen(0, 0, 1)
    runs.finished("global batch 32, lr 0.02, seed 0: 20 steps to the target, 3 s")
    runs.advance(300)
    runs.listen(0, 1, 0)
    assert told[-1][:2] == (3, 4)
    runs.listen(0, 0, 1)
    runs.finished("global batch 32, lr 0.04, seed 0: 22 steps to the target, 3 s")
    runs.advance(300)
    runs.close()
    assert told[-1] == (4, 4, "global batch 32, lr 0.04, seed 0: 22 steps to the target, 3 s")
    assert capsys.readouterr().err.splitlines() == [
        "ddplab study: 1 of 3 runs: 1 run read back, trained by an earlier driver",
        "ddplab study: 2 of 3 runs: global batch 32, lr 0.01, seed 0: 25 steps to the target, 3 s; 1 running",
        "ddplab study: 3 of 3 runs: global batch 32, lr 0.02, seed 0: 20 steps to the target, 3 s",
        "ddplab study: 4 of 4 runs: global batch 32, lr 0.04, seed 0: 22 steps to the target, 3 s",
    ]


def test_a_commands_runs_show_the_optimizer_settings_its_placeholders_set_and_no_others():
    # AdamW with weight decay 0.01 in the command, only {lr} placed: the study's defaults are no fact about it.
    from ddplab.study.command.engine import placed
    from ddplab.study.report.html import _settings

    study = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert _settings(placed(study, {"lr", "per_device_batch_size"})) == "the command's own"
    assert _settings(placed(study, {"lr", "beta1", "beta2"})) == "β (0.9, 0.999), the rest the command's own"
    every = {"lr", "beta1", "beta2", "eps", "weight_decay"}
    assert _settings(placed(study, every)) == "β (0.9, 0.999), ε 1e-08, λ 0"
    assert placed(None, every) is None  # SGD: no setting of Adam's to show
