"""Branches from checkpoints: the known answer on noiseless regression, torch.optim's trajectory from a saved
state, checkpoint files against the reference run's own states, and bad checkpoints refused before anything trains."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from ddplab.cli.main import main
from ddplab.errors import UsageError
from ddplab.study import optim, orders, workloads
from ddplab.study.branched import loading as branched_loading
from ddplab.study.branched import measurement as branched_measurement
from ddplab.study.branched import reference as branched_reference
from ddplab.study.branched.config import BranchConfig
from ddplab.study.config import OptimizerConfig, StudyConfig, StudyOptions, Target
from ddplab.study.engines import vmap_branches

DIM, REFERENCE = 16, 2


def _regression_config(**fields) -> StudyConfig:
    # Plain SGD at the reference batch's best lr B/(2(B + d + 1)), where the regression's theory holds.
    return StudyConfig(target=Target(kind="loss", value=1e-4), reference_global_batch_size=REFERENCE,
                       reference_lr=REFERENCE / (2 * (REFERENCE + DIM + 1)), optimizer=OptimizerConfig(momentum=0.0),
                       seeds=3, dtype="float64", **fields)


def _efficiency_critical_batch(dim: int, lag: float, batches: tuple[int, ...]) -> int:
    """The exact answer for a lag tolerance: at the best lr, E|e|² falls by (d + 1)/(B + d + 1) per step, so per
    sample at the rate log(1 + B/(d + 1))/B; a batch matches while its rate is at least (1 − lag) × the reference's."""
    rate = {b: math.log(1 + b / (dim + 1)) / b for b in batches}
    return max(b for b in batches if rate[b] >= (1 - lag) * rate[batches[0]])


