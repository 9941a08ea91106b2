"""ddplab plan: formulas by hand, properties by hypothesis, the CLI's JSON and errors, no torch."""

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddplab.cli.main import flags, main
from ddplab.errors import UsageError
from ddplab.plan import scaling
from ddplab.plan.planner import Data, Reference, Target, plan


def test_hand_computed_formulas():
    assert scaling.global_batch_size(per_device_batch_size=32, devices=8, nodes=2, accumulation_steps=4) == 2048
    assert scaling.global_batch_size(per_device_batch_size=256, devices=4, wrapper="dp") == 256
    assert scaling.lr_multiplier(9, "sqrt") == 3 and scaling.lr_multiplier(9, "none") == 1
    assert scaling.adam_betas(4, (0.9, 0.999)) == (0.9, 0.999 ** 4) and scaling.adam_sqrt_eps(4, 1e-8) == 5e-9
    assert scaling.samples_per_rank(10, world_size=4, drop_last=False) == 3
    assert scaling.samples_per_rank(10, world_size=4, drop_last=True) == 2
    assert scaling.padded_samples(10, world_size=4) == 2 and scaling.sampler_dropped_samples(10, world_size=4) == 2
    assert scaling.loader_batches(10, batch_size=4, drop_last=False) == 3
    assert scaling.loader_batches(10, batch_size=4, drop_last=True) == 2
    assert scaling.optimizer_steps(loader_batches=10, accumulation_steps=4) == 3
    assert scaling.split_global_batch(512, world_size=8, max_per_device=16) == (16, 4)
    assert scaling.split_global_batch(96, world_size=8, max_per_device=5) == (4, 3)
    assert scaling.warmup_factor(0, warmup_steps=10, lr_multiplier=8) == pytest.approx(1 / 8)
    assert scaling.warmup_factor(10, warmup_steps=10, lr_multiplier=8) == 1
    assert scaling.steps_factor(1000, 1000) == 2 and scaling.compute_factor(4000, 1000) == 5


def test_two_processes_of_eight_keep_the_lr_of_one_of_sixteen():
    # The folklore says halve it; DDP averages, so 2 × 8 is the gradient of 16.
    p = plan(Reference(per_device_batch_size=16, lr=0.1), Target(devices=2, per_device_batch_size=8))
    assert (p.mode, p.global_batch_size, p.lr) == ("trajectory", 16, 0.1)


def test_adam_sqrt_rule_keeps_beta1_and_the_half_life_of_beta2():
    p = plan(Reference(per_device_batch_size=32, lr=1e-3, optimizer="adam"), Target(devices=4))
    assert p.rule == "sqrt" and p.lr == pytest.approx(2e-3)
    assert p.betas == (0.9, 0.999 ** 4) and p.eps == pytest.approx(5e-9)
    # k = 16 once took 1 − 16·0.1 below 0 and clamped β₁ to 0: β₁ now stays, with no warning.
    far = plan(Reference(per_device_batch_size=32, lr=1e-3, optimizer="adam"), Target(devices=8, nodes=2))
    assert far.betas == (0.9, 0.999 ** 16) and not any("β" in w or "clamped" in w for w in far.warnings)


