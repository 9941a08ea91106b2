"""plan --config on DeepSpeed JSON: the batch keys resolved as DeepSpeed resolves them, its ZeRO stage named, and the
written file read back by DeepSpeed's own config class with the plan's numbers (no process group: its world size is
patched in)."""

import json
from unittest import mock

import pytest

from ddplab.cli.main import main
from ddplab.plan.formats import deepspeed as deepspeed_format
from ddplab.plan.from_config import plan_config

ADAMW = {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}


@pytest.fixture(scope="module")
def deepspeed_config():
    """DeepSpeed's own parser of a config, on a world of ``world_size`` data-parallel ranks."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import config

    def parse(source, world_size: int):
        # DeepSpeedConfig asks deepspeed.comm for the rank and world size; no process group is needed for those.
        with mock.patch.object(config.dist, "get_rank", return_value=0), \
                mock.patch.object(config.dist, "get_world_size", return_value=world_size):
            return config.DeepSpeedConfig(source)

    return parse


def _file(tmp_path, name: str, tree: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(tree, indent=2) + "\n")
    return str(path)


def _three(parsed) -> tuple[int, int, int]:
    return parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps


# Each of DeepSpeed's resolutions (_set_batch_related_parameters): the keys the file gives, the reference's world.
RESOLUTIONS = {
    "all three": ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, 4),
    "batch and micro": ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 16}, 8),
    "batch and accumulation": ({"train_batch_size": 256, "gradient_accumulation_steps": 2}, 8),
    "micro and accumulation": ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}, 4),
    "batch alone": ({"train_batch_size": 16}, 2),
    "micro alone": ({"train_micro_batch_size_per_gpu": 8}, 4),
}
# Targets: each mode, and one whose micro-batches must accumulate where the reference's did not.
TARGETS = {"per-device on 8": ["--devices", "8", "--keep", "per-device"],
           "trajectory on 8": ["--devices", "8", "--keep", "trajectory"],
           "trajectory within 1 per device": ["--devices", "2", "--keep", "trajectory",
                                              "--max-batch-size-per-device", "1"]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("resolution", sorted(RESOLUTIONS))
def test_written_files_parse_back_in_deepspeed_with_the_plans_numbers(resolution, target, stage, tmp_path,
                                                                      deepspeed_config, capsys):
    keys, world = RESOLUTIONS[resolution]
    tree = {**keys, "optimizer": ADAMW, "zero_optimization": {"stage": stage}}
    if stage == 0:
        del tree["zero_optimization"]  # DeepSpeed's default stage
    path, out = _file(tmp_path, "ds.json", tree), tmp_path / "planned.json"
    ref = ["--ref-devices", str(world)] if len(keys) < 3 else []
    assert main(["plan", "--config", path, *ref, *TARGETS[target], "--write-config", str(out), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    # The reference as DeepSpeed reads the original file on its own world.
    reference = deepspeed_config(path, world)
    assert reference.train_batch_size == planned["reference_global_batch_size"]
    run = deepspeed_format.FORMAT.read(path, (tmp_path / "ds.json").read_text(), {"devices": world} if ref else {})
    assert (run.reference["per_device_batch_size"], run.reference["accumulation_steps"]) == \
        (reference.train_micro_batch_size_per_gpu, reference.gradient_accumulation_steps)
    # The written file, as DeepSpeed reads it on the target's data-parallel ranks, is the plan.
    written = deepspeed_config(str(out), planned["data_parallel_size"])
    assert _three(written) == (planned["global_batch_size"], planned["per_device_batch_size"],
                               planned["accumulation_steps"])
    assert written.zero_optimization_stage == stage and planned["strategy"] == f"deepspeed-zero{stage}"
    assert written.optimizer_params["lr"] == pytest.approx(planned["lr"], rel=1e-5)


def test_a_global_batch_alone_on_a_known_world_keeps_its_per_device_batch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    path = _file(tmp_path, "ds.json", {"train_batch_size": 16, "optimizer": ADAMW,
                                       "zero_optimization": {"stage": 2}})
    argv = ["plan", "--config", path, "--ref-devices", "2", "--devices", "8", "--keep", "per-device"]
    assert main([*argv, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    # DeepSpeed: train_batch_size alone means accumulation 1 and 16 // 2 = 8 per device.
    assert (planned["per_device_batch_size"], planned["accumulation_steps"], planned["global_batch_size"]) == (8, 1, 64)
    assert any("DeepSpeed derives train_micro_batch_size_per_gpu 8 and gradient_accumulation_steps 1 on the "
               "reference's 2 data-parallel ranks" in note for note in planned["config_notes"])
    assert planned["reasons"]["world_size"] == "8 devices × 1 node, one DeepSpeed ZeRO-2 process per device"
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "DeepSpeed ZeRO-2" in shown and "DDP" not in shown


def test_auto_stays_auto_and_says_who_fills_it(tmp_path, deepspeed_config):
    tree = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2,
            "optimizer": {**ADAMW, "params": {**ADAMW["params"], "lr": "auto"}}, "zero_optimization": {"stage": 3}}
    path = _file(tmp_path, "ds.json", tree)
    result = plan_config(path, reference={"devices": 4, "lr": 3e-4}, target={"devices": 16}, data={})
    written = json.loads(result.text)
    assert written["train_batch_size"] == "auto" and written["optimizer"]["params"]["lr"] == "auto"
    assert any('train_batch_size, optimizer.params.lr stay "auto": DeepSpeed does not fill "auto", the Transformers '
               "Trainer or Accelerate does" in note for note in result.config_notes)
    # What the Trainer passes for "auto" (the plan's values), DeepSpeed accepts beside the written keys.
    filled = {**written, "train_batch_size": result.plan.global_batch_size,
              "optimizer": {**written["optimizer"], "params": {**written["optimizer"]["params"], "lr": result.plan.lr}}}
    parsed = deepspeed_config(filled, result.plan.data_parallel_size)
    assert _three(parsed) == (result.plan.global_batch_size, 16, 2) and parsed.zero_optimization_stage == 3


# What DeepSpeed refuses, refused in one line naming the file and its key (and DeepSpeed's own parser agrees).
REFUSED = [
    ("accumulation alone", {"gradient_accumulation_steps": 4}, ["--ref-devices", "2"],
     "gradient_accumulation_steps is the only batch key, which DeepSpeed refuses (it needs train_batch_size or "
     "train_micro_batch_size_per_gpu)"),
    ("not a multiple", {"train_batch_size": 100, "train_micro_batch_size_per_gpu": 8}, ["--ref-devices", "8"],
     "train_batch_size 100 is not train_micro_batch_size_per_gpu 8 × gradient_accumulation_steps 1 × 8 data-parallel "
     "ranks = 64 (train_batch_size 100 and train_micro_batch_size_per_gpu 8 given: gradient_accumulation_steps = "
     "100 // 8 // 8), which DeepSpeed refuses"),
    ("smaller than one micro-batch per rank", {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 8},
     ["--ref-devices", "1"], "gradient_accumulation_steps comes out as 0 on 1 data-parallel ranks"),
    ("zero micro-batch", {"train_micro_batch_size_per_gpu": 0}, ["--ref-devices", "2"],
     "train_micro_batch_size_per_gpu is 0, which DeepSpeed refuses: it must be greater than 0"),
    ("uneven per rank", {"train_batch_size": 10, "gradient_accumulation_steps": 1}, ["--ref-devices", "4"],
     "train_batch_size 10 is not train_micro_batch_size_per_gpu 2 × gradient_accumulation_steps 1 × 4"),
]


@pytest.mark.parametrize("keys, flags, said", [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_what_deepspeed_refuses_is_one_line(keys, flags, said, tmp_path, capsys, deepspeed_config):
    path = _file(tmp_path, "ds.json", {**keys, "optimizer": ADAMW})
    assert main(["plan", "--config", path, *flags, "--devices", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"error: {path}: " in err and said in err, err
    with pytest.raises((AssertionError, ZeroDivisionError)):
        deepspeed_config(path, int(flags[-1]))


def test_an_auto_key_the_other_two_do_not_fix_needs_its_flag(tmp_path, capsys):
    path = _file(tmp_path, "ds.json", {"train_batch_size": 256, "train_micro_batch_size_per_gpu": "auto",
                                       "optimizer": ADAMW})
    assert main(["plan", "--config", path, "--ref-devices", "8", "--devices", "16"]) == 2
    assert ('train_micro_batch_size_per_gpu is "auto", which DeepSpeed does not resolve: the Transformers Trainer or '
            "Accelerate fills it from its own arguments, so give the reference's with --ref-batch-size"
            in capsys.readouterr().err)
    # Given, it resolves as DeepSpeed then does: 256 // 16 // 8 = 2 accumulation steps.
    result = plan_config(path, reference={"devices": 8, "per_device_batch_size": 16}, target={"devices": 16}, data={})
    assert (result.plan.reference_global_batch_size, result.plan.accumulation_steps) == (256, 2)


def test_a_zero_stage_deepspeed_has_not_is_refused(tmp_path, capsys):
    path = _file(tmp_path, "ds.json", {"train_micro_batch_size_per_gpu": 8, "optimizer": ADAMW,
                                       "zero_optimization": {"stage": 4}})
    assert main(["plan", "--config", path, "--ref-devices", "2", "--devices", "8"]) == 2
    assert "zero_optimization.stage is 4: DeepSpeed's ZeRO stages are 0 to 3" in capsys.readouterr().err
