"""ddplab audit on a gallery of buggy scripts (gallery/), through torchrun, mp.spawn and fork.

Each mistake must be found with its code and severity, and nothing else at warning level or
above; the correct twin (and ddplab's own deterministic sandbox) must give no warning or error.
"""

import json
import os
import signal
import sys
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from ddplab.auditor import findings, rendering
from ddplab.cli.main import main
from ddplab.runtime.launch import LaunchConfig, launch
from ddplab.runtime.timescale import scaled

GALLERY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gallery")
# --standalone: a free port for the rendezvous, so launches never meet on torchrun's default 29500.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

EXPECTED = {
    "correct": {},
    "bypass": {"NO_ALLREDUCE": "error", "PARAMS_DIVERGED": "error"},
    "temporary_wrapper": {"NO_ALLREDUCE": "error", "PARAMS_DIVERGED": "error"},
    "no_sampler": {"SAME_DATA_ON_ALL_RANKS": "error"},
    "no_set_epoch": {"SET_EPOCH_MISSING": "warning"},
    "sum_reduction": {"SUM_REDUCTION": "warning"},
    "batchnorm": {},  # per-rank statistics are a choice, not a mistake: an info (checked below)
    "accumulation": {"ACCUMULATION_SYNCS_EVERY_STEP": "warning"},
}


def _audit(tmp_path, command, *flags):
    report = tmp_path / "audit.json"
    code = main(["audit", "--json-file", str(report), *flags, "--", *command])
    return code, json.loads(report.read_text())


def _serious(report):
    return {f["code"]: f["severity"] for f in report["findings"] if f["severity"] in ("error", "warning")}


# torchrun for the correct script (its agent and workers all load the auditor; the corpus runs five more programs
# under it) and fork for the mistakes, which starts the ranks from one process that imported torch once: the same
# findings, at a third of the start-up.
LAUNCHER = {"correct": "torchrun"}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_each_mistake_is_found(script, tmp_path, monkeypatch):
    monkeypatch.chdir(GALLERY)
    launcher = LAUNCHER.get(script, "fork")
    command = [*TORCHRUN, f"{script}.py"] if launcher == "torchrun" else \
        [sys.executable, f"{script}.py", "--launcher", launcher]
    code, report = _audit(tmp_path, command)
    assert code == 0
    assert _serious(report) == EXPECTED[script]
    assert report["world_size"] == 2 and report["steps_audited"] == 5 and report["lr"] > 0
    for finding in report["findings"]:
        assert finding["ranks"] == [0, 1] and finding["message"] and finding["fix"] is not None
    if script == "batchnorm":
        severities = {f["code"]: f["severity"] for f in report["findings"]}
        assert severities.get("BATCHNORM_NOT_SYNCED") == "info"
    if script == "correct":
        assert report["global_batch_size"] == 64  # 16 per rank × 2 ranks × 2 accumulation steps
        assert ({"BATCHNORM_NOT_SYNCED": "info"}.items()
                <= {f["code"]: f["severity"] for f in report["findings"]}.items())


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("script, strict_code", [("temporary_wrapper", 3), ("correct", 0)])
def test_ranks_started_by_mp_spawn_are_audited_too(script, strict_code, tmp_path, monkeypatch):
    monkeypatch.chdir(GALLERY)
    code, report = _audit(tmp_path, [sys.executable, f"{script}.py", "--launcher", "spawn"], "--strict")
    assert code == strict_code
    assert _serious(report) == EXPECTED[script]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_deterministic_sandbox_is_clean_and_the_bypass_is_caught(tmp_path):
    code, report = _audit(tmp_path, [*TORCHRUN, "-m", "ddplab", "sandbox", "multi", "--batch-size", "16"])
    assert code == 0 and _serious(report) == {}
    # ddplab's own launcher: ranks forked from the audited process carry the auditor with them.
    _, report = _audit(tmp_path, [sys.executable, "-m", "ddplab", "sandbox", "multi", "--world-size", "2", "--noisy",
                                  "--bypass-ddp", "--n-experiments", "100"])
    assert _serious(report) == {"NO_ALLREDUCE": "error", "PARAMS_DIVERGED": "error"}


