"""ddplab check: equivalence proved where it holds, and the cause named where it breaks."""

import json
import os

import pytest

from ddplab.check import CheckConfig, check
from ddplab.cli.main import main
from ddplab.runtime.timescale import scaled

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specs")


def _check(name, world_size, batch=8, steps=4, **options):
    return check(CheckConfig(spec_path=os.path.join(SPECS, f"{name}.py"), world_size=world_size,
                             per_device_batch_size=batch, steps=steps, **options))


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_correct_spec_is_equivalent(world_size):
    result = _check("correct", world_size)
    assert result.verdict == "EQUIVALENT" and result.cause is None
    assert all(d["max_rel_diff"] <= 1e-9 for d in result.per_step) and len(result.per_step) == 4


def test_sum_reduction_diverges_with_its_cause():
    result = _check("sum_reduction", 2)
    assert (result.verdict, result.cause, result.first_divergent_step) == ("DIVERGES", "SUM_REDUCTION", 0)
    assert "1/2" in result.explanation


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_summed_loss_plus_a_weight_penalty_is_still_a_summed_loss(world_size):
    # The penalty is averaged by DDP, not summed: the gradients are W apart only up to it.
    result = _check("sum_reduction_l2", world_size, steps=2)
    assert (result.verdict, result.cause, result.first_divergent_step) == ("DIVERGES", "SUM_REDUCTION", 0)
    assert f"is 1/{world_size} of the single-process gradient (1/W with W = {world_size} ranks) but for a small part" \
        in result.explanation
    assert "weight penalty" in result.explanation and "rescale the penalty" in result.fix


def test_a_per_rank_normalised_loss_is_not_taken_for_a_summed_one():
    result = _check("per_rank_count", 2, steps=2)
    assert (result.verdict, result.cause) == ("DIVERGES", "LOSS_NORMALISED_PER_DEVICE")


def test_token_means_over_padded_documents_are_named_per_device_and_per_micro_batch():
    # Documents of different lengths, padded by the spec's own collate(): each rank's mean has its own count.
    per_device = _check("token_mean", 2, batch=4, steps=3)
    assert (per_device.verdict, per_device.cause) == ("DIVERGES", "LOSS_NORMALISED_PER_DEVICE")
    assert "averages the 2 ranks' means" in per_device.explanation
    accumulated = _check("token_mean", 2, batch=4, steps=3, accumulation_steps=2)
    assert (accumulated.verdict, accumulated.cause) == ("DIVERGES", "LOSS_NORMALISED_PER_MICRO_BATCH")
    assert accumulated.to_json()["global_batch_size"] == 16 and accumulated.to_json()["accumulation_steps"] == 2
    # The same documents over a constant normaliser: K micro-batches on W ranks train exactly like one process.
    constant = _check("token_constant", 2, batch=4, steps=3, accumulation_steps=2)
    assert constant.verdict == "EQUIVALENT" and "2 ranks × 2 micro-batches of 4" in constant.explanation


def test_a_divisor_fixed_in_advance_is_named_by_its_factor_w_times_k_with_a_fix_a_spec_can_take():
    # "per-device batch × max length" written as a number: loss() computes the reference too, on W·K times the samples.
    result = _check("token_fixed_divisor", 2, batch=4, steps=2, accumulation_steps=2)
    assert (result.verdict, result.cause, result.first_divergent_step) == ("DIVERGES", "SUM_REDUCTION", 0)
    assert "exactly 1/4 of the single-process gradient (1/(W·K) with W = 2 ranks and K = 2 micro-batches)" \
        in result.explanation
    assert "divided by a number fixed in advance" in result.explanation
    # Multiplying loss() by the world size would scale the reference alike: the fix divides by what loss() is given.
    assert "multiply the loss by the world size" not in result.fix
    assert "len(target) × a constant" in result.fix and "a factor of the world size changes nothing" in result.fix
    # Which is what token_constant.py does (len(labels) × 31): equivalent, as the token-level losses page says.
    assert _check("token_constant", 2, batch=4, steps=2, accumulation_steps=2).verdict == "EQUIVALENT"


