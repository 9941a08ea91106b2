"""plan --config on text no framework would accept, in every format: one line naming the file (and its line where the
parser knows it), exit 2, never a traceback, and quickly. And Megatron-LM launch scripts as they are written now:
``NAME=${NAME:-default}`` lines and bash arrays."""

import pytest

from ddplab.cli.main import main
from ddplab.plan.formats import FORMATS
from ddplab.plan.from_config import MAX_CONFIG_BYTES, plan_config

DEEP = 50_000
# A YAML "billion laughs": nine aliases, each ten of the one before.
LAUGHS = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9))

# format: [(case, file name, text, what the line says)]
ADVERSARIAL = {
    "torchtitan": [
        ("unterminated quote", "job.toml", '[training]\nlocal_batch_size = "8\n[optimizer]\nlr = 3e-4\n',
         "is not TOML (Illegal character '\\n' (at line 2, column 22))"),
        ("deep nesting", "job.toml", "[training]\nlocal_batch_size = " + "[" * DEEP + "]" * DEEP + "\n",
         "nests its values too deeply to read"),
    ],
    "deepspeed": [
        ("unterminated quote", "ds.json", '{"train_batch_size": "16, "optimizer": {"type": "AdamW"}}',
         "is not JSON (Expecting ',' delimiter: line 1 column 28"),
        ("deep nesting", "ds.json", '{"train_batch_size": ' + "[" * DEEP + "]" * DEEP + "}",
         "nests its values too deeply to read"),
        ("a list for a number", "ds.json", '{"train_batch_size": [[1, 2], [3, 4], [5, 6], [7, 8], [9]], '
                                           '"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}',
         "train_batch_size must be a whole number, got [[1, 2], [3, 4], [5, 6], [7, 8], ...]"),
    ],
    "megatron": [
        ("a cycle of variables", "train.sh", "A=$B\nB=$A\ntorchrun --nproc_per_node 8 pretrain_gpt.py "
                                             "--micro-batch-size 4 --lr $A\n",
         "--lr is $B, a variable the script does not set: give its value"),
        ("unterminated quote", "train.sh", "LR=1e-4\ntorchrun --nproc_per_node 8 pretrain_gpt.py \\\n"
                                           "    --micro-batch-size 4 \\\n    --lr '$LR\n",
         "train.sh, line 4: a ' quote is never closed, so bash could not read the script either"),
        ("unterminated double quote", "train.sh", 'ARGS="--micro-batch-size 4\ntorchrun --nproc_per_node 8 x.py '
                                                  '$ARGS --lr 1e-4\n',
         'train.sh, line 1: a " quote is never closed'),
        ("unclosed array", "train.sh", "args=(\n  --micro-batch-size 4\n  --lr 1e-4\ntorchrun x.py \"${args[@]}\"\n",
         "train.sh, line 5: an array's '(' is never closed"),
        ("unclosed substitution", "train.sh", "N=$(nproc\ntorchrun --nproc_per_node $N x.py --micro-batch-size 4 "
                                              "--lr 1e-4\n", "train.sh, line 1: a $( is never closed"),
        ("unended here-document", "train.sh", "cat <<EOF > args.txt\n--micro-batch-size 4\n--lr 1e-4\n",
         "train.sh, line 1: a here-document is never ended by 'EOF'"),
    ],
    "lightning": [
        ("a recursive alias", "fit.yaml", "trainer:\n  devices: 4\ndata: &d\n  batch_size: *d\noptimizer:\n"
                                          "  class_path: torch.optim.SGD\n  init_args:\n    lr: 0.1\n",
         "data.batch_size must be a whole number, got {'batch_size': {'batch_size': {...}}}"),
        ("a billion laughs", "fit.yaml", LAUGHS + "trainer:\n  devices: 4\ndata:\n  batch_size: *a8\n"
                                                  "optimizer: *a8\n",
         "must be a whole number, got [[[...], [...], [...], [...], ...], "),
        ("unterminated quote", "fit.yaml", 'trainer:\n  devices: "4\ndata:\n  batch_size: 32\n',
         "is not YAML (line 5: found unexpected end of stream)"),
        ("deep nesting", "fit.yaml", "trainer:\n  devices: " + "[" * DEEP + "]" * DEEP + "\n",
         "is not YAML (line 2: exceeded maximum nesting depth)"),
    ],
    "litgpt": [
        ("a recursive alias", "lora.yaml", "train: &t\n  micro_batch_size: *t\n",
         "train.micro_batch_size must be a whole number, got {'micro_batch_size"),
        ("unterminated quote", "lora.yaml", "train:\n  micro_batch_size: 'a\n", "is not YAML (line 3: "),
    ],
    "transformers": [
        ("unterminated quote", "args.json", '{"per_device_train_batch_size": 8, "learning_rate": "1e-4}',
         "is not JSON (Unterminated string starting at: line 1 column 53"),
        ("deep nesting", "args.json", '{"learning_rate": ' + "[" * DEEP + "]" * DEEP + "}",
         "nests its values too deeply to read"),
        ("a billion laughs", "args.yaml", LAUGHS + "learning_rate: 1.0e-4\noptim: *a8\n",
         "optim is [[[...], [...], [...], [...], ...], "),
    ],
}
CASES = [(name, *case) for name, cases in ADVERSARIAL.items() for case in cases]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("format_name, case, file_name, text, said", CASES,
                         ids=[f"{case[0]}-{case[1]}" for case in CASES])