def test_audit_passes_the_commands_exit_code_through(capsys, tmp_path):
    report = tmp_path / "report.json"
    assert main(["audit", "--json-file", str(report), "--", sys.executable, "-c",
                 "import torch; raise SystemExit(7)"]) == 7
    assert "no DistributedDataParallel model was built" in capsys.readouterr().err
    # Nothing to audit, and the report is still written: no findings, and RUN_INFO says why.
    written = json.loads(report.read_text())
    assert written["audited"] is False and written["steps_audited"] == 0
    assert [(f["code"], f["severity"]) for f in written["findings"]] == [("RUN_INFO", "info")]
    assert "no DistributedDataParallel model was built" in written["findings"][0]["message"]
    assert main(["audit", "--", sys.executable, "-E", "-c", "pass"]) == 0
    assert "the auditor never loaded" in capsys.readouterr().err
    assert main(["audit"]) == 2
    # A report that cannot be written after the command ran is one line; the command's exit code stands.
    if os.path.exists("/dev/full"):
        assert main(["audit", "--json-file", "/dev/full", "--", sys.executable, "-c", "pass"]) == 0
        assert "could not write the report to /dev/full: No space left on device" in capsys.readouterr().err
    assert main(["audit", "--json-file", "", "--", sys.executable, "-c", "pass"]) == 2
    assert "--json-file needs a file name" in capsys.readouterr().err


GUEST = """
import os, sys, warnings
os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads, as torch's docs ask
print("torch loaded before the program imported it:", "torch" in sys.modules)
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

print("threads", torch.get_num_threads())
warnings.filterwarnings("error", category=FutureWarning, module="__main__")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
try:
    DDP(torch.nn.Linear(2, 1), broadcast_buffers=False)  # torch 2.13 deprecates the argument: a FutureWarning
except FutureWarning:
    print("the deprecation was raised as an error at this program's own line, as its filter asks")
model = torch.nn.Linear(2, 1)
scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    scheduler.step()  # before any optimizer step: torch warns, naming this line
print("warned at", [(os.path.basename(w.filename), w.lineno) for w in caught])
dist.destroy_process_group()
"""


def test_the_program_runs_as_it_would_unaudited(tmp_path, capfd):
    """The auditor loads only when the program imports torch, and its patches never take the blame for warnings."""
    import socket
    import subprocess

    script = tmp_path / "guest.py"
    script.write_text(GUEST)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    plain = subprocess.run([sys.executable, str(script), port], capture_output=True, text=True, timeout=scaled(60))
    assert plain.returncode == 0, plain.stderr
    assert "raised as an error" in plain.stdout and "threads 1" in plain.stdout and "guest.py" in plain.stdout
    assert main(["audit", "--", sys.executable, str(script), port]) == 0
    assert capfd.readouterr().out == plain.stdout
    assert main(["audit", "--", sys.executable, "-c", "import sys; print('torch' in sys.modules)"]) == 0
    captured = capfd.readouterr()
    assert captured.out == "False\n"
    assert "no Python process of the command imported torch" in captured.err


class _FlakyStep(torch.optim.SGD):
    """An optimizer whose first step raises (a user's own error, caught by the user's own code)."""

    failed = False

    @torch.no_grad()
    def step(self, closure=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("a step that fails once")
        return super().step(closure)


def _patched_now(patched):
    """Whether each (owner, name, original) is back to the original object."""
    return [getattr(owner, name) is original for owner, name, original in patched]


def _audit_from_code(ctx):
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    import ddplab
    from ddplab.auditor import install, state

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = _FlakyStep(ddp.parameters(), lr=0.1)
    handle = ddplab.audit(ddp, optimizer=optimizer, steps=3)
    patched = install.patched()
    generator = torch.Generator().manual_seed(ctx.rank)
    for _ in range(4):
        x = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp.module(x), x.sum(1, keepdim=True)).backward()  # bypass
        try:
            optimizer.step()
        except RuntimeError:
            pass  # the program goes on; so must the audit
    report = handle.report()  # the peers' records waited for 30 s times the suite's time scale
    hooks = (optimizer_hooks._global_optimizer_pre_hooks, optimizer_hooks._global_optimizer_post_hooks,
             module_hooks._global_forward_pre_hooks)
    left = {"restored": _patched_now(patched), "state": state.current(), "hooks": sum(map(len, hooks))}
    owners = {f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in patched}
    return sorted(handle.findings), handle.steps, {f.code: f.ranks for f in report.problems}, left, owners