def test_accumulation_keeps_a_mean_equivalent_and_skipping_its_division_breaks_it():
    # A sample mean over equal micro-batches, each divided by K: the same as one process on W·K·b.
    assert _check("correct", 2, batch=4, steps=3, accumulation_steps=3).verdict == "EQUIVALENT"
    # A summed loss over K micro-batches, each divided by K: 1/(W·K) of one process's summed gradient.
    summed = _check("sum_reduction", 2, batch=4, steps=2, accumulation_steps=2)
    assert (summed.verdict, summed.cause) == ("DIVERGES", "SUM_REDUCTION")
    assert "exactly 1/4 of the single-process gradient" in summed.explanation
    assert "of 2 micro-batches, each divided by 2" in summed.explanation


def test_accumulation_under_fsdp2_defers_the_reduction_and_finds_the_same_cause():
    result = _check("token_mean", 2, batch=4, steps=2, accumulation_steps=2, strategy="fsdp")
    assert (result.verdict, result.cause) == ("DIVERGES", "LOSS_NORMALISED_PER_MICRO_BATCH")


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

    from ddplab.check.diagnosis import gradient_ratio as _gradient_ratio

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

    # Spawned: a worker forked from this process inherits a thread pool that earlier tests ran, and can deadlock.
    config = ElasticConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, rdzv_backend="c10d",
                           rdzv_endpoint="localhost:0", run_id=uuid.uuid4().hex, max_restarts=0,
                           monitor_interval=0.1, start_method="spawn")
    return elastic_launch(config, _cli_under_torchrun)(*runs)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_and_noise_join_torchrun_and_rank_zero_alone_reports():
    # One command that starts a group per worker process, as torchrun runs it: a second one would meet stale keys.
    mismatch = ["check", os.path.join(SPECS, "correct.py"), "--batch-size", "8", "--world-size", "3"]
    check_run = ["check", os.path.join(SPECS, "correct.py"), "--batch-size", "8", "--steps", "3", "--json"]
    sandbox_mismatch = ["sandbox", "multi", "--world-size", "2"]
    results = _torchrun(4, mismatch, check_run, sandbox_mismatch)
    for rank in range(4):
        for index in (0, 2):
            code, stdout, stderr = results[rank][index]
            assert code == 2 and stdout == ""
            # Every rank refuses the same input: rank 0 says so, once for the whole job.
            if rank == 0:
                assert stderr.count("\n") == 1
                assert f"--world-size {3 if index == 0 else 2} disagrees with torchrun's WORLD_SIZE 4" in stderr
            else:
                assert stderr == ""
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


LATE_START = """import os, time
if os.environ.get("RANK") == {rank!r}:
    time.sleep({seconds})
"""


def _torchrun_command(*argv, late: tuple[str, int, float] | None = None):
    """``python -m torch.distributed.run --nproc-per-node 2 -m ddplab ARGV``; ``late``: (a folder, a rank, seconds)
    that rank starts late by (as on a loaded machine, where one rank can be seconds behind the other)."""
    import subprocess
    import sys

    import ddplab

    src = os.path.dirname(os.path.dirname(ddplab.__file__))
    path = [src, os.environ.get("PYTHONPATH", "")]
    if late is not None:
        folder, rank, seconds = late
        with open(os.path.join(folder, "sitecustomize.py"), "w") as fh:
            fh.write(LATE_START.format(rank=str(rank), seconds=seconds))
        path.insert(0, folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ddplab",
                           *argv], capture_output=True, text=True, env=env, timeout=scaled(120))


