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
from typing import Any, Literal

from ddplab.auditor import normalisation

Severity = Literal["error", "warning", "info"]
ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITY_ORDER: dict[Severity, int] = {ERROR: 0, WARNING: 1, INFO: 2}

# The fix for a loss normalised by a local count, in a plain loop (frameworks' own words in FRAMEWORK_FIXES).
GLOBAL_COUNT_RECIPE = (
    "divide the summed loss by the valid-element count of the whole optimizer step, all-reduced over the "
    "data-parallel ranks (and context-parallel ones) and summed over the step's micro-batches, times the "
    "data-parallel size DDP divides by: count = sum((labels != -100).sum() for the step's micro-batches); "
    "dist.all_reduce(count, group=dp_group); loss = F.cross_entropy(logits, labels, reduction='sum') * dp_size / "
    "count for each micro-batch (torchtitan's global valid-token count)")
# What the same fix is called in a framework the program used, per finding.
FRAMEWORK_FIXES: dict[str, str] = {
    "transformers": "TrainingArguments(average_tokens_across_devices=True) (the default) with a model whose "
                    "forward accepts num_items_in_batch (or a compute_loss_func that divides by it): the Trainer "
                    "then counts the step's label tokens over all micro-batches and devices",
    "lightning": "in training_step, sum the token losses and divide by the step's token count all-reduced with "
                 "self.all_gather or torch.distributed.all_reduce over the data-parallel group, times "
                 "self.trainer.world_size; with accumulate_grad_batches, count over the step's micro-batches too "
                 "(Lightning divides the returned loss by accumulate_grad_batches)",
    "accelerate": "count the step's valid tokens over its micro-batches, accelerator.reduce(count, 'sum') across "
                  "processes, and backward loss_sum * accelerator.num_processes / count (with "
                  "gradient_accumulation_steps, Accelerator.backward divides by the steps: multiply them back in)",
}
TOKEN_FINDINGS = ("LOSS_NORMALISED_PER_DEVICE", "LOSS_NORMALISED_PER_MICRO_BATCH")

