"""ddplab audit on a gallery of buggy scripts (tests/gallery), through torchrun and mp.spawn.

Each mistake must be found with its code and severity, and nothing else at warning level or
above; the correct twin (and ddplab's own deterministic sandbox) must give no warning or error.
"""

import json
import os
import sys

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from ddplab.auditor import findings
from ddplab.cli import main
from ddplab.launch import LaunchConfig, launch

GALLERY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gallery")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]

EXPECTED = {
    "correct": {},
    "bypass": {"NO_ALLREDUCE": "error", "PARAMS_DIVERGED": "error"},
    "temporary_wrapper": {"NO_ALLREDUCE": "error", "PARAMS_DIVERGED": "error"},
    "no_sampler": {"SAME_DATA_ON_ALL_RANKS": "error"},
    "no_set_epoch": {"SET_EPOCH_MISSING": "warning"},
    "sum_reduction": {"SUM_REDUCTION": "warning"},
    "batchnorm": {"BATCHNORM_NOT_SYNCED": "warning"},
    "accumulation": {"ACCUMULATION_SYNCS_EVERY_STEP": "warning"},
}


def _audit(tmp_path, command, *flags):
    report = tmp_path / "audit.json"
    code = main(["audit", "--json", str(report), *flags, "--", *command])
    return code, json.loads(report.read_text())


def _serious(report):
    return {f["code"]: f["severity"] for f in report["findings"] if f["severity"] in ("error", "warning")}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_each_mistake_is_found_under_torchrun(script, tmp_path, monkeypatch):
    monkeypatch.chdir(GALLERY)
    code, report = _audit(tmp_path, [*TORCHRUN, f"{script}.py"])
    assert code == 0
    assert _serious(report) == EXPECTED[script]
    assert report["world_size"] == 2 and report["steps_audited"] == 5 and report["lr"] > 0
    for finding in report["findings"]:
        assert finding["ranks"] == [0, 1] and finding["message"] and finding["fix"] is not None
    if script == "correct":
        assert report["global_batch_size"] == 64  # 16 per rank × 2 ranks × 2 accumulation steps
        assert {"BATCHNORM_NOT_SYNCED": "info"}.items() <= {f["code"]: f["severity"] for f in report["findings"]}.items()


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
    _, report = _audit(tmp_path, [*TORCHRUN, "-m", "ddplab", "sandbox", "multi", "--noisy", "--bypass-ddp",
                                  "--n-experiments", "100"])
    assert _serious(report) == {"NO_ALLREDUCE": "error", "PARAMS_DIVERGED": "error"}


def test_audit_passes_the_commands_exit_code_through(capsys):
    assert main(["audit", "--", sys.executable, "-c", "raise SystemExit(7)"]) == 7
    assert "nothing to audit" in capsys.readouterr().err
    assert main(["audit"]) == 2


def _audit_from_code(ctx):
    import ddplab

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    handle = ddplab.audit(ddp, optimizer=optimizer, steps=3)
    generator = torch.Generator().manual_seed(ctx.rank)
    for _ in range(3):
        x = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp.module(x), x.sum(1, keepdim=True)).backward()  # bypass
        optimizer.step()
    return sorted(handle.findings), handle.steps


def test_audit_from_code_finds_the_bypass():
    results = launch(_audit_from_code, LaunchConfig(world_size=2))
    assert all(codes == ["NO_ALLREDUCE", "PARAMS_DIVERGED"] and steps == 3 for codes, steps in results)


def test_reports_merge_over_ranks():
    def record(rank, codes):
        return {"rank": rank, "world_size": 2, "global_batch_size": 32, "lr": 0.1, "steps_audited": 5,
                "findings": [vars(findings.Finding.make(c, rank)) for c in codes]}

    report = findings.merge([record(1, ["SUM_REDUCTION", "NO_ALLREDUCE"]), record(0, ["NO_ALLREDUCE"])])
    assert [(f.code, f.ranks) for f in report.findings] == [("NO_ALLREDUCE", [0, 1]), ("SUM_REDUCTION", [1])]
    assert report.has_error and report.to_json()["world_size"] == 2
    assert "NO_ALLREDUCE on ranks [0, 1]" in findings.render_text(report)