def test_step_accounting_follows_distributed_sampler():
    p = plan(Reference(per_device_batch_size=4, lr=0.1), Target(devices=4, accumulation_steps=3),
             Data(dataset_size=1001, epochs=2))
    # ceil(1001/4) = 251 per rank, 3 padded; 63 loader batches; ceil(63/3) = 21 steps.
    assert (p.samples_per_rank, p.padded_samples, p.dropped_samples) == (251, 3, 0)
    assert (p.loader_batches_per_rank, p.steps_per_epoch, p.total_steps) == (63, 21, 42)
    assert "partial accumulation window" not in p.reasons["steps_per_epoch"]
    q = plan(Reference(per_device_batch_size=4, lr=0.1), Target(devices=4, accumulation_steps=2),
             Data(dataset_size=1001, sampler_drop_last=True, drop_last=True))
    assert (q.samples_per_rank, q.loader_batches_per_rank, q.steps_per_epoch) == (250, 62, 31)
    assert q.dropped_samples == 1 + 4 * 2
    assert "partial accumulation window" in plan(
        Reference(per_device_batch_size=4, lr=0.1), Target(devices=4, accumulation_steps=2),
        Data(dataset_size=1001)).reasons["steps_per_epoch"]
    assert not any("samples per epoch, fewer than" in w for w in p.warnings + q.warnings)
    # 1000 samples over 8 ranks is 125 each, less than one step's 256: the "global batch 2048" never happens.
    short = plan(Reference(per_device_batch_size=256, lr=0.1), Target(devices=8), Data(dataset_size=1000))
    assert short.global_batch_size == 2048 and short.steps_per_epoch == 1
    # A Python caller reads the field to change; the command line its flag.
    assert any("each rank holds 125 samples per epoch, fewer than one optimizer step's share "
               "(target.per_device_batch_size 256 × 1 accumulation step): every step sees at most 1000 samples" in w
               for w in short.warnings)
    flagged = plan(Reference(per_device_batch_size=256, lr=0.1), Target(devices=8), Data(dataset_size=1000),
                   names=flags())
    assert any("each rank holds 125 samples per epoch, fewer than one optimizer step's share (--batch-size 256 × 1 "
               "accumulation step): every step sees at most 1000 samples" in w for w in flagged.warnings)


def test_warmup_and_critical_batch():
    p = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8),
             Data(dataset_size=25600, epochs=10, warmup_epochs=5, critical_batch_size=64))
    assert p.warmup_recommended and p.warmup_steps == 5 * 100 and p.total_steps == 1000
    assert p.lr_lambda(0) == pytest.approx(1 / 8) and p.lr_lambda(500) == 1
    assert p.steps_factor == pytest.approx(1.25) and p.compute_factor == pytest.approx(5)
    assert any("well past the critical batch size" in w for w in p.warnings)


def test_sum_reduction_is_explained():
    p = plan(Reference(per_device_batch_size=32, lr=0.1, reduction="sum"), Target(devices=4))
    assert any("1/4 of the single-process sum" in w for w in p.warnings)


sizes = st.integers(min_value=1, max_value=64)


@settings(max_examples=200, deadline=None)
@given(batch=sizes, k1=st.integers(1, 8), k2=st.integers(1, 8))
def test_linear_rule_composes(batch, k1, k2):
    ref = Reference(per_device_batch_size=batch, lr=0.1)
    direct = plan(ref, Target(devices=k1 * k2, keep="per-device"))
    mid = plan(ref, Target(devices=k1, keep="per-device"))
    via = plan(Reference(per_device_batch_size=batch, lr=mid.lr, devices=k1, wrapper="ddp"),
               Target(devices=k1 * k2, keep="per-device"))
    assert via.lr == pytest.approx(direct.lr, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(batch=sizes, devices=sizes, nodes=st.integers(1, 4), accumulation=st.integers(1, 4),
       optimizer=st.sampled_from(["sgd", "adam"]))
def test_trajectory_on_the_same_setup_is_the_identity(batch, devices, nodes, accumulation, optimizer):
    ref = Reference(per_device_batch_size=batch, lr=0.3, devices=devices, nodes=nodes, accumulation_steps=accumulation,
                    wrapper="ddp", optimizer=optimizer)
    p = plan(ref, Target(devices=devices, nodes=nodes, keep="trajectory", per_device_batch_size=batch))
    assert (p.per_device_batch_size, p.accumulation_steps, p.lr, p.lr_multiplier) == (batch, accumulation, 0.3, 1)
    if optimizer == "adam":
        assert p.betas == ref.betas and p.eps == ref.eps


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 100_000), world=st.integers(1, 64), batch=sizes, accumulation=st.integers(1, 8),
       drop_last=st.booleans(), sampler_drop_last=st.booleans())
def test_steps_cover_the_dataset_and_accounting_adds_up(n, world, batch, accumulation, drop_last, sampler_drop_last):
    if n < world or (drop_last and scaling.samples_per_rank(n, world_size=world, drop_last=sampler_drop_last) < batch):
        return
    p = plan(Reference(per_device_batch_size=batch, lr=0.1), Target(devices=world, accumulation_steps=accumulation),
             Data(dataset_size=n, drop_last=drop_last, sampler_drop_last=sampler_drop_last))
    assert p.samples_per_epoch == n + p.padded_samples - p.dropped_samples
    assert p.steps_per_epoch * p.global_batch_size >= n - p.dropped_samples
    assert (p.steps_per_epoch - 1) * p.global_batch_size < p.samples_per_epoch


