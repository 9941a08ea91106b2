"""ddplab check -- COMMAND on programs written in the shapes real projects use (programs/), each correct and with one
planted mistake, under torchrun: one launch pair per program, every property it shows checked on it.

A correct program must be EQUIVALENT; a planted one DIVERGES with the cause and ratios a hand computation gives.
"""

import importlib.util
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from ddplab.cli.main import main

PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "{world_size}"]


def _check(capsys, program, *args, flags=()):
    code = main(["check", "--json", "--steps", "2", *flags, "--", *TORCHRUN, os.path.join(PROGRAMS, program),
                 *args])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def _classifier(capsys, *args, flags=()):
    return _check(capsys, "classifier.py", "--batch-size", "{per_device_batch_size}", *args, flags=flags)


def _step0(result):
    return result["per_step"][0]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_correct_classifier_is_equivalent_on_ddp_and_fsdp2_with_dropout_turned_off_and_said(capsys, strategy):
    result = _classifier(capsys, "--strategy", strategy)
    assert result["verdict"] == "EQUIVALENT" and result["cause"] is None
    assert result["first_divergent_step"] is None
    assert len(result["per_step"]) == 2 and all(step["agrees"] for step in result["per_step"])
    for step in result["per_step"]:
        assert step["gradient_ratio"] == pytest.approx(1, abs=1e-5) and step["cosine"] > 1 - 1e-9
        assert step["difference"] <= result["tolerance"] == 1e-4
        assert step["update"]["gradient_ratio"] == pytest.approx(1, abs=1e-4)
    assert set(_step0(result)["modules"]) == {"features", "head"}
    # The first global batch: the same 16 DistributedSampler indices on both sides.
    assert result["samples"] == {"compared": True, "same": True, "shared": 16, "size": 16, "how": "indices",
                                 "ranks_inconsistent": False, "why": None}
    assert any("dropout (p = 0.1) was turned off" in note for note in result["notes"])
    assert result["audit_findings"] == []
    ranks, one = result["runs"]
    assert (ranks["side"], one["side"]) == ("ranks", "one process")
    assert "--nproc_per_node" in ranks["command"] and ranks["command"][ranks["command"].index("--batch-size") + 1] \
        == "8" and one["command"][one["command"].index("--batch-size") + 1] == "16"
    assert ranks["returncode"] == one["returncode"] == 0
    assert result["check_s"] >= ranks["seconds"] + one["seconds"] > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, world_size", [("ddp", 2), ("fsdp", 2), ("hsdp", 4)])
