"""Megatron-LM's arguments, in a launch script (``torchrun ... pretrain_gpt.py --micro-batch-size 4 ...``) or an args
file: ``--micro-batch-size``, ``--global-batch-size`` (default micro × data-parallel degree; more accumulates),
``--rampup-batch-size START INCREMENT SAMPLES``, ``--lr``, ``--lr-warmup-iters``, ``--train-iters``, the
``--*-model-parallel-size`` and ``--context-parallel-size`` degrees, and the launcher's ``--nproc_per_node`` and
``--nnodes``. The script is read as bash runs it (:mod:`~ddplab.plan.formats.shell`): ``NAME=${NAME:-default}``
takes its default, an array's flags count where ``"${args[@]}"`` expands it. A value given as a shell variable
(``--lr $LR``) is read from, and written to, its assignment (its default, where the environment may set it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ddplab.errors import UsageError, literal
from ddplab.plan.formats import base, editing, shell
from ddplab.plan.inputs import Target
from ddplab.plan.result import Plan

FLAGS = {"per_device_batch_size": "--micro-batch-size", "global_batch_size": "--global-batch-size",
         "lr": "--lr", "warmup_steps": "--lr-warmup-iters", "total_steps": "--train-iters",
         "tensor_parallel_size": "--tensor-model-parallel-size",
         "pipeline_parallel_size": "--pipeline-model-parallel-size", "context_parallel_size": "--context-parallel-size",
         "beta1": "--adam-beta1", "beta2": "--adam-beta2", "eps": "--adam-eps", "weight_decay": "--weight-decay",
         "seq_len": "--seq-length", "optimizer": "--optimizer", "rampup": "--rampup-batch-size",
         "devices": "--nproc_per_node", "nodes": "--nnodes"}
SPELLINGS = {"--nproc_per_node": ("--nproc_per_node", "--nproc-per-node"), "--nnodes": ("--nnodes",)}
# Megatron's defaults for the flags a script may leave out (its Adam decouples weight decay, as AdamW).
DEFAULTS = {"--adam-beta1": 0.9, "--adam-beta2": 0.999, "--adam-eps": 1e-8, "--weight-decay": 0.01,
            "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1}
SAMPLE_COUNTED = ("--train-samples", "--lr-warmup-samples", "--lr-decay-samples")


class Megatron:
    name = "megatron"
    label = "Megatron-LM arguments"

    def detect(self, path: str, text: str) -> bool:
        return bool(re.search(r"(?<![\w-])--(micro-batch-size|global-batch-size|tensor-model-parallel-size)\b", text))

    def read(self, path: str, text: str, given: Mapping[str, Any]) -> base.FileRun:
        words = _words(path, text)
        raw = {flag: _value(words, flag) for flag in _all_flags()}
        values = {flag: _typed(path, flag, value) for flag, value in raw.items()}
        micro = values["--micro-batch-size"]
        if micro is base.MISSING:
            raise base.bad(path, "--micro-batch-size", "is missing: give the reference's per-device batch there")
        reference: dict[str, Any] = {"per_device_batch_size": micro, "optimizer": _family(path, values),
                                     **_optimizer(path, values), **_degrees(values)}
        reference.update(_hardware(path, values, given))
        reference.update(_accumulation(path, values, reference, given))
        data = {field: values[FLAGS[role]] for field, role in (("seq_len", "seq_len"), ("reference_steps",
                                                                  "total_steps"), ("reference_warmup_steps",
                                                                                   "warmup_steps"))
                if values[FLAGS[role]] is not base.MISSING}
        return base.FileRun(path=path, reference=reference, target=_degrees(values), data=data,
                            keys=_field_keys(), roles=dict(FLAGS), values=values, defaults=dict(DEFAULTS),
                            notes=_notes(values))

    def changes(self, run: base.FileRun, plan: Plan, target: Target) -> dict[str, Any]:
        roles = {role: flag for role, flag in FLAGS.items() if role not in ("seq_len", "optimizer", "rampup")}
        out = base.by_role(roles, base.planned(plan, target))
        if run.values["--global-batch-size"] is base.MISSING and plan.accumulation_steps == 1:
            out.pop("--global-batch-size")  # derived: micro × data-parallel degree
        for flag in ("--nproc_per_node", "--nnodes", "--lr-warmup-iters", "--train-iters"):
            if run.values[flag] is base.MISSING:
                out.pop(flag, None)
        if plan.betas is None:
            for flag in ("--adam-beta1", "--adam-beta2", "--adam-eps"):
                out.pop(flag, None)
        rampup = _scaled_rampup(run.values["--rampup-batch-size"], plan)
        if rampup is not None:
            out["--rampup-batch-size"] = rampup
        return out

    def edit(self, text: str, changes: Mapping[str, Any]) -> str:
        for flag, value in changes.items():
            text = _set(text, flag, value)
        # The words bash would run must hold the planned values: an edit that landed elsewhere (a flag in an array
        # the command never expands, before the one it does) is refused, not written.
        words = shell.words(text)
        for flag, value in changes.items():
            if not _reads_as(_value(words, flag), value):
                raise base.NotWritten(flag)
        return text


FORMAT = Megatron()


def _all_flags() -> list[str]:
    return [*FLAGS.values(), *SAMPLE_COUNTED]


def _reads_as(read: Any, value: Any) -> bool:
    """Whether the words' value is the written one (numbers to the 6 digits the editor writes)."""
    if isinstance(value, list):
        return isinstance(read, list) and len(read) == len(value) and all(map(_reads_as, read, value))
    try:
        return math.isclose(float(read), value, rel_tol=1e-5)
    except (TypeError, ValueError):
        return read == value


