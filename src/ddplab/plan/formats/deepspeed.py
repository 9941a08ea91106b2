"""DeepSpeed's JSON config: ``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps ×
world size``, ``optimizer.params`` and a ``scheduler`` (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``).

``"auto"`` (which the Transformers and Accelerate integrations fill in) stays ``"auto"`` where DeepSpeed can still
derive it from the keys the plan writes; a reference left all ``"auto"`` needs the flags.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ddplab.errors import literal
from ddplab.plan.formats import base, editing
from ddplab.plan.inputs import Target
from ddplab.plan.result import Plan

BATCH = {"global_batch_size": "train_batch_size", "per_device_batch_size": "train_micro_batch_size_per_gpu",
         "accumulation_steps": "gradient_accumulation_steps"}
OPTIMIZER = {"lr": "optimizer.params.lr", "betas": "optimizer.params.betas", "eps": "optimizer.params.eps",
             "weight_decay": "optimizer.params.weight_decay"}
SCHEDULER = {"lr": "scheduler.params.warmup_max_lr", "warmup_steps": "scheduler.params.warmup_num_steps",
             "total_steps": "scheduler.params.total_num_steps"}


class DeepSpeed:
    name = "deepspeed"
    label = "a DeepSpeed JSON config"

    def detect(self, path: str, text: str) -> bool:
        tree = _parse(path, text, quiet=True)
        keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization")
        return isinstance(tree, dict) and any(key in tree for key in keys)

    def read(self, path: str, text: str, given: Mapping[str, Any]) -> base.FileRun:
        tree = _parse(path, text)
        keys = {**BATCH, **{f"optimizer.{k}": v for k, v in OPTIMIZER.items()},
                **{f"scheduler.{k}": v for k, v in SCHEDULER.items()}}
        values = {key: base.lookup(tree, key) for key in keys.values()}
        values["optimizer.type"] = base.lookup(tree, "optimizer.type")
        reference = {**_batch(path, values, given), **_optimizer(path, values, given)}
        data = {}
        for field, key in (("reference_warmup_steps", SCHEDULER["warmup_steps"]),
                           ("reference_steps", SCHEDULER["total_steps"])):
            if _number(values[key]):
                data[field] = base.whole(path, key, values[key])
        field_keys = {f"reference.{f}": k for f, k in BATCH.items()} | {f"target.{f}": k for f, k in BATCH.items()}
        field_keys |= {f"reference.{f}": k for f, k in OPTIMIZER.items()}
        field_keys |= {"data.reference_warmup_steps": SCHEDULER["warmup_steps"],
                       "data.reference_steps": SCHEDULER["total_steps"]}
        return base.FileRun(path=path, reference=reference, data=data, keys=field_keys, roles=keys, values=values,
                            defaults={BATCH["accumulation_steps"]: 1}, notes=_notes(values))

    def changes(self, run: base.FileRun, plan: Plan, target: Target) -> dict[str, Any]:
        planned = base.planned(plan, target)
        out = {}
        for role, key in run.roles.items():
            field = role.rpartition(".")[2]
            old = run.values[key]
            if old is base.MISSING and role.startswith(("optimizer.", "scheduler.")):
                continue
            if old == "auto" or planned.get(field) is None:
                continue
            out[key] = planned[field]
        # Two of the three batch keys fix the third: one left out or "auto" stays so.
        given = [key for key in BATCH.values() if run.values[key] not in (base.MISSING, "auto")]
        if len(given) == 3:
            return out
        for key in BATCH.values():
            if key not in given:
                out.pop(key, None)
        return out

    def edit(self, text: str, changes: Mapping[str, Any]) -> str:
        for key, value in changes.items():
            text = editing.json_set(text, key, value)
        return text


FORMAT = DeepSpeed()


def _parse(path: str, text: str, *, quiet: bool = False) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if quiet:
            return None
        raise base.bad(path, "", f"is not JSON ({literal(str(exc))}): give a DeepSpeed config") from None


def _number(value: Any) -> bool:
    return value not in (base.MISSING, "auto", None)


def _batch(path: str, values: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The reference's batch and, where all three batch keys are numbers, its world size."""
    numbers = {field: base.whole(path, key, values[key]) for field, key in BATCH.items() if _number(values[key])}
    if not numbers and "per_device_batch_size" not in given:
        raise base.bad(path, BATCH["per_device_batch_size"], "is \"auto\" or missing, as are train_batch_size and "
                       "gradient_accumulation_steps: give the reference's batch with {reference.per_device_batch_size}")
    out: dict[str, Any] = {}
    if len(numbers) == 3 and "devices" not in given:
        micro, accumulation = numbers["per_device_batch_size"], numbers["accumulation_steps"]
        world, rest = divmod(numbers["global_batch_size"], micro * accumulation)
        if rest:
            raise base.bad(path, BATCH["global_batch_size"], f"{numbers['global_batch_size']} is not "
                           f"train_micro_batch_size_per_gpu {micro} × gradient_accumulation_steps {accumulation} × a "
                           "world size: give numbers DeepSpeed accepts")
        out.update(devices=world, nodes=1)
    elif "devices" not in given:
        raise base.bad(path, BATCH["global_batch_size"], "does not fix the world size (a batch key is \"auto\" or "
                                                         "missing): pass {reference.devices} and {reference.nodes}")
    world = given.get("devices", out.get("devices", 1)) * given.get("nodes", out.get("nodes", 1))
    if "per_device_batch_size" in numbers:
        out["per_device_batch_size"] = micro = numbers["per_device_batch_size"]
        out["accumulation_steps"] = numbers.get("accumulation_steps") or (
            base.accumulation(path, BATCH["global_batch_size"], numbers["global_batch_size"], micro, world,
                              BATCH["per_device_batch_size"]) if "global_batch_size" in numbers else 1)
    if "global_batch_size" in numbers:
        out["global_batch_size"] = numbers["global_batch_size"]
    return out


def _optimizer(path: str, values: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    kind = values["optimizer.type"]
    family = base.optimizer_family(kind) if isinstance(kind, str) else given.get("optimizer")
    if family is None:
        what = "is missing" if kind is base.MISSING else f"is {literal(repr(kind))}"
        raise base.bad(path, "optimizer.type", f"{what}: give Adam, AdamW or SGD there, or pass "
                                               "{reference.optimizer}")
    out: dict[str, Any] = {"optimizer": family}
    lr = values[SCHEDULER["lr"]] if _number(values[SCHEDULER["lr"]]) else values[OPTIMIZER["lr"]]
    key = SCHEDULER["lr"] if _number(values[SCHEDULER["lr"]]) else OPTIMIZER["lr"]
    if _number(lr):
        out["lr"] = base.real(path, key, lr)
    elif "lr" not in given:
        raise base.bad(path, OPTIMIZER["lr"], "is \"auto\" or missing: give the reference lr with {reference.lr}")
    if family != "sgd":
        for field, reader in (("betas", base.pair), ("eps", base.real), ("weight_decay", base.real)):
            if _number(values[OPTIMIZER[field]]):
                out[field] = reader(path, OPTIMIZER[field], values[OPTIMIZER[field]])
    return out


def _notes(values: dict[str, Any]) -> tuple[str, ...]:
    auto = [key for key in values if values[key] == "auto"]
    return (f"{', '.join(auto)} stay \"auto\": whatever fills them in (the Trainer, Accelerate) must pass the "
            "plan's values",) if auto else ()