@pytest.mark.timeout(60)
def test_on_noiseless_regression_the_lag_critical_batch_is_the_exact_one_and_near_b_simple(tmp_path):
    workload = workloads.regression(dim=DIM)
    config = _regression_config()
    fractions = (0.1, 0.3, 0.6)
    calls = []
    lagged = branched_measurement.measure(workload, config, BranchConfig(branch_at=fractions, branch_samples=256,
                                                                         branch_lag=0.5, branch_lr_rule="sqrt"),
                                          StudyOptions(out=str(tmp_path)),
                                          progress=lambda done, total, status="": calls.append((done, total)))
    values = lagged.to_json()
    # The progress bar moves forward to its total: the reference run's budget, then every branch step, and those of
    # the lrs past a sweep's edge.
    extended = sum((len(row["lrs"]) - 3) * 256 // row["global_batch_size"] for found in values["branches"]
                   for row in found["batches"])
    assert calls[-1][0] == calls[-1][1] == \
        2 * config.max_steps + 3 * sum(256 // b for b in (2, 4, 8, 16, 32, 64)) + extended
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    batches = tuple(values["global_batch_sizes"])
    assert batches == (2, 4, 8, 16, 32, 64)
    exact = _efficiency_critical_batch(DIM, 0.5, batches)
    assert exact == 32
    run = values["reference_run"]
    assert run["reached"] and [b["samples_seen"] for b in values["branches"]] == \
        [round(f * run["steps"]) * REFERENCE for f in fractions]
    for found in values["branches"]:
        # The grid's resolution: the exact answer within one doubling, B_simple = d + 1 within a factor 2.
        assert exact / 2 <= found["critical_batch_size"] <= exact * 2, found
        assert (DIM + 1) / 2 <= found["critical_batch_size"] <= 2 * (DIM + 1), found
        low, high = found["interval"]
        assert low <= found["critical_batch_size"] <= high
        assert found["b_simple"] == pytest.approx(DIM + 1, rel=0.25)
        # Inside the grid, so a schedule step (and no note of an interval spanning it).
        assert found["resolved"] and (low, high) != (2, 64) and not any("cannot tell" in n for n in found["notes"])
    # What the measurement cost: every lr it tried at every batch it trained × 3 seeds × 256 samples, at each
    # checkpoint; past a sweep's edge the lrs go on until the best is interior.
    trained = [sum(len(row["lrs"]) for row in found["batches"]) for found in values["branches"]]
    assert all(b / a == pytest.approx(2.0) for found in values["branches"] for row in found["batches"]
               for a, b in zip(row["lrs"], row["lrs"][1:]))
    assert not any(row["lr_at_edge"] for found in values["branches"] for row in found["batches"])
    assert [found["branch_samples"] for found in values["branches"]] == [n * 3 * 256 for n in trained]
    assert values["cost"]["branch_samples"] == sum(trained) * 3 * 256
    assert values["cost"]["per_checkpoint_relative"] == pytest.approx([n * 3 * 256 / run["samples"] for n in trained])
    assert values["cost"]["relative"] == pytest.approx(values["cost"]["branch_samples"] / run["samples"])
    assert json.load(open(os.path.join(tmp_path, "branched.json")))["branches"] == json.loads(
        json.dumps(values["branches"]))
    # The seeds' own spread as the tolerance asks for no degradation beyond the seeds' noise. On this problem a
    # doubling costs per-sample progress from the first one (the rate above falls 5% from 2 to 4), compounded over
    # the branch: the judgement stops at the reference or one doubling above, far below B_simple.
    seeds = branched_measurement.measure(workload, config, BranchConfig(branch_at=fractions, branch_samples=256,
                                                          branch_lr_rule="sqrt"), StudyOptions(out=str(tmp_path)))
    every = branched_measurement.measure(workload, config, BranchConfig(branch_at=fractions, branch_samples=256,
                                                          branch_lr_rule="sqrt", branch_every_batch=True),
                           StudyOptions(out=str(tmp_path)))
    for strict, full in zip(seeds.branches, every.branches):
        # Every batch trained: the same critical batch, interval and judged rows, at the full cost.
        assert full["untrained_global_batch_sizes"] == [] and \
            full["branch_samples"] == sum(len(row["lrs"]) for row in full["batches"]) * 3 * 256
        assert (strict["critical_batch_size"], strict["interval"]) == (full["critical_batch_size"], full["interval"])
        assert strict["batches"] == full["batches"][:len(strict["batches"])]
    for strict, lenient in zip(seeds.branches, lagged.branches):
        assert strict["critical_batch_size"] <= 2 * REFERENCE < DIM + 1
        assert strict["critical_batch_size"] <= lenient["critical_batch_size"]
        # The same branches (the same seeds, samples and lrs), judged twice; the strict judgement stops doubling at
        # the first batch that misses with every seed, so it trains fewer.
        judged = len(strict["batches"])
        assert strict["untrained_global_batch_sizes"] == list(batches[judged:]) and judged < len(batches)
        assert max(strict["batches"][-1]["seed_losses"]) >= min(strict["batches"][-1]["seed_losses"]) > \
            strict["reference_loss"] + strict["tolerance"]
        assert [{**row, "matches": None} for row in strict["batches"]] == \
            [{**row, "matches": None} for row in lenient["batches"][:judged]]
        assert [row["matches"] for row in strict["batches"]] == \
            [row["global_batch_size"] == REFERENCE or row["median_loss"] <= strict["reference_loss"]
             + strict["tolerance"] for row in strict["batches"]]


@pytest.mark.timeout(60)
@pytest.mark.timeout(60)
def test_branches_never_run_past_the_reference_runs_end_by_default(tmp_path, capsys):
    # The reference run trains 65 steps of 2 (130 samples). From step 6 (12 samples) 118 are left: 8 steps fit up to
    # batch 8 (64 samples). From step 39 (78 samples) 52 are left: up to batch 4 (32).
    workload, config = workloads.regression(dim=DIM), _regression_config()
    branch = BranchConfig(branch_at=(0.1, 0.6), branch_lr_rule="sqrt", branch_every_batch=True)
    values = branched_measurement.measure(workload, config, branch, StudyOptions(out=str(tmp_path))).to_json()
    assert values["reference_run"]["samples"] == 130 and values["branch_samples"] == 8 * 64
    early, late = values["branches"]
    assert (early["samples_seen"], early["length"], late["samples_seen"], late["length"]) == (12, 64, 78, 32)
    assert [r["global_batch_size"] for r in early["batches"]] == [2, 4, 8]
    assert [r["global_batch_size"] for r in late["batches"]] == [2, 4]
    assert early["beyond_run_global_batch_sizes"] == [16, 32, 64] and late["beyond_run_global_batch_sizes"] == [
        8, 16, 32, 64]
    assert late["notes"][-1] == ("at 78 samples the reference run had 52 samples left: the branches train 32, and "
                                 "global batches 8, 16, 32, 64, whose 8 steps would not fit, are left out")
    # Each kept batch trained its lrs × 3 seeds for the checkpoint's own length.
    for found in (early, late):
        assert found["branch_samples"] == sum(len(r["lrs"]) for r in found["batches"]) * 3 * found["length"]
    # A length given is every checkpoint's, and a branch past the run's end says so.
    given = BranchConfig(branch_at=(0.6,), branch_samples=128, branch_lr_rule="sqrt", branch_doublings=2)
    past = branched_measurement.measure(workload, config, given, StudyOptions(out=str(tmp_path / "given"))).to_json()
    assert past["branches"][0]["length"] == 128 and past["branches"][0]["beyond_run_global_batch_sizes"] == []
    assert past["branches"][0]["notes"][-1] == (
        "at 78 samples the branches (128 samples) run 76 samples past the reference run's end: they judge each batch "
        "over training the run does not have, where a larger batch catches up")


@pytest.mark.parametrize("optimizer", [OptimizerConfig(momentum=0.9, nesterov=True),
                                       OptimizerConfig(family="adamw", weight_decay=0.1)])
def test_a_branch_continues_as_torch_optim_would_from_the_saved_optimizer_state(optimizer):
    workload = workloads.regression(dim=8)
    config = StudyConfig(target=Target(kind="loss", value=1e-3), reference_global_batch_size=4, reference_lr=0.02,
                         optimizer=optimizer, dtype="float64", max_steps=40)
    [checkpoint], _ = branched_reference.reference_checkpoints(workload, config, (0.5,), torch.device("cpu"),
                                                              lambda steps: None)
    assert checkpoint.optimizer["state"]  # the run had stepped: its moments or buffer travel with it
    runs, global_batch, samples = [(0.01, 0), (0.04, 1)], 8, 80
    got = vmap_branches.train_branches(workload, config, checkpoint, global_batch, runs, samples,
                                device=torch.device("cpu"))[samples // global_batch]
    inputs, targets = workload.train
    for (lr, seed), loss in zip(runs, got):
        model = workload.model().double()
        model.load_state_dict(checkpoint.model)
        torch_optimizer = optim.torch_optimizer(optimizer, model.parameters(), lr)
        # torch.optim takes the saved tensors as they are and steps them in place: a copy keeps the checkpoint.
        torch_optimizer.load_state_dict(copy.deepcopy(checkpoint.optimizer))
        for group in torch_optimizer.param_groups:
            group["lr"] = lr
        stream = orders.Stream(workload.train_size, global_batch, [seed], start=checkpoint.samples_seen)
        for step in range(samples // global_batch):
            index = stream.indices(step)[0]
            torch_optimizer.zero_grad()
            workload.loss(model(inputs[index].double()), targets[index].double()).backward()
            torch_optimizer.step()
        val_inputs, val_targets = workload.val
        with torch.no_grad():
            expected = float(workload.loss(model(val_inputs.double()), val_targets.double()))
        assert loss == pytest.approx(expected, rel=1e-10)


@pytest.mark.timeout(60)
def test_a_saved_checkpoint_branches_as_the_reference_runs_own_state_and_bad_ones_are_refused(tmp_path, capsys,
                                                                                              monkeypatch):
    workload = workloads.regression(dim=DIM)
    config = _regression_config(max_steps=200)
    [state], _ = branched_reference.reference_checkpoints(workload, config, (0.3,), torch.device("cpu"),
                                                              lambda steps: None)
    good = tmp_path / "good.pt"
    torch.save({"model": state.model, "optimizer": state.optimizer, "step": state.samples_seen // REFERENCE}, good)
    base = ["study", "--workload", "regression", "--ref-global-batch-size", str(REFERENCE), "--ref-lr",
            str(config.reference_lr), "--dtype", "float64", "--seeds", "2", "--branch-doublings", "2",
            "--branch-samples", "32", "--out", str(tmp_path / "out"), "--json"]
    assert main([*base, "--branch-from", str(good), "--no-plots"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert "plots" not in from_file and not os.path.exists(tmp_path / "out" / "branched.png")
    assert main([*base, "--branch-at", "0.3", "--max-steps", "200"]) == 0
    from_run = json.loads(capsys.readouterr().out)
    # branched.png beside branched.json, its path given as the study gives its plots.
    assert from_run["plots"] == [str(tmp_path / "out" / "branched.png")]
    with open(from_run["plots"][0], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    # branched.html beside them: the figure embedded, a row per checkpoint with its interval, the schedule.
    page = (tmp_path / "out" / "branched.html").read_text()
    point = from_run["branches"][0]
    low, high = point["interval"]
    assert 'src="data:image/png;base64,' in page and f"<td>{point['samples_seen']:,}</td>" in page
    assert f"<td>[{low}, {high}]</td>" in page and "Batch schedule (double when" in page
    assert "no: the interval spans the grid" in page if not point["resolved"] else "<td>yes</td>" in page
    monkeypatch.setenv("COLUMNS", "400")  # the path on one line
    assert main([*base[:-1], "--branch-at", "0.3", "--max-steps", "200"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"plot: {tmp_path / 'out' / 'branched.png'}"
    assert from_file["branches"][0]["samples_seen"] == from_run["branches"][0]["samples_seen"] == state.samples_seen
    assert from_file["branches"][0]["batches"] == from_run["branches"][0]["batches"]
    assert from_file["reference_run"] is None and from_file["cost"]["reference_samples"] == state.samples_seen
    # A DDP model's state_dict (every key under "module.") loads as the bare model's; a file without optimizer state
    # and one whose optimizer ran at another lr load too, each with a note that says so.
    wrapped, bare, other_lr = tmp_path / "wrapped.pt", tmp_path / "bare.pt", tmp_path / "other_lr.pt"
    torch.save({"model": {f"module.{k}": v for k, v in state.model.items()}, "optimizer": state.optimizer,
                "samples_seen": state.samples_seen}, wrapped)
    torch.save({"model": state.model, "samples_seen": state.samples_seen}, bare)
    other = copy.deepcopy(state.optimizer)
    other["param_groups"][0]["lr"] = 0.123
    torch.save({"model": state.model, "optimizer": other, "samples_seen": state.samples_seen}, other_lr)
    assert main([*base, "--branch-from", str(wrapped), str(bare), str(other_lr), "--no-plots"]) == 0
    measured = json.loads(capsys.readouterr().out)
    found = measured["branches"]
    assert [f["batches"] for f in found[::2]] == [from_file["branches"][0]["batches"]] * 2
    fresh = f"{bare} has no optimizer state: its branches start with a fresh optimizer, as a restart would"
    lr_note = (f"{other_lr}'s optimizer ran at lr 0.123, and the branches scale from the reference lr "
               f"{config.reference_lr:g}: give the run's lr there as --ref-lr")

    def cannot_tell(f):
        """The note of a checkpoint whose seeds' interval spans every batch branched (2 to 8 here)."""
        low, high = f["interval"]
        if (low, high) != (f["batches"][0]["global_batch_size"], f["batches"][-1]["global_batch_size"]):
            return []
        return [f"the branches cannot tell the critical batch at {f['samples_seen']} samples: its seeds' interval "
                f"[{low}, {high}] spans every batch branched, so the schedule takes no step from it (more seeds, or "
                "longer branches, would tell)"]

    assert [f["notes"] for f in found] == [cannot_tell(found[0]), [fresh, *cannot_tell(found[1])],
                                           [lr_note, *cannot_tell(found[2])]]
    # These short branches span the grid (2 to 8) at every checkpoint: said, and no schedule step taken from them.
    assert all(map(cannot_tell, found)) and [f["resolved"] for f in found] == [not cannot_tell(f) for f in found]
    assert [f["resolved"] for f in found] == [False] * 3
    assert measured["schedule"] == [{"samples_seen": 0, "global_batch_size": 2, "lr": config.reference_lr}]
    # The default tolerance is the seeds' spread: one seed is refused, unless a tolerance is given.
    one_seed = [*base[:base.index("--seeds")], "--seeds", "1", *base[base.index("--seeds") + 2:]]
    assert main([*one_seed, "--branch-from", str(good)]) == 2
    assert "one seed has none: give --seeds 2 or more" in capsys.readouterr().err
    assert main([*one_seed, "--branch-from", str(good), "--branch-tolerance", "0.01", "--no-plots"]) == 0
    capsys.readouterr()
    # Each bad file: one line that names the file and the key, exit 2, before any branch trains.
    os.remove(tmp_path / "out" / "branched.json")
    weight = state.model["weight"]
    bad = {"missing.pt": ({"model": {}, "samples_seen": 10}, "has no key 'weight'"),
           "shape.pt": ({"model": {"weight": torch.zeros(1, DIM + 1)}, "samples_seen": 10},
                        "key 'weight' has shape (1, 17), the workload's model (1, 16)"),
           "extra.pt": ({"model": {"weight": weight, "bias": torch.zeros(1)}, "samples_seen": 10}, "key 'bias'"),
           "unseen.pt": ({"model": {"weight": weight}}, "has no key 'samples_seen' (nor 'step', counted in "
                                                      "--ref-global-batch-size samples)"),
           "adam.pt": ({"model": {"weight": weight}, "samples_seen": 10,
                        "optimizer": {"state": {0: {"momentum_buffer": None}}, "param_groups": [{"params": [0]}]}},
                       "has no key 'exp_avg', which Adam keeps")}
    for name, (saved, key) in bad.items():
        torch.save(saved, tmp_path / name)
        extra = ["--optimizer", "adam"] if name == "adam.pt" else []
        assert main([*base, *extra, "--branch-from", str(good), str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--branch-from {tmp_path / name}" in err and key in err, err
    assert not os.path.exists(tmp_path / "out" / "branched.json")
    assert main([*base, "--branch-from", str(tmp_path / "nothing.pt")]) == 2
    assert "nothing.pt does not exist" in capsys.readouterr().err


SPEC_WITH_LOAD = '''
import torch


def _data(seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(512, 4, generator=generator)
    return torch.utils.data.TensorDataset(inputs, (inputs[:, 0] + inputs[:, 1] > 0).long())


def model():
    return torch.nn.Linear(4, 2)


def dataset():
    return _data(0)


def val_dataset():
    return _data(1)


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def load(path, model, optimizer):
    saved = torch.load(path)
    model.load_state_dict(saved["net"])
    optimizer.load_state_dict(saved["opt"])
    return saved["tokens"]
'''


@pytest.mark.timeout(60)
def test_a_specs_own_load_reads_its_checkpoints(tmp_path, capsys):
    spec = tmp_path / "spec_with_load.py"
    spec.write_text(SPEC_WITH_LOAD)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    sgd.step()
    torch.save({"net": model.state_dict(), "opt": sgd.state_dict(), "tokens": 96}, tmp_path / "run.pt")
    torch.save({"net": model.state_dict(), "opt": sgd.state_dict(), "tokens": "many"}, tmp_path / "odd.pt")
    # No target: branches from checkpoints train no run to one.
    base = ["study", str(spec), "--ref-global-batch-size", "8", "--branch-doublings", "2",
            "--branch-samples", "64", "--seeds", "2", "--out", str(tmp_path / "out"), "--json"]
    assert main([*base, "--branch-from", str(tmp_path / "run.pt")]) == 0
    found = json.loads(capsys.readouterr().out)["branches"][0]
    assert found["samples_seen"] == 96 and found["source"] == str(tmp_path / "run.pt")
    trained = [row["global_batch_size"] for row in found["batches"]]
    assert trained + found["untrained_global_batch_sizes"] == [8, 16, 32] and len(trained) >= 2
    assert main([*base, "--branch-from", str(tmp_path / "odd.pt")]) == 2
    assert "must return the samples the run had seen, an integer ≥ 0, got 'many'" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_branches_are_cached_by_checkpoint_and_setting_so_a_rerun_or_another_tolerance_trains_only_what_is_missing(
        tmp_path, monkeypatch):
    workload = workloads.regression(dim=DIM)
    config = _regression_config(max_steps=200)
    [state], _ = branched_reference.reference_checkpoints(workload, config, (0.3,), torch.device("cpu"),
                                                              lambda steps: None)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": state.model, "optimizer": state.optimizer, "samples_seen": state.samples_seen}, path)
    trained = []
    real = vmap_branches.train_branches

    def counting(workload, config, checkpoint, global_batch, runs, samples, **kwargs):
        trained.append((global_batch, len(runs)))
        return real(workload, config, checkpoint, global_batch, runs, samples, **kwargs)

    monkeypatch.setattr(vmap_branches, "train_branches", counting)

    def measure(**fields):
        options = StudyOptions(out=str(tmp_path / "out"), fresh=fields.pop("fresh", False))
        trained.clear()
        settings = dict(branch_from=(str(path),), branch_samples=64, branch_doublings=3, **fields)
        return branched_measurement.measure(workload, config, BranchConfig(**settings), options).to_json()

    first = measure()
    first_trained = list(trained)
    assert first_trained and os.listdir(tmp_path / "out" / "branches")
    # The same measurement again: every branch from the cache, the same report.
    again = measure()
    assert trained == [] and again["branches"] == first["branches"] and again["cost"] == first["cost"]
    # Another tolerance judges the same branches; the lag needs the reference batch's loss mid-branch, which the
    # cache lacks: that batch alone trains again (its lrs, and any lr past an edge it then needs).
    lagged = measure(branch_lag=0.5)
    before = {row["global_batch_size"]: {**row, "matches": None} for row in first["branches"][0]["batches"]}
    assert {batch for batch, _ in trained} == {REFERENCE} | {row["global_batch_size"] for row in
                                                           lagged["branches"][0]["batches"]} - set(before)
    assert all({**row, "matches": None} == before[row["global_batch_size"]]
               for row in lagged["branches"][0]["batches"] if row["global_batch_size"] in before)
    # A checkpoint that differs in one number is another checkpoint: nothing of the first serves it.
    changed = copy.deepcopy(state.model)
    changed["weight"][0, 0] += 1e-6
    torch.save({"model": changed, "optimizer": state.optimizer, "samples_seen": state.samples_seen}, path)
    measure()
    assert trained == first_trained
    # --fresh starts over.
    measure(fresh=True)
    assert trained == first_trained


def test_wrapped_state_dicts_lose_their_wrappers_prefixes_and_a_broken_cache_is_no_cache(tmp_path):
    from ddplab.study.branched.cache import BranchCache

    bare = {"weight": 1, "bias": 2}
    # DDP inside torch.compile, compile inside DDP, and a model whose own child is called "module".
    assert branched_loading._unwrapped({f"_orig_mod.module.{k}": v for k, v in bare.items()}, set(bare)) == bare
    assert branched_loading._unwrapped({f"module._orig_mod.{k}": v for k, v in bare.items()}, set(bare)) == bare
    own = {"module.weight": 1, "module.bias": 2}
    assert branched_loading._unwrapped(own, set(own)) == own
    # Edited or broken entries read as missing, and a good entry of the same file still serves.
    cache = BranchCache(str(tmp_path), {"workload": "w"})
    cache.save("ckpt", 8, [(0.1, 0), (0.2, 0)], {4: [1.5, math.inf]})
    assert cache.load("ckpt", 8, [(0.1, 0), (0.2, 0)], {4}) == {4: [1.5, math.inf]}
    [path] = [os.path.join(cache.directory, name) for name in os.listdir(cache.directory)]
    with open(path) as fh:
        saved = json.load(fh)
    saved["runs"]["0.2|0"] = 3.0
    saved["runs"]["0.4|0"] = {"4": "x"}
    with open(path, "w") as fh:
        json.dump(saved, fh)
    assert cache.load("ckpt", 8, [(0.1, 0), (0.2, 0)], {4}) is None
    assert cache.load("ckpt", 8, [(0.1, 0)], {4}) == {4: [1.5]}
    # By group (the vectorized engine: dropout's masks depend on the group), another group is another file.
    grouped = BranchCache(str(tmp_path / "grouped"), {"workload": "w"}, by_group=True)
    grouped.save("ckpt", 8, [(0.1, 0), (0.2, 0)], {4: [1.5, 2.5]})
    assert grouped.load("ckpt", 8, [(0.1, 0)], {4}) is None
    assert grouped.load("ckpt", 8, [(0.2, 0), (0.1, 0)], {4}) is None
    assert grouped.load("ckpt", 8, [(0.1, 0), (0.2, 0)], {4}) == {4: [1.5, 2.5]}
    cache.save("ckpt", 8, [(0.2, 0)], {4: [2.5]})
    assert cache.load("ckpt", 8, [(0.1, 0), (0.2, 0)], {4}) == {4: [1.5, 2.5]}
    # A cache that cannot be kept is said before anything trains.
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="cannot keep the branches' cache"):
        BranchCache(str(tmp_path / "file"), {})
