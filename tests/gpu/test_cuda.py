"""ddplab on one CUDA device: each capability once, its results checked against the same work on the CPU.

Run where torch sees a GPU (skipped elsewhere): ``python -m pytest -m gpu tests/gpu -v``. Every CUDA run is
a ``python -m ddplab`` command, a rank the launch layer spawns, or a script: CUDA never starts in the test
process, whose later CPU tests fork ranks (conftest.py checks it after each test). One device means one NCCL
rank (NCCL wants a GPU per rank); the auditor gets two gloo ranks sharing the GPU.
"""

import contextlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddplab import AdaScale, BatchRamp, GradientNoiseScale
from ddplab.cli.main import main
from ddplab.runtime.launch import LaunchConfig, launch
from ddplab.runtime.timescale import scaled

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = os.path.join(ROOT, "tests", "specs")
CUDA_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "cuda_ddp.py")
# The CPU twin of a command that would take the GPU wherever torch sees one.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
ONE_RANK = LaunchConfig(world_size=1, pg_timeout_s=scaled(60), deadline_s=scaled(240))


def study(*args: str, batches: str = "32,128") -> list[str]:
    """One small study, on either device: digits, two rules, one seed, float64 (so the devices agree to rounding
    far below what could move an evaluation)."""
    return ["study", *args, "--dtype", "float64", "--global-batch-sizes", batches, "--rules", "constant,linear",
            "--seeds", "1", "--no-plots", "--json"]


def ddplab(*args: str, env: dict | None = None) -> dict:
    """``python -m ddplab ARGS`` in a fresh process; its JSON, after checking it exited 0."""
    done = subprocess.run([sys.executable, "-m", "ddplab", *args], capture_output=True, text=True, timeout=scaled(280),
                          env={**os.environ, **(env or {})}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


@pytest.fixture(scope="module")
def cpu_study(tmp_path_factory):
    return ddplab(*study("--device", "cpu", "--engine", "vmap", "--out", str(tmp_path_factory.mktemp("cpu"))),
                  env=NO_GPU)


def steps_by_run(report: dict) -> dict:
    return {(r["rule"], r["global_batch_size"], r["lr"], r["seed"]): r["steps_to_target"] for r in report["runs"]}


@pytest.mark.timeout(600)
def test_the_study_vectorized_on_cuda_trains_as_on_the_cpu_and_as_nccl_ranks(cpu_study, tmp_path):
    """--device cuda --engine vmap: every run reaches the target within one evaluation of the CPU's step, and
    --verify-ddp replays a grid point on one NCCL rank on the GPU to the same parameters."""
    report = ddplab(*study("--device", "cuda", "--engine", "vmap", "--out", str(tmp_path), "--verify-ddp", "1",
                           "--verify-world-size", "1"))
    assert report["device"] == "cuda" and report["engine"] == "vmap"
    on_gpu, on_cpu = steps_by_run(report), steps_by_run(cpu_study)
    assert on_gpu.keys() == on_cpu.keys() and None not in on_cpu.values()
    for run, steps in on_cpu.items():
        assert on_gpu[run] is not None and abs(on_gpu[run] - steps) <= report["eval_every"], run
    verify = report["verify_ddp"]
    assert verify["world_size"] == 1 and verify["points"] and verify["max_rel_diff"] <= 1e-9


@pytest.mark.timeout(600)
def test_a_vectorized_step_on_cuda_is_timed_against_the_devices_matmul_floor(tmp_path):
    """benchmarks/study_speed_cuda.py: a step takes at least the device's matmul floor (the clock waited for the
    GPU), by the benchmark's clock and by the engine's own (what --engine fastest compares), and the runs trained on
    the GPU match the same runs on the CPU after 10 steps."""
    out = tmp_path / "speed.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "study_speed_cuda.py"), "--workload",
                           "digits", "--batch-sizes", "32", "128", "--steps", "20", "--out", str(out)],
                          capture_output=True, text=True, timeout=scaled(500), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["device"].startswith("cuda") and result["matmul_flop_per_s"] > 0
    assert [row["global_batch_size"] for row in result["rows"]] == [32, 128]
    for row in result["rows"]:
        assert row["group_flops_per_step"] > 0 and row["floor_s_per_step"] > 0
        assert row["ratio_to_floor"] >= 1 and row["engine_ratio_to_floor"] >= 1, row
        assert row["max_abs_param_diff_vs_cpu"] <= 1e-4, row


@pytest.mark.timeout(600)
def test_the_study_ddp_engine_trains_on_one_nccl_rank(cpu_study, tmp_path):
    """--device cuda --engine ddp --world-size 1: the run trains on one NCCL rank and reaches the target within
    one evaluation of the vectorized CPU run."""
    report = ddplab(*study("--device", "cuda", "--engine", "ddp", "--world-size", "1", "--out", str(tmp_path),
                           batches="32"))
    assert report["device"] == "cuda" and report["engine"] == "ddp"
    on_gpu, on_cpu = steps_by_run(report), steps_by_run(cpu_study)
    assert on_gpu and on_gpu.keys() <= on_cpu.keys()
    for run, steps in on_gpu.items():
        assert steps is not None and abs(steps - on_cpu[run]) <= report["eval_every"], run