# code → (severity, what it does to training, the fix)
CATALOGUE: dict[str, tuple[str, str, str]] = {
    "NO_ALLREDUCE": (
        ERROR,
        "gradients were not all-reduced: every rank trains alone on its own data, as W separate runs",
        "call the DDP wrapper for every training forward (ddp_model(x), not the model it wraps), and keep the "
        "wrapper alive until backward: build it once, outside the training loop"),
    "PARAMS_DIVERGED": (
        ERROR,
        "parameters differ across ranks: the ranks no longer train the same model",
        "make every rank run the same optimizer steps on all-reduced gradients; look for rank-dependent code, "
        "per-rank seeds in the model, or a forward that bypasses the wrapper"),
    "SAME_DATA_ON_ALL_RANKS": (
        ERROR,
        "ranks trained on the same batches: the W ranks repeat each other's work, and an epoch covers only "
        "1/W of the data it should",
        "give the DataLoader sampler=DistributedSampler(dataset) (and shuffle=False on the loader), or seed each "
        "rank's random batches differently (e.g. seed + rank)"),
    "TP_RANKS_SEE_DIFFERENT_DATA": (
        ERROR,
        "ranks of one tensor-parallel group were fed different batches: each holds a shard of every parallelised "
        "layer and computes it on its own inputs, so the activations and gradients its group combines mix different "
        "samples; nothing fails, training just learns less",
        "split the data by the data-parallel mesh dimension only: DistributedSampler(dataset, "
        "num_replicas=mesh['dp'].size(), rank=mesh['dp'].get_local_rank()), the same on every rank of a "
        "tensor-parallel group (and seed their random batches alike)"),
    "SET_EPOCH_MISSING": (
        WARNING,
        "a shuffling DistributedSampler fed training the same sample order in two passes over the data: unless "
        "set_epoch is given each epoch's own number, every epoch repeats the first one's order",
        "call sampler.set_epoch(epoch) at the start of every epoch, with that epoch's number (one that advances), "
        "before iterating the loader"),
    "SUM_REDUCTION": (
        WARNING,
        "backward starts from a loss summed over the batch: DDP averages gradients over ranks, so the gradient is "
        "1/W of what one process summing the global batch gets (with SGD the step is W times smaller; Adam-style "
        "optimizers mostly normalise the scale away, but not their epsilon or an L2 penalty in the loss)",
        "use reduction='mean', divide the summed loss by a sample or token count, or multiply it by the world size"),
    "BATCHNORM_NOT_SYNCED": (
        INFO,
        "BatchNorm normalises with statistics over each rank's batch, not the global batch",
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping in DDP computes global statistics "
        "(it needs GPUs with NCCL); with large per-rank batches per-rank statistics are common practice"),
    "ACCUMULATION_SYNCS_EVERY_STEP": (
        WARNING,
        "performance: gradient accumulation all-reduces on every micro-step; the result is unchanged but "
        "communication is accumulation-steps times larger",
        "wrap every micro-step but the last in `with ddp_model.no_sync():`"),
    "ACCUMULATION_REDUCES_EVERY_STEP": (
        INFO,
        "FSDP2 reduced the gradients of every micro-batch accumulated into one optimizer step: the result is "
        "unchanged, the communication accumulation-steps times larger, and the gradients stay sharded between "
        "micro-batches (the memory this saves is why it is FSDP2's default)",
        "where memory allows, model.set_requires_gradient_sync(False) before every micro-batch but the last "
        "(True before the last); under HSDP, set_requires_all_reduce(False) defers only the all-reduce across "
        "replicas"),
    "NOT_DISTRIBUTED": (
        ERROR,
        "several processes were started but each trains a model of its own: W separate runs, each learning only "
        "from what its own process loads (its shard with DistributedSampler, the whole dataset without one)",
        "make the processes join one distributed run: init_process_group and DistributedDataParallel in a plain "
        "loop; with Accelerate on CPU, Accelerator(cpu=True) or ACCELERATE_USE_CPU=1 (check "
        "accelerator.num_processes == WORLD_SIZE)"),
    "SCHEDULER_STEPS_PER_PROCESS": (
        WARNING,
        "the lr scheduler steps several times per optimizer step, so a warmup or decay given in optimizer steps "
        "runs that many times faster: warmup ends early, and a decay reaches its end while training goes on",
        "give the schedule's lengths in scheduler steps (multiply warmup and total steps by num_processes), or "
        "prepare the scheduler with Accelerator(step_scheduler_with_optimizer=False) and step it once per "
        "optimizer step yourself"),
    "LR_SCALED_NOT_SCHEDULE": (
        WARNING,
        "the optimizer's lr was scaled for the world size after its scheduler was built: the scheduler's base_lrs "
        "(and the groups' initial_lr) keep the old lr",
        "scale the lr before building the scheduler, or scale group['initial_lr'] and scheduler.base_lrs too "
        "(ddplab.integrations' ScaleLearningRate does all three)"),
    "LR_SCALED_BY_WORLD_SIZE": (
        WARNING,
        "the lr was scaled by the world size, but under a device mesh only the data-parallel ranks add samples to "
        "the global batch (the ranks of a tensor-parallel group share theirs): the lr is world/dp times (or its "
        "square root) what the scaling rule gives",
        "scale the lr by the data-parallel size (mesh['dp'].size(), or the product of the data-parallel "
        "dimensions), not dist.get_world_size(); `ddplab plan --tp` computes it"),
    "LOSS_NORMALISED_PER_DEVICE": (
        WARNING,
        "each rank divided its loss by its own element (token) count, and DDP averages those means: with different "
        "counts per rank, an element on a rank with few weighs more than one on a rank with many, so the gradient is "
        "not the mean over the global batch's elements",
        GLOBAL_COUNT_RECIPE),
    "LOSS_NORMALISED_PER_MICRO_BATCH": (
        WARNING,
        "each micro-batch's loss was divided by its own element (token) count before the micro-batches were "
        "accumulated: with different counts per micro-batch, an element of a short micro-batch weighs more than one "
        "of a long one, so the step's gradient is not the mean over its elements",
        GLOBAL_COUNT_RECIPE),
    "GLOBAL_COUNT_WITHOUT_WORLD_SIZE": (
        WARNING,
        "the loss was divided by the element count of the whole step on all data-parallel ranks, and DDP then "
        "averages the gradients over those ranks: the gradient is 1/W of the global mean's (with SGD the step is W "
        "times smaller)",
        "multiply the loss by the data-parallel size: loss = loss_sum * dp_size / global_count (DDP and FSDP2 "
        "divide the summed gradients by dp_size, so this gives exactly the global mean)"),
    "EVAL_SAMPLES_DUPLICATED": (
        WARNING,
        "an evaluation pass over a DistributedSampler that padded the dataset to a multiple of the ranks "
        "(drop_last=False) reached a collective: the padded samples are evaluated and counted twice in the "
        "combined result",
        "count only real samples: shard without padding (indices range(rank, len(dataset), world_size), as "
        "Lightning's UnrepeatedDistributedSampler does), drop the padded duplicates before reducing "
        "(Accelerate's gather_for_metrics does), or DistributedSampler(drop_last=True) where skipping a few "
        "samples is acceptable"),
    "AUDIT_INCOMPLETE": (
        INFO,
        "the audit did not cover the whole run; training itself was not affected",
        "nothing to fix in training; the detail says what the audit could not see"),
    "RUN_INFO": (INFO, "", ""),
}


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

    @property
    def has_error(self) -> bool:
        return any(f.severity == ERROR for f in self.findings)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.code != "RUN_INFO"]

    def headline(self) -> str:
        if self.why_nothing is not None:
            return self.why_nothing
        if self.steps_audited == 0:
            return f"world size {self.world_size}, no optimizer step of a DDP model was audited"
        steps = f"{self.steps_audited} optimizer steps audited"
        if self.steps_requested and self.steps_audited < self.steps_requested:
            steps += f" (the run made fewer than the {self.steps_requested} asked for)"
        setting = describe_setting(self.world_size, self.data_parallel_size, self.strategy, self.mesh)
        return f"{setting}, global batch {self.global_batch_size}, lr {format_lr(self.lr)}, {steps}"

    def signature(self) -> list[list]:
        """What a reader would see change between two reports of one run (JSON-shaped)."""
        return sorted([f.code, f.severity, sorted(f.ranks)] for f in self.problems)

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "data_parallel_size": self.data_parallel_size,
                "global_batch_size": self.global_batch_size, "strategy": self.strategy, "mesh": self.mesh,
                "lr": self.lr, "steps_audited": self.steps_audited, "steps_requested": self.steps_requested,
                "findings": [f.to_json() for f in self.findings], "audited": self.why_nothing is None}