def test_audit_from_code_finds_the_bypass_and_leaves_nothing_behind():
    results = launch(_audit_from_code, LaunchConfig(world_size=2))
    for own, steps, merged, left, owners in results:
        # Each rank sees its own bypass; only comparing the ranks' records shows the divergence. The step that
        # raised did not silence the audit: the three that followed were audited.
        assert own == ["NO_ALLREDUCE"] and steps == 3
        assert merged == {"NO_ALLREDUCE": [0, 1], "PARAMS_DIVERGED": [0, 1]}
        # Ending the audit undid every patch (the same objects are back), every hook and the state.
        assert left["restored"] and all(left["restored"]) and left["state"] is None and left["hooks"] == 0
        assert {"DistributedDataParallel.forward", "DistributedDataParallel.__init__", "DistributedSampler.__iter__",
                "Tensor.backward", "torch.nn.functional.cross_entropy", "LRScheduler.step"} <= owners


def test_the_audited_command_keeps_its_own_environment(tmp_path, capfd, monkeypatch):
    """Only ddplab itself joins the command's path: a second interpreter keeps its own torch, or none."""
    import subprocess

    other = tmp_path / "other-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True)
    probe = "import torch; print('torch from', torch.__file__)"
    # An environment without torch: its program cannot import the torch of ddplab's own environment.
    assert main(["audit", "--", str(other / "bin" / "python"), "-c", probe]) == 1
    captured = capfd.readouterr()
    assert "No module named 'torch'" in captured.err and "torch from" not in captured.out
    # A torch of the user's own, on the user's PYTHONPATH, wins over ddplab's.
    fake = tmp_path / "user-site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.0+user'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "user-site"))
    assert main(["audit", "--", sys.executable, "-c", probe]) == 0
    captured = capfd.readouterr()
    assert f"torch from {fake / '__init__.py'}" in captured.out
    assert "auditing disabled in this process" in captured.err  # the auditor needs a real torch, and says so
    # What is put in front of the user's path holds the bootstrap and ddplab, nothing else of its environment.
    show = "import os; print(repr([(p, sorted(os.listdir(p))) for p in os.environ['PYTHONPATH'].split(os.pathsep)]))"
    monkeypatch.delenv("PYTHONPATH")
    assert main(["audit", "--", str(other / "bin" / "python"), "-c", show]) == 0
    (path, listing), = eval(capfd.readouterr().out.strip().splitlines()[-1])
    assert listing == ["ddplab", "sitecustomize.py"]


def test_the_auditor_loads_when_torch_is_looked_up_before_it_is_imported(capfd):
    """transformers and datasets call importlib.util.find_spec("torch") on import: asking is not importing."""
    probe = ("import importlib.util, sys; importlib.util.find_spec('torch'); importlib.util.find_spec('torch'); "
             "print('before', 'ddplab.auditor.install' in sys.modules); import torch; "
             "from ddplab.auditor import state; print('after', state.current() is not None, "
             "torch.__spec__.loader is torch.__loader__ and type(torch.__loader__).__name__)")
    assert main(["audit", "--", sys.executable, "-c", probe]) == 0
    # Nothing loaded before torch; the auditor after it, torch keeping its own loader.
    assert capfd.readouterr().out.splitlines() == ["before False", "after True SourceFileLoader"]


def test_reports_merge_over_ranks():
    def record(rank, codes):
        return {"rank": rank, "world_size": 2, "global_batch_size": 32, "lr": 0.1, "steps_audited": 5,
                "findings": [vars(findings.Finding.make(c, rank)) for c in codes]}

    report = findings.merge([record(1, ["SUM_REDUCTION", "NO_ALLREDUCE"]), record(0, ["NO_ALLREDUCE"])])
    assert report.headline().endswith("5 optimizer steps audited")
    assert [(f.code, f.ranks) for f in report.findings] == [("NO_ALLREDUCE", [0, 1]), ("SUM_REDUCTION", [1])]
    assert report.has_error and report.to_json()["world_size"] == 2
    assert "NO_ALLREDUCE (ranks 0, 1)" in rendering.render_text(report)
    # One renderer for the in-run and the final report: the same lines, wrapped at 120 columns.
    interim = rendering.render_text(report, interim_steps=5).splitlines()
    final = rendering.render_text(report).splitlines()
    assert interim[0] == "[rank 0, after 5 steps] " + final[0] and interim[1:] == final[1:]
    assert max(map(len, interim[1:])) <= 120 and len(final) > 4
    clean = findings.merge([record(0, []), record(1, [])])
    assert "no DDP mistakes found in the first 5 steps; a repeated epoch order" in rendering.render_text(
        clean, interim_steps=5)
    assert rendering.render_text(clean).splitlines()[1] == "no DDP mistakes found"
    # A clean run names the engine its gradients went through.
    for strategy, size, name in (("fsdp", 2, "FSDP2"), ("deepspeed-zero2", 2, "DeepSpeed ZeRO-2"),
                                 ("hsdp+tp", 4, "HSDP")):
        reduction = {"strategy": strategy, "data_parallel_size": size, "divisor": float(size)}
        engine = findings.merge([{**record(rank, []), "reduction": reduction, "strategy": strategy}
                                 for rank in (0, 1)])
        assert rendering.render_text(engine).splitlines()[1] == f"no {name} mistakes found"
        assert f"no {name} mistakes found in the first 5 steps" in rendering.render_text(engine, interim_steps=5)