@pytest.mark.timeout(240)
def test_under_torchrun_bad_input_is_said_once_and_a_rank_of_its_own_says_its_error(tmp_path):
    from ddplab.runtime.spec import shown_path

    correct, fragile = os.path.join(SPECS, "correct.py"), os.path.join(SPECS, "fails_on_rank_one.py")
    # Rank 0, the one to say it, starts 3 s after rank 1 has found the same mistake: rank 1 waits for torchrun to
    # stop it once rank 0 has spoken (leaving first, it had torchrun stop rank 0 before it said anything).
    done = _torchrun_command("check", correct, "--batch-size", "600", late=(str(tmp_path), 0, 3))
    said = [line for line in done.stderr.splitlines() if line.startswith("ddplab:")]
    assert done.returncode != 0 and said == [
        f"ddplab: error: spec file {shown_path(correct)}: dataset() holds 1000 samples, so each of 2 ranks gets 500, "
        "fewer than one batch of --batch-size 600: use --batch-size 500 or less, fewer ranks, or a larger dataset"]
    # Raised in rank 1's own training: rank 0 cannot know it, so rank 1 says it, naming itself.
    done = _torchrun_command("check", fragile, "--batch-size", "8", "--timeout", f"{scaled(20):g}")
    said = [line for line in done.stderr.splitlines() if line.startswith("ddplab:")]
    assert said == [f"ddplab: error: spec file {shown_path(fragile)}: the forward pass raised RuntimeError: "
                    "rank one cannot read its shard (on rank 1)"], done.stderr


def _strict_json(text):
    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_overflow_is_non_finite_on_both_sides_never_equivalent(capsys):
    assert main(["check", os.path.join(SPECS, "overflow.py"), "--batch-size", "8", "--steps", "7", "--json"]) == 0
    out = _strict_json(capsys.readouterr().out)
    where = out["non_finite"]
    assert out["verdict"] == "NON_FINITE" and where["side"] == "both" and 0 < where["step"] < 7
    assert all(d["max_rel_diff"] <= 1e-9 for d in out["per_step"][:where["step"]])
    assert all(d["max_rel_diff"] is None for d in out["per_step"][where["step"]:])


def test_nan_on_the_ranks_only_is_non_finite():
    # Each rank divides by its own count of positives; the rank holding the negative sample divides 0 by 0.
    result = _check("nan_on_ranks", 2, batch=1, steps=2)
    assert result.verdict == "NON_FINITE"
    assert result.non_finite == {"step": 0, "side": "ranks", "what": "gradients"}


def test_print_json_writes_standard_json(capsys):
    from ddplab.cli import render

    render.print_json({"nan": float("nan"), "inf": (1.0, float("inf")), "nested": [{"minus": -float("inf")}]})
    assert _strict_json(capsys.readouterr().out) == {"nan": None, "inf": [1.0, None], "nested": [{"minus": None}]}


@pytest.mark.timeout(120)
def test_unused_parameters_are_found_and_compared_exactly():
    from ddplab.noise.config import NoiseConfig
    from ddplab.noise.measure import measure_spec

    # Weight decay would move the unused head on one side only if DDP gave it a zero gradient instead of none.
    result = _check("unused_head", 2, steps=3)
    assert result.verdict == "EQUIVALENT" and result.unused_parameters == ("aux_head.weight", "aux_head.bias")
    assert result.find_unused_parameters
    # Unused on odd steps only: the first run fails inside DDP at step 2, the second looks for unused parameters.
    result = _check("unused_sometimes", 2, steps=3)
    assert (result.verdict, result.unused_parameters, result.find_unused_parameters) == ("EQUIVALENT", (), True)
    report = measure_spec(NoiseConfig(spec_path=os.path.join(SPECS, "unused_head.py"), world_size=2,
                                      per_device_batch_size=8, steps=3))
    assert len(report.history) == 3


