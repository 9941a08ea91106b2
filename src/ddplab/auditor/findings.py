"""What the audit can find, what each finding does to training, and how to fix it (pure Python).

Each rank records what it saw: findings it can make alone (a summed loss, a bypassed wrapper),
and digests of its parameters, gradients and batches at each audited optimizer step. Ranks never
compare with each other while training; :func:`merge` compares their records afterwards (or
rank 0 does, once every record is in the store), so the auditor has no collective to hang on.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ddplab.auditor import normalisation, slice_shares
from ddplab.auditor.catalogue import (
    CATALOGUE,
    ERROR,
    FIXES_IN_FRAMEWORK,
    REDUCTION_FINDINGS,
    SEVERITY_ORDER,
    TOKEN_FIXES,
    Severity,
    message,
)
from ddplab.runtime.reduction import Reduction, averaging, divisor_by_elements, measured_divisor


@dataclasses.dataclass
class Finding:
    """One kind of problem, seen on some ranks."""

    code: str
    severity: Severity
    message: str
    fix: str
    ranks: list[int]
    detail: str = ""

    @classmethod
    def make(cls, code: str, rank: int, detail: str = "", severity: Severity | None = None) -> Finding:
        text, fix = message(code)
        return cls(code, severity or CATALOGUE[code][0], text, fix, [rank], detail)

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
    steps_requested: int | None
    findings: list[Finding]
    why_nothing: str | None = None
    """Why nothing could be audited (no DDP model, the auditor never loaded); None when something was."""
    data_parallel_size: int | None = None
    """Ranks that split the data and average the gradients: the factor from the per-rank to the global batch."""
    strategy: str | None = None
    """``ddp``, ``fsdp`` or ``hsdp``, with the mesh's other dimensions after a '+' (``fsdp+tp``)."""
    mesh: dict[str, int] | None = None
    """The device mesh the model's parameters live on, dimension name → size (FSDP2); None for DDP."""
    model_parallel_only: dict[str, int] | None = None
    """The mesh of a run with model parallelism but no data-parallel dimension (pure tensor or sequence
    parallelism), whose optimizer stepped DTensor parameters; None otherwise."""
    reduction: Reduction | None = None
    """What the data-parallel reduction did to the ranks' gradients (the divisor read or measured); None when no
    step of a data-parallel model was audited."""
    unaudited: str | None = None
    """Why a run that started no step ddplab reads was not audited (an engine it does not read); None otherwise."""
    global_batch_unit: str | None = None
    """What the global batch counts where it is not the rows of the model's forwards (the loaders' samples)."""

    @property
    def audited(self) -> bool:
        """Whether anything of the run was audited: an optimizer step of a model ddplab reads, or evidence that
        the ranks each trained alone (a run of model parallelism alone is described, not audited)."""
        return self.why_nothing is None and (self.steps_audited > 0 or bool(self.problems))

    @property
    def has_error(self) -> bool:
        return any(f.severity == ERROR for f in self.findings)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.code != "RUN_INFO"]

    def headline(self) -> str:
        if self.why_nothing is not None:
            return self.why_nothing
        if self.steps_audited == 0 and self.model_parallel_only:
            shape = " × ".join(f"{name} {size}" for name, size in self.model_parallel_only.items())
            return (f"world size {self.world_size}, model parallelism on mesh {shape} with no data-parallel "
                    "dimension: every rank trains on the same batch, so the data-parallel findings do not apply")
        if self.steps_audited == 0:
            why = self.unaudited or ("no optimizer step of a DDP or FSDP2 model was seen (the run built none, or its "
                                     "training stopped before a step)")
            return f"world size {self.world_size}, nothing was audited: {why}"
        steps = f"{self.steps_audited} optimizer steps audited"
        if self.steps_requested and self.steps_audited < self.steps_requested:
            steps += f" (the run made fewer than the {self.steps_requested} asked for)"
        setting = describe_setting(self.world_size, self.data_parallel_size, self.strategy, self.mesh)
        reduction = self.reduction
        # The reduction is named where the program chose it: a sum, a divisor of its own, a comm hook.
        chosen = f"; {reduction.describe()}" if reduction is not None and reduction.source else ""
        return f"{setting}, {describe_global_batch(self.global_batch_size, self.global_batch_unit)}, " \
               f"lr {format_lr(self.lr)}, {steps}{chosen}"

    def signature(self) -> list[list]:
        """What a reader would see change between two reports of one run (JSON-shaped)."""
        return sorted([f.code, f.severity, sorted(f.ranks)] for f in self.problems)

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "data_parallel_size": self.data_parallel_size,
                "global_batch_size": self.global_batch_size, "global_batch_unit": self.global_batch_unit,
                "strategy": self.strategy, "mesh": self.mesh,
                "lr": self.lr, "steps_audited": self.steps_audited, "steps_requested": self.steps_requested,
                "findings": [f.to_json() for f in self.findings], "audited": self.audited,
                "model_parallel_only": self.model_parallel_only,
                "reduction": self.reduction.to_json() if self.reduction is not None else None}