def test_steps_past_a_ranks_join_are_not_compared_across_ranks():
    def window(step, digest):
        return {"wrapper": "ddp0-0.1", "step": step, "params": [["w", digest, 1.0]]}

    def record(rank, digests, joined=None):
        return {"rank": rank, "world_size": 2, "steps_audited": len(digests), "findings": [],
                "windows": [window(step, d) for step, d in enumerate(digests)], "joined": joined or {}}

    # Rank 0 joined before its step 2: its steps 2 and 3 are the next epoch's, rank 1's the end of this one.
    uneven = [record(0, ["a", "b", "x", "y"], {"ddp0-0.1": 2}), record(1, ["a", "b", "c", "d"])]
    report = findings.merge(uneven)
    assert [f.code for f in report.findings] == ["AUDIT_INCOMPLETE"]
    assert "before its optimizer step 2 and joined" in report.findings[0].detail
    # Before the join the comparison stands; a join after the audited window changes nothing.
    assert [f.code for f in findings.merge([record(0, ["a", "z", "x"], {"ddp0-0.1": 2}), record(1, ["a", "b", "c"])])
            .findings][0] == "PARAMS_DIVERGED"
    assert findings.merge([record(0, ["a", "b"], {"ddp0-0.1": 2}), record(1, ["a", "b"])]).findings == []


# --- the auditor as a guest: no hang, no change, no state left in the user's objects ---

def _guest_behaviour(ctx):
    """Paths one rank takes alone, ZeRO, pickling and summed losses, all inside the audited window."""
    import io

    from torch.distributed.optim import ZeroRedundancyOptimizer

    import ddplab

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                                      torch.nn.Linear(8, 1)))
    handle = ddplab.audit(ddp, steps=4)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    probe = torch.nn.Linear(4, 1)
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(ctx.rank)
    for step in range(4):
        x = torch.randn(16, 4, generator=generator)
        per_sample = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True), reduction="none")
        loss = per_sample.sum() if step == 3 else per_sample.sum() / per_sample.numel()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if ctx.rank == 0:
            # Rank 0 alone: a probe optimizer and an evaluation through the inner module.
            probe_optimizer.zero_grad()
            torch.nn.functional.mse_loss(probe(x), x[:, :1]).backward()
            probe_optimizer.step()
            with torch.no_grad():
                ddp.module.eval()
                ddp.module(x)
                ddp.module.train()
        buffer = io.BytesIO()
        torch.save(ddp.module, buffer)  # no weakref or hook of the auditor's in the module to pickle
    report = handle.report()  # the peers' records waited for 30 s times the suite's time scale
    hooks = len(ddp.module._forward_pre_hooks) + len(ddp.module._forward_hooks) + len(ddp._forward_pre_hooks)
    return handle.steps, {f.code: f.severity for f in report.problems}, hooks


@pytest.mark.timeout(120)
def test_the_auditor_never_blocks_rank_local_paths_and_finds_a_summed_per_sample_loss():
    results = launch(_guest_behaviour, LaunchConfig(world_size=2, pg_timeout_s=30))
    for steps, problems, hooks in results:
        assert steps == 4 and hooks == 0
        # Only the planted mistake: the probe, ZeRO's inner optimizer and rank 0's evaluation raise nothing.
        assert problems == {"SUM_REDUCTION": "warning", "BATCHNORM_NOT_SYNCED": "info"}


