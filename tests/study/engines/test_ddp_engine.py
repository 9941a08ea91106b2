"""The study's DDP engine: real DDP ranks per grid point, agreeing with the vectorized engine; specs only it can
train; torchrun across two local agents."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from ddplab.cli.main import main
from ddplab.noise import estimators as noise_estimators
from ddplab.runtime.launch import LaunchConfig
from ddplab.runtime.timescale import scaled
from ddplab.study import fit, workloads
from ddplab.study.config import OptimizerConfig, StudyConfig, StudyOptions, Target
from ddplab.study.engines import choice as engines_choice
from ddplab.study.engines import ddp
from ddplab.study.engines import vmap as engine
from ddplab.study.grid import analysis
from ddplab.study.grid import training as grid_training

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "specs")


def _ddp_engine(world_size: int, max_per_device: int | None) -> ddp.DdpEngine:
    return ddp.DdpEngine(LaunchConfig(world_size=world_size, backend="gloo"), max_per_device=max_per_device)


@pytest.mark.timeout(180)
def test_the_ddp_engine_takes_the_vectorized_engines_steps():
    """float64, a deterministic model: every run's evaluations and steps to target are the same on 2 DDP ranks (with
    and without accumulation) as in the vectorized group, Adam's adam-sqrt runs and the tuned sweep's runs with
    adam-sqrt's settings included."""
    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.05), global_batch_sizes=(8, 32), seeds=2,
                         optimizer=OptimizerConfig(family="adam"), reference_global_batch_size=8,
                         # The rules scale from the reference lr itself (as --ref-lr does): runs of known lrs.
                         reference_lr=0.02, rules_lr=0.02, sweep_margin=2, max_steps=150, eval_every=5,
                         dtype="float64")
    vectorized = grid_training.run_grid(workload, config, None, engine.VmapEngine())
    for world_size, cap in ((2, None), (2, 4)):
        on_ranks = grid_training.run_grid(workload, config, None, _ddp_engine(world_size, cap))
        for b in config.global_batch_sizes:
            assert len(on_ranks[b]) == len(vectorized[b]) > 0
            for mine, theirs in zip(on_ranks[b], vectorized[b]):
                assert mine.key == theirs.key and mine.rule == theirs.rule
                # Both engines stop a sweep lr that can no longer win, each when it knows: compare what both ran.
                shared = min(len(mine.history), len(theirs.history))
                if not (theirs.pruned or mine.pruned):
                    assert mine.steps_to_target == theirs.steps_to_target and mine.diverged == theirs.diverged
                    assert len(mine.history) == len(theirs.history)
                assert [h[0] for h in mine.history[:shared]] == [h[0] for h in theirs.history[:shared]]
                assert [h[2] for h in mine.history[:shared]] == pytest.approx(
                    [h[2] for h in theirs.history[:shared]], rel=1e-9)
        # The answer is the same: the best tuned lr and its median steps at every batch.
        assert analysis.analyze(config, on_ranks).tuned_lr == analysis.analyze(config, vectorized).tuned_lr
        assert any(r.pruned for rs in on_ranks.values() for r in rs)
        # The DDP engine measures the noise scale as ddplab noise does, at every evaluation: on this problem
        # B_simple = dim + 1 = 9 wherever the weights are (tr Σ and |G|² both scale with the error).
        measured = [r for rs in on_ranks.values() for r in rs if r.steps_to_target]
        assert all(len(r.noise_g2) == len(r.history) for r in measured)
        summary = noise_estimators.summarize([g for r in measured for g in r.noise_g2],
                                             [t for r in measured for t in r.noise_trace])
        low, high = summary.b_simple_ci95
        assert low <= 9 <= high and 6 < summary.b_simple < 13.5, summary
    assert any(r.steps_to_target for r in vectorized[32]) and any(r.rule == "adam-sqrt" for r in vectorized[32])
    assert ddp.split(32, 2, 4) == ddp.DdpPlan(world_size=2, accumulation_steps=4, per_device_batch_size=4)
    assert ddp.split(24, 2, 5) == ddp.DdpPlan(world_size=2, accumulation_steps=3, per_device_batch_size=4)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_in_float32_the_engines_agree_run_for_run_at_a_stable_lr_and_within_the_seeds_spread_past_it():
    """digits, SGD with momentum, lr 0.1 at global batches 8 and 32, 8 seeds, float32, 2 DDP ranks. At 32 lr 0.1 is the
    best tuned lr: each seed takes the same steps on both engines. At 8 it is 4× the best tuned lr (0.025), where
    training is unstable and float32's summation order (the whole batch in one process, two rank shares averaged on
    DDP) grows into other steps to target, as a seed does: each engine's median lies within the other's seeds, and
    at least half of each engine's seeds arrive."""
    workload = workloads.digits()
    config = StudyConfig(target=Target(kind="accuracy", value=0.95), global_batch_sizes=(8, 32), seeds=8,
                         rules=("constant",), reference_global_batch_size=32, reference_lr=0.1, rules_lr=0.1,
                         max_steps=2000, eval_every=5, dtype="float32")

    def steps(results):
        return {b: [r.steps_to_target or math.inf for r in runs] for b, runs in results.items()}

    vectorized = steps(grid_training.run_grid(workload, config, None, engine.VmapEngine()))
    on_ranks = steps(grid_training.run_grid(workload, config, None, _ddp_engine(2, None)))
    assert on_ranks[32] == vectorized[32] and all(math.isfinite(s) for s in vectorized[32])
    # Each median inside the other engine's seeds, a seed that never arrived counted above every one that did: the
    # processor's own float32 kernels (AVX-512 or AVX2, as this suite runs them) decide which seeds stall at this lr.
    for mine, theirs in ((vectorized[8], on_ranks[8]), (on_ranks[8], vectorized[8])):
        arrived = [s for s in theirs if math.isfinite(s)]
        assert len(arrived) >= len(theirs) // 2, (vectorized[8], on_ranks[8])
        assert min(theirs) <= fit.median(mine) <= max(theirs), (vectorized[8], on_ranks[8])


