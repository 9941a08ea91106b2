"""plan --from-noise and --from-study: the reference is the run the report measured, flags win over it and each one
that contradicts it is a warning; a study of the user's own spec is not called another workload (no torch)."""

import json

import pytest

from ddplab.cli.main import flags, main
from ddplab.plan.from_noise import plan_from_noise
from ddplab.plan.from_study import plan_from_study
from ddplab.plan.planner import Target

# What ddplab noise writes of the run it measured (the command form: no lr; the spec form: its optimizer's lrs).
COMMAND_REPORT = {"b_simple": 500.0, "b_simple_ci95": [400.0, 650.0], "strategy": "ddp", "world_size": 2,
                  "data_parallel_size": 2, "per_device_batch_size": 8, "accumulation_steps": 2,
                  "global_batch_size": 32}
SPEC_REPORT = {**COMMAND_REPORT, "lr": [0.05]}


def _write(tmp_path, name: str, tree: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(tree))
    return str(path)


def _plan(argv: list[str], capsys) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_noise_reports_run_is_the_reference(tmp_path, capsys):
    report = _write(tmp_path, "noise.json", SPEC_REPORT)
    from_report = _plan(["--from-noise", report, "--devices", "8"], capsys)
    from_flags = _plan(["--ref-batch-size", "8", "--ref-accumulation", "2", "--ref-devices", "2", "--ref-lr", "0.05",
                        "--critical-batch-size", "500", "--devices", "8"], capsys)
    assert from_report == from_flags
    assert (from_report["reference_global_batch_size"], from_report["global_batch_size"]) == (32, 128)
    # The command form saw no lr: the flag gives it, and nothing contradicts.
    command = _write(tmp_path, "command.json", COMMAND_REPORT)
    assert _plan(["--from-noise", command, "--ref-lr", "0.05", "--devices", "8"], capsys) == from_flags
    assert main(["plan", "--from-noise", command, "--devices", "8"]) == 2
    assert "the reference needs its learning rate: give --ref-lr" in capsys.readouterr().err


def test_a_flag_that_contradicts_the_noise_report_wins_and_is_warned(tmp_path, capsys):
    report = _write(tmp_path, "noise.json", SPEC_REPORT)
    out = _plan(["--from-noise", report, "--ref-batch-size", "16", "--ref-lr", "0.1", "--ref-devices", "4",
                 "--devices", "8"], capsys)
    assert out["reference_global_batch_size"] == 16 * 4 * 2
    assert out["warnings"][:3] == [f"--ref-batch-size 16 contradicts {report} (8): the plan takes --ref-batch-size",
                                   f"--ref-lr 0.1 contradicts {report} (0.05): the plan takes --ref-lr",
                                   f"--ref-devices × --ref-nodes = 4 ranks contradicts {report}, which ran on 2: "
                                   "the plan takes the flags"]
    # Flags that agree with it say nothing; a world split over nodes as the report's is the same world.
    agreed = _plan(["--from-noise", report, "--ref-batch-size", "8", "--ref-nodes", "2", "--devices", "8"], capsys)
    assert not any("contradicts" in warning for warning in agreed["warnings"])
    assert agreed["reference_global_batch_size"] == 32
    # A reference given by its global batch alone, against the report's.
    by_global = _plan(["--from-noise", report, "--ref-global-batch-size", "64", "--devices", "8", "--batch-size",
                       "8"], capsys)
    assert by_global["warnings"][0] == (f"--ref-global-batch-size 64 contradicts {report} (32): the plan takes "
                                        "--ref-global-batch-size")