def test_digests_see_every_bit_and_ignore_nothing_else():
    from ddplab.guest.tensors import digest

    for dtype, bits in ((torch.float32, torch.int32), (torch.float16, torch.int16), (torch.bfloat16, torch.int16),
                        (torch.float64, torch.int64)):
        weight = torch.randn(256, 256).to(dtype)
        nudged = weight.clone()
        nudged.view(bits)[17, 3] += 1  # the last bit of one element
        assert digest(weight) == digest(weight.clone()) and digest(weight) != digest(nudged)
    bias = torch.zeros(1024)
    assert digest(bias) != digest(bias + torch.eye(1024)[5] * 3e-5)
    assert digest(torch.zeros(2, 3)) != digest(torch.zeros(3, 2))


def _windows(rank, params):
    return {"rank": rank, "world_size": 2, "findings": [],
            "windows": [{"wrapper": "ddp0-0.1", "group": [0, 1], "step": 0, "params": params}]}


def test_a_tiny_divergence_in_one_tensor_is_named():
    same = [["weight", "aaa", 1024.0], ["bias", "bbb", 0.0]]
    drift = [["weight", "aaa", 1024.0], ["bias", "ccc", 3e-5]]
    assert findings.cross_rank_findings([_windows(0, same), _windows(1, same)]) == []
    (finding,) = findings.cross_rank_findings([_windows(0, same), _windows(1, drift)])
    assert finding.code == "PARAMS_DIVERGED" and finding.ranks == [0, 1] and "'bias' on rank 1" in finding.detail


def _batches(rank, batches):
    return {"rank": rank, "world_size": 2, "findings": [], "batches": {"ddp0-0.1": batches}}


@pytest.mark.parametrize("rank0, rank1, expected", [
    (["a", "b", "c", "d", "e", "f"], ["c", "d", "e", "f", "g", "h"], True),  # one stream, shifted by 2 batches
    (["a", "b", "c", "d"], ["e", "f", "g", "h"], False),  # sharded
    (["a", "a", "a", "a"], ["a", "a", "a", "a"], False),  # one fixed batch: a benchmark, not unsharded data
    (["a", "b", "c", "d", "e", "f"], ["a", "x", "y", "z", "w", "v"], False),  # one coincidence is no evidence
])
def test_duplicate_batches_are_found_whatever_the_step(rank0, rank1, expected):
    found = findings.cross_rank_findings([_batches(0, rank0), _batches(1, rank1)])
    assert bool(found) == expected
    if expected:
        assert found[0].code == "SAME_DATA_ON_ALL_RANKS" and found[0].ranks == [0, 1]


def test_the_same_indices_on_every_rank_are_the_same_data_whatever_the_pixels():
    def record(rank, tensors, indices):
        return {"rank": rank, "world_size": 2, "findings": [], "batches": {"ddp0-0.1": tensors},
                "index_batches": {"ddp0-0.1": indices}}

    augmented = [record(0, ["a", "b", "c", "d"], ["i", "j", "k", "l"]),
                 record(1, ["e", "f", "g", "h"], ["i", "j", "k", "l"])]
    (finding,) = findings.cross_rank_findings(augmented)
    assert finding.code == "SAME_DATA_ON_ALL_RANKS" and finding.ranks == [0, 1]
    assert "same indices of the same dataset" in finding.detail
    sharded = [record(0, ["a", "b", "c", "d"], ["i", "j", "k", "l"]),
               record(1, ["e", "f", "g", "h"], ["m", "n", "o", "p"])]
    assert findings.cross_rank_findings(sharded) == []


def test_a_datasets_signature_tells_shards_apart_and_needs_data_to_tell():
    from torch.utils.data import Dataset, TensorDataset

    from ddplab.auditor.data import _signature

    class Synthetic(Dataset):  # random samples drawn per index: nothing in it says which data it is
        def __init__(self):
            self.length, self.name = 100, "noise"

    shard = [TensorDataset(torch.arange(8.0) + offset) for offset in (0, 0, 1)]
    assert _signature(shard[0]) == _signature(shard[1]) != _signature(shard[2])
    assert _signature(Synthetic()) is None