def merge(rank_records: list[dict[str, Any]]) -> Report:
    """Merge per-rank records into one report: their own findings, then what comparing them shows."""
    merged: dict[str, Finding] = {}
    records = sorted(rank_records, key=lambda r: r.get("rank", 0))
    local = [Finding(**raw) for record in records for raw in record.get("findings", [])]
    for finding in local + cross_rank_findings(records):
        if finding.code in merged:
            known = merged[finding.code]
            known.ranks = sorted(set(known.ranks) | set(finding.ranks))
            if SEVERITY_ORDER[finding.severity] < SEVERITY_ORDER[known.severity]:
                known.severity, known.detail = finding.severity, finding.detail
        else:
            merged[finding.code] = dataclasses.replace(finding, ranks=sorted(finding.ranks))
    main = records[0] if records else {}
    findings = sorted(merged.values(), key=lambda f: (SEVERITY_ORDER[f.severity], f.code))
    return Report(main.get("world_size"), main.get("global_batch_size"), main.get("lr"),
                  max((r.get("steps_audited", 0) for r in records), default=0), main.get("steps_requested"), findings,
                  data_parallel_size=main.get("data_parallel_size"), strategy=main.get("strategy"),
                  mesh=main.get("mesh"))


def describe_setting(world_size: int | None, data_parallel_size: int | None, strategy: str | None,
                     mesh: dict[str, int] | None) -> str:
    """The run's ranks as a report's first words: the world size, and under a mesh its shape and data-parallel size.

    >>> describe_setting(4, 2, "fsdp+tp", {"dp": 2, "tp": 2})
    'world size 4, fsdp+tp on mesh dp 2 × tp 2 (data-parallel size 2)'
    >>> describe_setting(2, 2, "ddp", None)
    'world size 2'
    """
    if not mesh:
        return f"world size {world_size}"
    shape = " × ".join(f"{name} {size}" for name, size in mesh.items())
    return f"world size {world_size}, {strategy} on mesh {shape} (data-parallel size {data_parallel_size})"


def format_lr(lr: float | None) -> str:
    """An lr as a reader wants it: four significant digits (0.003, 1.527e-05)."""
    return "None" if lr is None else f"{lr:.4g}"


def nothing_audited(why: str) -> Report:
    """The report of a command in which nothing could be audited: no findings, and RUN_INFO saying why."""
    return Report(None, None, None, 0, None, [Finding.make("RUN_INFO", 0, why)], why_nothing=why)