def test_cli_json_keys(capsys):
    assert main(["plan", "--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "8",
                 "--dataset-size", "10000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("mode", "rule", "world_size", "per_device_batch_size", "accumulation_steps", "global_batch_size",
                "reference_global_batch_size", "lr", "lr_multiplier", "betas", "eps", "samples_per_rank",
                "padded_samples", "dropped_samples", "steps_per_epoch", "total_steps", "warmup_steps", "warnings",
                "reasons"):
        assert key in out, key
    assert out["lr"] == pytest.approx(3e-4 * math.sqrt(8)) and isinstance(out["warnings"], list)


@pytest.mark.parametrize("argv, message", [
    (["--ref-batch-size", "0", "--ref-lr", "0.1", "--devices", "2"],
     "--ref-batch-size must be a positive integer, got 0"),
    (["--ref-batch-size", "32", "--ref-lr", "-1", "--devices", "2"], "positive number"),
    (["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "4", "--dataset-size", "3"],
     "smaller than the world size"),
    (["--ref-batch-size", "100", "--ref-lr", "0.1", "--devices", "3", "--keep", "trajectory"],
     "use a global batch of 99 or 102"),
    (["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "2", "--keep", "trajectory",
      "--global-batch-size", "64"], "drop --global-batch-size"),
    (["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "2", "--batch-size", "64",
      "--max-batch-size-per-device", "32"], "larger than"),
    (["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "2", "--betas", "0.9"], "two numbers"),
    (["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "2", "--eps", "1e-6"],
     "--eps set Adam's moments and the plan's optimizer is SGD"),
    (["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "2", "--batch-size", "8",
      "--global-batch-size", "20"], "not a multiple"),
    (["--ref-batch-size", "250", "--ref-devices", "4", "--ref-wrapper", "dp", "--ref-lr", "0.1", "--devices", "4"],
     "unevenly"),
    (["--ref-batch-size", "16", "--ref-lr", "0.1", "--devices", "8", "--batch-size", "16", "--accumulation", "2",
      "--global-batch-size", "1024"],
     "--batch-size 16 × 8 ranks × --accumulation 2 = 256, not --global-batch-size 1024: give two of the three"),
])
def test_bad_input_exits_2_with_one_sentence(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(["plan", *argv]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") <= 2


def test_plan_and_help_never_import_torch():
    code = ("import sys, contextlib, io\nfrom ddplab.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['plan', '--ref-batch-size', '32', '--ref-lr', '0.1', '--devices', '8', "
            "'--dataset-size', '1000'])\n"
            "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_documented_examples_run():
    import doctest

    from ddplab.plan import planner

    for module in (scaling, planner):
        assert doctest.testmod(module).failed == 0


# Item 21: the warmup fits the run, has a known length, and lr_lambda follows the table.

def _cli_json(argv, capsys) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_default_warmup_fits_a_short_run_and_the_plan_does_not_contradict_itself(capsys):
    out = _cli_json(["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "8",
                     "--nodes", "2", "--dataset-size", "100000", "--epochs", "3"], capsys)
    # 100000/16 = 6250 per rank, ceil(6250/32) = 196 steps per epoch, 588 in 3 epochs; 5 × 196 = 980 > 588, so the
    # default takes a tenth of the run instead of a ramp that never reaches the planned lr.
    assert (out["steps_per_epoch"], out["total_steps"], out["warmup_steps"]) == (196, 588, 58)
    assert "a tenth of the 588-step run" in out["reasons"]["warmup_steps"]
    assert not any("never reaches" in w or "clamped" in w for w in out["warnings"])
    # A length the user asks for is theirs: clamped to the run, and said.
    asked = _cli_json(["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "8",
                       "--nodes", "2", "--dataset-size", "100000", "--epochs", "3", "--warmup-epochs", "5"], capsys)
    assert asked["warmup_steps"] == 588 and "980, clamped to the run's 588 steps" in asked["reasons"]["warmup_steps"]
    assert any("does not end before the 588-step run" in w for w in asked["warnings"])


def test_the_default_warmup_is_five_epochs_where_they_are_a_tenth_of_the_run_or_less():
    p = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8), Data(dataset_size=10_000))
    # ceil(10000/8) = 1250 per rank → ceil(1250/32) = 40 steps, and the default run is one epoch: 4 warmup steps.
    assert (p.steps_per_epoch, p.total_steps, p.warmup_steps) == (40, 40, 4)
    assert p.lr_lambda(3) < 1 and p.lr_lambda(4) == 1 and not p.warnings
    long = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8), Data(dataset_size=10_000, epochs=50))
    assert long.warmup_steps == 200 and long.warmup_epochs == 5 and not long.warnings
    assert long.reasons["warmup_steps"] == "5 warmup epochs × 40 steps per epoch"


def test_warmup_without_a_dataset_size_is_unknown_not_skipped():
    p = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8))
    assert p.warmup_recommended and p.warmup_steps is None
    assert any("length in steps is unknown" in w for w in p.warnings)
    # The command line's warning speaks of the plan, not of Python methods it cannot call.
    assert not any("lr_lambda" in w or "scheduler()" in w for w in p.warnings)
    with pytest.raises(UsageError, match="length is unknown"):
        p.lr_lambda(0)
    with pytest.raises(UsageError, match="length is unknown"):
        p.scheduler(None)
    given = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8), Data(warmup_steps=100))
    assert given.warmup_steps == 100 and given.warmup_epochs is None and not given.warnings
    assert given.lr_lambda(0) == pytest.approx(1 / 8) and given.lr_lambda(50) == pytest.approx(1 / 8 + 7 / 16)
    assert given.lr_lambda(99) < 1 == given.lr_lambda(100)


