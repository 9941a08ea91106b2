"""ddplab plan for Adam and AdamW: β₂ by its half-life, weight decay by its timescale, the surge rule (no torch)."""

import doctest
import json
import os

import pytest

from ddplab.cli.main import main
from ddplab.errors import UsageError
from ddplab.plan import scaling
from ddplab.plan.from_study import plan_from_study
from ddplab.plan.planner import Data, Reference, Target, plan

K16 = ["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "8", "--nodes", "2"]


def _adamw(**fields) -> Reference:
    return Reference(per_device_batch_size=32, lr=3e-4, optimizer="adamw", **fields)


def test_the_scaling_modules_doctests_hold_their_hand_computed_values():
    result = doctest.testmod(scaling)
    assert result.failed == 0 and result.attempted >= 15


def test_beta2_keeps_its_half_life_in_samples_and_beta1_stays():
    p = plan(_adamw(betas=(0.9, 0.99)), Target(devices=8, nodes=2))
    assert p.batch_ratio == 16 and p.betas == (0.9, 0.99 ** 16)
    # Half-life in samples: steps × batch is the same before and after.
    assert scaling.half_life_steps(p.betas[1]) * 512 == pytest.approx(scaling.half_life_steps(0.99) * 32)
    assert "Marek et al. 2025" in p.reasons["betas"] and "0.99^16" in p.reasons["betas"]
    # Shrinking the batch lengthens β₂'s memory per step instead.
    small = plan(_adamw(betas=(0.9, 0.99)), Target(devices=1, per_device_batch_size=8))
    assert small.betas == (0.9, 0.99 ** 0.25)


def test_k16_no_longer_sets_beta1_to_zero(capsys):
    assert main(["plan", *K16]) == 0
    out = capsys.readouterr().out
    assert "0.9, 0.984119" in out and "clamped to 0" not in out and "β₁ = 1 − 16" not in out
    assert main(["plan", *K16, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["betas"] == [0.9, 0.999 ** 16] and result["eps"] == 1e-8 / 4
    assert not any("β" in warning for warning in result["warnings"])


def test_adamw_weight_decay_keeps_its_timescale_in_epochs():
    sqrt = plan(_adamw(), Target(devices=8, nodes=2), Data(dataset_size=100_000))
    # Square-root rule at k = 16: λ × 16 / 4 = λ × 4.
    assert (sqrt.lr_multiplier, sqrt.weight_decay) == (4, 0.01 * 4)
    # τ = B/(η·λ·N): 512/(1.2e-3 × 0.04 × 100000) = 32/(3e-4 × 0.01 × 100000) = 106.67 epochs.
    assert sqrt.adamw_timescale_epochs == pytest.approx(32 / (3e-4 * 0.01 * 100_000))
    assert sqrt.reasons["adamw_timescale_epochs"].endswith("the reference's too")
    linear = plan(_adamw(weight_decay=0.1), Target(devices=8, nodes=2, rule="linear"))
    assert (linear.lr_multiplier, linear.weight_decay) == (16, 0.1)
    # No dataset size: the timescale is said in steps, 1/(η·λ) = 1/(1.2e-3 × 0.04) = 20,833.
    assert sqrt.adamw_timescale_epochs is not None
    unsized = plan(_adamw(), Target(devices=8, nodes=2))
    assert unsized.adamw_timescale_epochs is None and "20,833 steps" in unsized.reasons["weight_decay"]
    # The JSON holds the number its reason gives: the timescale in steps, with or without a dataset size.
    assert unsized.adamw_timescale_steps == pytest.approx(1 / (1.2e-3 * 0.04))
    assert unsized.to_json()["adamw_timescale_steps"] == pytest.approx(20_833.33, rel=1e-5)
    assert sqrt.adamw_timescale_steps == pytest.approx(sqrt.adamw_timescale_epochs * 100_000 / sqrt.global_batch_size)


def test_weight_decay_defaults_follow_torch_and_adam_keeps_its_coupled_decay():
    assert (Reference(per_device_batch_size=32, lr=1e-3, optimizer="adam").weight_decay, _adamw().weight_decay) == (
        0.0, 0.01)
    adam = plan(Reference(per_device_batch_size=32, lr=1e-3, optimizer="adam", weight_decay=0.1), Target(devices=16),
                Data(dataset_size=10_000))
    assert adam.weight_decay == 0.1 and adam.adamw_timescale_epochs is None
    assert "AdamW's decoupled decay" in adam.reasons["weight_decay"]
    none = plan(_adamw(weight_decay=0.1), Target(devices=16, rule="none"))
    assert (none.weight_decay, none.betas, none.eps) == (0.1, (0.9, 0.999), 1e-8)


def test_sgd_json_has_no_adam_keys_and_adamw_json_has_both(capsys):
    assert main(["plan", "--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8", "--json"]) == 0
    sgd = json.loads(capsys.readouterr().out)
    assert not {"betas", "eps", "weight_decay", "adamw_timescale_epochs"} & set(sgd)
    assert main(["plan", *K16, "--dataset-size", "100000", "--json"]) == 0
    adamw = json.loads(capsys.readouterr().out)
    assert adamw["weight_decay"] == 0.04 and adamw["adamw_timescale_epochs"] == pytest.approx(106.6667, rel=1e-5)


def test_surge_multiplier_is_exact_where_it_is_known():
    # η*(B) ∝ 1/(½(√(B_noise/B) + √(B/B_noise))): B_noise/4 and 4·B_noise sit at 0.8 of the peak.
    symmetric = plan(_adamw(noise_scale=128), Target(devices=8, nodes=2, rule="surge"))
    assert (symmetric.global_batch_size, symmetric.lr_multiplier, symmetric.lr) == (512, 1.0, 3e-4)
    rising = plan(_adamw(noise_scale=128), Target(devices=4, rule="surge"))
    assert (rising.global_batch_size, rising.lr_multiplier) == (128, 1.25)
    assert rising.rule == "surge" and "Li et al. 2024" in rising.reasons["lr"] and not rising.warnings
    # λ' = λ·k/multiplier; β₂ by its half-life; ε' = ε/√k belongs to the square-root rule only.
    assert rising.weight_decay == pytest.approx(0.01 * 4 / 1.25) and rising.betas == (0.9, 0.999 ** 4)
    assert rising.eps == 1e-8


@pytest.mark.parametrize("ratio", [1.5, 3.0, 7.0, 40.0])
def test_surge_multiplier_is_one_between_batches_symmetric_about_the_noise_scale(ratio):
    assert scaling.surge_lr_multiplier(1000 / ratio, 1000 * ratio, 1000) == pytest.approx(1.0)
    assert scaling.surge_lr_multiplier(1000, 1000 * ratio, 1000) < 1 < scaling.surge_lr_multiplier(
        1000 / ratio, 1000, 1000)


def test_surge_warns_when_a_batch_is_far_from_the_noise_scale():
    far = plan(_adamw(noise_scale=20), Target(devices=16, rule="surge"))
    surge = [w for w in far.warnings if "more than 10×" in w]
    assert len(surge) == 1 and surge[0].startswith("the planned global batch 512 lies more than 10× from "
                                                   "reference.noise_scale 20")
    both = plan(_adamw(noise_scale=2), Target(devices=16, rule="surge"))
    assert any(w.startswith("the reference's global batch 32 and the planned global batch 512 lie") for w in
               both.warnings)
    near = plan(_adamw(noise_scale=51.2), Target(devices=16, rule="surge"))
    assert not any("more than 10×" in w for w in near.warnings)


def test_surge_takes_the_noise_scale_from_a_study(tmp_path, capsys):
    study = {"workload": "w", "b_simple": {"value": 128.0}}
    p = plan_from_study(_adamw(), Target(devices=4, rule="surge"), None, study)
    assert (p.rule, p.lr_multiplier) == ("surge", 1.25)
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    assert main(["plan", "--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "4",
                 "--rule", "surge", "--from-study", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lr_multiplier"] == 1.25
    with pytest.raises(UsageError, match="no positive B_simple"):
        plan_from_study(_adamw(), Target(devices=4, rule="surge"), None, {"b_simple": {"value": -3.0}})
    with pytest.raises(UsageError, match="both give the noise scale"):
        plan_from_study(_adamw(noise_scale=100), Target(devices=4, rule="surge"), None, study)


def test_a_measured_lr_keeps_adamws_settings_and_says_its_timescale():
    study = {"workload": "w", "optimizer": {"family": "adamw"}, "fit": {"tuned": {"b_crit": 100.0}},
             "tuned_lr": [{"global_batch_size": b, "lr": 1e-5 * b} for b in (32, 128, 512)]}
    p = plan_from_study(_adamw(), Target(devices=4), None, study)
    assert (p.rule, p.betas, p.eps, p.weight_decay) == ("measured", (0.9, 0.999), 1e-8, 0.01)
    assert "kept as given" in p.reasons["weight_decay"] and p.adamw_timescale_epochs is None
    # 1/(η·λ) = 1/(1.28e-3 × 0.01) = 78,125 steps.
    assert "78,125 steps" in p.reasons["weight_decay"]
    sized = plan_from_study(_adamw(), Target(devices=4), Data(dataset_size=12_800), study)
    # 128/(1.28e-3 × 0.01 × 12800) = 781.25 epochs; the reference's 32/(3e-4 × 0.01 × 12800) = 833.3.
    assert sized.adamw_timescale_epochs == pytest.approx(781.25)
    assert sized.reasons["adamw_timescale_epochs"].endswith("the reference's: 833.3")


@pytest.mark.parametrize("argv, message", [
    (["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "8", "--rule", "surge"],
     "--rule surge puts the lr's peak at the gradient noise scale: give it with --noise-scale"),
    (["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8", "--weight-decay", "1e-4"],
     "SGD's weight decay is coupled (an L2 term in its gradient) and the plan does not rescale it"),
    (["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8", "--rule", "surge", "--noise-scale", "64"],
     "--rule surge is Adam's"),
    (["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adam", "--devices", "8", "--noise-scale", "64"],
     "--noise-scale is read only by --rule surge"),
    (["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adam", "--devices", "8", "--betas", "0.9,1"],
     "--betas must be two numbers in [0, 1), got (0.9, 1.0)"),
    (["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adam", "--devices", "8", "--betas=-0.1,0.99"],
     "--betas must be two numbers in [0, 1)"),
    (["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "8", "--weight-decay", "-1"],
     "--weight-decay must be zero or more"),
    (["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "8", "--rule", "surge",
      "--noise-scale", "0"], "--noise-scale must be a positive number"),
])
def test_bad_adam_input_exits_2_with_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err


def test_the_new_flags_explain_themselves():
    from ddplab.cli.main import build_parser

    plan_parser = build_parser()._subparsers._group_actions[0].choices["plan"]
    helps = {option: action.help for action in plan_parser._actions for option in action.option_strings}
    assert "0.01 for adamw" in helps["--weight-decay"] and "surge" in helps["--noise-scale"]
    assert "surge" in helps["--rule"]


def test_keep_optimizer_settings_changes_only_the_batch_and_the_lr(capsys):
    reference = _adamw(betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    scaled = plan(reference, Target(devices=8, nodes=2))
    kept = plan(reference, Target(devices=8, nodes=2, keep_optimizer_settings=True))
    assert (kept.global_batch_size, kept.lr) == (scaled.global_batch_size, scaled.lr)
    assert (kept.betas, kept.eps, kept.weight_decay) == ((0.9, 0.95), 1e-6, 0.1)
    assert (scaled.betas, scaled.eps, scaled.weight_decay) != (kept.betas, kept.eps, kept.weight_decay)
    assert kept.reasons["eps"] == "kept as given (target.keep_optimizer_settings): the rules' 2.5e-07 is not written"
    # The decay kept at a larger lr shortens AdamW's averaging timescale in steps, and the reasons say what it is.
    assert "the weights average over 1/(η·λ)" in kept.reasons["weight_decay"]
    assert main(["plan", *K16, "--keep-optimizer-settings", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["betas"], out["eps"], out["weight_decay"]) == ([0.9, 0.999], 1e-8, 0.01)
    assert "(--keep-optimizer-settings)" in out["reasons"]["betas"]


def test_keep_optimizer_settings_writes_no_adam_key_into_a_config(capsys):
    config = ["--config", os.path.join(os.path.dirname(__file__), "configs", "zero2_auto.json"), "--ref-devices", "8",
              "--devices", "32"]
    assert main(["plan", *config, "--keep-optimizer-settings", "--json"]) == 0
    changed = set(json.loads(capsys.readouterr().out)["config_changes"])
    assert changed == {"train_batch_size", "optimizer.params.lr", "scheduler.params.warmup_max_lr",
                       "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps"}


def test_keep_optimizer_settings_for_sgd_is_refused(capsys):
    assert main(["plan", "--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8",
                 "--keep-optimizer-settings"]) == 2
    err = capsys.readouterr().err
    assert "--keep-optimizer-settings keeps Adam's betas, eps and AdamW's weight decay, and the plan's optimizer is " \
           "SGD" in err and err.count("\n") == 1