def test_adversarial_text_is_one_line_naming_the_file(format_name, case, file_name, text, said, tmp_path, capsys):
    path = tmp_path / file_name
    path.write_text(text)
    assert main(["plan", "--config", str(path), "--config-format", format_name, "--ref-devices", "2",
                 "--devices", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and said in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("format_name", sorted(FORMATS))
def test_a_huge_file_is_refused_before_it_is_parsed(format_name, tmp_path, capsys):
    path = tmp_path / "huge"
    path.write_text("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    assert main(["plan", "--config", str(path), "--config-format", format_name, "--devices", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--config {path} is over 1 MiB, which no framework's config is" in err, err


@pytest.mark.timeout(60)
def test_a_long_launch_script_reads_in_one_pass(tmp_path):
    # 20,000 lines of comments, assignments and an array before the command: read linearly, not line by line again.
    lines = [f"# step {i}\nV{i}=${{V{i}:-{i}}}\n" for i in range(10_000)]
    path = tmp_path / "long.sh"
    path.write_text("".join(lines) + "args=(\n" + "  --num-layers 2\n" * 1000 + "  --micro-batch-size 4\n)\n"
                    "torchrun --nproc_per_node $V7 pretrain_gpt.py \"${args[@]}\" --lr 1e-4\n")
    result = plan_config(str(path), reference={}, target={"devices": 14}, data={})
    assert (result.plan.reference_global_batch_size, result.plan.global_batch_size) == (28, 56)


# Megatron-LM's launch scripts as they are written now: defaults from the environment, flags in bash arrays.
LAUNCH = """#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6001}
NUM_NODES=${NUM_NODES:-2}
NODE_RANK=${NODE_RANK:-0}
LR="${LR:-3.0e-4}"
CHECKPOINT_PATH=$1

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

model_args=(--num-layers 24 --hidden-size 1024   # the 345M model
    --seq-length 2048)

training_args=(
    --micro-batch-size 4
    --global-batch-size 256
    --lr $LR
    --train-iters 50000
    --lr-warmup-iters 500
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95)
# A flag only in a comment or an unused array is not the run's.
unused_args=(--micro-batch-size 64)

parallel_args=(
\t--tensor-model-parallel-size 2
\t--pipeline-model-parallel-size 1
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \\
    "${model_args[@]}" \\
    "${training_args[@]}" \\
    "${parallel_args[@]}" \\
    --save $CHECKPOINT_PATH
"""


def test_megatron_defaults_from_the_environment_and_bash_arrays_are_read_and_written(tmp_path):
    path = tmp_path / "train_gpt.sh"
    path.write_text(LAUNCH)
    result = plan_config(str(path), reference={}, target={"devices": 8, "nodes": 4}, data={})
    plan = result.plan
    # 4 per device × (16 ranks ÷ tp 2) × 8 accumulation steps = 256; on 32 ranks keeping per-device doubles it.
    assert (plan.reference_global_batch_size, plan.global_batch_size, plan.accumulation_steps) == (256, 512, 8)
    assert plan.lr == pytest.approx(3e-4 * 2 ** 0.5, rel=1e-5)
    # The defaults are edited where they stand (the environment can still set them); the arrays in place.
    assert 'NUM_NODES=${NUM_NODES:-4}\n' in result.text and 'LR="${LR:-0.000424264}"\n' in result.text
    assert "    --global-batch-size 512\n" in result.text and "    --adam-beta2 0.9025)\n" in result.text
    assert "unused_args=(--micro-batch-size 64)" in result.text
    # Read back, the written script is the plan's reference.
    written = tmp_path / "planned.sh"
    written.write_text(result.text)
    again = plan_config(str(written), reference={}, target={"devices": 8, "nodes": 4}, data={})
    assert (again.plan.reference_global_batch_size, again.config_changes) == (512, {})
    assert again.plan.lr == pytest.approx(plan.lr, rel=1e-5)


def test_a_value_is_written_where_the_command_reads_it_or_not_at_all(tmp_path, capsys):
    # A flag in a comment before the command's is not where the value is written.
    path, out = tmp_path / "train.sh", tmp_path / "planned.sh"
    path.write_text("# tried --lr 1e-3 first\ntorchrun --nproc_per_node 4 pretrain_gpt.py --micro-batch-size 4 "
                    "--lr 1e-4\n")
    result = plan_config(str(path), reference={}, target={"devices": 16}, data={})
    assert "# tried --lr 1e-3 first\n" in result.text and "--lr 0.0002 " in result.text
    # An array the command never expands, before the one it does: the value would land in the wrong one, so the
    # plan is refused in one line and nothing is written.
    path.write_text("old_args=(--micro-batch-size 64 --lr 1e-3)\nargs=(--micro-batch-size 4 --lr 1e-4)\n"
                    "torchrun --nproc_per_node 4 pretrain_gpt.py \"${args[@]}\"\n")
    assert plan_config(str(path), reference={}, target={"devices": 4}, data={}).plan.lr == 1e-4
    assert main(["plan", "--config", str(path), "--devices", "16", "--write-config", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the planned values could not be written into its layout" in err, err
    assert not out.exists()


@pytest.mark.parametrize("name, text, key, meant", [
    ("ds_config.json", '{"train_micro_batch_size_per_gpu": 8, "gradient_acumulation_steps": 4, '
                       '"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}',
     "gradient_acumulation_steps", "gradient_accumulation_steps"),
    ("ds_config.json", '{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, '
                       '"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decya": 0.1}}}',
     "optimizer.params.weight_decya", "optimizer.params.weight_decay"),
    ("train.sh", "torchrun --nproc_per_node 8 pretrain_gpt.py --micro-batch-size 4 --global-batch-sise 64 "
                 "--lr 1e-4\n", "--global-batch-sise", "--global-batch-size"),
])
def test_a_misspelt_key_is_a_warning_naming_both_spellings(name, text, key, meant, tmp_path):
    # The framework ignores the key, and so does the plan: said, not silently planned around.
    path = tmp_path / name
    path.write_text(text)
    result = plan_config(str(path), reference={"devices": 8}, target={"devices": 16}, data={})
    said = [w for w in result.plan.warnings if "misspelling" in w]
    assert len(said) == 1 and key in said[0] and meant in said[0], result.plan.warnings


def test_a_file_no_format_recognises_is_refused_in_its_parsers_words(tmp_path, capsys):
    # A DeepSpeed JSON with a missing comma: the JSON error and its line, not a guess at the format.
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "train_batch_size": 64,\n  "train_micro_batch_size_per_gpu": 8\n'
                    '  "gradient_accumulation_steps": 4\n}\n')
    assert main(["plan", "--config", str(path), "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert "is not JSON (Expecting ',' delimiter: line 4 column 3" in err and "no known format" not in err, err