def test_warmup_steps_flag_reaches_the_table(capsys):
    out = _cli_json(["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8", "--warmup-steps", "300",
                     "--dataset-size", "100000", "--epochs", "2"], capsys)
    # ceil(100000/8) = 12500 per rank → 391 steps per epoch, 782 in two epochs.
    assert ((out["warmup_steps"], out["total_steps"], out["reasons"]["warmup_steps"])
            == (300, 782, "given by --warmup-steps"))
    assert out["warmup_epochs"] == pytest.approx(300 / 391)
    clamped = _cli_json(["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8", "--warmup-steps", "5000",
                         "--dataset-size", "100000"], capsys)
    assert clamped["warmup_steps"] == clamped["total_steps"] == 391


warmup_configs = st.fixed_dictionaries({
    "batch": st.integers(1, 64), "devices": st.integers(1, 16), "accumulation": st.integers(1, 4),
    "optimizer": st.sampled_from(["sgd", "adam"]), "rule": st.sampled_from(["auto", "linear", "sqrt", "none"]),
    "dataset_size": st.one_of(st.none(), st.integers(16, 200_000)), "epochs": st.sampled_from([0.5, 1, 2, 3, 90]),
    "warmup_epochs": st.sampled_from([0, 0.5, 1, 5]), "warmup_steps": st.one_of(st.none(), st.integers(0, 5000)),
    "threshold": st.sampled_from([1.5, 2, 4]),
})


def _plan_from(c):
    return plan(Reference(per_device_batch_size=c["batch"], lr=0.1, optimizer=c["optimizer"]),
                Target(devices=c["devices"], accumulation_steps=c["accumulation"], rule=c["rule"]),
                Data(dataset_size=c["dataset_size"], epochs=c["epochs"], warmup_epochs=c["warmup_epochs"],
                     warmup_steps=c["warmup_steps"], warmup_threshold=c["threshold"]))