def test_a_summed_loss_is_sum_reduction_with_a_gradient_of_exactly_one_over_w(capsys, strategy, world_size):
    result = _classifier(capsys, "--strategy", strategy, "--mistake", "sum", flags=("--world-size", str(world_size)))
    assert (result["verdict"], result["cause"], result["first_divergent_step"]) == ("DIVERGES", "SUM_REDUCTION", 0)
    step = _step0(result)
    # DDP, FSDP2 and HSDP average W per-rank sums of b: 1/W of one process's sum over W·b.
    assert step["gradient_ratio"] == pytest.approx(1 / world_size, rel=1e-5)
    assert step["cosine"] > 1 - 1e-6
    # SGD: the update is the gradient's scale too (momentum starts from the first gradient).
    assert step["update"]["gradient_ratio"] == pytest.approx(1 / world_size, rel=1e-3)
    assert all(m["gradient_ratio"] == pytest.approx(1 / world_size, rel=1e-5) for m in step["modules"].values())
    assert [f["code"] for f in result["audit_findings"]] == ["SUM_REDUCTION"]
    assert f"1/{world_size} of the one process's" in result["explanation"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sampler_seeded_per_rank_is_named_with_the_samples_the_two_sides_share(capsys):
    result = _classifier(capsys, "--mistake", "seed-per-rank")
    # The audit beside the split run saw the samplers' seeds differ: the cause has its name.
    assert (result["verdict"], result["cause"]) == ("DIVERGES", "SAMPLER_SEEDED_PER_RANK")
    assert "SAMPLER_SEEDED_PER_RANK" in [f["code"] for f in result["audit_findings"]]
    # Rank 0's seed is the reference's: its 8 samples are shared; rank 1 draws 8 from another order.
    assert result["samples"]["compared"] and not result["samples"]["same"]
    assert result["samples"]["shared"] < 16 and result["samples"]["size"] == 16
    assert f"share {result['samples']['shared']} of 16" in result["explanation"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_lr_multiplied_by_the_world_size_shows_in_the_updates_while_the_gradients_agree(capsys):
    result = _classifier(capsys, "--mistake", "lr-times-world")
    assert (result["verdict"], result["cause"]) == ("DIVERGES", "LR_SCALED_BY_WORLD_SIZE")
    step = _step0(result)
    assert step["gradient_ratio"] == pytest.approx(1, abs=1e-5) and step["difference"] < 1e-4
    assert step["update"]["gradient_ratio"] == pytest.approx(2, rel=1e-3) and step["update"]["cosine"] > 0.999


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ranks_that_never_average_their_gradients_are_no_allreduce(capsys):
    result = _classifier(capsys, "--mistake", "no-ddp")
    assert (result["verdict"], result["cause"]) == ("DIVERGES", "NO_ALLREDUCE")
    assert "NOT_DISTRIBUTED" in [f["code"] for f in result["audit_findings"]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_micro_batch_means_never_divided_by_the_accumulation_steps_are_k_times_the_gradient(capsys):
    """Equal micro-batches: each mean undivided is exactly K times the step's mean, a pure scale the audit cannot tell
    from a constant of the program's; check names it with the audit's name for it."""
    result = _classifier(capsys, "--grad-accum", "{accumulation_steps}", "--mistake", "accum-undivided",
                         flags=("--accumulation", "2"))
    assert (result["verdict"], result["cause"]) == ("DIVERGES", "ACCUMULATION_NOT_DIVIDED")
    step = _step0(result)
    assert step["gradient_ratio"] == pytest.approx(2, rel=1e-5) and step["cosine"] > 1 - 1e-6
    assert "2× is the accumulation steps" in result["explanation"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("gather", ["autograd", "no-grad", "local"])
def test_a_clip_loss_over_gathered_features_each_way(capsys, gather):
    result = _check(capsys, "clip.py", "--batch-size", "{per_device_batch_size}", "--gather", gather)
    modules = _step0(result)["modules"]
    if gather == "autograd":
        assert result["verdict"] == "EQUIVALENT"
        return
    assert result["verdict"] == "DIVERGES" and modules["logit_scale"]["gradient_ratio"] == pytest.approx(1, abs=1e-6)
    if gather == "no-grad":
        # Each rank's loss reaches only its own slice: the towers get 1/W, the scale (used on all logits) all of it.
        assert result["cause"] == "GATHERED_LOSS_WITHOUT_WORLD_SIZE"
        for tower in ("visual", "text"):
            assert modules[tower]["gradient_ratio"] == pytest.approx(0.5, rel=1e-5)
            assert modules[tower]["cosine"] > 1 - 1e-6
    else:
        # Terms missing, not a scale: the towers' gradients point elsewhere, as the audit beside it measured.
        assert result["cause"] == "GATHERED_TERMS_MISSING"
        assert max(modules["visual"]["cosine"], modules["text"]["cosine"]) < 0.99


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("reduce", ["avg", "avg-buffer", "sum"])
def test_an_optimizer_that_reduces_the_gradients_itself_is_read_after_its_reduction(capsys, reduce):
    result = _check(capsys, "handwritten_dp.py", "--batch-size", "{per_device_batch_size}", "--reduce", reduce)
    step = _step0(result)
    if reduce == "avg":
        assert result["verdict"] == "EQUIVALENT" and step["gradient_ratio"] == pytest.approx(1, abs=1e-5)
        return
    if reduce == "avg-buffer":
        # Each rank's .grad is its own at the step, yet the ranks update alike: judged by the updates, and said.
        assert result["verdict"] == "EQUIVALENT", result["explanation"]
        assert step["update"]["gradient_ratio"] == pytest.approx(1, abs=1e-4) and step["update"]["cosine"] > 0.9999
        assert any("buffers of its own" in note for note in result["notes"])
        return
    # A sum of W averaged-per-rank gradients without ÷ W: W times one process's mean.
    assert (result["verdict"], result["cause"]) == ("DIVERGES", "GRADIENT_SCALE")
    assert step["gradient_ratio"] == pytest.approx(2, rel=1e-5) and step["cosine"] > 1 - 1e-6
    assert "2×" in result["explanation"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("normalise", ["global", "micro-mean"])
def test_a_padded_lm_under_accumulation_against_its_exact_gradient(capsys, normalise):
    result = _check(capsys, "token_lm.py", "--batch-size", "{per_device_batch_size}", "--grad-accum",
                    "{accumulation_steps}", "--normalise", normalise, flags=("--accumulation", "2"))
    assert result["accumulation_steps"] == 2 and result["per_device_batch_size"] == 4
    step = _step0(result)
    if normalise == "global":
        assert result["verdict"] == "EQUIVALENT" and step["gradient_ratio"] == pytest.approx(1, abs=1e-5)
        return
    assert (result["verdict"], result["cause"]) == ("DIVERGES", "LOSS_NORMALISED_PER_MICRO_BATCH")
    ratio, cosine = _micro_mean_against_global_mean()
    assert step["gradient_ratio"] == pytest.approx(ratio, rel=1e-4)
    # The cosine comes from sketches: its error is a few percent of 1 - cos.
    assert 1 - step["cosine"] == pytest.approx(1 - cosine, rel=0.15)


def _micro_mean_against_global_mean() -> tuple[float, float]:
    """The first step's gradient of token_lm.py --normalise micro-mean on 2 ranks × 4 × 2 micro-batches against one
    process's global token mean over the same 16 sequences, computed here in one process: (ratio, cosine)."""
    sys.path.insert(0, PROGRAMS)
    try:
        import token_lm
    finally:
        sys.path.remove(PROGRAMS)
    data = token_lm.sequences(512, seed=1)
    torch.manual_seed(0)
    model = token_lm.TinyLM()

    def gradient(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]).double()

    def order(world, rank):
        return list(DistributedSampler(data, num_replicas=world, rank=rank, seed=0, shuffle=True))

    def token_loss(indices, reduction):
        inputs, labels = token_lm.collate([data[i] for i in indices])
        return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction=reduction)

    # The ranks: each micro-batch's own mean ÷ 2 accumulation steps, then DDP's average over the 2 ranks.
    ranks = sum(token_loss(order(2, r)[m * 4:(m + 1) * 4], "mean") / 2 for r in range(2) for m in range(2)) / 2
    split = gradient(ranks)
    first = order(1, 0)[:16]
    one = gradient(token_loss(first, "sum") / sum(len(data[i]) - 1 for i in first))
    return float(split.norm() / one.norm()), float(split @ one / (split.norm() * one.norm()))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mistake", ["none", "sum"])
def test_under_bfloat16_autocast_rounding_is_told_from_a_mistake(capsys, mistake):
    result = _classifier(capsys, "--autocast", "--mistake", mistake)
    assert result["tolerance"] == 5e-2 and any("half precision" in note for note in result["notes"])
    step = _step0(result)
    if mistake == "none":
        # bfloat16's rounding of two batch splits: above float32's 1e-4, far below the tolerance.
        assert (result["verdict"], result["cause"]) == ("ROUNDING", "REDUCE_PRECISION")
        assert 1e-4 < step["difference"] < 5e-2
        return
    assert (result["verdict"], result["cause"]) == ("DIVERGES", "SUM_REDUCTION")
    assert step["gradient_ratio"] == pytest.approx(0.5, rel=1e-2)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sampler", ["distributed", "random"])
def test_a_lightning_module_whose_backward_runs_inside_the_optimizer_step(capsys, sampler):
    result = _check(capsys, "lightning_classifier.py", "--devices", "{world_size}", "--batch-size",
                    "{per_device_batch_size}", "--sampler", sampler)
    if sampler == "distributed":
        assert result["verdict"] == "EQUIVALENT"
        assert _step0(result)["gradient_ratio"] == pytest.approx(1, abs=1e-5)
        assert result["samples"]["how"] == "indices" and result["samples"]["same"]
        return
    # One device shuffles with a RandomSampler: another first batch, seen in the inputs, and said, not judged.
    assert (result["verdict"], result["cause"]) == ("INCOMPARABLE", "SAMPLES_DIFFER")
    assert result["samples"]["how"] == "inputs" and not result["samples"]["ranks_inconsistent"]
    assert result["samples"]["shared"] < 16


DEEPSPEED_CORPUS = os.path.join(os.path.dirname(PROGRAMS), os.pardir, "deepspeed", "corpus")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage, loss", [(0, "divided-by-accum"), (2, "mean")])
def test_a_deepspeed_engine_loop_is_compared_at_zero_0_and_refused_where_it_steps_flat_partitions(
        capsys, monkeypatch, stage, loss):
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: it prints to this process's stdout
        pytest.skip("needs deepspeed")
    # DeepSpeed's CPU op is built in the suite's folder for it (tests/conftest.py).
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (DEEPSPEED_CORPUS, os.environ.get("PYTHONPATH")) if p))
    argv = ["check", "--json", "--steps", "2", "--accumulation", "2", "--", *TORCHRUN,
            os.path.join(DEEPSPEED_CORPUS, "engine_loop.py"), "--stage", str(stage), "--micro-batch",
            "{per_device_batch_size}", "--accumulation", "{accumulation_steps}", "--loss", loss]
    code = main(argv)
    captured = capsys.readouterr()
    if stage == 2:
        # ZeRO-2's optimizer steps flat partitions whose shapes change with the world size: said, not compared.
        assert code == 2 and "DeepSpeed ZeRO's flat partitions" in captured.err
        return
    result = json.loads(captured.out)
    # engine.backward divides by the 2 accumulation steps, and so did the program: 1/K, as the audit names it.
    assert (result["verdict"], result["cause"]) == ("DIVERGES", "ACCUMULATION_DIVIDED_TWICE")
    assert _step0(result)["gradient_ratio"] == pytest.approx(0.5, rel=1e-5)
    assert "ACCUMULATION_DIVIDED_TWICE" in [f["code"] for f in result["audit_findings"]]


NEVER_STEPS = "import sys, torch; print('loaded', sys.argv[1:])"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_command_that_never_steps_is_named_with_exit_code_2(capsys):
    code = main(["check", "--steps", "1", "--no-audit", "--", *TORCHRUN, "--no-python", sys.executable, "-c",
                 NEVER_STEPS, "{per_device_batch_size}"])
    err = capsys.readouterr().err
    assert code == 2 and "2 ranks × 8" in err and "ended before any optimizer step" in err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_command_that_fails_on_one_side_is_named_with_its_own_error(capsys):
    code = main(["check", "--steps", "1", "--no-audit", "--", *TORCHRUN, os.path.join(PROGRAMS, "classifier.py"),
                 "--batch-size", "{per_device_batch_size}", "--fail-alone"])
    err = capsys.readouterr().err
    assert code == 2 and "the run on one process × 16" in err and "exited with code 1" in err
    # The reference's output goes to a log; its end, with the program's own error, is in the message.
    assert "RuntimeError: this config needs at least 2 ranks" in err
