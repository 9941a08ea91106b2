"""plan --config: each framework's file read, planned, and written back with only the changed keys (no torch)."""

import dataclasses
import json
import os
import shlex

import pytest
import tomllib
import yaml

from ddplab.cli.main import main
from ddplab.errors import UsageError
from ddplab.plan.formats import FORMATS, choose, editing
from ddplab.plan.from_config import plan_config

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
PROSE = ("reasons", "warnings", "other_mode")

# Each corpus file, its format, the flags that give the same run, the target, and the flags its hardware needs.
CASES = {
    "llama_pretrain.toml": ("torchtitan", [
        "--ref-batch-size", "4", "--ref-lr", "3e-4", "--optimizer", "adamw", "--betas", "0.9,0.95", "--eps", "1e-8",
        "--weight-decay", "0.1", "--ref-tp", "2", "--tp", "2", "--strategy", "fsdp", "--seq-len", "8192",
        "--ref-steps", "1000", "--ref-warmup-steps", "200"], ["--devices", "8", "--nodes", "4"],
        ["--ref-devices", "8"]),
    "zero2_auto.json": ("deepspeed", [
        "--ref-batch-size", "16", "--ref-accumulation", "2", "--ref-lr", "6e-4", "--optimizer", "adamw", "--betas",
        "0.9,0.95", "--eps", "1e-8", "--weight-decay", "0.1", "--ref-steps", "20000", "--ref-warmup-steps", "500",
        "--strategy", "deepspeed-zero2"],
        ["--devices", "32"], ["--ref-devices", "8"]),
    "pretrain_gpt.sh": ("megatron", [
        "--ref-batch-size", "4", "--ref-accumulation", "8", "--ref-lr", "1.5e-4", "--optimizer", "adamw", "--betas",
        "0.9,0.95", "--eps", "1e-8", "--weight-decay", "0.1", "--ref-tp", "2", "--ref-pp", "2", "--tp", "2", "--pp",
        "2", "--seq-len", "2048", "--ref-steps", "100000", "--ref-warmup-steps", "2000", "--ref-devices", "8",
        "--ref-nodes", "2"], ["--devices", "8", "--nodes", "4"], []),
    "lightning_cli.yaml": ("lightning", [
        "--ref-batch-size", "128", "--ref-lr", "0.1", "--ref-devices", "4", "--epochs", "30", "--dataset-size",
        "50000"], ["--devices", "8", "--nodes", "2", "--dataset-size", "50000"], []),
    "litgpt_lora.yaml": ("litgpt", [
        "--ref-batch-size", "2", "--ref-accumulation", "4", "--ref-lr", "2e-4", "--optimizer", "adamw", "--betas",
        "0.9,0.95", "--weight-decay", "0", "--epochs", "4", "--seq-len", "512", "--ref-warmup-steps", "10"],
        ["--devices", "4"], []),
    "sft_recipe.yaml": ("transformers", [
        "--ref-batch-size", "8", "--ref-accumulation", "4", "--ref-lr", "2e-5", "--optimizer", "adamw",
        "--weight-decay", "0", "--epochs", "1", "--seq-len", "2048"], ["--devices", "8", "--nodes", "2"],
        ["--ref-devices", "8"]),
    "training_args.json": ("transformers", [
        "--ref-batch-size", "16", "--ref-accumulation", "2", "--ref-lr", "5e-5", "--optimizer", "adamw", "--betas",
        "0.9,0.98", "--weight-decay", "0.01", "--ref-steps", "10000", "--ref-warmup-steps", "500"],
        ["--devices", "8"], ["--ref-devices", "4"]),
}


def _path(name: str) -> str:
    return os.path.join(CONFIGS, name)


def _text(name: str) -> str:
    with open(_path(name)) as fh:
        return fh.read()


def _cli_json(argv, capsys) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _flag_fields(argv: list[str]) -> dict:
    """The fields the command line passes beside the file, as the library takes them."""
    from ddplab.cli.main import build_parser
    from ddplab.cli.options import fields_given
    from ddplab.plan.planner import Data, Reference, Target

    args = build_parser().parse_args(["plan", *argv])
    return {"reference": fields_given(args, Reference, prefix="reference"),
            "target": fields_given(args, Target, prefix="target"), "data": fields_given(args, Data, prefix="data")}