@settings(max_examples=200, deadline=None)
@given(c=warmup_configs)
def test_lr_lambda_follows_the_table(c):
    if c["dataset_size"] is not None and c["dataset_size"] < c["devices"]:
        return
    p = _plan_from(c)
    if p.warmup_steps is None:
        # No length: either no warmup is wanted (factor 1 throughout) or lr_lambda refuses.
        if p.warmup_recommended:
            with pytest.raises(UsageError):
                p.lr_lambda(0)
        else:
            assert all(p.lr_lambda(s) == 1 for s in (0, 1, 1000))
        return
    warmup = p.warmup_steps
    expected_steps = c["warmup_steps"] if c["warmup_steps"] is not None else \
        math.ceil(c["warmup_epochs"] * p.steps_per_epoch)
    if p.total_steps is not None:
        expected_steps = min(expected_steps, p.total_steps)
        assert warmup <= p.total_steps
        assert any("does not end before" in w for w in p.warnings) == (0 < p.total_steps <= (
            c["warmup_steps"] if c["warmup_steps"] is not None else math.ceil(c["warmup_epochs"] * p.steps_per_epoch)))
    assert warmup == expected_steps
    # Goyal et al.: the reference lr (= lr / multiplier) at step 0, linear to the planned lr at the table's step.
    for step in {0, 1, warmup // 2, max(warmup - 1, 0)}:
        if step < warmup:
            assert p.lr * p.lr_lambda(step) == pytest.approx(0.1 + (p.lr - 0.1) * step / warmup, rel=1e-12)
    for step in (warmup, warmup + 1, 10 * warmup + 7):
        assert p.lr_lambda(step) == 1


def test_a_batch_past_the_critical_batch_comes_with_one_the_target_can_make_and_its_steps_and_samples():
    p = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8),
             Data(critical_batch_size=37, dataset_size=50_000, epochs=3), names=flags())
    (past,) = [w for w in p.warnings if "well past" in w]
    # B_crit 37 over 8 ranks: 5 per device, 40 in all; S = S_min(1 + 37/B): 588 × (1 + 37/40)/(1 + 37/256) = 989.
    assert "a global batch of 40 (5 per device × 8 ranks, no accumulation: --global-batch-size 40)" in past
    assert "1.93× the minimum steps and 2.08× the minimum samples" in past
    assert "in 588 steps of 256 (150,528 samples) takes about 989 steps of 40 (39,560 samples)" in past
    suggested = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8, global_batch_size=40),
                     Data(critical_batch_size=37))
    assert suggested.global_batch_size == 40 and not any("well past" in w for w in suggested.warnings)


def test_keep_trajectory_says_what_one_sample_per_device_costs():
    p = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=32, keep="trajectory"), names=flags())
    assert p.per_device_batch_size == 1
    (small,) = [w for w in p.warnings if "per micro-step" in w]
    assert "1 sample per device per micro-step, 32× fewer than the reference's 32" in small
    assert "BatchNorm" in small and "--keep per-device keeps 32 per device" in small
    # A batch the memory limit sets, or the user gives, is no surprise.
    fits = plan(Reference(per_device_batch_size=256, lr=0.1),
                Target(devices=4, keep="trajectory", max_batch_size_per_device=16))
    given = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=32, per_device_batch_size=1))
    assert not any("per micro-step" in w for w in fits.warnings + given.warnings)


@pytest.mark.parametrize("data", [
    Data(dataset_size=2560, epochs=2, warmup_epochs=1),
    Data(dataset_size=2560, epochs=0.5),  # the default warmup: one step of the 5-step run
    Data(warmup_steps=7),  # no dataset size, explicit length
])
def test_scheduler_steps_the_lr_the_plan_tabulates(data):
    import torch

    p = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8), data)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=p.lr)
    scheduler = p.scheduler(optimizer)
    seen = []
    for _ in range(p.warmup_steps + 2):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([p.lr * p.lr_lambda(step) for step in range(len(seen))], rel=1e-12)
    assert seen[0] == pytest.approx(0.1) and seen[p.warmup_steps] == pytest.approx(0.8) and max(seen) <= 0.8 + 1e-12


# Item 22: the memory limit in per-device mode, a float overflow, the none rule.