def _words(path: str, text: str) -> list[str]:
    """The words of the script's commands, as bash expands them (the flags and their values)."""
    try:
        return shell.words(text)
    except shell.ShellError as exc:
        raise UsageError(f"{literal(path)}, line {exc.line}: {exc.what}, so bash could not read the script either: "
                         "close it") from None


def _value(words: list[str], flag: str) -> Any:
    spellings = SPELLINGS.get(flag, (flag,))
    count = 3 if flag == "--rampup-batch-size" else 1
    for index, word in enumerate(words):
        name, equals, inline = word.partition("=")
        if name in spellings:
            tokens = [inline] if equals else words[index + 1:index + 1 + count]
            return tokens if count > 1 else tokens[0] if tokens else base.MISSING
    return base.MISSING


def _typed(path: str, flag: str, value: Any) -> Any:
    if value is base.MISSING or flag == "--optimizer":
        return value
    if flag == "--rampup-batch-size":
        if len(value) != 3:
            raise base.bad(path, flag, "needs START INCREMENT SAMPLES: give three whole numbers")
        return [base.whole(path, flag, _number(path, flag, v)) for v in value]
    number = _number(path, flag, value)
    integer = flag not in ("--lr", "--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay")
    return base.whole(path, flag, number) if integer else number


def _number(path: str, flag: str, text: str) -> float:
    if text.startswith("$"):
        raise base.bad(path, flag, f"is {literal(text)}, a variable the script does not set: give its value")
    return base.real(path, flag, text)


def _family(path: str, values: dict[str, Any]) -> str:
    name = values["--optimizer"]
    if name is base.MISSING or name == "adam":
        return "adamw"  # Megatron's Adam decouples weight decay
    if name == "sgd":
        return "sgd"
    raise base.bad(path, "--optimizer", f"is {literal(name)}: the plan scales adam and sgd")


def _optimizer(path: str, values: dict[str, Any]) -> dict[str, Any]:
    if values["--lr"] is base.MISSING:
        raise base.bad(path, "--lr", "is missing: give the reference lr there")
    out: dict[str, Any] = {"lr": values["--lr"]}
    if _family(path, values) == "sgd":
        return out
    pick = {flag: values[flag] if values[flag] is not base.MISSING else DEFAULTS[flag]
            for flag in ("--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay")}
    return {**out, "betas": (pick["--adam-beta1"], pick["--adam-beta2"]), "eps": pick["--adam-eps"],
            "weight_decay": pick["--weight-decay"]}


def _degrees(values: dict[str, Any]) -> dict[str, int]:
    return {field: values[FLAGS[field]] for field in ("tensor_parallel_size", "pipeline_parallel_size",
                                                      "context_parallel_size")
            if values[FLAGS[field]] is not base.MISSING}