def _one_nccl_rank(ctx) -> dict:
    values = torch.arange(4.0, device=ctx.device)
    dist.all_reduce(values)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(ctx.device)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(ctx.device)
    plain.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, device_ids=ctx.device_ids)
    x, y = torch.randn(32, 6, device=ctx.device), torch.randn(32, 2, device=ctx.device)
    for net in (ddp, plain):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            F.mse_loss(net(x), y).backward()
            optimizer.step()
    # Plain Python back to the parent: a CUDA tensor unpickled there would start CUDA in the test process.
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
    return {"backend": ctx.backend, "group_backend": dist.get_backend(), "device": str(ctx.device),
            "device_ids": ctx.device_ids, "all_reduced": values.tolist(), "max_diff": diff,
            "param_devices": sorted({str(p.device) for p in model.parameters()})}


@pytest.mark.timeout(300)
def test_the_launch_layer_gives_one_rank_nccl_on_the_gpu():
    """world size 1 with a GPU: NCCL, cuda:0, a working all-reduce, and DDP steps equal to plain ones."""
    [rank] = launch(_one_nccl_rank, ONE_RANK)
    assert rank["backend"] == rank["group_backend"] == "nccl"
    assert rank["device"] == "cuda:0" and rank["device_ids"] == [0] and rank["param_devices"] == ["cuda:0"]
    assert rank["all_reduced"] == [0.0, 1.0, 2.0, 3.0] and rank["max_diff"] <= 1e-6


@pytest.mark.timeout(300)
def test_the_sandbox_on_one_nccl_rank_matches_one_cpu_process():
    """sandbox multi --world-size 1 (NCCL on the GPU) against sandbox single (CPU): the same w and update
    variance over 2,000 noisy experiments, and one all-reduce per step."""
    flags = ["--batch-size", "16", "--noisy", "--n-experiments", "2000", "--json"]
    on_gpu = ddplab("sandbox", "multi", "--world-size", "1", *flags)
    on_cpu = ddplab("sandbox", "single", *flags)
    assert on_gpu["world_size"] == 1 and on_gpu["allreduces"] == on_gpu["steps"] == on_cpu["steps"] == 16
    assert abs(on_gpu["w"] - on_cpu["w"]) <= 1e-6
    assert relative(on_gpu["update_step_variance"], on_cpu["update_step_variance"]) <= 1e-3


@pytest.mark.timeout(300)
def test_check_on_one_nccl_rank_finds_equivalence_and_the_gpus_own_dropout():
    """check --world-size 1 on the GPU against its CPU reference: EQUIVALENT in float64 for a correct spec, and
    STOCHASTIC for dropout, whose masks the GPU draws from its own generator."""
    correct = ddplab("check", os.path.join(SPECS, "correct.py"), "--world-size", "1", "--batch-size", "8",
                     "--json", "--strict")
    assert correct["verdict"] == "EQUIVALENT" and correct["world_size"] == 1 and len(correct["per_step"]) == 5
    assert max(step["max_rel_diff"] for step in correct["per_step"]) <= 1e-9
    dropout = ddplab("check", os.path.join(SPECS, "dropout.py"), "--world-size", "1", "--batch-size", "8", "--json")
    assert dropout["verdict"] == "STOCHASTIC" and dropout["first_divergent_step"] == 0


@pytest.mark.timeout(300)
def test_noise_on_one_nccl_rank_with_accumulation_measures_as_on_the_cpu():
    """noise --world-size 1 --accumulation 2 on the GPU and with CUDA hidden: the same B_simple step by step,
    and the closed form of the spec (12) inside the interval."""
    args = ["noise", os.path.join(ROOT, "examples", "linear_regression_spec.py"), "--world-size", "1",
            "--batch-size", "16", "--accumulation", "2", "--steps", "100", "--json"]
    on_gpu, on_cpu = ddplab(*args), ddplab(*args, env=NO_GPU)
    assert on_gpu["measured_steps"] == on_cpu["measured_steps"] == 100 and on_gpu["skipped_steps"] == 0
    for gpu_step, cpu_step in zip(on_gpu["per_step"], on_cpu["per_step"], strict=True):
        assert relative(gpu_step["g_small_sq"], cpu_step["g_small_sq"]) <= 1e-4
        assert relative(gpu_step["g_big_sq"], cpu_step["g_big_sq"]) <= 1e-4
    assert relative(on_gpu["b_simple"], on_cpu["b_simple"]) <= 1e-3
    low, high = on_gpu["b_simple_ci95"]
    assert low <= 12.0 <= high


def _regression(device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True) + torch.randn(512, 1, generator=generator, dtype=torch.float64)
    return x.to(device), y.to(device)


