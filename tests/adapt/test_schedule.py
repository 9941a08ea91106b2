"""BatchSchedule: the schedule read every way it is written, the accumulation, lr and samples seen at each threshold
exactly (one process and 2 DDP ranks through the launch layer), checkpoints, and what it refuses."""

import doctest
import json
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from ddplab.adapt import thresholds
from ddplab.adapt.schedule import BatchSchedule
from ddplab.errors import UsageError
from ddplab.runtime.launch import LaunchConfig, launch

SCHEDULE = [{"samples_seen": 0, "global_batch_size": 4, "lr": 0.1},
            {"samples_seen": 16, "global_batch_size": 8, "lr": 0.2},
            {"samples_seen": 40, "global_batch_size": 16, "lr": 0.4}]
# At 4 samples a step, 16 are reached after step 4; then at 8 a step, 40 after step 7 (both 1-based).
SAMPLES_SEEN = [4, 8, 12, 16, 24, 32, 40, 56, 72, 88]
ACCUMULATION = [1, 1, 1, 1, 2, 2, 2, 4, 4, 4]  # with 2 ranks × 2 samples per micro-step
# The optimizer's lr 0.1 × the entry's lr over the first's, over a warmup of 2 steps after each change.
LRS = [0.1, 0.1, 0.1, 0.1, 0.15, 0.2, 0.2, 0.3, 0.4, 0.4]


def test_the_pure_modules_doctests_hold():
    assert doctest.testmod(thresholds).failed == 0