def test_a_dataset_smaller_than_one_batch_is_refused_with_the_sizes(capsys):
    spec = os.path.join(SPECS, "tiny_dataset.py")
    for command in ("check", "noise"):
        assert main([command, spec, "--batch-size", "8", "--steps", "2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "tiny_dataset.py" in err
        assert "10 samples, so each of 2 ranks gets 5, fewer than one batch of --batch-size 8" in err
        assert "use --batch-size 5 or less" in err


def test_partial_batches_are_reported_as_what_they_hold():
    from torch.utils.data import DataLoader, DistributedSampler

    # 10 samples on 2 ranks of 4: each epoch is a batch of 4, then one of 1, as a DataLoader yields them.
    result = _check("tiny_dataset", 2, batch=4, steps=3)
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    loader_batches = [len(b) for b in DataLoader(range(10), batch_size=4, sampler=sampler)]
    assert result.verdict == "EQUIVALENT" and loader_batches == [4, 1]
    assert [d["samples_per_rank"] for d in result.per_step] == (loader_batches * 2)[:3]


SPEC_HEAD = """import torch
from torch.utils.data import TensorDataset
def dataset():
    return TensorDataset(torch.randn(64, 6), torch.randint(0, 2, (64,)))
def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)
"""
LINEAR = "def model():\n    return torch.nn.Linear(6, 2)\n"
USER_ERRORS = {
    "syntax": ("def model(:\n    pass\n", "does not load: SyntaxError at line 1"),
    "import": ("import not_a_module_xyz\n", "does not load: line 1 raised ModuleNotFoundError: No module named"),
    "model_raises": (SPEC_HEAD + "def model():\n    raise RuntimeError('no weights here')\n",
                     ": model() raised RuntimeError: no weights here"),
    "not_a_module": (SPEC_HEAD + "def model():\n    return 3\n", ": model() must return a torch.nn.Module, got int"),
    "no_parameters": (SPEC_HEAD + "def model():\n    return torch.nn.ReLU()\n", "no parameters that require gradients"),
    "empty_dataset": (SPEC_HEAD.replace("64", "0") + LINEAR, ": dataset() is empty"),
    "exits": (SPEC_HEAD + "import sys\ndef model():\n    sys.exit(7)\n", ": model() called sys.exit(7)"),
    "exits_at_import": ("import sys\nsys.exit(7)\n", "does not load: line 2 calls sys.exit(7)"),
    "hard_exit_at_import": ("import os\nos._exit(3)\n", "does not load: line 2 calls os._exit(3) at import"),
    "float_loss": (SPEC_HEAD + LINEAR + "def step(model, batch, loss_fn):\n"
                   "    return loss_fn(model(batch[0]), batch[1]).item()\n",
                   "the loss must be a single-number tensor, got float"),
    "not_pairs": (SPEC_HEAD.replace("TensorDataset(torch.randn(64, 6), torch.randint(0, 2, (64,)))",
                                    "[torch.zeros(6)] * 64") + LINEAR, "items must be (input, target) pairs"),
}


@pytest.mark.parametrize("case", sorted(USER_ERRORS))
def test_user_errors_are_one_line_naming_the_spec(case, tmp_path, capsys):
    text, expected = USER_ERRORS[case]
    path = tmp_path / f"{case}.py"
    path.write_text(text)
    for command in ("check", "noise"):
        assert main([command, str(path), "--batch-size", "4", "--steps", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ddplab: error: spec file {path}") and err.count("\n") == 1, err
        assert expected in err, err


@pytest.mark.timeout(120)
def test_an_error_inside_one_rank_comes_back_as_one_line(capsys):
    spec = os.path.join(SPECS, "fails_on_rank_one.py")
    for command in ("check", "noise"):
        assert main([command, spec, "--batch-size", "4", "--steps", "2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "fails_on_rank_one.py: the forward pass raised RuntimeError: rank one cannot " \
            "read its shard (on rank 1)" in err, err


@pytest.mark.timeout(120)
def test_accumulation_over_a_partial_last_step_divides_by_its_own_micro_batches():
    """10 samples, 2 ranks, micro-batches of 2, accumulation 2: step 1 holds one micro-batch per rank, divided by 1."""
    result = _check("tiny_dataset", 2, batch=2, steps=2, accumulation_steps=2)
    assert result.verdict == "EQUIVALENT" and result.partial_steps == [(1, 1)]


@pytest.mark.timeout(120)
def test_strict_fails_a_divergence_and_a_hung_rank_is_named_with_its_stack(capsys):
    assert main(["check", os.path.join(SPECS, "sum_reduction.py"), "--batch-size", "4", "--steps", "2"]) == 0
    assert main(["check", os.path.join(SPECS, "sum_reduction.py"), "--batch-size", "4", "--steps", "2",
                 "--strict"]) == 3
    assert "DIVERGES" in capsys.readouterr().out
    # Rank 0 waits in DDP's all-reduce and times out; rank 1 is the one to name, with where it is stuck.
    spec = os.path.join(SPECS, "hangs_on_rank_one.py")
    assert main(["check", spec, "--batch-size", "4", "--steps", "2", "--timeout", f"{scaled(3):g}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ddplab: rank 1 stopped answering: rank 0 waited in a collective"), err
    assert "hangs_on_rank_one.py" in err and "in step" in err and "spec file" not in err
    # A folder given as the spec is named as a folder.
    assert main(["check", SPECS, "--batch-size", "4"]) == 2
    assert "is a directory: give the Python file that defines model()" in capsys.readouterr().err


def test_one_rank_is_one_rank(capsys):
    argv = ["check", os.path.join(SPECS, "correct.py"), "--world-size", "1", "--batch-size", "8", "--steps", "1"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "ddplab check: 1 rank × 8 vs one process × 8" in out and "1 rank × 8 and one process" in out
    # Allowed (a one-GPU machine has nothing else), but the verdict says what one rank cannot show.
    note = "one rank: this compares DDP's wrapper with the plain model, not ranks against each other"
    assert f"note: {note}" in out
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "EQUIVALENT" and report["note"].startswith(note)
    assert "world size of 2 or more" in report["note"]


def test_two_ranks_need_no_note():
    assert _check("correct", 2, steps=1).note is None


def test_a_wrong_spec_path_is_said_before_torch_is_imported(tmp_path):
    import subprocess
    import sys

    import ddplab

    text = tmp_path / "spec.txt"
    text.write_text("def model(): pass\n")
    # A fresh interpreter: torch must still be absent from it when each error has been said.
    program = f"""
import sys
from ddplab.cli.main import main
for argv in (["check", "missing.py"], ["check", {str(tmp_path)!r}], ["check", {str(text)!r}],
             ["noise", "missing.py"]):
    code = main([*argv, "--batch-size", "8"])
    print(code, "torch" in sys.modules)
"""
    src = os.path.dirname(os.path.dirname(ddplab.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=scaled(60))
    assert done.stdout.split("\n")[:4] == ["2 False"] * 4, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 4 and all(line.startswith("ddplab: error: spec file ") for line in lines)
    assert lines[0].endswith("missing.py does not exist") and "is a directory" in lines[1]
    assert "is not a Python file: give a .py file" in lines[2] and lines[3].endswith("missing.py does not exist")


def _run_with_stderr_on_a_terminal(argv) -> tuple[int, str, str]:
    import pty
    import select
    import subprocess
    import sys

    import ddplab

    src = os.path.dirname(os.path.dirname(ddplab.__file__))
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    terminal, stderr = pty.openpty()
    command = subprocess.Popen([sys.executable, "-m", "ddplab", *argv], stdout=subprocess.PIPE, stderr=stderr, env=env)
    os.close(stderr)
    drawn = []
    while True:
        if select.select([terminal], [], [], 0.2)[0]:
            try:
                data = os.read(terminal, 65536)
            except OSError:  # the command ended and closed the terminal
                break
            if not data:
                break
            drawn.append(data)
        elif command.poll() is not None:
            break
    out = command.stdout.read().decode()
    os.close(terminal)
    return command.wait(timeout=scaled(60)), out, b"".join(drawn).decode(errors="replace")


@pytest.mark.timeout(120)
def test_long_checks_show_a_progress_bar_at_a_terminal_only(capsys):
    argv = ["check", os.path.join(SPECS, "correct.py"), "--batch-size", "8", "--steps", "40", "--json"]
    code, out, drawn = _run_with_stderr_on_a_terminal(argv)
    assert code == 0 and json.loads(out)["verdict"] == "EQUIVALENT"
    # Drawn by rank 0 while the ranks train, then by the command during the single-process reference.
    assert "ddplab check" in drawn and "40/40" in drawn
    assert drawn.index("2 DDP ranks") < drawn.index("one process")
    # Not at a pipe or in a log.
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verdict"] == "EQUIVALENT" and "ddplab check" not in captured.err


def test_the_library_reports_each_step_through_its_callback(tmp_path):
    calls = tmp_path / "calls"

    class Record:
        # Rank 0 calls it in its own process: what it saw comes back through a file.
        def __call__(self, completed, total, status=""):
            with open(calls, "a") as fh:
                fh.write(f"{completed}/{total} {status}\n")

    check(CheckConfig(spec_path=os.path.join(SPECS, "correct.py"), world_size=2, per_device_batch_size=8, steps=3),
          progress=Record())
    assert calls.read_text().splitlines() == [f"{i}/3 2 DDP ranks" for i in (1, 2, 3)] + [
        f"{i}/3 one process" for i in (1, 2, 3)]


def _check_with(name, world_size, batch=8, steps=3, **parallelism):
    return check(CheckConfig(spec_path=os.path.join(SPECS, f"{name}.py"), world_size=world_size,
                             per_device_batch_size=batch, steps=steps, **parallelism))


@pytest.mark.timeout(300)
def test_fsdp_and_hsdp_train_like_one_process_and_break_where_ddp_does(capsys):
    # FSDP2 on 2 ranks: the sharded parameters, gathered whole, equal one process's to float64 rounding.
    assert main(["check", os.path.join(SPECS, "correct.py"), "--strategy", "fsdp", "--batch-size", "8", "--steps", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["verdict"], out["strategy"], out["world_size"], out["data_parallel_size"]) == (
        "EQUIVALENT", "fsdp", 2, 2)
    assert max(d["max_rel_diff"] for d in out["per_step"]) <= 1e-15
    # HSDP, 2 replicas × 2 shards: every one of the 4 ranks trains on its own samples.
    result = _check_with("correct", 4, strategy="hsdp", replicate=2)
    assert (result.verdict, result.config.global_batch_size) == ("EQUIVALENT", 32)
    assert max(d["max_rel_diff"] for d in result.per_step) <= 1e-15
    # The same mistakes as under DDP, named the same way.
    result = _check_with("sum_reduction", 2, strategy="fsdp")
    assert (result.verdict, result.cause, result.first_divergent_step) == ("DIVERGES", "SUM_REDUCTION", 0)
    assert "exactly 1/2 of the single-process gradient" in result.explanation
    assert "FSDP averages the 2 per-rank sums" in result.explanation
    result = _check_with("batchnorm", 2, strategy="fsdp")
    assert (result.verdict, result.cause) == ("DIVERGES", "BATCHNORM")
    # A divide factor of 1 sums the ranks' gradients: named, and confirmed by a reference scaled by W/f.
    result = _check_with("fsdp_divide_factor", 4, strategy="hsdp", replicate=2)
    assert (result.verdict, result.cause, result.first_divergent_step) == ("DIVERGES", "DIVIDE_FACTOR", 0)
    assert "4 times the single process's" in result.explanation and "divide factor to 1" in result.explanation
    # ... which is exactly what a loss summed over the batch needs.
    assert _check_with("fsdp_sum_divide_factor", 2, strategy="fsdp").verdict == "EQUIVALENT"


@pytest.mark.timeout(240)
def test_a_lower_reduce_dtype_is_rounding_within_its_bound_not_a_mistake():
    result = _check_with("correct", 2, strategy="fsdp", reduce_dtype="float32")
    assert (result.verdict, result.cause, result.passed) == ("ROUNDING", "REDUCE_PRECISION", True)
    fractions = [d["reduction_error_of_bound"] for d in result.per_step]
    # Beyond the float64 tolerance, within float32's bound, and the bound not a vacuous one.
    assert max(d["max_rel_diff"] for d in result.per_step) > result.config.tolerance
    assert 0.05 < max(fractions) <= 1
    assert "a single process given the same rounding matches the ranks" in result.explanation
    result = _check_with("correct", 4, steps=2, strategy="hsdp", replicate=2, reduce_dtype="bfloat16")
    assert (result.verdict, result.cause) == ("ROUNDING", "REDUCE_PRECISION")
    # A summed loss stays a mistake under a reduce_dtype, its 1/W exact up to the rounding.
    result = _check_with("sum_reduction", 2, steps=2, strategy="fsdp", reduce_dtype="float32")
    assert (result.verdict, result.cause) == ("DIVERGES", "SUM_REDUCTION")
    assert "up to float32's rounding, 1/2 of the single-process gradient" in result.explanation


def test_the_rounding_bound_holds_for_a_reduction_in_a_lower_dtype():
    import torch

    from ddplab.check.diagnosis import reduction_rounding_bound

    generator = torch.Generator().manual_seed(0)
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        for world_size in (2, 3, 4, 8):
            # Values spread over orders of magnitude and of both signs: sums that cancel round worst.
            local = torch.randn(world_size, 20000, generator=generator, dtype=torch.float64)
            local *= 10.0 ** torch.randint(-3, 3, (world_size, 20000), generator=generator)
            summed = local[0].to(dtype)
            for rank in range(1, world_size):
                summed = summed + local[rank].to(dtype)
            reduced = (summed / world_size).to(torch.float64)
            error = (reduced - local.mean(0)).abs()
            bound = reduction_rounding_bound(name, world_size) * local.abs().mean(0)
            fraction = (error / bound).max().item()
            assert 0.2 < fraction <= 1, (name, world_size, fraction)


def test_bad_parallelism_input_is_one_line(monkeypatch, capsys, tmp_path):
    correct = os.path.join(SPECS, "correct.py")
    cases = [
        (["--strategy", "hsdp", "--world-size", "4"],
         "hsdp needs --replicate, the replicas of its 2-D mesh, to divide the world size 4 (none given)"),
        (["--strategy", "hsdp", "--world-size", "4", "--replicate", "3"], "to divide the world size 4 (got 3)"),
        (["--replicate", "2"], "--replicate is not an option of the ddp strategy"),
        (["--reduce-dtype", "float32"], "--reduce-dtype is not an option of the ddp strategy"),
        (["--strategy", "hsdp", "--replicate", "0"], "--replicate must be at least 1, got 0"),
    ]
    for flags, expected in cases:
        assert main(["check", correct, "--batch-size", "8", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
    # A model without parameters has nothing to shard: said before any rank starts.
    spec = tmp_path / "no_parameters.py"
    spec.write_text(USER_ERRORS["no_parameters"][0])
    assert main(["check", str(spec), "--batch-size", "4", "--strategy", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no parameters that require gradients" in err
    # A torch without FSDP2: the version needed, in one line.
    from ddplab.runtime import compat

    monkeypatch.setattr(compat, "fully_shard_api", lambda: None)
    assert main(["check", correct, "--batch-size", "8", "--strategy", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the fsdp and hsdp strategies need torch >= 2.6 (torch.distributed.fsdp." \
        "fully_shard); this is torch " in err, err