def test_memory_limit_applies_in_per_device_mode():
    ref = Reference(per_device_batch_size=32, lr=0.1)
    free = plan(ref, Target(devices=8))
    one = plan(ref, Target(devices=8, max_batch_size_per_device=1))
    assert (one.mode, one.per_device_batch_size, one.accumulation_steps) == ("per-device", 1, 32)
    assert (one.global_batch_size, one.lr) == (free.global_batch_size, free.lr) == (256, 0.8)
    five = plan(ref, Target(devices=8, max_batch_size_per_device=5))
    assert (five.per_device_batch_size, five.accumulation_steps) == (4, 8)
    assert "target.max_batch_size_per_device 5" in five.reasons["per_device_batch_size"]
    assert "--max-batch-size-per-device 5" in plan(ref, Target(devices=8, max_batch_size_per_device=5),
                                                   names=flags()).reasons["per_device_batch_size"]
    given = plan(ref, Target(devices=8, global_batch_size=512, max_batch_size_per_device=16))
    assert (given.per_device_batch_size, given.accumulation_steps) == (16, 4)
    assert (given.reasons["per_device_batch_size"]
            == "target.global_batch_size 512 over 8 ranks with at most 16 per device")
    assert (plan(ref, Target(devices=8, global_batch_size=512, max_batch_size_per_device=16),
                 names=flags()).reasons["per_device_batch_size"]
            == "--global-batch-size 512 over 8 ranks with at most 16 per device")
    with pytest.raises(UsageError, match="drop target.accumulation_steps"):
        plan(ref, Target(devices=8, max_batch_size_per_device=5, accumulation_steps=2))
    # The other mode's summary respects the limit too.
    traj = plan(Reference(per_device_batch_size=256, lr=0.1), Target(devices=4, keep="trajectory",
                                                                      max_batch_size_per_device=16))
    assert "16 per device × 16 accumulation (global 1024)" in traj.other_mode


@settings(max_examples=200, deadline=None)
@given(batch=sizes, accumulation=st.integers(1, 4), devices=st.integers(1, 16), limit=st.integers(1, 64))
def test_memory_limit_keeps_the_per_device_global_batch(batch, accumulation, devices, limit):
    ref = Reference(per_device_batch_size=batch, lr=0.1, accumulation_steps=accumulation)
    free = plan(ref, Target(devices=devices, keep="per-device"))
    limited = plan(ref, Target(devices=devices, keep="per-device", max_batch_size_per_device=limit))
    assert limited.per_device_batch_size <= limit
    assert (limited.global_batch_size, limited.lr) == (free.global_batch_size, free.lr)
    assert limited.per_device_batch_size * limited.accumulation_steps == batch * accumulation


def test_huge_reference_lr_is_an_error_not_infinity(capsys):
    with pytest.raises(UsageError, match="no optimizer can use"):
        plan(Reference(per_device_batch_size=32, lr=1e308), Target(devices=8))
    assert main(["plan", "--ref-batch-size", "32", "--ref-lr", "1e308", "--devices", "8", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--ref-lr" in captured.err and "Infinity" not in captured.err
    # The same lr on the same global batch is representable and stays.
    assert plan(Reference(per_device_batch_size=32, lr=1e308), Target(devices=1)).lr == 1e308


@pytest.mark.parametrize("rule, multiplier, phrase", [
    ("none", 1, "the lr is not scaled, although k = new global batch / reference global batch = 8"),
    ("linear", 8, "= 8; the linear rule multiplies the lr by k"),
    ("sqrt", math.sqrt(8), "the square-root rule multiplies the lr by √k = 2.828"),
])
def test_multiplier_reason_names_the_rule_that_applied(rule, multiplier, phrase):
    p = plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8, rule=rule))
    assert p.lr_multiplier == pytest.approx(multiplier) and p.lr == pytest.approx(0.1 * multiplier)
    assert phrase in p.reasons["lr_multiplier"]
    assert "under the none rule" not in p.reasons["lr_multiplier"]