def _train(ctx, schedule, per_device_batch_size: int, steps: int):
    """SGD in float64 under a BatchSchedule; beside it, the same updates computed from each whole global batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    reference = torch.nn.Linear(3, 1, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model) if ctx.world_size > 1 else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    plan = BatchSchedule(ddp, optimizer, schedule, per_device_batch_size=per_device_batch_size, warmup_steps=2)
    lrs, windows = [], []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    x = torch.randn(1024, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = x.sum(1, keepdim=True) + torch.randn(1024, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    micro, taken, record = per_device_batch_size * ctx.world_size, 0, []
    while len(record) < steps:
        # Micro-step m: this rank's slice of the global stream's m-th block (what a DistributedSampler would give).
        start = taken * micro + ctx.rank * per_device_batch_size
        with plan.accumulate():
            loss = torch.nn.functional.mse_loss(ddp(x[start:start + per_device_batch_size]),
                                                y[start:start + per_device_batch_size])
            (loss / plan.accumulation_steps).backward()
        taken += 1
        if plan.should_step():
            window = plan.global_batch_size
            optimizer.step()
            optimizer.zero_grad()
            # The reference: one step on the mean loss of the window's whole global batch, at the lr recorded.
            block = slice(taken * micro - window, taken * micro)
            torch.nn.functional.mse_loss(reference(x[block]), y[block]).backward()
            with torch.no_grad():
                for p, q in zip(reference.parameters(), model.parameters()):
                    p -= lrs[-1] * p.grad
                    p.grad = None
                    assert torch.allclose(p, q, rtol=0, atol=1e-12)
            windows.append(window)
            record.append((plan.samples_seen, plan.accumulation_steps))
    return record, lrs, windows, plan.state_dict(), [p.detach().clone() for p in model.parameters()]


def _on_two_ranks(ctx):
    """The schedule on DDP, then what the ranks refuse: an entry that the 4 samples of a micro-step do not divide."""
    out = _train(ctx, SCHEDULE, per_device_batch_size=2, steps=len(SAMPLES_SEEN))
    with pytest.raises(UsageError) as info:
        BatchSchedule(DistributedDataParallel(torch.nn.Linear(1, 1)), torch.optim.SGD([torch.zeros(1)], lr=0.1),
                      "0:4 16:6", per_device_batch_size=2)
    return out, str(info.value)


@pytest.mark.timeout(120)
def test_on_two_ddp_ranks_the_accumulation_lr_and_samples_change_exactly_at_the_thresholds():
    results = launch(_on_two_ranks, LaunchConfig(world_size=2))
    (record, lrs, windows, state, params), refused = results[0]
    assert [r[0] for r in record] == SAMPLES_SEEN
    # The accumulation after each step: the one for the next window, from the threshold reached.
    assert [r[1] for r in record] == ACCUMULATION[1:] + [4]
    assert windows == [4 * a for a in ACCUMULATION]
    assert lrs == pytest.approx(LRS, rel=1e-12)
    # Each update equalled one step on the whole global batch (checked on the ranks); both ranks agree throughout.
    assert all(torch.equal(a, b) for a, b in zip(params, results[1][0][4]))
    assert results[1][0][:4] == results[0][0][:4]
    assert [(c["step"], c["samples_seen"], c["entry"], c["global_batch_size"]) for c in state["changes"]] == \
        [(3, 16, 1, 8), (6, 40, 2, 16)]
    assert refused == ("schedule entry 1 (global batch 6 from 16 samples) is not a multiple of the 4 samples one "
                       "micro-step trains (per-device batch × data-parallel size): change the entry or the per-device "
                       "batch")
    assert results[1][1] == refused


def test_on_one_process_the_same_schedule_needs_twice_the_accumulation():
    record, lrs, windows, _, _ = _train(_OneRank(), SCHEDULE, per_device_batch_size=2, steps=10)
    assert [r[0] for r in record] == SAMPLES_SEEN and windows == [4 * a for a in ACCUMULATION]
    assert [r[1] for r in record] == [2 * a for a in ACCUMULATION[1:] + [4]]
    assert lrs == pytest.approx(LRS, rel=1e-12)


class _OneRank:
    rank, world_size = 0, 1


def test_a_checkpoint_resumes_the_same_batch_warmup_and_samples():
    param = torch.nn.Parameter(torch.zeros(1))
    model = torch.nn.Linear(1, 1)
    plan = BatchSchedule(model, torch.optim.SGD([param], lr=0.1), SCHEDULE, per_device_batch_size=4, warmup_steps=4)
    optimizer = plan.optimizer
    param.grad = torch.zeros(1)
    for _ in range(5):  # 4 steps at 4 samples reach 16; the fifth is the first of the warmup toward ×2
        optimizer.step()
    assert (plan.samples_seen, plan.accumulation_steps, plan.lr_factor()) == (24, 2, 1.5)
    state = json.loads(json.dumps(plan.state_dict()))  # a checkpoint may store it as JSON
    resumed = BatchSchedule(model, torch.optim.SGD([param], lr=0.1), SCHEDULE, per_device_batch_size=4,
                            warmup_steps=4)
    resumed.load_state_dict(state)
    assert (resumed.samples_seen, resumed.accumulation_steps, resumed.global_batch_size, resumed.entry) == \
        (24, 2, 8, 1)
    assert resumed.lr_factor() == plan.lr_factor() == 1.5 and resumed.changes == plan.changes
    # Both go on alike: two more steps reach 40 samples, the last entry.
    for p in (plan, resumed):
        p.optimizer.step()
        p.optimizer.step()
    assert plan.state_dict() == resumed.state_dict() and resumed.accumulation_steps == 4
    # Resumed at a sample count by hand, the schedule starts at the entry in force there, without a warmup.
    later = BatchSchedule(model, torch.optim.SGD([param], lr=0.1), SCHEDULE, per_device_batch_size=4,
                          samples_seen=100, warmup_steps=4)
    assert (later.entry, later.accumulation_steps, later.lr_factor()) == (2, 4, 4.0)


def test_the_megatron_string_and_a_json_list_are_read_as_the_list():
    parsed = thresholds.parse("0:4 16:8   40:16")
    assert [(t.samples_seen, t.global_batch_size, t.lr) for t in parsed] == [(0, 4, None), (16, 8, None),
                                                                           (40, 16, None)]
    assert parsed == tuple(thresholds.Threshold(t["samples_seen"], t["global_batch_size"]) for t in SCHEDULE)
    plan = BatchSchedule(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1), "0:4 16:8 40:16",
                         per_device_batch_size=2)
    # No lrs in a Megatron string: the optimizer's own lr throughout.
    assert plan.entry_accumulation_steps == (2, 4, 8) and plan.entry_lr_factors == (1.0, 1.0, 1.0)


def test_a_bad_schedule_is_refused_in_one_sentence_naming_the_entry(tmp_path):
    optimizer = torch.optim.SGD([torch.zeros(1)], lr=0.1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schedule": 3}')
    for schedule, message in (
            ("0:4 16:6", "schedule entry 1 (global batch 6 from 16 samples) is not a multiple of the 4 samples"),
            ("0:4 16", "schedule entry 1 '16' must be SAMPLES:BATCH (two integers), as in '0:32 416:64'"),
            ("8:4 16:8", "schedule entry 0 starts at samples_seen 8: the first must be at 0"),
            ("0:4 16:8 16:16", "schedule entry 2 at samples_seen 16 does not come after entry 1 at 16"),
            ([{"samples_seen": 0, "global_batch_size": 4, "lr": 0}], "schedule entry 0 has lr 0: it must be a "
                                                                      "positive number"),
            ([{"samples_seen": 0, "global_batch_size": 4}, {"samples_seen": 4, "global_batch_size": 8, "lr": 0.1}],
             "schedule entry 0 has no lr but later ones do"),
            ([{"samples_seen": 0}], "schedule entry 0 must be a dict with samples_seen and global_batch_size"),
            ([], "schedule must be a non-empty list of entries"),
            (str(bad), "holds neither a list of entries nor a 'schedule' key"),
            (str(tmp_path / "missing.json"), "cannot be read as JSON")):
        with pytest.raises(UsageError) as info:
            BatchSchedule(torch.nn.Linear(1, 1), optimizer, schedule, per_device_batch_size=4)
        assert message in str(info.value) and str(info.value).count(". ") == 0, str(info.value)
    for kwargs, message in (({"per_device_batch_size": 0}, "per_device_batch_size must be an integer ≥ 1, got 0"),
                            ({"per_device_batch_size": 4, "warmup_steps": -1}, "warmup_steps must be an integer"),
                            ({"per_device_batch_size": 4, "samples_seen": 1.5}, "samples_seen must be an integer")):
        with pytest.raises(UsageError, match=message):
            BatchSchedule(torch.nn.Linear(1, 1), optimizer, "0:4", **kwargs)
    # Nothing was hooked by a refused schedule: the optimizer steps at its own lr.
    assert not optimizer._optimizer_step_pre_hooks


@pytest.mark.timeout(120)
def test_the_schedule_a_branched_study_writes_is_followed_from_its_file(tmp_path):
    from ddplab.study import workloads
    from ddplab.study.branched import measurement as branched_measurement
    from ddplab.study.branched.config import BranchConfig
    from ddplab.study.config import OptimizerConfig, StudyConfig, StudyOptions, Target

    # The noiseless regression of docs/study/branched.md with the lag criterion: "0:2 12:32", lrs 0.05 and 0.4.
    config = StudyConfig(target=Target(kind="loss", value=1e-4), reference_global_batch_size=2, reference_lr=0.05,
                         optimizer=OptimizerConfig(momentum=0.0), seeds=3, dtype="float64")
    branched_measurement.measure(workloads.regression(dim=16), config,
                   BranchConfig(branch_at=(0.1, 0.3, 0.6), branch_samples=256, branch_lag=0.5, branch_lr_rule="sqrt"),
                   StudyOptions(out=str(tmp_path)))
    written = json.load(open(os.path.join(tmp_path, "branched.json")))
    steps = written["schedule"]
    assert len(steps) >= 2 and steps[0]["global_batch_size"] == 2 and steps[0]["lr"] == 0.05
    param = torch.nn.Parameter(torch.zeros(1))
    plan = BatchSchedule(torch.nn.Linear(1, 1), torch.optim.SGD([param], lr=0.05),
                         os.path.join(tmp_path, "branched.json"), per_device_batch_size=1)
    assert plan.entry_accumulation_steps == tuple(s["global_batch_size"] for s in steps)
    assert plan.entry_lr_factors == pytest.approx([s["lr"] / 0.05 for s in steps], rel=1e-12)
    # Its Megatron string, beside it in the file, gives the same thresholds.
    assert [(t.samples_seen, t.global_batch_size) for t in thresholds.parse(written["step_batch_size_schedule"])] \
        == [(s["samples_seen"], s["global_batch_size"]) for s in steps]
    # Followed: each step trains its entry's batch at its lr until the next threshold is reached.
    lrs = []
    plan.optimizer.register_step_pre_hook(lambda opt, a, k: lrs.append(opt.param_groups[0]["lr"]))
    param.grad = torch.zeros(1)
    batches = []
    while plan.samples_seen < steps[-1]["samples_seen"] + 3 * steps[-1]["global_batch_size"]:
        batches.append(plan.global_batch_size)
        plan.optimizer.step()
    expected, seen = [], 0
    for batch in batches:
        entry = max(i for i, s in enumerate(steps) if s["samples_seen"] <= seen)
        expected.append((steps[entry]["global_batch_size"], steps[entry]["lr"]))
        seen += batch
    assert batches == [b for b, _ in expected] and lrs == pytest.approx([lr for _, lr in expected], rel=1e-12)