def merge(rank_records: list[dict[str, Any]]) -> Report:
    """Merge per-rank records into one report: their own findings, then what comparing them shows."""
    merged: dict[str, Finding] = {}
    records = sorted(rank_records, key=lambda r: r.get("rank", 0))
    reduction = run_reduction(records)
    local = [Finding(**raw) for record in records for raw in record.get("findings", [])]
    for finding in _judged_by(local, reduction) + cross_rank_findings(records, reduction):
        if finding.code in merged:
            known = merged[finding.code]
            known.ranks = sorted(set(known.ranks) | set(finding.ranks))
            if SEVERITY_ORDER[finding.severity] < SEVERITY_ORDER[known.severity]:
                known.severity, known.detail = finding.severity, finding.detail
        else:
            merged[finding.code] = dataclasses.replace(finding, ranks=sorted(finding.ranks))
    main = records[0] if records else {}
    findings = sorted(merged.values(), key=lambda f: (SEVERITY_ORDER[f.severity], f.code))
    used = {name for record in records for name in record.get("frameworks", [])}
    if (main.get("strategy") or "").startswith("deepspeed"):
        used.add("deepspeed")  # its engine's backward, not a module the program imported, decides the recipe
    if main.get("strategy") == "manual":
        used.add("manual")  # the program's own collectives: its fix is in them, not in a wrapper's settings
    dimension = _data_parallel_dimension(main)
    for finding in findings:
        _reword(finding, reduction, used)
        # Fixes that name the mesh's data-parallel dimension use the program's own name for it.
        finding.fix = finding.fix.replace("mesh['dp']", f"mesh['{dimension}']")
    return Report(main.get("world_size"), main.get("global_batch_size"), main.get("lr"),
                  max((r.get("steps_audited", 0) for r in records), default=0), main.get("steps_requested"), findings,
                  data_parallel_size=main.get("data_parallel_size"), strategy=main.get("strategy"),
                  mesh=main.get("mesh"), model_parallel_only=main.get("model_parallel_only"), reduction=reduction,
                  unaudited=next((r["unaudited"] for r in records if r.get("unaudited")), None),
                  global_batch_unit=main.get("global_batch_unit"))


def _reword(finding: Finding, reduction: Reduction | None, frameworks: set[str]) -> None:
    """The catalogue's words for the run: its own reduction (a rank's findings were made before it was known), and
    the fix in the words of a framework the program used; a fix set for this finding alone is kept."""
    text, fix = message(finding.code, reduction)
    if finding.code in REDUCTION_FINDINGS:
        finding.message = text
    if finding.fix in (message(finding.code)[1], fix):
        in_framework = FIXES_IN_FRAMEWORK.get(finding.code, {})
        finding.fix = next((in_framework[name] for name in in_framework if name in frameworks), fix)