def test_a_python_caller_reads_field_names_and_the_defaults_live_in_the_config():
    import torch

    from ddplab.noise.scale import GradientNoiseScale

    # The wrapper defaults in Reference itself: several devices mean DDP, one a single device.
    assert Reference(per_device_batch_size=32, lr=0.1, devices=8).wrapper == "ddp"
    assert Reference(per_device_batch_size=32, lr=0.1).wrapper == "single"
    calls = [
        (lambda: Reference(per_device_batch_size=0, lr=0.1), "reference.per_device_batch_size must be a positive"),
        (lambda: Reference(per_device_batch_size=8, lr=float("nan")), "reference.lr must be a positive number"),
        (lambda: Reference(per_device_batch_size=8, lr="0.1"), "reference.lr must be a positive number, got '0.1' "
                                                               "(a str)"),
        (lambda: Target(devices=8, per_device_batch_size=16, accumulation_steps=2, global_batch_size=1024),
         "target.per_device_batch_size 16 × 8 ranks × target.accumulation_steps 2 = 256, not "
         "target.global_batch_size 1024"),
        (lambda: plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8)).lr_lambda(0),
         "plan with data.dataset_size or data.warmup_steps"),
        (lambda: Data(warmup_epochs=-1), "data.warmup_epochs must be zero or more"),
        (lambda: GradientNoiseScale(torch.nn.Linear(2, 1), per_device_batch_size=0, accumulation_steps=2),
         "per_device_batch_size, accumulation_steps and every must be positive"),
    ]
    for call, expected in calls:
        with pytest.raises(UsageError) as info:
            call()
        assert expected in str(info.value) and "--" not in str(info.value)
    with pytest.raises(ValueError, match="step must be ≥ 0"):
        plan(Reference(per_device_batch_size=32, lr=0.1), Target(devices=8), Data(dataset_size=1000)).lr_lambda(-1)


def test_keep_trajectory_from_a_study_keeps_the_reference_lr(capsys):
    from ddplab.plan.from_study import plan_from_study

    # The study's best lr at the reference's own global batch (0.006) is twice the reference's 0.003.
    study = {"workload": "w", "fit": {"tuned": {"b_crit": 100.0}}, "train_size": 4000,
             "tuned_lr": [{"global_batch_size": 32, "lr": 0.006}, {"global_batch_size": 128, "lr": 0.012},
                          {"global_batch_size": 512, "lr": 0.024}]}
    reference = Reference(per_device_batch_size=32, lr=0.003)
    scaled = plan_from_study(reference, Target(devices=4), None, study)
    assert (scaled.mode, scaled.rule, scaled.lr) == ("per-device", "measured", pytest.approx(0.012))
    # The other mode holds the reference's global batch and so its lr, whatever the study measured there.
    assert scaled.other_mode.endswith("(global 32) at lr 0.003")
    kept = plan_from_study(reference, Target(devices=4, keep="trajectory"), None, study)
    assert (kept.global_batch_size, kept.lr, kept.lr_multiplier) == (32, 0.003, 1.0)
    assert "the measured lr is not used" in kept.reasons["lr"]
    # The study's B_crit still applies, and the per-device alternative still takes the study's lr.
    assert kept.steps_factor == pytest.approx(1 + 100 / 32) and kept.other_mode.endswith("at lr 0.012")


def test_adams_moments_with_sgd_are_refused_by_the_reference_itself():
    with pytest.raises(UsageError, match=r"reference.betas and reference.eps set Adam's moments and the plan's "
                                         r"optimizer is SGD"):
        Reference(per_device_batch_size=8, lr=0.1, betas=(0.9, 0.99), eps=1e-6)
    assert Reference(per_device_batch_size=8, lr=0.1).betas is None
    assert Reference(per_device_batch_size=8, lr=0.1, optimizer="adam").betas == (0.9, 0.999)


def test_a_run_counted_in_steps_keeps_its_samples_and_its_own_warmup():
    p = plan(Reference(per_device_batch_size=8, lr=3e-4, optimizer="adamw", devices=8), Target(devices=32),
             Data(reference_steps=1000, reference_warmup_steps=100), names=flags())
    # 1000 steps of 64 are 64,000 samples: 250 steps of 256; the warmup's 6,400 samples are 25 steps.
    assert (p.total_steps, p.warmup_steps) == (250, 25)
    assert p.reasons["total_steps"] == "--ref-steps 1,000 steps of 64 samples, the same samples in steps of 256"
    assert p.reasons["warmup_steps"] == "--ref-warmup-steps 100 steps of 64 samples: the same 6,400 samples"


def test_a_reference_given_by_its_global_batch_says_so():
    p = plan(Reference(global_batch_size=256, lr=0.1), Target(devices=8, per_device_batch_size=16), names=flags())
    assert p.reasons["reference_global_batch_size"] == "given by --ref-global-batch-size"
