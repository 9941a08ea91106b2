"""ddplab plan under a device mesh: only data-parallel ranks add samples, and every rule counts them (no torch)."""

import doctest
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddplab.cli.main import flags, main
from ddplab.errors import UsageError
from ddplab.plan import mesh
from ddplab.plan.planner import Data, Reference, Target, plan
from ddplab.runtime.timescale import scaled

# torchtitan's shape: 2 nodes × 8 GPUs with tensor parallelism 2, from one GPU's AdamW run at batch 8.
TITAN = ["--ref-batch-size", "8", "--ref-lr", "3e-4", "--optimizer", "adamw", "--rule", "sqrt", "--devices", "8",
         "--nodes", "2", "--tp", "2"]


def _json(argv, capsys) -> dict:
    capsys.readouterr()
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _exit_2(argv, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(["plan", *argv]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") <= 2
    return err


def test_the_mesh_formulas_by_hand():
    result = doctest.testmod(mesh)
    assert result.failed == 0 and result.attempted >= 10
    assert mesh.data_parallel_size(world_size=16, tensor_parallel_size=2) == 8
    assert mesh.data_parallel_size(world_size=64, tensor_parallel_size=4, pipeline_parallel_size=2,
                                   context_parallel_size=2) == 4
    assert not mesh.divides(world_size=16, tensor_parallel_size=3)
    with pytest.raises(ValueError):
        mesh.data_parallel_size(world_size=16, tensor_parallel_size=3)
    assert mesh.global_batch_size(per_device_batch_size=8, data_parallel_size=8, accumulation_steps=2) == 128
    assert mesh.tokens_per_step(global_batch_size=64, seq_len=4096) == 262_144
    assert mesh.shard_size(data_parallel_size=16, replicate_size=2) == 8
    with pytest.raises(ValueError):
        mesh.shard_size(data_parallel_size=8, replicate_size=3)


def test_torchtitan_shaped_plan_counts_data_parallel_ranks_not_the_world(capsys):
    out = _json([*TITAN, "--seq-len", "4096"], capsys)
    # world = 2 nodes × 8 = 16 ranks; dp = 16 ÷ tp 2 = 8; global batch = 8 per device × 8 × 1 accumulation = 64.
    # Reference: 8 × 1 device × 1 = 8, so k = 64/8 = 8 and the square-root rule gives lr = 3e-4 × √8 = 8.4853e-4.
    assert (out["world_size"], out["data_parallel_size"], out["tensor_parallel_size"]) == (16, 8, 2)
    assert (out["global_batch_size"], out["reference_global_batch_size"], out["batch_ratio"]) == (64, 8, 8)
    assert out["reference_data_parallel_size"] == 1
    assert out["lr"] == pytest.approx(3e-4 * math.sqrt(8), rel=1e-12) == pytest.approx(8.48528137e-4)
    # Scaled by the world size instead (k = 16), the lr would be 3e-4 × 4 = 1.2e-3: √2 too high.
    assert out["lr"] < 3e-4 * math.sqrt(16) / 1.41
    # Adam's settings follow the same k = 8: β₂^8, ε/√8, λ × 8/√8.
    assert out["betas"] == [0.9, 0.999 ** 8] and out["eps"] == pytest.approx(1e-8 / math.sqrt(8), rel=1e-12)
    assert out["weight_decay"] == pytest.approx(0.01 * 8 / math.sqrt(8), rel=1e-12)
    # Tokens: 64 × 4096 = 262,144 per step; the reference's 8 × 4096 = 32,768.
    assert (out["tokens_per_step"], out["reference_tokens_per_step"]) == (262_144, 32_768)
    reasons = out["reasons"]
    assert reasons["data_parallel_size"].startswith("data-parallel degree 8 = 16 ranks ÷ tp 2: tp ranks split each "
                                                    "layer of the same samples, adding none to the batch")
    assert reasons["global_batch_size"] == "8 per device × data-parallel degree 8 × 1 accumulation step"
    assert "16 ranks ×" not in reasons["global_batch_size"]
    assert reasons["per_device_batch_size"] == ("keep per-device: the reference's per-device batch, so the global "
                                                "batch grows ×8: data-parallel degree 1 → 8 (not the world size)")
    assert reasons["lr_multiplier"].endswith("k counts data-parallel ranks: counting all 16 ranks would make k 16 and "
                                             "the lr ×4, 1.414× too high")
    assert reasons["tokens_per_step"] == "global batch 64 × --seq-len 4096; the reference's: 8 × 4096 = 32,768"


def test_json_keys_for_target_and_reference(capsys):
    out = _json(TITAN, capsys)
    for key in ("world_size", "data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
                "context_parallel_size", "strategy", "data_parallel_replicate_size", "data_parallel_shard_size",
                "tokens_per_step", "reference_data_parallel_size", "reference_tokens_per_step"):
        assert key in out, key
    assert out["tokens_per_step"] is None and out["reference_tokens_per_step"] is None
    assert (out["strategy"], out["data_parallel_replicate_size"], out["data_parallel_shard_size"]) == ("ddp", 8, 1)
    # Plain DDP too: the keys are always there.
    plain = _json(["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8"], capsys)
    assert (plain["data_parallel_size"], plain["reference_data_parallel_size"]) == (8, 1)
    assert plain["tokens_per_step"] is None


def test_the_table_shows_the_data_parallel_degree_only_under_a_mesh(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    assert main(["plan", *TITAN, "--seq-len", "4096"]) == 0
    text = capsys.readouterr().out
    assert "data-parallel degree 8 = 16 ranks ÷ tp 2" in text
    assert [line.split("│")[2].strip() for line in text.splitlines() if "│ tokens per step" in line] == ["262,144"]
    assert main(["plan", "--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8"]) == 0
    assert "data-parallel degree" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (TITAN[:-1] + ["3"], "16 ranks (2 nodes × 8 devices) do not split into tp 3 × pp 1 × cp 1: choose --tp, --pp "
                         "and --cp whose product divides 16"),
    (TITAN + ["--pp", "4", "--cp", "4"], "16 ranks (2 nodes × 8 devices) do not split into tp 2 × pp 4 × cp 4"),
    (TITAN[:-1] + ["0"], "--tp must be a positive integer, got 0"),
    (TITAN + ["--pp", "0"], "--pp must be a positive integer, got 0"),
    (TITAN + ["--cp", "-1"], "--cp must be a positive integer, got -1"),
    (TITAN + ["--ref-tp", "0"], "--ref-tp must be a positive integer, got 0"),
    (TITAN + ["--ref-devices", "2", "--ref-tp", "4"],
     "2 ranks (1 node × 2 devices) do not split into tp 4 × pp 1 × cp 1: choose --ref-tp, --ref-pp and --ref-cp"),
    (TITAN + ["--ref-tp", "2"], "1 rank (1 node × 1 device) does not split into tp 2 × pp 1 × cp 1"),
    (TITAN + ["--ref-devices", "2", "--ref-wrapper", "dp", "--ref-cp", "2"],
     "--ref-wrapper dp is one process, which has no device mesh"),
    (TITAN + ["--replicate", "2"], "--replicate is HSDP's replicate degree and --strategy ddp has none: pass "
                                   "--strategy hsdp, or drop --replicate"),
    (TITAN + ["--strategy", "fsdp", "--replicate", "2"], "--strategy fsdp has none"),
    (TITAN + ["--strategy", "hsdp", "--replicate", "3"],
     "--replicate 3 does not divide the data-parallel degree 8: HSDP's data-parallel ranks are replicate × shard"),
    (TITAN + ["--strategy", "hsdp", "--replicate", "0"], "--replicate must be a positive integer, got 0"),
    (TITAN + ["--seq-len", "0"], "--seq-len must be a positive integer, got 0"),
    (TITAN + ["--batch-size", "8", "--accumulation", "2", "--global-batch-size", "256"],
     "--batch-size 8 × 8 data-parallel ranks × --accumulation 2 = 128, not --global-batch-size 256"),
])
def test_bad_mesh_input_is_one_line_and_exit_2(argv, message, capsys):
    assert message in _exit_2(argv, capsys)


def test_a_python_caller_reads_the_mesh_fields():
    with pytest.raises(UsageError) as info:
        Target(devices=8, nodes=2, tensor_parallel_size=3)
    assert str(info.value) == ("16 ranks (2 nodes × 8 devices) do not split into tp 3 × pp 1 × cp 1: choose "
                               "target.tensor_parallel_size, target.pipeline_parallel_size and "
                               "target.context_parallel_size whose product divides 16")
    with pytest.raises(UsageError, match="target.data_parallel_replicate_size is HSDP's"):
        Target(devices=8, strategy="fsdp", data_parallel_replicate_size=2)
    with pytest.raises(UsageError, match="target.strategy must be one of ddp, fsdp, hsdp"):
        Target(devices=8, strategy="zero3")


ACCUMULATE = TITAN + ["--accumulation", "4"]


def test_the_strategy_changes_no_number_only_how_to_accumulate(capsys):
    runs = {strategy: _json([*ACCUMULATE, "--strategy", strategy], capsys) for strategy in mesh.STRATEGIES}
    words = ("strategy", "data_parallel_replicate_size", "data_parallel_shard_size", "reasons")
    numbers = [{key: value for key, value in run.items() if key not in words} for run in runs.values()]
    assert numbers[0] == numbers[1] == numbers[2]
    # 8 per device × dp 8 × 4 accumulation steps = 256; k = 256/8 = 32.
    assert (numbers[0]["global_batch_size"], numbers[0]["lr"]) == (256, pytest.approx(3e-4 * math.sqrt(32)))
    ddp, fsdp, hsdp = (runs[name]["reasons"]["accumulation_steps"] for name in ("ddp", "fsdp", "hsdp"))
    assert ddp == "given by --accumulation"
    assert fsdp == ("given by --accumulation; under fsdp there is no no_sync(): call "
                    "model.set_requires_gradient_sync(False) on the micro-steps before the last (it skips their "
                    "reduce-scatter and keeps unsharded gradients in memory until the last micro-step reduces them) "
                    "and True on the last")
    assert "under hsdp there is no no_sync()" in hsdp and "reduce-scatter and the all-reduce" in hsdp
    assert ("set_requires_all_reduce(False) defers only the all-reduce across the replicas: each micro-step still "
            "reduce-scatters within its shard group, so gradients stay sharded") in hsdp
    assert "one FSDP2 process per device" in runs["fsdp"]["reasons"]["world_size"]
    assert "fsdp (FSDP2's fully_shard) shards parameters" in runs["fsdp"]["reasons"]["data_parallel_size"]
    assert (runs["fsdp"]["data_parallel_replicate_size"], runs["fsdp"]["data_parallel_shard_size"]) == (1, 8)
    assert (runs["hsdp"]["data_parallel_replicate_size"], runs["hsdp"]["data_parallel_shard_size"]) == (None, None)
    # Without accumulation there is nothing to skip: no advice.
    single = _json([*TITAN, "--strategy", "fsdp"], capsys)
    assert single["reasons"]["accumulation_steps"] == "kept from the reference"


def test_hsdp_replicate_degree_is_shown_and_changes_no_number(capsys):
    split = _json([*ACCUMULATE, "--strategy", "hsdp", "--replicate", "2"], capsys)
    whole = _json([*ACCUMULATE, "--strategy", "hsdp"], capsys)
    # dp 8 = replicate 2 × shard 4.
    assert (split["data_parallel_replicate_size"], split["data_parallel_shard_size"]) == (2, 4)
    assert split["reasons"]["data_parallel_size"].endswith(
        "all-reduces across the replicas: replicate 2 × shard 4 (shard degree = 8 ÷ --replicate 2)")
    assert "pass --replicate to show the split" in whole["reasons"]["data_parallel_size"]
    assert (split["global_batch_size"], split["lr"]) == (whole["global_batch_size"], whole["lr"]) == (256, whole["lr"])


def test_fsdp_without_a_mesh_explains_its_data_parallel_ranks(capsys):
    out = _json(["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8", "--strategy", "fsdp"], capsys)
    assert out["reasons"]["data_parallel_size"].startswith("data-parallel degree 8 = 8 ranks, each loading its own "
                                                           "batch; fsdp (FSDP2's fully_shard) shards")
    assert (out["global_batch_size"], out["lr"]) == (256, 0.8)


def test_a_reference_mesh_counts_its_data_parallel_ranks_too():
    # Reference: 2 devices with tp 2 is one data-parallel rank: 8 × 1 × 1 = 8. Target: 16 ranks ÷ tp 2 = 8 → 64.
    ref = Reference(per_device_batch_size=8, lr=3e-4, optimizer="adamw", devices=2, tensor_parallel_size=2)
    assert (ref.data_parallel_size, ref.global_batch_size) == (1, 8)
    p = plan(ref, Target(devices=8, nodes=2, tensor_parallel_size=2))
    assert (p.reference_data_parallel_size, p.global_batch_size, p.batch_ratio) == (1, 64, 8)
    assert p.reasons["reference_global_batch_size"] == ("8 per device × data-parallel degree 1 (2 ranks ÷ tp 2) × "
                                                        "1 accumulation step")
    # The same tp on both sides: counting every rank would have scaled both by 2, so there is no overshoot to name.
    assert "counting all" not in p.reasons["lr_multiplier"]
    # Reference tp 4 on 8 devices (dp 2), target tp 2 on 8 (dp 4): k = 2, and counting ranks would give k = 1.
    q = plan(Reference(per_device_batch_size=8, lr=0.1, devices=8, tensor_parallel_size=4), Target(devices=8,
             tensor_parallel_size=2, rule="linear"))
    assert (q.batch_ratio, q.lr) == (2, 0.2)
    assert q.reasons["lr_multiplier"].endswith("counting all 8 ranks would make k 1 and the lr ×1, 0.5× too low")


def test_trajectory_and_step_counts_split_over_data_parallel_ranks():
    # Reference: 32 × 8 devices = 256. Target: 16 ranks ÷ (tp 2 × pp 2) = 4 data-parallel ranks, at most 16 each:
    # 256 / 4 = 64 per rank = 16 per device × 4 accumulation steps.
    ref = Reference(per_device_batch_size=32, lr=0.1, devices=8)
    target = Target(devices=8, nodes=2, tensor_parallel_size=2, pipeline_parallel_size=2, keep="trajectory",
                    max_batch_size_per_device=16)
    p = plan(ref, target, Data(dataset_size=1000), names=flags())
    assert (p.data_parallel_size, p.per_device_batch_size, p.accumulation_steps, p.global_batch_size, p.lr) == (
        4, 16, 4, 256, 0.1)
    assert p.reasons["accumulation_steps"] == ("the fewest accumulation steps that reach 256 with 16 per device on "
                                               "4 data-parallel ranks")
    # DistributedSampler's num_replicas is the data-parallel degree: ceil(1000/4) = 250 per rank, 16 loader batches.
    assert (p.samples_per_rank, p.loader_batches_per_rank, p.steps_per_epoch) == (250, 16, 4)
    assert p.reasons["samples_per_rank"] == ("DistributedSampler gives each data-parallel rank ceil(1000/4), "
                                             "padding by repetition")
    assert p.reasons["data_parallel_size"].startswith("data-parallel degree 4 = 16 ranks ÷ (tp 2 × pp 2): tp ranks "
                                                      "split each layer, pp ranks hold successive stages")
    # 100 samples do not split over 16 ranks ÷ tp 2 = 8 data-parallel ranks: 96 or 104 do.
    with pytest.raises(UsageError) as info:
        plan(Reference(per_device_batch_size=100, lr=0.1), Target(devices=8, nodes=2, tensor_parallel_size=2,
                                                                   keep="trajectory"))
    assert str(info.value) == ("a data-parallel degree of 8 (16 ranks ÷ tp 2) cannot split a global batch of 100 "
                               "evenly; use a global batch of 96 or 104")


def test_a_summed_loss_is_averaged_over_data_parallel_ranks():
    p = plan(Reference(per_device_batch_size=8, lr=0.1, reduction="sum"), Target(devices=8, nodes=2,
             tensor_parallel_size=2, strategy="fsdp"))
    assert any(w.startswith("reduction='sum': FSDP2 averages gradients over data-parallel ranks, so its gradient is "
                            "1/8 of the single-process sum; multiply the loss by the data-parallel degree")
               for w in p.warnings)


def test_context_parallel_ranks_add_no_tokens():
    # 16 ranks ÷ cp 4 = 4 data-parallel ranks: 2 per device × 4 = 8 sequences of 8192 = 65,536 tokens per step.
    p = plan(Reference(per_device_batch_size=2, lr=1e-3, optimizer="adam"),
             Target(devices=8, nodes=2, context_parallel_size=4), Data(seq_len=8192))
    assert (p.data_parallel_size, p.global_batch_size, p.tokens_per_step, p.reference_tokens_per_step) == (
        4, 8, 65_536, 16_384)
    assert p.reasons["tokens_per_step"].endswith("each of the 4 context-parallel ranks holds 1/4 of every sequence, "
                                                 "adding none")


meshes = st.fixed_dictionaries({
    "batch": st.integers(1, 64), "accumulation": st.integers(1, 4), "data_parallel": st.integers(1, 16),
    "tp": st.sampled_from([1, 2, 4, 8]), "pp": st.sampled_from([1, 2, 4]), "cp": st.sampled_from([1, 2]),
    "optimizer": st.sampled_from(["sgd", "adam", "adamw"]), "keep": st.sampled_from(["per-device", "trajectory"]),
    "strategy": st.sampled_from(mesh.STRATEGIES), "dataset_size": st.one_of(st.none(), st.integers(64, 100_000)),
    "rule": st.sampled_from(["auto", "none", "linear", "sqrt", "surge"]),
})


@settings(max_examples=200, deadline=None)
@given(c=meshes)
def test_a_mesh_plans_as_ddp_on_its_data_parallel_ranks(c):
    # tp × pp × cp ranks add no samples: d data-parallel ranks in a mesh plan exactly as d plain DDP ranks.
    surge = c["rule"] == "surge"
    # The surge rule is Adam's, and reads a noise scale.
    ref = Reference(per_device_batch_size=c["batch"], lr=1e-3, noise_scale=128 if surge else None,
                    optimizer="adam" if surge and c["optimizer"] == "sgd" else c["optimizer"])
    d, rule = c["data_parallel"], c["rule"]
    data = Data(dataset_size=c["dataset_size"]) if c["dataset_size"] and c["dataset_size"] >= d else Data()
    plain = _plan_or_error(ref, Target(devices=d, accumulation_steps=c["accumulation"], keep=c["keep"], rule=rule),
                           data)
    meshed = _plan_or_error(ref, Target(devices=d * c["tp"] * c["pp"] * c["cp"], tensor_parallel_size=c["tp"],
                                        pipeline_parallel_size=c["pp"], context_parallel_size=c["cp"],
                                        strategy=c["strategy"], accumulation_steps=c["accumulation"], keep=c["keep"],
                                        rule=rule), data)
    assert meshed == plain


def _plan_or_error(reference, target, data):
    """The plan's numbers, or "error" where the plan refuses (the mesh must refuse exactly where DDP does)."""
    try:
        result = plan(reference, target, data).to_json()
    except UsageError:
        return "error"
    words = {"world_size", "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "strategy",
             "data_parallel_replicate_size", "data_parallel_shard_size", "reasons", "other_mode", "warnings"}
    return {key: value for key, value in result.items() if key not in words}


def test_plan_with_a_mesh_never_imports_torch():
    code = ("import sys, contextlib, io\nfrom ddplab.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['plan', '--ref-batch-size', '8', '--ref-lr', '3e-4', '--optimizer', 'adamw', '--devices', '8', "
            "'--nodes', '2', '--tp', '2', '--strategy', 'hsdp', '--replicate', '2', '--accumulation', '2', "
            "'--seq-len', '4096'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=scaled(60))


def test_the_plan_the_audit_and_the_runtime_read_one_mesh_the_same_way():
    # One value for the degrees: the plan's target, the audit's reading of a program's DeviceMesh and HSDP's mesh.
    from ddplab.auditor.meshes import layout
    from ddplab.parallel_dims import ParallelDims
    from ddplab.runtime.config import ParallelismConfig
    from ddplab.runtime.strategies.hsdp import HSDPStrategy

    planned = ParallelDims(devices=8, nodes=2, tensor_parallel_size=2, context_parallel_size=2, replicate_size=2)
    assert (planned.world_size, planned.data_parallel_size, planned.shard_size) == (16, 4, 2)
    assert planned.mesh_shape() == {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}
    # The same 16 ranks as a program builds them: (dp_replicate, dp_shard, cp, tp), ranks in row-major order.
    grid = [[[[r * 8 + s * 4 + c * 2 + t for t in range(2)] for c in range(2)] for s in range(2)] for r in range(2)]
    averaged = {0, 4, 8, 12}  # rank 0's replicate × shard group
    read = layout(grid, ["dp_replicate", "dp_shard", "cp", "tp"], 0, averaged, True).dims
    assert read.mesh_shape() == planned.mesh_shape()
    assert (read.data_parallel_size, read.shard_size, read.model_parallel_size) == (4, 2, 4)
    built = HSDPStrategy(replicate=2).dims(4)
    assert (built.replicate_size, built.shard_size, built.data_parallel_size) == (2, 2, 4)
    assert ParallelismConfig(strategy="hsdp", replicate=2).strategy_text(4) == "hsdp: 2 replicas × 2 shards"
    # Pipeline stages add no samples, a dimension the gradients are not averaged over is model-parallel.
    staged = ParallelDims.from_mesh({"pp": 2, "dp": 4, "tp": 2}, data=["dp"], pipeline=["pp"])
    assert (staged.data_parallel_size, staged.pipeline_parallel_size, staged.tensor_parallel_size) == (4, 2, 2)
    with pytest.raises(ValueError, match="replicate 3 does not divide the data-parallel degree 4"):
        _ = ParallelDims(devices=4, replicate_size=3).shard_size


def test_a_launch_script_whose_degrees_do_not_fit_its_world_says_so_in_its_degrees(tmp_path, capsys):
    # GPT-3 175B's launch script read without its reference hardware: tp 8 × pp 16 on the 8 ranks of one node.
    from ddplab.cli.main import main

    script = tmp_path / "gpt3_175b.sh"
    script.write_text("torchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size 8 "
                      "--pipeline-model-parallel-size 16 --micro-batch-size 1 --global-batch-size 1536 --lr 6e-5\n")
    assert main(["plan", "--config", str(script), "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert "tp 8 × pp 16 = 128 ranks do not fit on 8" in err and "degree 0" not in err, err