def _planned(name: str):
    _, _, target, hardware = CASES[name]
    return plan_config(_path(name), **_flag_fields(target + hardware))


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_format_is_detected_from_the_file(name):
    assert choose(_path(name), _text(name)).name == CASES[name][0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_from_a_file_equals_the_plan_from_the_same_flags(name, capsys):
    _, flags, target, hardware = CASES[name]
    from_file = _cli_json(["--config", _path(name), *target, *hardware], capsys)
    from_flags = _cli_json([*flags, *target, *hardware], capsys)
    assert {k: v for k, v in from_file.items() if k not in PROSE and not k.startswith("config")} == \
        {k: v for k, v in from_flags.items() if k not in PROSE}
    assert from_file["config_format"] == CASES[name][0] and from_file["config_changes"]


def _parse(name: str, text: str):
    """The file as its framework's loader reads it (the native parser where it is installed here)."""
    if name.endswith(".toml"):
        return tomllib.loads(text)
    if name.endswith(".json"):
        return json.loads(text)
    if name.endswith(".sh"):
        return _megatron_args(text)
    return yaml.safe_load(text)


def _megatron_args(text: str) -> dict:
    """Megatron-LM's arguments as its argparse reads them (the flags this corpus uses), variables substituted."""
    import argparse

    variables = dict(line.split("=", 1) for line in text.splitlines() if line[:1].isupper() and "=" in line)
    words = editing.shell_words(text)
    words = [w for word in words for w in (shlex.split(variables[word[1:]].strip('"'))
                                           if word.startswith("$") and word[1:] in variables else [word])]
    words = [variables.get(w[1:], w) if w.startswith("$") else w for w in words]
    parser = argparse.ArgumentParser()
    for flag in ("--micro-batch-size", "--global-batch-size", "--train-iters", "--lr-warmup-iters",
                 "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--nproc_per_node", "--nnodes"):
        parser.add_argument(flag, type=int)
    for flag in ("--lr", "--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay", "--min-lr"):
        parser.add_argument(flag, type=float)
    parser.add_argument("--rampup-batch-size", nargs=3, type=int)
    args, _ = parser.parse_known_args(words)
    return {f"--{k.replace('_', '-')}" if k not in ("nproc_per_node",) else f"--{k}": v
            for k, v in vars(args).items()}


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, tree


@pytest.mark.parametrize("name", sorted(CASES))
def test_written_files_change_only_the_planned_keys_and_parse_back_to_the_plan(name, tmp_path):
    result = _planned(name)
    out = tmp_path / name
    _, _, target, hardware = CASES[name]
    assert main(["plan", "--config", _path(name), *target, *hardware, "--write-config", str(out)]) == 0
    written = out.read_text()
    assert written == result.text != result.original_text
    before, after = dict(_leaves(_parse(name, result.original_text))), dict(_leaves(_parse(name, written)))
    changed = result.config_changes
    # Every key the plan does not change reads as it did; every changed key reads as the plan's value.
    assert {k: v for k, v in before.items() if k not in changed} == {k: v for k, v in after.items() if k not in changed}
    for key, (_, new) in changed.items():
        assert after[key] == pytest.approx(new, rel=1e-5), key
    # Unchanged lines are byte-identical: the only lines that differ hold a changed key.
    # (JSON's separator moves: a line that gained only a comma before an added member is unchanged.)
    removed = {line.rstrip(",") for line in result.original_text.splitlines()} - \
        {line.rstrip(",") for line in written.splitlines()}
    leaf = {key.rpartition(".")[2] for key in changed}
    # (A block sequence's items stand on lines of their own; a script's variables on their assignment lines.)
    assert all(any(key in line for key in leaf) or line.lstrip().startswith("- ") or line[:1].isupper()
               for line in removed), removed
    assert sum(1 for line in result.original_text.splitlines() if line.lstrip().startswith("#")) == \
        sum(1 for line in written.splitlines() if line.lstrip().startswith("#"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_same_hardware_changes_nothing_and_writes_the_file_back_byte_for_byte(name):
    reference = {"llama_pretrain.toml": ["--devices", "8"], "zero2_auto.json": ["--devices", "8"],
                 "pretrain_gpt.sh": ["--devices", "8", "--nodes", "2", "--tp", "2", "--pp", "2"],
                 "lightning_cli.yaml": ["--devices", "4"], "litgpt_lora.yaml": ["--devices", "1"],
                 "sft_recipe.yaml": ["--devices", "8"], "training_args.json": ["--devices", "4"]}[name]
    result = plan_config(_path(name), **_flag_fields(reference + CASES[name][3]))
    assert result.config_changes == {} and result.text == result.original_text
    # Every key of these files is one its framework reads: none is taken for a misspelling.
    assert not [w for w in result.plan.warnings if "misspelling" in w]


def test_the_reasons_name_the_files_keys(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the table as a 120-column terminal shows it, whatever the runner's width
    out = _cli_json(["--config", _path("zero2_auto.json"), "--ref-devices", "8", "--devices", "32"], capsys)
    assert out["config_keys"]["per_device_batch_size"] == "train_micro_batch_size_per_gpu"
    assert out["config_keys"]["lr"] == "optimizer.params.lr"
    assert "scheduler.params.warmup_num_steps 500 steps of 256 samples" in out["reasons"]["warmup_steps"]
    assert out["config_changes"]["train_batch_size"] == [256, 1024]
    # "auto" stays "auto": DeepSpeed derives it from the two keys the plan writes.
    assert "gradient_accumulation_steps" not in out["config_changes"]
    assert main(["plan", "--config", _path("zero2_auto.json"), "--ref-devices", "8", "--devices", "32"]) == 0
    shown = capsys.readouterr().out
    assert "-  \"train_batch_size\": 256," in shown and "+  \"train_batch_size\": 1024," in shown
    assert "per-device batch" in shown and "(train_micro_batch_size_per_gpu)" in shown


def test_megatron_ramp_carries_over_scaled_and_variables_are_edited_where_they_are_set():
    result = _planned("pretrain_gpt.sh")
    # 4 per device × data-parallel degree 4 (16 ranks ÷ tp 2 × pp 2) × 8 accumulation steps = 128, on 32 ranks 256.
    assert (result.plan.reference_global_batch_size, result.plan.global_batch_size) == (128, 256)
    assert result.config_changes["--rampup-batch-size"] == ([32, 32, 1000000], [64, 64, 1000000])
    assert "LR=0.000212132" in result.text and "--lr $LR" in result.text
    assert "NNODES=4" in result.text and any("batch schedule" in note for note in result.config_notes)
    assert result.config_keys["betas"] == "--adam-beta1/--adam-beta2"


def test_a_warmup_ratio_is_kept_and_said():
    result = _planned("sft_recipe.yaml")
    assert "warmup_ratio" not in result.config_changes and "warmup_ratio: 0.1" in result.text
    assert any("warmup_ratio 0.1 is a share of the run" in note for note in result.config_notes)


# The SFT recipe keeps the recipes' own gradient_checkpointing, which Transformers 5 renames.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_training_arguments_written_parse_with_transformers_own_parser(tmp_path):
    transformers = pytest.importorskip("transformers")
    for name in ("training_args.json", "sft_recipe.yaml"):
        result = _planned(name)
        parser = transformers.HfArgumentParser(transformers.TrainingArguments)
        # The written file as the Trainer's scripts load it, on this CPU-only machine (no bf16).
        loaded = json.loads(result.text) if name.endswith(".json") else yaml.safe_load(result.text)
        (args,) = parser.parse_dict({**loaded, "bf16": False, "use_cpu": True, "output_dir": str(tmp_path)},
                                    allow_extra_keys=True)
        assert args.per_device_train_batch_size == result.plan.per_device_batch_size
        assert args.gradient_accumulation_steps == result.plan.accumulation_steps
        assert args.learning_rate == pytest.approx(result.plan.lr, rel=1e-5)


def test_lightning_cli_reads_the_written_trainer_section(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch import Trainer

    result = _planned("lightning_cli.yaml")
    trainer = yaml.safe_load(result.text)["trainer"]
    # The keys are Trainer's own arguments: it accepts them (on CPU, with the accelerator the machine has).
    Trainer(**{**trainer, "accelerator": "cpu", "devices": 1, "num_nodes": 1, "precision": "32-true",
               "logger": False, "enable_checkpointing": False, "enable_progress_bar": False})
    assert (trainer["devices"], trainer["num_nodes"]) == (8, 2)


# --- bad input: one line naming the file and key, exit 2, nothing written ---------------------------------------

BAD = [
    ("unknown.txt", "just some words\n", [], "is of no known format: pass --config-format"),
    ("wrong_type.toml", "[training]\nlocal_batch_size = \"eight\"\n[optimizer]\nlr = 3e-4\n", ["--ref-devices", "8"],
     "training.local_batch_size must be a whole number, got 'eight'"),
    ("no_world.toml", "[training]\nlocal_batch_size = 8\n[optimizer]\nlr = 3e-4\n", [],
     "parallelism.data_parallel_shard_degree is -1 (derived from the world size, which the file does not give): "
     "pass --ref-devices and --ref-nodes"),
    ("tp3.toml", "[training]\nlocal_batch_size = 8\n[optimizer]\nlr = 3e-4\n[parallelism]\ntensor_parallel_degree = 3"
                 "\ndata_parallel_shard_degree = 2\n", [],
     "do not split into tp 3 × pp 1 × cp 1: choose parallelism.tensor_parallel_degree"),
    ("all_auto.json", '{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", '
                      '"gradient_accumulation_steps": "auto", '
                      '"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}',
     ["--ref-devices", "8"], "train_micro_batch_size_per_gpu is \"auto\" or missing, as are train_batch_size and "
                             "gradient_accumulation_steps: give the reference's batch with --ref-batch-size"),
    ("lr_auto.json", '{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}',
     ["--ref-devices", "8"], "optimizer.params.lr is \"auto\" or missing: give the reference lr with --ref-lr"),
    ("uneven.json", '{"train_batch_size": 100, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, '
                    '"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}', [],
     "train_batch_size 100 is not train_micro_batch_size_per_gpu 8 × gradient_accumulation_steps 1 × a world size"),
    ("unreachable.sh", "torchrun --nproc_per_node 8 pretrain_gpt.py --micro-batch-size 4 --global-batch-size 48 "
                       "--lr 1e-4\n", [],
     "--global-batch-size 48 is not a multiple of --micro-batch-size 4 × the data-parallel degree 8"),
    ("no_hardware.json", '{"per_device_train_batch_size": 8, "learning_rate": 1e-4}', [],
     "is TrainingArguments, which do not say how many processes ran: pass --ref-devices and --ref-nodes"),
]


@pytest.mark.parametrize("name, text, flags, said", BAD, ids=[case[0] for case in BAD])
def test_bad_input_is_one_line_naming_the_file_and_key_and_writes_nothing(name, text, flags, said, tmp_path, capsys):
    path, out = tmp_path / name, tmp_path / f"out-{name}"
    path.write_text(text)
    assert main(["plan", "--config", str(path), "--devices", "8", *flags, "--write-config", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}" in err and said in err, err
    assert not out.exists()


def test_a_global_batch_no_split_reaches_on_the_target_is_refused_naming_the_file(tmp_path, capsys):
    path = tmp_path / "tt.toml"
    path.write_text("[training]\nlocal_batch_size = 8\nglobal_batch_size = 64\n[optimizer]\nlr = 3e-4\n"
                    "[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n")
    assert main(["plan", "--config", str(path), "--devices", "6", "--keep", "trajectory"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: a data-parallel degree of 3 (6 ranks ÷ tp 2) cannot split a global batch of 64 evenly" in err


def test_writing_onto_the_file_read_needs_force(tmp_path, capsys):
    path = tmp_path / "args.json"
    path.write_text(_text("training_args.json"))
    argv = ["plan", "--config", str(path), "--ref-devices", "4", "--devices", "8", "--write-config", str(path)]
    assert main(argv) == 2
    assert "is the file read: pass --force to overwrite it" in capsys.readouterr().err
    assert path.read_text() == _text("training_args.json")
    assert main([*argv, "--force"]) == 0 and json.loads(path.read_text())["max_steps"] == 5000


def test_every_format_is_registered_by_name_and_named_by_config_format(capsys):
    assert set(FORMATS) == {"torchtitan", "deepspeed", "megatron", "lightning", "litgpt", "transformers"}
    out = _cli_json(["--config", _path("training_args.json"), "--config-format", "transformers",
                     "--ref-devices", "4", "--devices", "8"], capsys)
    assert out["config_format"] == "transformers"
    with pytest.raises(UsageError, match="cannot be read as nothing"):
        choose(_path("training_args.json"), "", "nothing")


def test_a_layout_the_editor_cannot_write_into_is_refused_and_nothing_is_written(tmp_path, capsys):
    path, out = tmp_path / "flow.yaml", tmp_path / "out.yaml"
    path.write_text("trainer: {devices: 4}\ndata:\n  batch_size: 32\noptimizer:\n  class_path: torch.optim.SGD\n"
                    "  init_args: {lr: 0.1}\n")
    assert main(["plan", "--config", str(path), "--devices", "8", "--write-config", str(out)]) == 2
    assert "could not be written into its layout" in capsys.readouterr().err and not out.exists()


def test_a_recommended_warmup_the_file_has_no_key_for_is_said():
    result = plan_config(_path("lightning_cli.yaml"), **_flag_fields(["--devices", "8", "--nodes", "2",
                                                                      "--dataset-size", "50000"]))
    assert result.plan.warmup_recommended and result.plan.warmup_steps == 75
    assert any("recommends a warmup (75 steps" in note for note in result.config_notes)


def test_torchtitans_2024_layout_reads_and_is_written_in_its_own_keys(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[optimizer]\nname = \"AdamW\"\nlr = 8e-4\n\n[training]\nbatch_size = 8\nseq_len = 2048\n"
                    "steps = 1000\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n\n[experimental]\n"
                    "pipeline_parallel_degree = 1\n")
    result = plan_config(str(path), **_flag_fields(["--devices", "16"]))
    # 8 ranks (shard 4 × tp 2), 8 per device on 4 data-parallel ranks; 16 ranks double it.
    assert (result.plan.reference_global_batch_size, result.plan.global_batch_size) == (32, 64)
    assert result.config_keys["per_device_batch_size"] == "training.batch_size"
    assert result.config_changes["training.data_parallel_shard_degree"] == (4, 8)
    assert "local_batch_size" not in result.text and tomllib.loads(result.text)["training"]["steps"] == 500


def test_a_megatron_args_file_with_equals_signs_and_no_launcher_takes_the_hardware_from_flags(tmp_path):
    path = tmp_path / "args.txt"
    path.write_text("--micro-batch-size=2\n--global-batch-size=64\n--lr=2e-4\n--train-iters=5000\n")
    result = plan_config(str(path), config_format="megatron", **_flag_fields(["--ref-devices", "8", "--devices",
                                                                              "16"]))
    assert (result.plan.reference_global_batch_size, result.plan.global_batch_size) == (64, 128)
    assert "--lr=0.000282843\n" in result.text and "--train-iters=2500\n" in result.text
    assert "--micro-batch-size=2\n--global-batch-size=128\n" in result.text


# A LightningModule that builds its own optimizer from its init args (configure_optimizers), no optimizer block.
OWN_OPTIMIZER = """trainer:
  devices: 4
  max_steps: 10000
model:
  class_path: models.GPT
  init_args:
    n_layer: 12
    lr: 6.0e-4
    {beta1}: 0.9
    {beta2}: 0.95
    {eps}: 1.0e-8
    {decay}: 0.1
data:
  init_args:
    batch_size: 16
"""


@pytest.mark.parametrize("beta1, beta2, eps, decay", [("beta_1", "beta_2", "eps", "weight_decay"),
                                                      ("beta1", "beta2", "epsilon", "wd"),
                                                      ("b1", "b2", "eps", "weight_decay")])
def test_a_models_own_optimizer_settings_are_read_and_written_in_its_init_args(beta1, beta2, eps, decay, tmp_path):
    path = tmp_path / "fit.yaml"
    path.write_text(OWN_OPTIMIZER.format(beta1=beta1, beta2=beta2, eps=eps, decay=decay))
    result = plan_config(str(path), reference={"optimizer": "adamw"}, target={"devices": 8}, data={})
    from_flags = plan_config(str(path), reference={"optimizer": "adamw", "betas": (0.9, 0.95), "eps": 1e-8,
                                                   "weight_decay": 0.1}, target={"devices": 8}, data={})
    assert result.plan == from_flags.plan and result.plan.betas[1] == pytest.approx(0.95 ** 2)
    written = yaml.safe_load(result.text)["model"]["init_args"]
    assert written[beta2] == pytest.approx(result.plan.betas[1], rel=1e-5) and written[beta1] == 0.9
    assert written[eps] == pytest.approx(result.plan.eps, rel=1e-5)
    assert written[decay] == pytest.approx(result.plan.weight_decay, rel=1e-5)
    # Nothing the model does not take is added; which key was taken as what is said.
    assert set(written) == {"n_layer", "lr", beta1, beta2, eps, decay} and "optimizer:" not in result.text
    assert result.config_keys["betas"] == f"model.init_args.{beta1}/model.init_args.{beta2}"
    assert any(f"model.init_args.{beta1} as Adam's β₁, model.init_args.{beta2} as β₂, model.init_args.{eps} as ε, "
               f"model.init_args.{decay} as the weight decay" in note for note in result.config_notes)


def test_a_models_own_adam_settings_without_a_named_optimizer_are_planned_as_adams_and_said(tmp_path, capsys):
    # LightningCLI's documented shape: the module builds its optimizer from beta_1/beta_2; no block names it.
    path = tmp_path / "fit.yaml"
    path.write_text(OWN_OPTIMIZER.format(beta1="beta1", beta2="beta2", eps="eps", decay="weight_decay"))
    assert main(["plan", "--config", str(path), "--devices", "8", "--keep", "trajectory"]) == 0
    capsys.readouterr()
    result = plan_config(str(path), reference={}, target={"devices": 8}, data={})
    named = plan_config(str(path), reference={"optimizer": "adam"}, target={"devices": 8}, data={})
    # The same numbers as with --optimizer adam (the reasons name where each came from).
    assert dataclasses.replace(result.plan, reasons={}) == dataclasses.replace(named.plan, reasons={})
    assert any("nothing names that optimizer, and model.init_args.beta1 is Adam's: planned as Adam" in note
               for note in result.config_notes), result.config_notes
    # Its betas as one list, and its optimizer named among its init args.
    path.write_text(OWN_OPTIMIZER.replace("    {beta1}: 0.9\n    {beta2}: 0.95\n", "    betas: [0.9, 0.98]\n"
                                          "    optimizer: adamw\n").format(eps="eps", decay="wd"))
    result = plan_config(str(path), reference={}, target={"devices": 4}, data={})
    assert (result.plan.betas, result.plan.eps, result.plan.weight_decay) == ((0.9, 0.98), 1e-8, 0.1)
    assert any("model.init_args.optimizer as the optimizer" in note for note in result.config_notes)


def test_lightnings_deepspeed_strategy_is_the_plans(tmp_path):
    path = tmp_path / "fit.yaml"
    path.write_text(_text("lightning_cli.yaml").replace("strategy: ddp", "strategy: deepspeed_stage_3_offload"))
    assert plan_config(str(path), reference={}, target={"devices": 8}, data={}).plan.strategy == "deepspeed-zero3"
    path.write_text(_text("lightning_cli.yaml").replace("strategy: ddp", "strategy: deepspeed"))
    assert plan_config(str(path), reference={}, target={"devices": 8}, data={}).plan.strategy == "deepspeed-zero2"