def test_what_a_noise_report_cannot_say_is_one_line(tmp_path, capsys):
    cases = [({**SPEC_REPORT, "lr": [0.05, 0.005]}, [],
              "saw 2 learning rates (0.05, 0.005), one per parameter group: give the reference's with --ref-lr"),
             ({**SPEC_REPORT, "world_size": 8}, [], "ran 8 ranks, 2 of them data-parallel: give the reference's "
                                                    "--ref-tp, --ref-pp and --ref-cp"),
             ({**SPEC_REPORT, "per_device_batch_size": "eight"}, [],
              "holds per_device_batch_size 'eight', not a positive whole number"),
             ([1, 2], [], "is not a ddplab noise JSON report (no object)")]
    for tree, extra, said in cases:
        report = _write(tmp_path, "noise.json", tree)
        assert main(["plan", "--from-noise", report, "--devices", "8", *extra]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    assert main(["plan", "--config", "x.toml", "--from-noise", report, "--devices", "8"]) == 2
    assert "--from-noise and --config both give the reference run" in capsys.readouterr().err


def test_a_tensor_parallel_run_in_a_noise_report_takes_its_degrees_from_flags(tmp_path):
    report = {**SPEC_REPORT, "world_size": 8, "data_parallel_size": 4}
    p = plan_from_noise({"tensor_parallel_size": 2}, Target(devices=8, tensor_parallel_size=2), None, report)
    assert (p.reference_global_batch_size, p.global_batch_size, p.lr) == (64, 64, 0.05)


STUDY = {"workload": "w", "fit": {"tuned": {"b_crit": 100.0}}, "train_size": 4000,
         "reference": {"global_batch_size": 32, "lr": 0.003, "rules_lr": {"lr": 0.006, "source": "best_at_reference"}},
         "optimizer": {"family": "adamw", "name": "AdamW", "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.05},
         "tuned_lr": [{"global_batch_size": 32, "lr": 0.012}, {"global_batch_size": 128, "lr": 0.024},
                      {"global_batch_size": 512, "lr": 0.048}]}


def test_the_studys_reference_is_the_reference_and_contradictions_are_warned(tmp_path, capsys):
    study = _write(tmp_path, "study.json", STUDY)
    out = _plan(["--from-study", study, "--devices", "4", "--batch-size", "32"], capsys)
    given = _plan(["--from-study", study, "--ref-global-batch-size", "32", "--ref-lr", "0.003", "--optimizer",
                   "adamw", "--betas", "0.9,0.98", "--weight-decay", "0.05", "--devices", "4", "--batch-size", "32"],
                  capsys)
    assert out == given and (out["reference_global_batch_size"], out["global_batch_size"]) == (32, 128)
    assert out["lr"] == pytest.approx(0.024) and out["rule"] == "measured"
    # A per-device batch that makes another global batch than the study's reference is said first.
    other = _plan(["--from-study", study, "--ref-batch-size", "64", "--devices", "4"], capsys)
    assert other["warnings"][0] == (f"the flags make the reference's global batch 64 and {study} measured 32: the "
                                    "plan takes the flags'")

    # Another optimizer named by the flags takes none of the study's AdamW settings: the refusal names the optimizer.
    assert main(["plan", "--from-study", study, "--optimizer", "sgd", "--devices", "4", "--batch-size", "32"]) == 2
    assert "the study measured the best lr of AdamW, and --optimizer sgd scales by other rules" in \
        capsys.readouterr().err


def test_a_study_of_your_own_spec_is_not_called_another_workload(tmp_path):
    target = Target(devices=4, per_device_batch_size=32)
    builtin = plan_from_study({}, target, None, STUDY, names=flags())
    own = plan_from_study({}, target, None, {**STUDY, "workload": "train_spec.py"}, names=flags())
    # The reference lr 0.003 is 4× the study's best at its global batch 32 (0.012).
    assert any("the study's workload may not behave like yours" in warning for warning in builtin.warnings)
    mismatch = [warning for warning in own.warnings if "4× away from --ref-lr 0.003" in warning]
    assert mismatch == ["the study's best lr at the reference's global batch 32 is 0.012, 4× away from --ref-lr "
                        "0.003: the study trained your own spec (train_spec.py), so the reference lr is not its "
                        "best there; the planned lr follows the study's best lrs, not the reference's"]
    assert not any("may not behave like yours" in warning for warning in own.warnings)


def _window(samples: float, b_simple: float, interval: list, status: str, steps: list[int]) -> dict:
    return {"samples_seen": samples, "samples_from": samples - 80, "samples_to": samples + 80, "steps": steps,
            "b_simple": b_simple, "b_simple_ci95": interval, "b_simple_status": status}


# A padded LM's noise over training: B_simple grows, the last window's |G|² is not resolved (its point estimate
# 94,304 with an open interval), and the whole run's one ratio mixes the phases.
OVER_TRAINING = {**SPEC_REPORT, "b_simple": 92.49, "b_simple_ci95": [45.11, 2301.0], "b_simple_status": "resolved",
                 "dataset_size": 2000, "by_samples": [
                     _window(320, 12.0, [8.0, 20.0], "resolved", [4, 14]),
                     _window(960, 40.0, [25.0, 80.0], "resolved", [16, 26]),
                     _window(1600, 94304.0, [307.5, None], "g2_unresolved", [28, 38])]}


def test_a_noise_report_over_training_plans_with_its_last_resolved_window_and_says_so(tmp_path, capsys):
    report = _write(tmp_path, "noise.json", OVER_TRAINING)
    out = _plan(["--from-noise", report, "--devices", "8"], capsys)
    # Steps relative to the fewest at the planned global batch 128: 1 + B_crit / 128.
    assert out["global_batch_size"] == 128 and out["steps_factor"] == pytest.approx(1 + 40 / 128)
    said = [w for w in out["warnings"] if "last resolved window" in w]
    assert len(said) == 1 and "window 2 of 3, steps 16-26, at 960 samples seen" in said[0], out["warnings"]
    assert "--noise-window whole takes the whole run's 92.49" in said[0]
    whole = _plan(["--from-noise", report, "--noise-window", "whole", "--devices", "8"], capsys)
    assert whole["steps_factor"] == pytest.approx(1 + 92.49 / 128)
    assert not [w for w in whole["warnings"] if "window" in w]
    # The samples the run drew from are the report's: no --dataset-size asked for the epochs and the warmup.
    assert out["samples_per_rank"] == 2000 // 8 == whole["samples_per_rank"]
    # No window resolved: no number to plan with, in one line.
    unresolved = {**OVER_TRAINING, "by_samples": [{**w, "b_simple_status": "g2_unresolved"}
                                                  for w in OVER_TRAINING["by_samples"]]}
    assert main(["plan", "--from-noise", _write(tmp_path, "u.json", unresolved), "--devices", "8"]) == 2
    assert "none of its 3 windows has a resolved B_simple" in capsys.readouterr().err
    whole_unresolved = {**SPEC_REPORT, "b_simple": 9.4e4, "b_simple_ci95": [307.5, None],
                        "b_simple_status": "g2_unresolved"}
    assert main(["plan", "--from-noise", _write(tmp_path, "w.json", whole_unresolved), "--devices", "8"]) == 2
    assert "B_simple is not resolved (g2_unresolved" in capsys.readouterr().err


# What `ddplab study --branch-at` wrote for the digits run on docs/study/branched.md (its per-batch rows left out).
BRANCHED = {"workload": "digits-mlp", "optimizer": {"family": "sgd", "momentum": 0.9},
            "reference": {"global_batch_size": 32, "lr": 0.1}, "global_batch_sizes": [32, 64, 128, 256, 512],
            "branches": [{"samples_seen": 416, "critical_batch_size": 64, "interval": [32, 64], "at_edge": False,
                          "resolved": True},
                         {"samples_seen": 1248, "critical_batch_size": 128, "interval": [128, 256], "at_edge": False,
                          "resolved": True},
                         {"samples_seen": 2496, "critical_batch_size": 128, "interval": [64, 128], "at_edge": False,
                          "resolved": True}]}


def test_a_critical_batch_measured_over_training_plans_with_its_last_resolved_checkpoint(tmp_path, capsys):
    branched = _write(tmp_path, "branched.json", BRANCHED)
    out = _plan(["--from-study", branched, "--devices", "8", "--batch-size", "32"], capsys)
    # The reference is the measurement's, the critical batch its last checkpoint's 128, the lr the rule's.
    same = _plan(["--ref-global-batch-size", "32", "--ref-lr", "0.1", "--critical-batch-size", "128", "--devices",
                  "8", "--batch-size", "32"], capsys)
    assert {k: v for k, v in out.items() if k != "warnings"} == {k: v for k, v in same.items() if k != "warnings"}
    assert (out["global_batch_size"], out["lr"]) == (256, 0.8) and out["rule"] == "linear"
    assert out["warnings"][0] == (
        f"the critical batch over training ({branched!r}): 64 [32, 64] at 416 samples, 128 [128, 256] at 1,248 "
        "samples, 128 [64, 128] at 2,496 samples; planned with the last resolved one, 128 at 2,496 samples seen")
    assert out["warnings"][1:] == same["warnings"]
    # A last checkpoint whose interval spans the grid, or at its top, is passed over; none left: no critical batch.
    tree = json.loads(json.dumps(BRANCHED))
    tree["branches"][2].update(critical_batch_size=512, interval=[32, 512], resolved=False)
    spans = _plan(["--from-study", _write(tmp_path, "spans.json", tree), "--devices", "8", "--batch-size", "32"],
                  capsys)
    assert spans["warnings"][0].endswith("planned with the last resolved one, 128 at 1,248 samples seen; the later 1 "
                                         "checkpoint placed none inside the grid")
    for point in tree["branches"]:
        point.update(at_edge=True, critical_batch_size=512, interval=[512, 512])
    none = _plan(["--from-study", _write(tmp_path, "edge.json", tree), "--devices", "8", "--batch-size", "32"],
                 capsys)
    unplanned = _plan(["--ref-global-batch-size", "32", "--ref-lr", "0.1", "--devices", "8", "--batch-size", "32"],
                      capsys)
    assert none["warnings"][0].endswith("no checkpoint places it inside the batches branched (each spans the grid or "
                                        "lies at its top), so no critical batch is planned with")
    assert none["compute_factor"] == unplanned["compute_factor"] and none["lr"] == unplanned["lr"]
    # The surge rule's noise scale is no part of a critical-batch measurement.
    assert main(["plan", "--from-study", branched, "--rule", "surge", "--devices", "8", "--batch-size", "32"]) == 2
    assert "which a critical-batch measurement (branched.json) does not give" in capsys.readouterr().err