def run_reduction(records: list[dict[str, Any]]) -> Reduction | None:
    """The run's reduction: as rank 0 read it, with a divisor measured across the ranks where it had to be (a DDP
    communication hook of the program's own: :mod:`ddplab.auditor.comm_hooks`)."""
    main = records[0] if records else {}
    reduction = Reduction.from_json(main.get("reduction"))
    if reduction is None:
        if not main.get("steps_audited"):
            return None
        size = main.get("data_parallel_size") or main.get("world_size") or 1
        return averaging(main.get("strategy") or "ddp", size)
    if reduction.strategy == "manual":
        # Written by hand: measured by its effect where every rank read it, else what the op says.
        measured, scaled = _measured_by_hand(records, reduction.data_parallel_size)
        then = ", then scaled by the program" if scaled else ""
        return reduction if measured is None else dataclasses.replace(
            reduction, divisor=measured, source=f"{reduction.source}{then}; measured")
    if reduction.known:
        return reduction
    return dataclasses.replace(reduction, divisor=_measured(records))


def _measured_by_hand(records: list[dict[str, Any]], size: int) -> tuple[float | None, bool]:
    """D from the first step whose probed gradients every rank recorded (:mod:`ddplab.auditor.handwritten`), and
    whether it differs from what the collectives' op divides by (the program scaled the reduced gradients)."""
    for probes in _every_ranks_steps(records, "reduced_by_hand"):
        divisor = divisor_by_elements(probes, size)
        if divisor is not None:
            ops = {probe.get("op") for by_rank in probes.values() for probe in by_rank}
            implied = {"avg": float(size), "sum": 1.0}.get(ops.pop()) if len(ops) == 1 else None
            return divisor, implied != divisor
    return None, False


def _measured(records: list[dict[str, Any]]) -> float | None:
    """D from the first step whose hooked reductions every rank measured: Σ_r local_r = D · reduced."""
    for sums in _every_ranks_steps(records, "comm_sums"):
        if len(records) >= 2:
            reduced = [reduced for _, reduced in sums.values()]
            return measured_divisor([local for local, _ in sums.values()], sum(reduced) / len(reduced))
    return None


def _every_ranks_steps(records: list[dict[str, Any]], field: str) -> list[dict[int, Any]]:
    """rank → its window's ``field``, for each model's step that every rank recorded it for, in step order."""
    by_step: dict[tuple[str, int], dict[int, Any]] = {}
    for record in records:
        for window in record.get("windows", []):
            if window.get(field):
                by_step.setdefault((window["wrapper"], window["step"]), {})[record["rank"]] = window[field]
    return [by_rank for (_, _), by_rank in sorted(by_step.items(), key=lambda item: item[0][1])
            if len(by_rank) == len(records)]


def _judged_by(local: list[Finding], reduction: Reduction | None) -> list[Finding]:
    """A rank's own findings that hold under the run's reduction: a summed loss is what one process summing the
    global batch computes when the reduction sums too; under a divisor nobody could read, it is not judged."""
    if reduction is None or (reduction.known and not reduction.sums):
        return local
    kept = [finding for finding in local if finding.code != "SUM_REDUCTION"]
    if not reduction.known and len(kept) < len(local):
        note = Finding.make("AUDIT_INCOMPLETE", local[0].ranks[0],
                            f"{reduction.describe()}: a summed loss was seen, but how it compares with one process "
                            "depends on that divisor, so it was not judged")
        kept.append(note)
    return kept


def _data_parallel_dimension(record: dict[str, Any]) -> str:
    """The name of the mesh's one data-parallel dimension (Lightning's ``data_parallel``, torchtitan's ``dp``)."""
    model_dims = {dim for group in (record.get("tp_groups") or {}).values() for dim in group.get("dims", [])}
    data_dims = [name for name in (record.get("mesh") or {}) if name not in model_dims and name not in ("pp", "cp")]
    return data_dims[0] if len(data_dims) == 1 else "dp"


def describe_setting(world_size: int | None, data_parallel_size: int | None, strategy: str | None,
                     mesh: dict[str, int] | None) -> str:
    """The run's ranks as a report's first words: the world size, and under a mesh its shape and data-parallel size.

    >>> describe_setting(4, 2, "fsdp+tp", {"dp": 2, "tp": 2})
    'world size 4, fsdp+tp on mesh dp 2 × tp 2 (data-parallel size 2)'
    >>> describe_setting(2, 2, "ddp", None)
    'world size 2'
    """
    if strategy and strategy.startswith("deepspeed"):
        return f"world size {world_size}, {strategy_name(strategy)} (data-parallel size {data_parallel_size})"
    if not mesh:
        return f"world size {world_size}"
    shape = " × ".join(f"{name} {size}" for name, size in mesh.items())
    return f"world size {world_size}, {strategy} on mesh {shape} (data-parallel size {data_parallel_size})"