# --- comparing ranks' records ---

def cross_rank_findings(records: list[dict[str, Any]]) -> list[Finding]:
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
    out += _normalisation_findings(windows, records)
    # Tensors first; then the indices behind them, which random augmentation cannot hide.
    duplicate = _duplicate_batches(records, "batches") or _duplicate_batches(records, "index_batches")
    if duplicate is not None:
        out.append(duplicate)
    different = _tensor_parallel_batches(records)
    if different is not None:
        out.append(different)
    return out


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
    for (_, step), by_rank in sorted(windows.items(), key=lambda item: item[0][1]):
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
            detail = (f"{what} {step}: '{name}' on rank {rank} differs from rank {reference_rank}{size}")
            finding = Finding.make(code, reference_rank, detail)
            finding.ranks = sorted({reference_rank, *differing})
            return finding
    return None


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
            finding.fix = FRAMEWORK_FIXES["transformers"]  # the Trainer's own count is what it records
            return finding
    return None


def _normalisation_findings(windows, records: list[dict[str, Any]]) -> list[Finding]:
    """Losses divided by per-rank or per-micro-batch counts, or by a global count without × W."""
    used = {name for record in records for name in record.get("frameworks", [])}
    framework = next((name for name in FRAMEWORK_FIXES if name in used), None)
    out = []
    for judgement in normalisation.judge_windows(windows):
        ranks = sorted({rank for (_, step), by_rank in windows.items() if step == judgement.step for rank in by_rank})
        finding = Finding.make(judgement.code, ranks[0] if ranks else 0, judgement.detail)
        finding.ranks = ranks or [0]
        if framework is not None and judgement.code in TOKEN_FINDINGS:
            finding.fix = FRAMEWORK_FIXES[framework]
        out.append(finding)
    return out


def _duplicate_batches(records: list[dict[str, Any]], field: str) -> Finding | None:
    """Evidence of unsharded data: most of a rank's training batches (``field``: their tensors, or the dataset
    indices they were loaded from) also reached another rank, at any step."""
    by_wrapper: dict[str, dict[int, list[str]]] = {}
    for record in records:
        for wrapper, batches in record.get(field, {}).items():
            by_wrapper.setdefault(wrapper, {})[record["rank"]] = batches
    # Each wrapper's (or data-parallel group's) ranks among themselves; the ranks of every group alike are named.
    found: set[int] = set()
    shared_total = 0
    for ranks in by_wrapper.values():
        involved = set()
        for rank, batches in ranks.items():
            distinct = set(batches)
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
    detail = (f"up to {shared_total} distinct training batches of one rank also reached another rank during "
              "the audited window") if field == "batches" else (
        f"up to {shared_total} distinct training batches of one rank were loaded from the same indices of the "
        "same dataset as batches of another rank during the audited window (the tensors differ, e.g. by "
        "random augmentation, but the samples are the same: a sampler seeded alike on every rank)")
    finding = Finding.make("SAME_DATA_ON_ALL_RANKS", min(found), detail)
    finding.ranks = sorted(found)
    return finding


# Training batches of a tensor-parallel group compared one for one: differing in at least this many, and in at
# least half of those compared, is evidence (ranks of a tensor-parallel group run every forward together).
TP_EVIDENCE = 2


def _tensor_parallel_batches(records: list[dict[str, Any]]) -> Finding | None:
    """Evidence that ranks of one tensor-parallel group were fed different batches: their i-th training batches
    came from different dataset indices (or, without a DataLoader's indices, are different tensors)."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for record in records:
        for group, spec in record.get("tp_groups", {}).items():
            groups.setdefault(group, {})[record["rank"]] = {
                **spec, "index_batches": record.get("index_batches", {}).get(spec["batches"], []),
                "batches": record.get("batches", {}).get(spec["batches"], [])}
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
                        ("batches", "were different tensors")):
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


def render_text(report: Report) -> str:
    """A plain-text report, for logs and for rank 0's report inside the run."""
    lines = [f"ddplab audit: {report.headline()}"]
    if not report.problems:
        lines.append("  no DDP mistakes found")
    for finding in report.problems:
        data = finding.to_json()
        lines.append(f"  {finding.severity.upper():7} {finding.code} on ranks {data['ranks']}: {data['message']}")
        lines.append(f"          fix: {finding.fix}")
    return "\n".join(lines)
