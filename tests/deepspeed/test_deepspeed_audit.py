"""ddplab audit and noise on DeepSpeed programs (tests/deepspeed/corpus), ZeRO 0-3, through torchrun: each planted
mistake gets exactly its finding, each correct program none, and the program's own output is what it prints
unaudited; the noise scale of noiseless regression under ZeRO 0-2 is D + 1 within its interval.

DeepSpeed compiles a small CPU op the first time it initialises on a machine (about 3 minutes here), then caches it
in torch's extensions folder (the suite's, outside the clone: tests/conftest.py): tests/deepspeed/conftest.py does
that once, before any test's own bound starts.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("deepspeed")

import ddplab  # noqa: E402
from ddplab.runtime import timescale  # noqa: E402

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ddplab.__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
GLOO_EXIT_ABORT = "terminate called without an active exception"  # gloo's exit race (tests/conftest.py)
RUN_S = 240

# (script and flags) → the findings at warning level and above it must give: {} for a correct program.
CORRECT = {
    "loop_zero0": ("engine_loop.py", "--stage", "0"),
    "loop_zero1": ("engine_loop.py", "--stage", "1"),
    "loop_zero2_deepspeed_scheduler": ("engine_loop.py", "--stage", "2", "--scheduler", "deepspeed"),
    "loop_zero3": ("engine_loop.py", "--stage", "3"),
    # A global token count × world, given to engine.backward(loss, scale_wrt_gas=False): exactly the global mean.
    "lm_global_count_zero2": ("engine_lm.py", "--stage", "2"),
    "lm_global_count_zero3": ("engine_lm.py", "--stage", "3"),
    # Accelerate's DeepSpeed plugin and the Transformers Trainer's deepspeed= end in the same engine.
    "accelerate_zero3": ("accelerate_ds.py", "--stage", "3"),
    "trainer_zero2": ("trainer_ds.py", "--stage", "2"),
}
MISTAKES = {
    "loop_sum_zero1": (("engine_loop.py", "--stage", "1", "--loss", "sum"), {"SUM_REDUCTION": "warning"}),
    "loop_sum_zero3": (("engine_loop.py", "--stage", "3", "--loss", "sum"), {"SUM_REDUCTION": "warning"}),
    # The user's own / accumulation on top of engine.backward's.
    "loop_divided_twice_zero2": (("engine_loop.py", "--stage", "2", "--loss", "divided-by-accum"),
                                 {"ACCUMULATION_DIVIDED_TWICE": "warning"}),
    "loop_same_data_zero2": (("engine_loop.py", "--stage", "2", "--sampler", "none"),
                             {"SAME_DATA_ON_ALL_RANKS": "error"}),
    "loop_no_set_epoch_zero2": (("engine_loop.py", "--stage", "2", "--no-set-epoch"), {"SET_EPOCH_MISSING": "warning"}),
    "lm_token_mean_zero2": (("engine_lm.py", "--stage", "2", "--loss", "token-mean"),
                            {"LOSS_NORMALISED_PER_MICRO_BATCH": "warning"}),
    # The same mean divided by the accumulation steps too, before engine.backward divides again: both effects.
    "lm_token_mean_gas_zero2": (("engine_lm.py", "--stage", "2", "--loss", "token-mean-gas"),
                                {"LOSS_NORMALISED_PER_MICRO_BATCH": "warning",
                                 "ACCUMULATION_DIVIDED_TWICE": "warning"}),
    "lm_token_mean_zero3_no_accumulation": (("engine_lm.py", "--stage", "3", "--loss", "token-mean",
                                             "--accumulation", "1"), {"LOSS_NORMALISED_PER_DEVICE": "warning"}),
    # The global-count recipe given to a plain engine.backward, which divides by the accumulation steps again.
    "lm_global_count_divided_twice_zero2": (("engine_lm.py", "--stage", "2", "--loss", "global-gas"),
                                            {"ACCUMULATION_DIVIDED_TWICE": "warning"}),
    "accelerate_sum_zero2": (("accelerate_ds.py", "--stage", "2", "--loss", "sum"), {"SUM_REDUCTION": "warning"}),
    # A compute_loss override dividing each micro-batch's token loss by its own count.
    "trainer_rank_mean_zero2": (("trainer_ds.py", "--stage", "2", "--mistake", "rank-mean"),
                                {"LOSS_NORMALISED_PER_MICRO_BATCH": "warning"}),
}
# What a fix says on DeepSpeed's engine, whose backward divides by the accumulation steps itself: its own recipe, or
# the framework's that drives the engine.
FIXES = {"lm_token_mean_zero2": "engine.backward(loss_sum * dp_size / count, scale_wrt_gas=False)",
         "lm_token_mean_gas_zero2": "engine.backward(loss_sum * dp_size / count, scale_wrt_gas=False)",
         "trainer_rank_mean_zero2": "TrainingArguments(average_tokens_across_devices=True)"}
# What `ddplab audit` itself prints: its report lines, told apart from the program's own.
REPORT_LINE = re.compile(r"^(ddplab audit\b|\[rank \d+, after |\s*(ERROR|WARNING|INFO)\b|\s*fix:|"
                         r"\s*no [\w -]+ mistakes found)")


def _env() -> dict:
    # The op's build folder is the suite's (tests/conftest.py: outside the clone, one per interpreter).
    return dict(os.environ, DS_ACCELERATOR="cpu",
                PYTHONPATH=os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))


def _run(command: list[str], bound: float = RUN_S) -> subprocess.CompletedProcess:
    """Run in the corpus folder; a run that gloo aborted at exit, and only so, runs once more."""
    def once():
        return subprocess.run(command, cwd=CORPUS, env=_env(), capture_output=True, text=True,
                              timeout=timescale.scaled(bound))

    done = once()
    return once() if done.returncode != 0 and GLOO_EXIT_ABORT in done.stderr else done


def _audit(args: tuple[str, ...]) -> tuple[subprocess.CompletedProcess, dict]:
    with tempfile.TemporaryDirectory(prefix="ds-audit-") as tmp:
        path = os.path.join(tmp, "audit.json")
        run = _run([sys.executable, "-m", "ddplab", "audit", "--json-file", path, "--", *TORCHRUN, *args])
        assert run.returncode == 0, run.stderr[-3000:]
        with open(path) as fh:
            return run, json.load(fh)


def _serious(report: dict) -> dict[str, str]:
    return {f["code"]: f["severity"] for f in report["findings"] if f["severity"] in ("error", "warning")}


# DeepSpeed's own log lines carry the time they were written.
DEEPSPEED_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] ")


def _program_lines(stdout: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if not (REPORT_LINE.match(line) or DEEPSPEED_LOG.match(line)))


@pytest.mark.timeout(2 * RUN_S + 60)
@pytest.mark.parametrize("name", sorted(CORRECT))
def test_a_correct_deepspeed_program_is_clean_and_runs_unchanged(name):
    args = CORRECT[name]
    audited, report = _audit(args)
    assert _serious(report) == {}, report["findings"]
    stage = args[args.index("--stage") + 1]
    assert report["strategy"] == f"deepspeed-zero{stage}" and report["data_parallel_size"] == 2
    assert report["steps_audited"] == 5 and report["reduction"]["divisor"] == 2.0
    # Rank 0's report in the run after the 5 audited steps, as on DDP, naming the engine.
    assert f"[rank 0, after 5 steps] ddplab audit: world size 2, DeepSpeed ZeRO-{stage}" in audited.stderr
    assert f"\nno DeepSpeed ZeRO-{stage} mistakes found in the first 5 steps" in audited.stderr
    if name == "loop_zero2_deepspeed_scheduler":
        # The header's lr is the configured one, WarmupDecayLR's warmup_max_lr, not a point its warmup passed.
        assert report["lr"] == 1e-2
    # The engine's own numbers: micro-batch 4 × accumulation 2 × 2 ranks (ds_config.json; the Trainer fills "auto").
    assert report["global_batch_size"] == 16
    if name in ("loop_zero2_deepspeed_scheduler", "lm_global_count_zero3"):
        plain = _run([*TORCHRUN, *args])
        assert plain.returncode == 0 and _program_lines(audited.stdout) == _program_lines(plain.stdout)


@pytest.mark.timeout(RUN_S + 60)
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_a_planted_deepspeed_mistake_gets_exactly_its_finding(name):
    args, expected = MISTAKES[name]
    _, report = _audit(args)
    assert _serious(report) == expected, report["findings"]
    headline = f"DeepSpeed ZeRO-{args[args.index('--stage') + 1]} (data-parallel size 2)"
    assert headline in next(f["message"] for f in report["findings"] if f["code"] == "RUN_INFO")
    if name in FIXES:
        code = next(iter(expected))
        assert FIXES[name] in next(f["fix"] for f in report["findings"] if f["code"] == code)


NOISE_SCRIPTS = os.path.join(os.path.dirname(CORPUS), os.pardir, "noise", "scripts")


@pytest.mark.timeout(2 * RUN_S + 60)
@pytest.mark.parametrize("stage, accumulation", [(3, 2), (2, 2), (1, 2), (0, 1)])
def test_noise_under_deepspeed_finds_d_plus_one_for_noiseless_regression(stage, accumulation):
    sys.path.insert(0, NOISE_SCRIPTS)
    try:
        import regression
    finally:
        sys.path.remove(NOISE_SCRIPTS)
    with tempfile.TemporaryDirectory(prefix="ds-noise-") as tmp:
        path = os.path.join(tmp, "noise.json")
        script = os.path.join(NOISE_SCRIPTS, "regression_deepspeed.py")
        run = _run([sys.executable, "-m", "ddplab", "noise", "--json-file", path, "--start-step", "3", "--steps", "50",
                    "--", *TORCHRUN, script, "--stage", str(stage), "--accumulation", str(accumulation)], 2 * RUN_S)
        assert run.returncode == 0, run.stderr[-3000:]
        with open(path) as fh:
            out = json.load(fh)
    low, high = out["b_simple_ci95"]
    assert low <= regression.D + 1 <= high and high - low < regression.D + 1, out["b_simple"]
    # ZeRO 2-3 reduce every micro-batch: the small batch is one micro-batch of 16, the big one the global 64.
    assert (out["strategy"], out["data_parallel_size"], out["per_device_batch_size"], out["accumulation_steps"],
            out["global_batch_size"]) == (f"deepspeed-zero{stage}", 2, 16, accumulation, 32 * accumulation)
    assert out["measured_steps"] == 50 and out["left_out"] == {}


def test_zero3s_reduction_is_where_the_noise_guest_reads_it_in_this_deepspeed():
    """The private method the ZeRO-3 tap wraps exists in the pinned DeepSpeed (else the guest disarms, saying so)."""
    import deepspeed.runtime.zero.stage3  # noqa: F401 - the engine imports it when it configures ZeRO-3

    from ddplab.noise.guest import deepspeed_tap

    stage3 = deepspeed_tap.zero3_optimizer()
    assert stage3 is not None and stage3.__name__ == "DeepSpeedZeroOptimizer_Stage3"