@pytest.mark.timeout(180)
def test_adascale_on_the_ddp_engine_is_the_library_adapter_with_the_closed_form_gain():
    """The adascale rule on 2 DDP ranks (ddplab.AdaScale on the noise scale measured across them): at the reference
    batch its gain is 1 and each run is the constant rule's run exactly; at S = 4 its gain settles near the closed
    form, and its steps overlap the vectorized engine's."""
    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.01), global_batch_sizes=(8, 32), seeds=3,
                         optimizer=OptimizerConfig(family="sgd", momentum=0.0), reference_global_batch_size=8,
                         reference_lr=0.02, rules=("constant", "adascale"), max_steps=400, eval_every=5,
                         dtype="float64")
    vectorized = grid_training.run_grid(workload, config, None, engine.VmapEngine())
    on_ranks = grid_training.run_grid(workload, config, None, _ddp_engine(2, None))
    fixed = {b: [r for r in rs if r.rule != "adascale"] for b, rs in on_ranks.items()}
    ada = {b: [r for r in rs if r.rule == "adascale"] for b, rs in on_ranks.items()}
    assert all(len(ada[b]) == config.seeds for b in (8, 32))
    for run, same in zip(ada[8], fixed[8]):
        assert [g[1] for g in run.gains] == [1.0] * len(run.history)
        assert run.history == same.history and run.steps_to_target == same.steps_to_target
    # Noiseless regression: tr Σ = (dim + 1)|G|² everywhere, so σ² = 9|G|²/8 per reference batch and the gain at
    # S = 4 is (σ² + μ²)/(σ²/4 + μ²) = 68/41.
    exact = (9 / 8 + 1) / (9 / 32 + 1)
    final = sorted(run.gains[-1][1] for run in ada[32])
    assert final[1] == pytest.approx(exact, rel=0.15) and all(1 < g < 4 for g in final), final
    for run in ada[32]:
        steps, taus = [g[0] for g in run.gains], [g[2] for g in run.gains]
        assert taus == sorted(taus) and all(s < tau < 4 * s for s, tau in zip(steps, taus))
    # Faster than the same lr untuned at S = 4, and within the vectorized engine's AdaScale runs' seed range.
    mine = [r.steps_to_target for r in ada[32]]
    theirs = [r.steps_to_target for r in vectorized[32] if r.rule == "adascale"]
    assert max(mine) < min(r.steps_to_target for r in fixed[32])
    assert min(theirs) <= sorted(mine)[1] <= max(theirs), (mine, theirs)