def _micro_batches(x, y, batch: int):
    for start in range(0, 10**9, batch):
        start %= len(x)
        yield x[start:start + batch], y[start:start + batch]


def _seeded_linear(device, wrap):
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 1).to(device, torch.float64)
    return module, wrap(module)


def _adapted(device, wrap) -> dict:
    """AdaScale (scale 2: two micro-batches of the reference batch 8), then BatchRamp (from 2 micro-batches of 4
    up to 16), each driving SGD on a noisy regression in float64 on ``device``; what they did, as plain numbers."""
    x, y = _regression(device)
    module, model = _seeded_linear(device, wrap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    gns = GradientNoiseScale(model, per_device_batch_size=8, accumulation_steps=2, every=1)
    adascale = AdaScale(optimizer, gns, reference_batch_size=8)
    batches = _micro_batches(x, y, 8)
    for _ in range(30):
        optimizer.zero_grad()
        for micro in range(2):
            inputs, targets = next(batches)
            with model.no_sync() if micro == 0 and hasattr(model, "no_sync") else contextlib.nullcontext():
                (F.mse_loss(model(inputs), targets) / 2).backward()
        gns.step()
        optimizer.step()
    devices = {str(t.device) for p in module.parameters() for t in (p, *optimizer.state[p].values())}
    out = {"adascale_gains": [s.gain for s in adascale.history], "adascale_tau": adascale.tau,
           "adascale_lrs": [s.lr for s in adascale.history], "adascale_params": _flat(module)}
    module, model = _seeded_linear(device, wrap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    gns = GradientNoiseScale(model, per_device_batch_size=4, accumulation_steps=2, every=1)
    ramp = BatchRamp(model, optimizer, gns, max_accumulation_steps=16, rule="linear", interval=4)
    batches = _micro_batches(x, y, 4)
    while ramp.steps < 40:
        inputs, targets = next(batches)
        with ramp.accumulate():
            (F.mse_loss(model(inputs), targets) / ramp.accumulation_steps).backward()
        if ramp.should_step():
            gns.step()
            optimizer.step()
            optimizer.zero_grad()
    devices |= {str(p.device) for p in module.parameters()}
    return {**out, "ramp_changes": [(c.step, c.accumulation_steps) for c in ramp.changes],
            "ramp_b_simple": [c.b_simple for c in ramp.changes], "ramp_params": _flat(module),
            "devices": sorted(devices)}


def _flat(module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()


def _adapt_on_rank(ctx) -> dict:
    on_gpu = _adapted(ctx.device, lambda m: DistributedDataParallel(m, device_ids=ctx.device_ids))
    return {"gpu": on_gpu, "cpu": _adapted(torch.device("cpu"), lambda m: m)}


@pytest.mark.timeout(300)
def test_adascale_and_the_batch_ramp_drive_a_cuda_loop_as_a_cpu_one():
    """In a CUDA training loop (DDP on one NCCL rank, the noise scale over two micro-batches), AdaScale's gains
    stay within [1, S] and advance τ by their sum, and the ramp grows the batch; gains, lrs, changes and final
    weights equal the same loop's on the CPU (float64)."""
    [both] = launch(_adapt_on_rank, ONE_RANK)
    gpu, cpu = both["gpu"], both["cpu"]
    assert gpu["devices"] == ["cuda:0"] and cpu["devices"] == ["cpu"]
    gains = gpu["adascale_gains"]
    assert len(gains) == 30 and all(1 <= g <= 2 for g in gains) and max(gains) > 1.1
    assert math.isclose(gpu["adascale_tau"], sum(gains), rel_tol=1e-12)
    assert all(math.isclose(lr, 0.02 * g, rel_tol=1e-12) for lr, g in zip(gpu["adascale_lrs"], gains))
    assert gpu["ramp_changes"] and gpu["ramp_changes"] == cpu["ramp_changes"]
    for key in ("adascale_gains", "adascale_params", "ramp_b_simple", "ramp_params"):
        assert max(abs(a - b) for a, b in zip(gpu[key], cpu[key], strict=True)) <= 1e-9, key


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake, expected", [(False, {}), (True, {"NO_ALLREDUCE": "error",
                                                                    "PARAMS_DIVERGED": "error"})])
def test_the_auditor_digests_cuda_tensors(mistake, expected, tmp_path):
    """ddplab audit on a script whose two ranks train on the GPU: the bypassed wrapper is found from the CUDA
    tensors' digests, and the correct loop has nothing at warning level or above."""
    device_file, report_file = tmp_path / "device.txt", tmp_path / "audit.json"
    code = main(["audit", "--json-file", str(report_file), "--", sys.executable, CUDA_SCRIPT,
                 "--out", str(device_file), *(["--bypass"] if mistake else [])])
    report = json.loads(report_file.read_text())
    assert code == 0 and device_file.read_text() == "cuda:0"
    assert report["world_size"] == 2 and report["steps_audited"] == 5
    serious = {f["code"]: f["severity"] for f in report["findings"] if f["severity"] in ("error", "warning")}
    assert serious == expected
