"""Branches on real ranks: the vectorized branches' losses on 2 DDP (and FSDP2) ranks from a saved optimizer state,
the same measurement under torchrun, a spec only ranks can train, and what is still refused."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from ddplab.cli.main import main
from ddplab.runtime.timescale import scaled
from ddplab.study import workloads
from ddplab.study.branched import checkpoint as branched_checkpoint
from ddplab.study.branched import measurement as branched_measurement
from ddplab.study.branched import reference as branched_reference
from ddplab.study.branched.config import BranchConfig
from ddplab.study.config import OptimizerConfig, StudyConfig, StudyOptions, Target
from ddplab.study.engines import choice as engines_choice
from ddplab.study.engines import vmap_branches
from ddplab.study.engines.choice import build_engine
from ddplab.study.engines.ddp_branches import load_state, train_branches_ddp

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "specs")
CPU = torch.device("cpu")


def _largest_difference(a: branched_checkpoint.Trained, b: branched_checkpoint.Trained) -> float:
    assert {batch: set(steps) for batch, steps in a.items()} == {batch: set(steps) for batch, steps in b.items()}
    return max(abs(x - y) for batch in a for step in a[batch] for x, y in zip(a[batch][step], b[batch][step]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", [OptimizerConfig(momentum=0.9, nesterov=True),
                                       OptimizerConfig(family="adamw", weight_decay=0.1)])
def test_branches_on_ranks_are_the_vectorized_branches_from_the_saved_optimizer_state(optimizer):
    """float64 regression from the reference run's checkpoint (its momentum buffer or Adam moments loaded): every
    run's held-out loss, at the last step and at a recorded one, on 2 DDP ranks (with and without accumulation) and
    on 2 FSDP2 ranks equals the vectorized engine's; without the saved state it does not."""
    workload = workloads.regression(dim=8, n_train=512, n_val=256)
    config = StudyConfig(target=Target(kind="loss", value=1e-3), reference_global_batch_size=4, reference_lr=0.02,
                         optimizer=optimizer, dtype="float64", max_steps=40)
    [checkpoint], _ = branched_reference.reference_checkpoints(workload, config, (0.5,), CPU, lambda steps: None)
    assert checkpoint.optimizer["state"] and checkpoint.samples_seen == 80
    runs = [(0.01, 0), (0.04, 1), (0.02, 1)]
    groups = {4: (runs, {5}), 8: (runs, set()), 16: (runs, {0})}
    samples = 64
    vectorized = {batch: vmap_branches.train_branches(workload, config, checkpoint, batch, runs, samples,
                                                          device=CPU, record=record)
                  for batch, (runs, record) in groups.items()}
    for strategy, cap in (("ddp", None), ("ddp", 2), ("fsdp", None)):
        engine = build_engine("ddp", CPU, StudyOptions(world_size=2, strategy=strategy, max_batch_size_per_device=cap),
                              None)
        advanced = []
        on_ranks = train_branches_ddp(workload, config, checkpoint, groups, samples, engine=engine,
                                      advance=advanced.append)
        assert _largest_difference(on_ranks, vectorized) < 1e-12, (strategy, cap)
        assert sum(advanced) == sum(samples // batch for batch in groups)
    # Equivalence breaks where it must: the same branches from a fresh optimizer state are other branches.
    fresh = dataclasses.replace(checkpoint, optimizer=None)
    engine = build_engine("ddp", CPU, StudyOptions(world_size=2), None)
    assert _largest_difference(train_branches_ddp(workload, config, fresh, groups, samples, engine=engine),
                               vectorized) > 1e-6


def test_a_saved_state_loads_into_the_runs_own_optimizer_which_keeps_its_own_lr():
    """A spec's own optimizer (RMSprop here) takes the checkpoint's state as torch.optim's load_state_dict would,
    and keeps its own hyperparameters; the checkpoint's tensors are never stepped in place."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    saved_run = torch.optim.RMSprop(model.parameters(), lr=0.1, alpha=0.9, momentum=0.5)
    for _ in range(3):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        saved_run.step()
    saved = saved_run.state_dict()
    before = {key: value.clone() for key, value in saved["state"][0].items()}
    mine = torch.optim.RMSprop(model.parameters(), lr=0.02, alpha=0.9, momentum=0.5)
    load_state(mine, saved)
    theirs = torch.optim.RMSprop(model.parameters(), lr=0.1, alpha=0.9, momentum=0.5)
    theirs.load_state_dict(saved)
    for param in model.parameters():
        assert mine.state[param].keys() == theirs.state[param].keys()
        for key, value in theirs.state[param].items():
            assert torch.equal(mine.state[param][key], value) and mine.state[param][key] is not value
    assert mine.param_groups[0]["lr"] == 0.02
    model(torch.randn(8, 4)).pow(2).mean().backward()
    mine.step()
    assert all(torch.equal(saved["state"][0][key], value) for key, value in before.items())


def _cli(*argv: str) -> list[str]:
    return ["study", "--workload", "regression", "--ref-global-batch-size", "4", "--ref-lr", "0.02", "--momentum",
            "0.9", "--branch-at", "0.3,0.6", "--branch-doublings", "2", "--branch-samples", "64", "--dtype",
            "float64", "--max-steps", "60", "--seeds", "2", "--json", *argv]


def _seed_losses(values: dict) -> list[float]:
    return [loss for found in values["branches"] for row in found["batches"] for loss in row["seed_losses"]]


@pytest.mark.timeout(300)
def test_under_torchrun_the_branches_train_on_the_jobs_ranks_and_rank_0_alone_writes(tmp_path, capsys):
    """torchrun --nproc-per-node 2: the reference run trains in every rank, the branches across both, rank 0 alone
    prints and writes branched.json; the numbers are those of 2 ranks the command starts itself, and the vectorized
    engine's to float64's rounding."""
    assert main(_cli("--engine", "ddp", "--world-size", "2", "--out", str(tmp_path / "spawned"))) == 0
    spawned = json.loads(capsys.readouterr().out)
    assert main(_cli("--out", str(tmp_path / "vmap"))) == 0
    vectorized = json.loads(capsys.readouterr().out)
    assert (vectorized["engine"], vectorized["world_size"], vectorized["strategy"]) == ("vmap", None, None)
    import ddplab

    src = os.path.dirname(os.path.dirname(ddplab.__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "ddplab", *_cli("--engine", "ddp", "--out", str(tmp_path / "torchrun"))],
                          capture_output=True, text=True, env=env, timeout=scaled(240))
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)  # one JSON object: rank 0's alone
    written = json.loads((tmp_path / "torchrun" / "branched.json").read_text())
    assert printed["branches"] == written["branches"]
    assert (written["engine"], written["engine_reason"], written["world_size"], written["strategy"]) == \
        ("ddp", "asked for", 2, "ddp")
    assert [found["samples_seen"] for found in written["branches"]] == [72, 144]
    assert all(found["critical_batch_size"] in (4, 8, 16) for found in written["branches"])
    # Both launches train the same branches on the same samples: the same numbers to the last bit.
    assert written["branches"] == spawned["branches"] and written["schedule"] == spawned["schedule"]
    assert written["reference_run"] == spawned["reference_run"] == vectorized["reference_run"]
    assert [f["critical_batch_size"] for f in written["branches"]] == \
        [f["critical_batch_size"] for f in vectorized["branches"]]
    assert max(abs(a - b) for a, b in zip(_seed_losses(written), _seed_losses(vectorized))) < 1e-12
    assert seconds < 200


@pytest.mark.timeout(180)
def test_a_spec_with_its_own_step_branches_on_ranks_and_what_still_cannot_is_one_line(tmp_path, capsys):
    spec = os.path.join(SPECS, "study_bn_step.py")
    workload = workloads.from_spec(spec)
    config = StudyConfig(target=Target(kind="accuracy", value=0.85), reference_global_batch_size=8,
                         reference_lr=0.1, max_steps=60, seeds=2)
    calls = []
    report = branched_measurement.measure(workload, config,
                                          BranchConfig(branch_at=(0.5,), branch_doublings=2, branch_samples=64),
                            StudyOptions(out=str(tmp_path / "out")),
                            progress=lambda done, total, status="": calls.append((done, total)))
    values = json.loads((tmp_path / "out" / "branched.json").read_text())
    assert (values["engine"], values["engine_reason"], values["world_size"]) == \
        ("ddp", "the spec cannot be vectorized: it defines step()", 2)
    assert values["branches"] == json.loads(json.dumps(report.to_json()["branches"]))
    [found] = values["branches"]
    assert [row["global_batch_size"] for row in found["batches"]] == [8, 16, 32]
    assert all(0 < loss < 1 for row in found["batches"] for loss in row["seed_losses"])
    # The progress bar moves forward to its total: the reference run's budget, then every branch step, and those of
    # the lrs past a sweep's edge.
    extended = sum((len(row["lrs"]) - 3) * 64 // row["global_batch_size"] for row in found["batches"])
    assert calls[-1][0] == calls[-1][1] == 2 * 60 + 64 // 8 + 64 // 16 + 64 // 32 + extended
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    base = ["study", spec, "--target-accuracy", "0.85", "--branch-at", "0.5", "--branch-doublings", "2",
            "--branch-samples", "64", "--max-steps", "60", "--out", str(tmp_path / "refused")]
    for extra, message in ((["--engine", "vmap"], "--engine vmap cannot train these branches: the spec cannot be "
                                                  "vectorized: it defines step(); use --engine ddp (or auto)"),
                           (["--ref-global-batch-size", "9"], "the reference global batch 9 does not split evenly "
                                                              "over 2 ranks (--world-size): give a "
                                                              "--ref-global-batch-size that is a multiple of 2")):
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "refused" / "branched.json")
    assert main(["study", "--workload", "regression", "--branch-at", "0.5", "--engine", "vmap", "--strategy", "fsdp",
                 "--out", str(tmp_path / "refused")]) == 2
    assert "--engine vmap cannot train these branches: the fsdp strategy wraps the model on ranks" in \
        capsys.readouterr().err


def test_the_branches_train_vectorized_unless_something_asks_for_ranks(monkeypatch):
    from ddplab.errors import UsageError

    regression, spec = workloads.regression(dim=4, n_train=64, n_val=16), workloads.from_spec(
        os.path.join(SPECS, "study_rmsprop.py"))
    assert engines_choice.engine_for(regression, StudyOptions()) == \
        ("vmap", "the model and optimizer vectorize: every run of a batch trains at once in this process")
    assert engines_choice.engine_for(regression, StudyOptions(engine="ddp")) == ("ddp", "asked for")
    assert engines_choice.engine_for(regression, StudyOptions(strategy="hsdp")) == \
        ("ddp", "the hsdp strategy wraps the model on ranks")
    assert engines_choice.engine_for(spec, StudyOptions()) == \
        ("ddp", "the spec cannot be vectorized: its optimizer() (RMSprop is not among SGD, Adam and AdamW)")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert engines_choice.engine_for(regression, StudyOptions()) == \
        ("ddp", "under torchrun the branches train across the job's ranks")
    with pytest.raises(UsageError, match="engine vmap cannot train these branches: under torchrun"):
        engines_choice.engine_for(regression, StudyOptions(engine="vmap"))