@pytest.mark.timeout(240)
def test_a_spec_with_batchnorm_and_its_own_step_runs_on_the_ddp_engine(tmp_path, capsys):
    spec = os.path.join(SPECS, "study_bn_step.py")
    argv = ["study", spec, "--target-accuracy", "0.85", "--global-batch-sizes", "8,32,256", "--seeds", "2",
            "--max-steps", "300", "--sweep-factor", "4", "--out", str(tmp_path / "out")]
    assert main([*argv, "--rules", "constant,linear,sqrt,tuned,adascale,ramp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"] == "ddp" and report["engine_reason"] == "the spec cannot be vectorized: it defines step()"
    # The adaptive rules train too: AdaScale on the ranks (gain 1 at the reference batch, above it beyond), the
    # ramp with the spec's step, growing its batch.
    gains = {p["global_batch_size"]: p["mean_gain"] for p in report["adascale"]}
    assert gains[32] == 1.0 and 1 < gains[256] <= 8, gains
    assert report["ramp"]["median_steps"] and max(report["ramp"]["final_global_batch_sizes"]) > 8
    assert report["device"] == "cpu" and report["fit"] and any(p.endswith("report.html") for p in [report["report"]])
    assert report["optimizer"]["name"] == "SGD"
    # plan --from-study reads it as any study.
    assert main(["plan", "--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "2", "--batch-size", "32",
                 "--from-study", str(tmp_path / "out" / "study.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rule"] == "measured"
    # What the DDP engine cannot do, or the vectorized engine for this spec, is one line and exit 2.
    cases = [(["--engine", "vmap"], "--engine vmap cannot train study_bn_step.py: it defines step(); use --engine ddp"),
             (["--rules", "tuned,adascale", "--world-size", "1"],
              "the rule adascale on the DDP engine measures the noise scale across ranks"),
             (["--global-batch-sizes", "15,64"], "global batch 15 does not split evenly over 2 DDP ranks")]
    if not _cuda():
        cases.append((["--device", "cuda"], "--device cuda, but torch sees no CUDA device here"))
    for extra, message in cases:
        assert main([*argv, *extra, "--no-plots", "--fresh"]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.timeout(180)
def test_a_spec_with_collate_trains_on_the_ddp_engine_and_the_vectorized_engine_says_why_not(tmp_path, capsys):
    """Token sequences of different lengths, padded per batch by the spec's collate() (as check takes them): the DDP
    engine's runs reach the target on batches collate() built; vmap declines, naming collate(), so auto picks ddp."""
    spec = os.path.join(SPECS, "study_padded_lm.py")
    argv = ["study", spec, "--target-loss", "0.85", "--global-batch-sizes", "8,16,32", "--seeds", "1", "--rules",
            "linear,sqrt", "--max-steps", "200", "--eval-every", "5", "--max-batch-size-per-device", "8", "--out",
            str(tmp_path / "out"), "--no-plots"]
    assert main([*argv, "--engine", "ddp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"] == "ddp" and report["train_size"] == 512
    reached = {(r["global_batch_size"], r["rule"]): r["steps_to_target"] for r in report["runs"]}
    assert len(reached) == 6 and all(reached.values()), reached
    # Twice the batch at twice the lr (linear) takes fewer steps: the batches really grew.
    assert reached[(32, "linear")] < reached[(8, "linear")]
    workload = workloads.from_spec(spec)
    assert workload.train is None and workload.collate is not None and workload.val[1].eq(-100).any()
    # One step's batch is the spec's own collate() of its items, as check builds it.
    inputs, labels = workload.batches("cpu", torch.float32)(torch.tensor([0, 5]))
    items = [workload.dataset[0], workload.dataset[5]]
    assert labels.shape == (2, max(len(d) for d in items) - 1) and int(labels.ne(-100).sum()) == sum(
        len(d) - 1 for d in items)
    config = StudyConfig(target=Target(kind="loss", value=0.85))
    engine, why = engines_choice.choose_engine(workload, config, StudyOptions())
    assert engine == "ddp" and "collate()" in why
    assert main([*argv, "--engine", "vmap", "--fresh"]) == 2
    err = capsys.readouterr().err
    assert "--engine vmap cannot train study_padded_lm.py: its collate() batches items of different lengths" in err
    assert err.count("\n") == 1


@pytest.mark.timeout(180)
def test_a_spec_optimizer_outside_the_families_trains_on_the_ddp_engine(tmp_path, capsys):
    """RMSprop: one line says why the DDP engine, the runs train with the spec's own optimizer (its lr scaled by the
    grid's), the JSON names it, and plan --from-study refuses it for SGD rather than apply SGD's rule."""
    spec = os.path.join(SPECS, "study_rmsprop.py")
    out = tmp_path / "out"
    assert main(["study", spec, "--target-accuracy", "0.85", "--global-batch-sizes", "16,64", "--seeds", "1",
                 "--rules", "constant,tuned", "--max-steps", "400", "--out", str(out), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "engine: ddp (the spec cannot be vectorized: its optimizer() (RMSprop is not among SGD, Adam and AdamW))" \
        in " ".join(printed.split())
    report = json.loads((out / "study.json").read_text())
    assert report["optimizer"] == {"family": "other", "name": "RMSprop", "momentum": 0, "alpha": 0.9, "eps": 1e-08,
                                   "centered": False, "weight_decay": 0, "parameter_groups": 1}
    assert report["reference"]["lr"] == 0.02 and any(r["steps_to_target"] for r in report["runs"])
    # The grid's lr scales the spec's: a run at the reference lr is the spec's optimizer exactly.
    workload = workloads.from_spec(spec)
    built = ddp.run_optimizer(workload, StudyConfig(target=Target(kind="accuracy", value=0.85)),
                              workload.model().parameters(), 0.08)
    assert isinstance(built, torch.optim.RMSprop) and built.param_groups[0]["lr"] == pytest.approx(0.08)
    assert built.param_groups[0]["alpha"] == 0.9
    assert main(["plan", "--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "2", "--batch-size", "32",
                 "--from-study", str(out / "study.json")]) == 2
    assert "the study measured the best lr of RMSprop" in capsys.readouterr().err


def _cuda() -> bool:
    return torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_study_runs_under_torchrun_on_two_local_agents(tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 2 over loopback: the grid trains across 4 ranks, rank 0 alone reports,
    and the result is the vectorized engine's (float64, deterministic workload)."""
    spec = tmp_path / "regression.py"
    spec.write_text(REGRESSION_SPEC)
    out = tmp_path / "out"
    port = _free_port()
    command = functools.partial(
        _agent, ["-m", "ddplab", "study", str(spec), "--target-loss", "0.02", "--global-batch-sizes", "8,32",
                 "--seeds", "2", "--max-steps", "200", "--dtype", "float64", "--out", str(out), "--no-plots",
                 "--json", "--sweep-margin", "2", "--ref-global-batch-size", "8"], port)
    agents = [command(node) for node in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=scaled(280)) for agent in agents]
    finally:  # a test that timed out or was interrupted leaves neither agent nor its ranks behind
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    printed = [stdout for stdout, _ in outputs if stdout.strip()]
    assert len(printed) == 1  # rank 0 alone
    report = json.loads((out / "study.json").read_text())
    assert json.loads(printed[0])["runs"] == report["runs"]
    assert report["engine"] == "ddp" and "under torchrun" in report["engine_reason"]
    assert main(["study", str(spec), "--target-loss", "0.02", "--global-batch-sizes", "8,32", "--seeds", "2",
                 "--max-steps", "200", "--dtype", "float64", "--out", str(tmp_path / "vmap"), "--no-plots",
                 "--sweep-margin", "2", "--ref-global-batch-size", "8", "--engine", "vmap", "--json"]) == 0
    vectorized = json.loads((tmp_path / "vmap" / "study.json").read_text())
    assert vectorized["engine"] == "vmap"
    assert [(r["rule"], r["lr"], r["seed"], r["steps_to_target"]) for r in report["runs"]] == \
        [(r["rule"], r["lr"], r["seed"], r["steps_to_target"]) for r in vectorized["runs"]]


def _agent(argv: list[str], port: int, node: int) -> subprocess.Popen:
    torchrun = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *torchrun, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)


REGRESSION_SPEC = '''
import torch


def model():
    layer = torch.nn.Linear(8, 1, bias=False)
    torch.nn.init.zeros_(layer.weight)
    return layer


def _data(seed, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.linspace(-1, 1, 8).unsqueeze(1) / 2)


def dataset():
    return _data(0, 512)


def val_dataset():
    return _data(1, 256)


def loss(output, target):
    return torch.nn.functional.mse_loss(output, target)
'''


def test_auto_is_a_fixed_choice_never_a_timing():
    """The default picks the same engine whatever a step would time (so the same command gives the same numbers
    under any load): vectorized where it can train the grid, else the DDP engine; only ``fastest`` times."""
    from ddplab.study.config import StudyOptions

    config = StudyConfig(target=Target(kind="loss", value=1e-3), global_batch_sizes=(16, 32))
    plain = workloads.regression(dim=8, n_train=256, n_val=64)
    spec_step = dataclasses.replace(plain, not_vectorized="the spec defines its own step()")
    chosen = [engines_choice.choose_engine(plain, config, StudyOptions(engine=e))[0] for e in ("auto", "fastest")]
    assert chosen == ["vmap", "fastest"]
    assert engines_choice.choose_engine(spec_step, config, StudyOptions())[0] == "ddp"
    # BatchNorm normalizes per rank on DDP: fastest keeps one engine for every batch, and says it did not time.
    normed = dataclasses.replace(plain, model=lambda: torch.nn.Sequential(torch.nn.BatchNorm1d(8),
                                                                           torch.nn.Linear(8, 1)))
    engine_name, why = engines_choice.choose_engine(normed, config, StudyOptions(engine="fastest"))
    assert engine_name == "vmap" and why.startswith("not timed: the model has buffers")


def test_fastest_times_each_batch_on_every_engine_and_trains_where_it_was_faster():
    from ddplab.study import engines
    from ddplab.study.runs import RunGroup, grid_group

    calls = []

    class Timed:
        def __init__(self, name, overhead, timings):
            self.name, self.overhead, self.timings = name, overhead, timings

        def train(self, workload, config, group, progress=None):
            calls.append((self.name, group.global_batch_size))
            return []

        def seconds_per_step(self, workload, config, group):
            return self.timings[group.global_batch_size]

    # 8: vectorized far faster; 256: run by run a little faster, within the timing's noise; 1024: clearly faster.
    fastest = engines.Fastest([Timed("vmap", 1.0, {8: 0.001, 256: 0.12, 1024: 0.2}),
                               Timed("ddp", 1.5, {8: 0.01, 256: 0.1, 1024: 0.1})])
    config = StudyConfig(target=Target(kind="loss", value=1e-3), global_batch_sizes=(16, 32))
    runs = [(0.1, 0), (0.2, 0)]
    for b in (8, 256, 1024, 1024):
        fastest.train(None, config, grid_group(config, b, runs))
    # AdaScale's groups stay on the first engine: they measure at every step, cheapest inside the group.
    fastest.train(None, config, RunGroup(global_batch_size=1024, runs=tuple(runs), optimizer=config.optimizer,
                                      rule="adascale", lr_scaling="gain"))
    assert calls == [("vmap", 8), ("vmap", 256), ("ddp", 1024), ("ddp", 1024), ("vmap", 1024)]
    chosen, why = fastest.summary()
    assert chosen == "vmap+ddp" and why.startswith("timed per global batch, each engine in this process: 8: vmap (one "
                                                    "step of its 2 runs: vmap 1 ms, ddp 10 ms)")
    assert [engines.duration(s) for s in (0.4382, 4.0912, 0.0000512, 1234.5)] == ["438 ms", "4.09 s", "0.0512 ms",
                                                                                  "1234 s"]
    assert engines.Fastest([Timed("vmap", 1.0, {})]).summary()[1].startswith("no group was timed")
    # The timing itself: each engine measured for real, positive and finite.
    workload = workloads.regression(dim=8, n_train=256, n_val=64)
    group = grid_group(config, 32, runs)
    seconds = [e.seconds_per_step(workload, config, group)
               for e in (engine.VmapEngine(), ddp.DdpEngine(LaunchConfig(world_size=2)))]
    assert all(0 < s < 1 for s in seconds), seconds


def test_the_ddp_engine_on_gpus_needs_one_per_rank_and_fastest_then_stays_vectorized(monkeypatch):
    from ddplab.errors import UsageError
    from ddplab.study import engines
    from ddplab.study.config import StudyOptions

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = torch.device("cuda")
    with pytest.raises(UsageError, match="each of its 2 ranks a GPU of its own, but torch sees 1: give world_size 1"):
        engines_choice.build_engine("ddp", cuda, StudyOptions(world_size=2), None)
    fastest = engines_choice.build_engine("fastest", cuda, StudyOptions(world_size=2), None)
    assert isinstance(fastest, engines.Fastest) and [e.name for e in fastest.engines] == ["vmap"]
    one = engines_choice.build_engine("ddp", cuda, StudyOptions(world_size=1), None)
    assert one.launch_config.backend == "nccl" and one.launch_config.world_size == 1
    on_cpu = engines_choice.build_engine("ddp", torch.device("cpu"), StudyOptions(world_size=2), None)
    assert on_cpu.launch_config.backend == "gloo"


@pytest.mark.timeout(240)
def test_the_ddp_engine_trains_a_grid_point_on_fsdp_as_on_ddp():
    """One grid point (one lr, one seed, global batch 16 on 2 ranks, 2 micro-steps each), float64: FSDP2's runs and
    DDP's agree evaluation for evaluation, and so do the noise scales each measures across the ranks."""
    from ddplab.runtime import strategies
    from ddplab.study.runs import grid_group

    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.05), global_batch_sizes=(16, 32), seeds=1,
                         optimizer=OptimizerConfig(family="sgd", momentum=0.9), reference_global_batch_size=16,
                         reference_lr=0.02, max_steps=60, eval_every=5, dtype="float64")
    group = grid_group(config, 16, [(0.02, 0)])
    launch_config = LaunchConfig(world_size=2, backend="gloo")
    (on_ddp,) = ddp.train_group_ddp(workload, config, group, launch_config, max_per_device=4)
    (on_fsdp,) = ddp.train_group_ddp(workload, config, group, launch_config, max_per_device=4,
                                     strategy=strategies.get("fsdp"))
    assert on_ddp.steps_to_target is not None and on_ddp.steps_to_target == on_fsdp.steps_to_target
    assert [h[0] for h in on_fsdp.history] == [h[0] for h in on_ddp.history] and len(on_ddp.history) >= 3
    for mine, theirs in zip(on_fsdp.history, on_ddp.history):
        assert mine[1:] == pytest.approx(theirs[1:], rel=1e-12)
    assert len(on_fsdp.noise_g2) == len(on_fsdp.history)
    assert on_fsdp.noise_g2 == pytest.approx(on_ddp.noise_g2, rel=1e-9)
    assert on_fsdp.noise_trace == pytest.approx(on_ddp.noise_trace, rel=1e-9)


def test_a_sharding_strategy_needs_the_ddp_engine(tmp_path, capsys):
    out = str(tmp_path / "study")
    assert main(["study", "--engine", "vmap", "--strategy", "fsdp", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--strategy fsdp wraps the model on ranks, which only the DDP engine starts" in err
    assert main(["study", "--engine", "ddp", "--strategy", "hsdp", "--replicate", "3", "--out", out]) == 2
    assert "hsdp needs --replicate, the replicas of its 2-D mesh, to divide the world size 2 (got 3)" in \
        capsys.readouterr().err