def _hardware(path: str, values: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    if "devices" in given:
        return {}
    if values["--nproc_per_node"] is base.MISSING:
        raise base.bad(path, "--nproc_per_node", "is not in the file (no torchrun line): pass {reference.devices} "
                                                 "and {reference.nodes}")
    nodes = values["--nnodes"]
    return {"devices": values["--nproc_per_node"], "nodes": 1 if nodes is base.MISSING else nodes}


def _accumulation(path: str, values: dict[str, Any], reference: dict[str, Any],
                  given: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron accumulates micro-batches to reach --global-batch-size."""
    global_batch = values["--global-batch-size"]
    if global_batch is base.MISSING:
        return {}
    devices, nodes = given.get("devices", reference.get("devices")), given.get("nodes", reference.get("nodes", 1))
    dims = base.dims(devices * nodes, _degrees(values))
    return {"accumulation_steps": base.accumulation(path, "--global-batch-size", global_batch,
                                                    reference["per_device_batch_size"], dims, "--micro-batch-size")}


def _scaled_rampup(rampup: Any, plan: Plan) -> list[int] | None:
    """The batch ramp at the planned batch: its start and increment × k, its samples as they were."""
    if rampup is base.MISSING:
        return None
    start, increment, samples = rampup
    k = plan.batch_ratio
    scaled = [start * k, increment * k]
    unit = plan.per_device_batch_size * plan.data_parallel_size
    if any(v != int(v) or int(v) % unit for v in scaled):
        return None
    return [int(scaled[0]), int(scaled[1]), samples]


def _set(text: str, flag: str, value: Any) -> str:
    """The flag's value, written where the script keeps it: in place, or in the variable it names."""
    count = len(value) if isinstance(value, list) else 1
    spellings = SPELLINGS.get(flag, (flag,))
    flag = next((s for s in spellings if editing.flag_value(text, s) is not None), flag)
    span = editing.flag_value(text, flag, count)
    reference = re.match(r"[\"']?\$\{?(\w+)", text[span[0]:]) if span is not None else None
    if reference is not None and not isinstance(value, list):
        assigned = _assignment_value(text, reference[1])
        if assigned is not None:
            start, end = assigned
            return text[:start] + editing.number(value) + text[end:]
    if span is not None:
        return editing.args_set(text, flag, value, after=flag)
    return _add(text, flag, value)


def _assignment_value(text: str, name: str) -> tuple[int, int] | None:
    """The span of the value ``NAME=value`` gives, the default where it is ``${NAME:-default}`` (the variable set
    from the environment stays so)."""
    assignment = re.search(rf"^[ \t]*(?:export[ \t]+)?{name}=([\"']?)([^\s#;\"']+)\1", text, re.M)
    if assignment is None:
        return None
    default = re.fullmatch(rf"\$\{{{name}:?[-=]([\"']?)([^}}\"']*)\1\}}", assignment[2])
    if default is not None:
        start = assignment.start(2) + default.start(2)
        return start, start + len(default[2])
    return assignment.span(2)


def _add(text: str, flag: str, value: Any) -> str:
    """A flag the script lacks, on a line of its own after the flag it belongs beside (its continuation kept)."""
    anchor = "--lr" if flag.startswith(("--adam", "--weight")) else "--micro-batch-size"
    start, end = editing.flag_value(text, anchor)
    line_start, line_end = text.rfind("\n", 0, start) + 1, text.find("\n", end)
    line = text[line_start:line_end if line_end >= 0 else len(text)]
    continued = line.rstrip().endswith("\\")
    alone = line.strip() == text[text.find(anchor, line_start):end].strip()
    if line_end < 0 or not (continued or alone):
        return editing.args_set(text, flag, value, after=anchor)
    indent = line[:len(line) - len(line.lstrip())]
    rendered = " ".join(editing.number(v) if isinstance(v, (int, float)) else str(v)
                        for v in (value if isinstance(value, list) else [value]))
    # An args file's own style: one flag a line, with "=" where it uses one.
    separator = "=" if not continued and text[start - 1] == "=" else " "
    new = f"{indent}{flag}{separator}{rendered}" + (" \\" if continued else "")
    return text[:line_end + 1] + new + "\n" + text[line_end + 1:]


def _field_keys() -> dict[str, str]:
    out = {f"{side}.{field}": FLAGS[field] for field in ("per_device_batch_size", "tensor_parallel_size",
                                                         "pipeline_parallel_size", "context_parallel_size")
           for side in ("reference", "target")}
    return {**out, "reference.lr": "--lr", "reference.betas": "--adam-beta1/--adam-beta2", "reference.eps":
            "--adam-eps", "reference.weight_decay": "--weight-decay", "target.global_batch_size": "--global-batch-size",
            "reference.devices": "--nproc_per_node", "reference.nodes": "--nnodes", "data.seq_len": "--seq-length",
            "data.reference_steps": "--train-iters", "data.reference_warmup_steps": "--lr-warmup-iters"}


def _notes(values: dict[str, Any]) -> tuple[str, ...]:
    notes = []
    if values["--rampup-batch-size"] is not base.MISSING:
        start, increment, samples = values["--rampup-batch-size"]
        notes.append(f"--rampup-batch-size {start} {increment} {samples} is a batch schedule: the plan scales its "
                     "start and increment with the global batch and keeps its samples (kept as it was where the "
                     "scaled batches are not whole multiples of micro-batch × data-parallel degree); the lr is planned "
                     "for the final global batch")
    counted = [flag for flag in SAMPLE_COUNTED if values[flag] is not base.MISSING]
    if counted:
        notes.append(f"{', '.join(counted)} count samples, which the plan keeps: unchanged")
    return tuple(notes)