def describe_global_batch(size: int | None, unit: str | None) -> str:
    """The header's global batch, in the unit it counts; unknown where no training forward took a tensor."""
    if size is None:
        return "global batch unknown (no training forward took a tensor whose first dimension could be counted)"
    return f"global batch {size}" + (f" ({unit})" if unit else "")


def strategy_name(strategy: str) -> str:
    """How a report names a strategy: DeepSpeed ZeRO-2 for ``deepspeed-zero2``.

    >>> strategy_name("deepspeed-zero3")
    'DeepSpeed ZeRO-3'
    """
    if strategy.startswith("deepspeed-zero"):
        return f"DeepSpeed ZeRO-{strategy.removeprefix('deepspeed-zero')}"
    return strategy


def format_lr(lr: float | None) -> str:
    """An lr as a reader wants it: four significant digits (0.003, 1.527e-05)."""
    return "None" if lr is None else f"{lr:.4g}"


def nothing_audited(why: str) -> Report:
    """The report of a command in which nothing could be audited: no findings, and RUN_INFO saying why."""
    return Report(None, None, None, 0, None, [Finding.make("RUN_INFO", 0, why)], why_nothing=why)


# --- comparing ranks' records ---

def cross_rank_findings(records: list[dict[str, Any]], reduction: Reduction | None = None) -> list[Finding]:
    """Parameters, buffers and gradients compared step by step; batches compared over the whole window."""
    out = []
    joined = _joined(records)
    windows: dict[tuple[str, int], dict[int, dict]] = {}
    for record in records:
        for window in record.get("windows", []):
            # Past a rank's Join, steps of the same number are different steps on different ranks.
            if window["step"] < joined.get(window["wrapper"], (float("inf"),))[0]:
                windows.setdefault((window["wrapper"], window["step"]), {})[record["rank"]] = window
    out += _join_notes(records, joined)
    for field, code, what in (("params", "PARAMS_DIVERGED", "parameters after optimizer step"),
                              ("buffers", "PARAMS_DIVERGED", "buffers right after DDP broadcast them, at step"),
                              ("grads", "NO_ALLREDUCE", "gradients used by optimizer step")):
        finding = _first_difference(windows, field, code, what)
        if finding is not None:
            out.append(finding)
    tokens = _per_device_tokens(windows)
    if tokens is not None:
        out.append(tokens)
    out += _normalisation_findings(windows, reduction)
    # Tensors first; then the indices behind them, which random augmentation cannot hide.
    duplicate = _duplicate_batches(records, "batches") or _duplicate_batches(records, "index_batches")
    if duplicate is not None:
        out.append(duplicate)
    seeded = _seeded_per_rank(records)
    if seeded is not None and duplicate is None:
        out.append(seeded)
    different = _tensor_parallel_batches(records)
    if different is not None:
        out.append(different)
    gathered = slice_shares.judge(records) if _averaged_as_is(records, reduction) else None
    if gathered is not None:
        finding = Finding.make(gathered[0], 0, gathered[1])
        finding.ranks = sorted(record.get("rank", 0) for record in records)
        finding.fix = gathered[2] or finding.fix
        out.append(finding)
    return out


def _averaged_as_is(records: list[dict[str, Any]], reduction: Reduction | None) -> bool:
    """Whether the ranks' gradients were averaged over W and not scaled after (a sum, a divisor of the program's, or
    a factor on the gradients after backward can make a put-back gather's 1/W exact)."""
    if reduction is not None and reduction.known and reduction.divisor != reduction.data_parallel_size:
        return False
    return not any("grad_scale" in window for record in records for window in record.get("windows", []))