def test_a_view_of_the_loaded_batch_keeping_its_samples_is_that_batch():
    """A language model's ``batch[:, :-1]`` is matched to the loaded batch (its indices are compared across ranks);
    a micro-batch sliced from it, or a copy, is not the whole batch and is left unmatched."""
    from ddplab.auditor.data import _batch_base

    batch = torch.stack([torch.arange(6) + 6 * row for row in range(4)])  # as a DataLoader's collate makes it
    assert _batch_base(batch[:, :-1]) is batch and _batch_base(batch[:, 1:].t().t()) is batch
    assert _batch_base(batch[:2]) is None and _batch_base(batch[:, :-1].contiguous()) is None
    assert _batch_base(batch) is None and _batch_base(None) is None and _batch_base(batch[0, 0]) is None
    # A loaded batch that is itself a view (of a flat stream): its inputs' base is the stream, not the batch.
    assert _batch_base(torch.arange(24).reshape(4, 6)[:, :-1]) is None


# --- the command: flags, bad input, signals ---

def test_bad_commands_and_paths_are_one_line_errors(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["audit", "--", str(script)]) == 2
    assert "is not executable" in capsys.readouterr().err
    assert main(["audit", "--", "no-such-launcher-xyz"]) == 2
    assert main(["audit", "--json-file", str(tmp_path / "missing" / "r.json"), "--", sys.executable, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the report" in err and "Traceback" not in err
    # A directory is refused before the command runs, not after it (the report would be lost).
    marker = tmp_path / "ran"
    assert main(["audit", "--json-file", str(tmp_path), "--", sys.executable, "-c",
                 f"open({str(marker)!r}, 'w').close()"]) == 2
    assert "--json-file" in capsys.readouterr().err and not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_json_flag_keeps_stdout_for_the_report_alone(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(GALLERY)
    code = main(["audit", "--json", "--", sys.executable, "sum_reduction.py", "--launcher", "fork"])
    report = json.loads(capfd.readouterr().out)  # the whole of stdout is the report
    assert code == 0 and _serious(report) == {"SUM_REDUCTION": "warning"}
    # The program's own stdout goes to stderr, so that `ddplab audit --json -- ... | jq` parses.
    code = main(["audit", "--json", "--", sys.executable, "-c", "import torch; print('a line of the program')"])
    captured = capfd.readouterr()
    assert code == 0 and json.loads(captured.out)["audited"] is False
    assert "a line of the program" in captured.err
    # Without --json the program's stdout stays its stdout.
    assert main(["audit", "--", sys.executable, "-c", "import torch; print('a line of the program')"]) == 0
    assert capfd.readouterr().out == "a line of the program\n"


def test_the_header_shows_the_configured_lr_rounded():
    from torch.optim import lr_scheduler

    from ddplab.auditor.schedulers import configured_lr

    report = findings.Report(2, 32, 1.5267837178600974e-05, 5, 5, [])
    assert "lr 1.527e-05," in report.headline()
    # A schedule's base (initial_lr) or peak (max_lr), not the lr of the step it is at.
    model = torch.nn.Linear(2, 1)
    warmup = torch.optim.SGD(model.parameters(), lr=0.003)
    scheduler = lr_scheduler.LambdaLR(warmup, lambda step: (step + 1) / 10)
    for _ in range(3):
        warmup.step()
        scheduler.step()
    assert warmup.param_groups[0]["lr"] != 0.003 and configured_lr(warmup, None) == 0.003
    one_cycle = torch.optim.SGD(model.parameters(), lr=0.1)
    lr_scheduler.OneCycleLR(one_cycle, max_lr=0.4, total_steps=10)
    assert configured_lr(one_cycle, None) == 0.4
    # A schedule written into the param groups by hand (nanoGPT): the highest lr seen.
    by_hand, seen = torch.optim.AdamW(model.parameters(), lr=0.01), None
    for lr in (0.001, 0.002, 0.003, 0.0025):
        by_hand.param_groups[0]["lr"] = lr
        seen = configured_lr(by_hand, seen)
    assert seen == 0.003
    # DeepSpeed's schedulers overwrite the groups' lr and keep no initial_lr: their own peak is the configured lr
    # (the attributes of WarmupLR and WarmupDecayLR, of WarmupCosineLR; tests/deepspeed reads a real one's).
    from types import SimpleNamespace

    from ddplab.auditor.schedulers import scheduler_peak_lr

    assert scheduler_peak_lr(SimpleNamespace(min_lrs=[0.0], max_lrs=[0.02, 0.01])) == 0.02
    assert scheduler_peak_lr(SimpleNamespace(org_lrs=[0.02])) == 0.02
    assert scheduler_peak_lr(lr_scheduler.LambdaLR(warmup, lambda s: 1.0)) == 0.003
    assert scheduler_peak_lr(None) is None and scheduler_peak_lr(SimpleNamespace(max_lrs=[0.0])) is None


NEEDS_TORCHRUN = {
    "local_rank": "import os\nimport torch\nlocal_rank = int(os.environ['LOCAL_RANK'])\n",
    "init": "import torch\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n",
}


@pytest.mark.parametrize("shape, variable", [("local_rank", "LOCAL_RANK"), ("init", "RANK")])
def test_a_torchrun_script_run_with_python_is_told_how_to_launch(shape, variable, tmp_path, capfd, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "train.py"
    script.write_text(NEEDS_TORCHRUN[shape])
    report = tmp_path / "report.json"
    # The program fails as it would unaudited: its traceback and exit code pass through.
    assert main(["audit", "--json-file", str(report), "--", sys.executable, "-u", str(script), "--epochs", "1"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and variable in err
    expected = f"ddplab audit -- torchrun --nproc_per_node 2 {script} --epochs 1"
    said = " ".join(err.split())  # the report's lines as wrapped for the terminal, joined again
    assert "looks like a torchrun script" in said and f"because {variable} was not set" in said
    why = json.loads(report.read_text())["findings"][0]["message"]
    assert "looks like a torchrun script" in why and expected in why


CHILDREN = """
import subprocess, sys, time
children = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
with open(sys.argv[1], "w") as fh:
    fh.write(" ".join(str(c.pid) for c in children))
time.sleep(300)
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_cancelling_the_audit_ends_the_whole_command_and_cleans_up(signum, tmp_path):
    import subprocess
    import time

    pids = tmp_path / "pids"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    # SIGINT ignored by inheritance, as under nohup or in CI: only the forwarded signal can stop the command.
    audit = subprocess.Popen([sys.executable, "-m", "ddplab", "audit", "--", sys.executable, "-c", CHILDREN, str(pids)],
                             env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
                             if signum == signal.SIGTERM else None)
    deadline = time.monotonic() + scaled(30)
    while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [int(p) for p in pids.read_text().split()]
    audit.send_signal(signum)
    # The command died by the signal, and so does ddplab: a shell sees what it would see without it.
    assert audit.wait(timeout=scaled(20)) == -signum
    assert not any(_alive(pid) for pid in children)
    assert not list(tmp_path.glob("ddplab-audit-*"))


def test_a_run_in_which_nothing_was_audited_is_never_reported_clean():
    record = {"rank": 0, "world_size": 2, "steps_audited": 0, "findings": [], "frameworks": ["deepspeed"]}
    report = findings.merge([record, {**record, "rank": 1}])
    assert not report.audited and report.to_json()["audited"] is False
    text = rendering.render_text(report)
    assert "no DDP mistakes found" not in text
    assert text == ("ddplab audit: world size 2, nothing was audited: no optimizer step of a DDP or FSDP2 model was "
                    "seen (the run built none, or its training stopped before a step)")
    # An engine the audit does not read says so, on every launcher: the record carries it.
    why = "a DeepSpeed engine trained the model, and the audit does not read DeepSpeed's engine"
    unread = findings.merge([{**record, "unaudited": why}])
    assert rendering.render_text(unread).endswith(f"nothing was audited: {why}")


def test_the_users_line_is_named_with_the_librarys_beside_it(tmp_path, monkeypatch):
    library = tmp_path / "site-packages" / "fakelib"
    library.mkdir(parents=True)
    (library / "__init__.py").write_text("")
    (library / "loss_utils.py").write_text("from ddplab.auditor import weights\n\n\ndef compute():\n"
                                           "    return weights.site()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    from fakelib import loss_utils

    from ddplab.auditor import weights

    line = sys._getframe().f_lineno + 1
    assert loss_utils.compute() == f"test_audit.py:{line} (through loss_utils.py:5)"
    assert weights.site() == f"test_audit.py:{sys._getframe().f_lineno}"


def test_a_scheduler_stepped_per_process_is_said_only_where_its_schedule_ran_out():
    from torch.optim.lr_scheduler import LambdaLR

    from ddplab.auditor import install, schedulers, state

    def run(lengths: int, factor) -> dict:
        install.install(steps=5)
        try:
            param = torch.nn.Parameter(torch.ones(2))
            optimizer = torch.optim.SGD([param], lr=0.1)
            scheduler = LambdaLR(optimizer, lambda step: factor(step, lengths))
            for _ in range(12):
                param.grad = torch.ones(2)
                optimizer.step()
                scheduler.step()  # Accelerate steps a prepared scheduler once per process: twice here
                scheduler.step()
            schedulers.at_exit()
            return {code: f.detail for code, f in state.current().findings.items()}
        finally:
            install.uninstall()

    def decay_to_tenth(step, lengths):
        return max(0.1, 1 - step / lengths)

    # Given in optimizer steps (12) but stepped twice per step: at its end from optimizer step 6 on.
    ran_out = run(12, decay_to_tenth)["SCHEDULER_STEPS_PER_PROCESS"]
    assert "stepped 2 times per optimizer step, and the lr stopped changing at optimizer step 6 of 12" in ran_out
    # Lengthened by the processes (24): it changes to the end; a constant lr changes nothing: silent.
    assert "SCHEDULER_STEPS_PER_PROCESS" not in run(24, decay_to_tenth)
    assert "SCHEDULER_STEPS_PER_PROCESS" not in run(12, lambda step, lengths: 1.0)


def test_a_launcher_beside_ddplabs_own_interpreter_runs_without_an_activated_environment(tmp_path, capsys,
                                                                                         monkeypatch):
    # .venv/bin/ddplab audit -- torchrun ... from a shell that never activated .venv: torchrun is in .venv/bin only.
    folder, marker = tmp_path / "venv-bin", tmp_path / "ran"
    folder.mkdir()
    launcher = folder / "ddplab-test-launcher"
    launcher.write_text(f"#!{sys.executable}\nopen({str(marker)!r}, 'w').close()\n")
    launcher.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(folder / "python"))
    assert main(["audit", "--json-file", str(tmp_path / "audit.json"), "--", "ddplab-test-launcher"]) == 0
    assert marker.exists() and "command not found" not in capsys.readouterr().err
    marker.unlink()
    # noise runs a command through the same runner.
    main(["noise", "--", "ddplab-test-launcher"])
    assert marker.exists() and "command not found" not in capsys.readouterr().err
    # Nowhere at all: one line that says where it looked.
    assert main(["audit", "--", "no-such-launcher-xyz"]) == 2
    assert f"looked on PATH and in {folder}" in capsys.readouterr().err


def test_a_deepspeed_op_build_is_said_once_and_a_stale_lock_is_named(tmp_path, monkeypatch, capsys):
    """DeepSpeed's OpBuilder.jit_load, stood in for: before its first build the note says it builds once; a lock
    older than any build left by one killed half-way is named with its age; the build itself runs as it would."""
    import types

    from ddplab.guest import extension_builds
    from ddplab.guest.patches import Patches
    from ddplab.runtime import op_builds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(op_builds, "_SAID", set())
    loaded = []

    class OpBuilder:
        name = "shm_comm"

        def jit_load(self, verbose=True):
            loaded.append(verbose)
            return "module"

    patches = Patches()
    try:
        extension_builds._patch(patches, types.SimpleNamespace(OpBuilder=OpBuilder))
        lock = tmp_path / "shm_comm" / "lock"
        lock.parent.mkdir()
        lock.write_text("")
        os.utime(lock, (time.time() - 3600, time.time() - 3600))
        assert OpBuilder().jit_load(verbose=False) == "module" and loaded == [False]
        assert capsys.readouterr().err.splitlines() == [
            f"ddplab: DeepSpeed builds its shm_comm op once (a few minutes on a CPU), in {lock.parent}; later runs "
            "load it from there",
            f"ddplab: {lock} is 60 min old: a build killed half-way leaves it, and torch waits while it exists; if no "
            "build of this op is running, delete it"]
        # Once per build folder; a lock as young as a running build's, and a built op, are not remarked on.
        OpBuilder().jit_load()
        assert capsys.readouterr().err == ""
        (lock.parent / "shm_comm.so").write_text("")
        os.utime(lock, None)
        assert op_builds.notes("shm_comm", str(lock.parent)) == []
        # Only rank 0 speaks.
        monkeypatch.setattr(op_builds, "_SAID", set())
        monkeypatch.setenv("RANK", "1")
        lock.unlink()
        (lock.parent / "shm_comm.so").unlink()
        OpBuilder().jit_load()
        assert capsys.readouterr().err == "" and len(loaded) == 3
    finally:
        patches.undo()
