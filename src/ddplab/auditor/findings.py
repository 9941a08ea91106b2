"""What the audit can find, what each finding does to training, and how to fix it (pure Python).

Ranks record findings locally and write them to files; the report merges them by code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITY_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}

# code → (severity, what it does to training, the fix)
CATALOGUE: dict[str, tuple[str, str, str]] = {
    "NO_ALLREDUCE": (
        ERROR,
        "gradients were not all-reduced: every rank trains alone on its own data, as W separate runs",
        "call the DDP wrapper itself for every forward (ddp_model(x), never ddp_model.module(x)), and keep the "
        "wrapper alive until backward: build it once, outside the training loop"),
    "PARAMS_DIVERGED": (
        ERROR,
        "parameters differ across ranks: the ranks no longer train the same model",
        "make every rank run the same optimizer steps on all-reduced gradients; look for rank-dependent code, "
        "per-rank seeds in the model, or a forward that bypasses the wrapper"),
    "SAME_DATA_ON_ALL_RANKS": (
        ERROR,
        "every rank receives the same batches: the W ranks repeat each other's work, and an epoch covers only "
        "1/W of the data it should",
        "give the DataLoader sampler=DistributedSampler(dataset) (and shuffle=False on the loader), or shard the "
        "data by rank yourself"),
    "SET_EPOCH_MISSING": (
        WARNING,
        "a shuffling DistributedSampler was iterated twice with the same epoch: every epoch sees the same order",
        "call sampler.set_epoch(epoch) at the start of every epoch, before iterating the loader"),
    "SUM_REDUCTION": (
        WARNING,
        "backward starts from a loss summed over the batch: DDP averages gradients over ranks, so the gradient is "
        "1/W of what one process summing the global batch gets (the effective lr is W times smaller)",
        "use reduction='mean', divide the summed loss by a sample or token count, or multiply it by the world size"),
    "BATCHNORM_NOT_SYNCED": (
        WARNING,
        "BatchNorm normalises with statistics over each rank's batch, not the global batch",
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping in DDP computes global statistics "
        "(it needs GPUs with NCCL); with large per-rank batches per-rank statistics are common practice"),
    "ACCUMULATION_SYNCS_EVERY_STEP": (
        WARNING,
        "performance: gradient accumulation all-reduces on every micro-step; the result is unchanged but "
        "communication is accumulation-steps times larger",
        "wrap every micro-step but the last in `with ddp_model.no_sync():`"),
    "RUN_INFO": (INFO, "", ""),
}


@dataclasses.dataclass
class Finding:
    """One kind of problem, seen on some ranks."""

    code: str
    severity: str
    message: str
    fix: str
    ranks: list[int]
    detail: str = ""

    @classmethod
    def make(cls, code: str, rank: int, detail: str = "", severity: str | None = None) -> "Finding":
        default_severity, message, fix = CATALOGUE[code]
        return cls(code, severity or default_severity, message, fix, [rank], detail)

    def to_json(self) -> dict[str, Any]:
        message = f"{self.message} ({self.detail})" if self.detail and self.message else self.message or self.detail
        return {"code": self.code, "severity": self.severity, "message": message, "fix": self.fix,
                "ranks": sorted(self.ranks)}


@dataclasses.dataclass
class Report:
    """Findings merged over ranks, with the run's batch and lr."""

    world_size: int | None
    global_batch_size: int | None
    lr: float | None
    steps_audited: int
    findings: list[Finding]

    @property
    def has_error(self) -> bool:
        return any(f.severity == ERROR for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "global_batch_size": self.global_batch_size, "lr": self.lr,
                "steps_audited": self.steps_audited, "findings": [f.to_json() for f in self.findings]}


def merge(rank_records: list[dict[str, Any]]) -> Report:
    """Merge per-rank records (as written by the auditor) into one report."""
    merged: dict[str, Finding] = {}
    for record in sorted(rank_records, key=lambda r: r.get("rank", 0)):
        for raw in record.get("findings", []):
            finding = Finding(**raw)
            if finding.code in merged:
                merged[finding.code].ranks = sorted(set(merged[finding.code].ranks) | set(finding.ranks))
            else:
                merged[finding.code] = finding
    main = min(rank_records, key=lambda r: r.get("rank", 0)) if rank_records else {}
    findings = sorted(merged.values(), key=lambda f: (SEVERITY_ORDER[f.severity], f.code))
    return Report(main.get("world_size"), main.get("global_batch_size"), main.get("lr"),
                  max((r.get("steps_audited", 0) for r in rank_records), default=0), findings)


def read_records(directory: str) -> list[dict[str, Any]]:
    """Every rank's record file in ``directory`` (the latest per rank)."""
    latest: dict[int, dict[str, Any]] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank-") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as fh:
                record = json.load(fh)
            rank = record.get("rank", 0)
            # Several processes can report one rank (a launcher, a parent): keep the one that audited most.
            if rank not in latest or record.get("steps_audited", 0) >= latest[rank].get("steps_audited", 0):
                latest[rank] = record
    return list(latest.values())


def render_text(report: Report) -> str:
    """A plain-text report, for logs and for rank 0's interim print."""
    lines = [f"ddplab audit: world size {report.world_size}, global batch {report.global_batch_size}, "
             f"lr {report.lr}, {report.steps_audited} optimizer steps audited"]
    problems = [f for f in report.findings if f.code != "RUN_INFO"]
    if not problems:
        lines.append("  no DDP mistakes found")
    for finding in problems:
        data = finding.to_json()
        lines.append(f"  {finding.severity.upper():7} {finding.code} on ranks {data['ranks']}: {data['message']}")
        lines.append(f"          fix: {finding.fix}")
    return "\n".join(lines)