def _joined(records: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """wrapper → (the first optimizer step at which some rank had joined with uneven inputs, that rank)."""
    joined: dict[str, tuple[int, int]] = {}
    for record in records:
        for wrapper, step in record.get("joined", {}).items():
            if wrapper not in joined or step < joined[wrapper][0]:
                joined[wrapper] = (step, record["rank"])
    return joined


def _join_notes(records: list[dict[str, Any]], joined: dict[str, tuple[int, int]]) -> list[Finding]:
    audited = max((r.get("steps_audited", 0) for r in records), default=0)
    notes = []
    for step, rank in sorted(joined.values()):
        if step < audited:
            notes.append(Finding.make("AUDIT_INCOMPLETE", rank,
                                      f"rank {rank} ran out of inputs before its optimizer step {step} and joined "
                                      "(torch's Join for uneven inputs): ranks are compared step by step only "
                                      "before it"))
    return notes[:1]


def _first_difference(windows, field: str, code: str, what: str) -> Finding | None:
    scaled = None
    for (_, step), by_rank in sorted(windows.items(), key=lambda item: item[0][1]):
        scaled = scaled or _scaled_per_rank(by_rank, step)
        if field == "grads" and _scaled_per_rank(by_rank, step):
            continue  # reduced alike, then scaled by each rank's own number: not gradients left unreduced
        present = {rank: w[field] for rank, w in by_rank.items() if w.get(field)}
        if len(present) < 2:
            continue
        reference_rank = min(present)
        reference = {name: (digest, norm) for name, digest, norm in present[reference_rank]}
        differing = [rank for rank, tensors in present.items()
                     if [t[1] for t in tensors] != [reference.get(t[0], (None,))[0] for t in tensors]]
        if differing:
            rank = differing[0]
            name, _, norm = next(t for t in present[rank] if reference.get(t[0], (None,))[0] != t[1])
            ref_norm = reference.get(name, (None, 0.0))[1]
            size = f"; norms {ref_norm:.6g} vs {norm:.6g}" if ref_norm != norm else "; equal norms, other values"
            detail = (f"{what} {step}: '{name}' on rank {rank} differs from rank {reference_rank}{size}"
                      f"{f'; {scaled}' if scaled and field == 'params' else ''}")
            finding = Finding.make(code, reference_rank, detail)
            finding.ranks = sorted({reference_rank, *differing})
            return finding
    return None


def _scaled_per_rank(by_rank: dict[int, dict], step: int) -> str | None:
    """Where the ranks scaled their gradients between backward and the step by different numbers
    (:mod:`ddplab.auditor.grad_scaling`), what they were."""
    factors = {rank: float(w.get("grad_scale", 1.0)) for rank, w in by_rank.items()}
    if len(factors) < 2 or max(factors.values()) - min(factors.values()) <= 1e-4 * max(map(abs, factors.values())):
        return None
    each = ", ".join(f"rank {rank} ×{factor:.4g}" for rank, factor in sorted(factors.items()))
    return (f"at optimizer step {step} the program scaled its gradients after they were reduced by a different number "
            f"on each rank ({each}), so the ranks stepped different gradients")


def _per_device_tokens(windows) -> Finding | None:
    """Evidence of per-device loss normalisation: ranks that each divided by their own, different, token counts."""
    for (_, step), by_rank in sorted(windows.items(), key=lambda item: item[0][1]):
        counts = {rank: w["tokens"] for rank, w in by_rank.items() if w.get("tokens") is not None}
        if len(counts) >= 2 and len(set(counts.values())) > 1:
            (low_rank, low), (high_rank, high) = min(counts.items(), key=lambda c: c[1]), max(counts.items(),
                                                                                              key=lambda c: c[1])
            why = next(w.get("tokens_why", "") for w in by_rank.values() if w.get("tokens") is not None)
            finding = Finding.make("LOSS_NORMALISED_PER_DEVICE", min(counts),
                                   f"{why}; at optimizer step {step} rank {low_rank} had {low} label tokens and "
                                   f"rank {high_rank} {high}, so a token on rank {low_rank} weighed "
                                   f"{high / max(low, 1):.3g} times one on rank {high_rank}")
            finding.ranks = sorted(counts)
            finding.fix = TOKEN_FIXES["transformers"]  # the Trainer's own count is what it records
            return finding
    return None


def _normalisation_findings(windows, reduction: Reduction | None) -> list[Finding]:
    """Losses divided by per-rank or per-micro-batch counts, or by a global count that disagrees with the reduction."""
    divisor = normalisation.AVERAGE if reduction is None else reduction.divisor
    out = []
    for judgement in normalisation.judge_windows(windows, divisor):
        ranks = sorted({rank for (_, step), by_rank in windows.items() if step == judgement.step for rank in by_rank})
        finding = Finding.make(judgement.code, ranks[0] if ranks else 0, judgement.detail)
        finding.ranks = ranks or [0]
        out.append(finding)
    return out


def _duplicate_batches(records: list[dict[str, Any]], field: str) -> Finding | None:
    """Evidence of unsharded data: most of a rank's training batches (``field``: their tensors, or the dataset
    indices they were loaded from) also reached another rank, at any step."""
    by_wrapper: dict[str, dict[int, list[str]]] = {}
    audited: dict[tuple[str, int], list[str]] = {}
    for record in records:
        for wrapper, batches in record.get(field, {}).items():
            by_wrapper.setdefault(wrapper, {})[record["rank"]] = batches
            audited[wrapper, record["rank"]] = batches[:_audited_count(record, field, wrapper, len(batches))]
    # Each wrapper's (or data-parallel group's) ranks among themselves; the ranks of every group alike are named.
    found: set[int] = set()
    shared_total = 0
    for wrapper, ranks in by_wrapper.items():
        involved = set()
        for rank in ranks:
            # A rank's batches of its audited steps, sought among all the others' (streams shifted in time meet).
            distinct = set(audited[wrapper, rank])
            # One batch repeated is a fixed-batch benchmark or an overfitting test, not unsharded data.
            if len(distinct) < 2:
                continue
            others = set().union(*(set(b) for r, b in ranks.items() if r != rank))
            shared = distinct & others
            if len(shared) >= 2 and len(shared) * 2 >= len(distinct):
                involved.add(rank)
                shared_total = max(shared_total, len(shared))
        if len(involved) >= 2:
            found |= involved
    if not found:
        return None
    detail = (f"up to {shared_total} distinct training batches of one rank's audited steps also reached another "
              "rank") if field == "batches" else (
        f"up to {shared_total} distinct training batches of one rank's audited steps were loaded from the same "
        "indices of the same dataset as batches of another rank (the tensors differ, e.g. by "
        "random augmentation, but the samples are the same: a sampler seeded alike on every rank)")
    finding = Finding.make("SAME_DATA_ON_ALL_RANKS", min(found), detail)
    finding.ranks = sorted(found)
    return finding


def _seeded_per_rank(records: list[dict[str, Any]]) -> Finding | None:
    """Evidence that the ranks' DistributedSamplers of one dataset drew from different permutations: the same
    dataset (its signature and size) split over the same replicas, shuffled in the same epoch with other seeds."""
    by_dataset: dict[tuple, dict[int, dict]] = {}
    for record in records:
        for sampler in record.get("samplers", []):
            if sampler.get("signature") is None:
                continue  # a dataset that cannot be told apart from another rank's shard: no evidence
            key = (sampler["signature"], sampler["size"], sampler["num_replicas"], sampler["epoch"])
            by_dataset.setdefault(key, {}).setdefault(record["rank"], sampler)
    for (_, size, replicas, _), ranks in by_dataset.items():
        seeds = {rank: sampler["seed"] for rank, sampler in ranks.items()}
        if len(ranks) < 2 or len(set(seeds.values())) < 2:
            continue
        shown = ", ".join(f"rank {rank} seed {seed}" for rank, seed in sorted(seeds.items())[:4])
        never = (1 - 1 / replicas) ** replicas
        once = (1 - 1 / replicas) ** (replicas - 1)
        prefixes = [set(sampler.get("prefix", [])) for sampler in ranks.values()]
        met = len(set.intersection(*prefixes[:2])) if len(prefixes) >= 2 else 0
        detail = (f"one dataset of {size} samples over {replicas} replicas, {shown}: about "
                  f"{1 - never - once:.0%} of the samples train on two ranks or more in an epoch and {never:.0%} on "
                  f"none (the first {len(prefixes[0])} indices of two ranks already share {met})")
        finding = Finding.make("SAMPLER_SEEDED_PER_RANK", min(ranks), detail)
        finding.ranks = sorted(ranks)
        return finding
    return None


# Training batches of a tensor-parallel group compared one for one: differing in at least this many, and in at
# least half of those compared, is evidence (ranks of a tensor-parallel group run every forward together).
TP_EVIDENCE = 2


def _audited_count(record: dict[str, Any], field: str, wrapper: str, default: int) -> int:
    """How many of a rank's training batches (``field``) its audited steps took: one count for the in-run report and
    the final one, though batches are kept for longer (the data window)."""
    return record.get("audited_batches", {}).get(field, {}).get(wrapper, default)


def _tensor_parallel_batches(records: list[dict[str, Any]]) -> Finding | None:
    """Evidence that ranks of one tensor-parallel group were fed different batches: their i-th training batches
    came from different dataset indices (or, without a DataLoader's indices, are different tensors)."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for record in records:
        for group, spec in record.get("tp_groups", {}).items():
            key = spec["batches"]
            groups.setdefault(group, {})[record["rank"]] = {**spec, **{
                field: batches[:_audited_count(record, field, key, len(batches))]
                for field in ("index_batches", "batches") for batches in [record.get(field, {}).get(key, [])]}}
    involved: set[int] = set()
    details: list[str] = []
    for by_rank in groups.values():
        evidence = _differing_batches(by_rank)
        if evidence is not None:
            involved |= set(by_rank)
            details.append(evidence)
    if not involved:
        return None
    finding = Finding.make("TP_RANKS_SEE_DIFFERENT_DATA", min(involved), details[0] + (
        f" ({len(details)} groups alike)" if len(details) > 1 else ""))
    finding.ranks = sorted(involved)
    return finding


def _differing_batches(by_rank: dict[int, dict[str, Any]]) -> str | None:
    """How one group's ranks' batches differ, compared with its lowest rank's; None without evidence."""
    reference_rank = min(by_rank)
    reference = by_rank[reference_rank]
    dims = "/".join(reference.get("dims", [])) or "tensor-parallel"
    for field, what in (("index_batches", "were loaded from different dataset indices"),
                        ("batches", "held different values (the model's inputs compared element for element: too "
                                    "few of their DataLoader indices were seen)")):
        # Under context parallelism each rank holds its own slice of every sequence: only indices can be compared.
        if field == "batches" and any(r.get("sharded_inputs") for r in by_rank.values()):
            return None
        for rank, theirs in sorted(by_rank.items()):
            compared = list(zip(reference[field], theirs[field]))
            if rank == reference_rank or len(compared) < TP_EVIDENCE:
                continue
            differing = sum(a != b for a, b in compared)
            if differing >= TP_EVIDENCE and differing * 2 >= len(compared):
                return (f"in the {dims} group of ranks {', '.join(map(str, sorted(by_rank)))}, {differing} of the "
                        f"first {len(compared)} training batches of rank {rank} and rank {reference_rank} {what}")
        if any(len(r[field]) >= TP_EVIDENCE for r in by_rank.values()):
            return None  # the indices agree: whatever the tensors show (augmentation), the samples are the same
    return None


# --- records on disk ---

# A marker file's name prefix: this process ended for lack of a torchrun variable (written by auditor.environment).
NEEDS_LAUNCHER_MARKER = "needs-launcher-"

def read_records(directory: str) -> list[dict[str, Any]]:
    """Every rank's record in ``directory``: its own file first, else a copy rank 0 fetched from the store."""
    own: dict[int, dict[str, Any]] = {}
    copies: dict[int, dict[str, Any]] = {}
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            continue  # a file cut short by a kill: the rank's older files or copies still count
        rank = record.get("rank", 0)
        # Several processes can report one rank (a launcher, a parent): keep the one that audited most.
        if rank not in own or _weight(record) >= _weight(own[rank]):
            own[rank] = record
        for peer in record.get("peers", []):
            copies.setdefault(peer.get("rank", 0), peer)
    return list({**copies, **own}.values())


def _weight(record: dict[str, Any]) -> tuple[int, int]:
    return record.get("steps_audited", 0), len(record.get("windows", []))
