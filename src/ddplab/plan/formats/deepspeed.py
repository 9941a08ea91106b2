"""DeepSpeed's JSON config: ``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps ×
world size``, ``optimizer.params`` and a ``scheduler`` (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``).

``"auto"`` (which the Transformers and Accelerate integrations fill in) stays ``"auto"`` where DeepSpeed can still
derive it from the keys the plan writes; a reference left all ``"auto"`` needs the flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
        # DeepSpeed's optimizer block ({"type": ..., "params": ...}) is its own: TrainingArguments name theirs "optim".
        return isinstance(tree, dict) and (any(key in tree for key in keys) or (
            isinstance(tree.get("optimizer"), dict) and "type" in tree["optimizer"]))

    def read(self, path: str, text: str, given: Mapping[str, Any]) -> base.FileRun:
        tree = _parse(path, text)
        keys = {**BATCH, **{f"optimizer.{k}": v for k, v in OPTIMIZER.items()},
                **{f"scheduler.{k}": v for k, v in SCHEDULER.items()}}
        values = {key: base.lookup(tree, key) for key in keys.values()}
        values["optimizer.type"] = base.lookup(tree, "optimizer.type")
        batch, derived = _batch(path, values, given)
        reference = {**batch, **_optimizer(path, values, given)}
        data = {}
        for field, key in (("reference_warmup_steps", SCHEDULER["warmup_steps"]),
                           ("reference_steps", SCHEDULER["total_steps"])):
            if _number(values[key]):
                data[field] = base.whole(path, key, values[key])
        field_keys = {f"reference.{f}": k for f, k in BATCH.items()} | {f"target.{f}": k for f, k in BATCH.items()}
        field_keys |= {f"reference.{f}": k for f, k in OPTIMIZER.items()}
        field_keys |= {"data.reference_warmup_steps": SCHEDULER["warmup_steps"],
                       "data.reference_steps": SCHEDULER["total_steps"]}
        target = {"strategy": f"deepspeed-zero{_stage(path, tree)}"}
        return base.FileRun(path=path, reference=reference, target=target, data=data, keys=field_keys, roles=keys,
                            values=values, defaults={BATCH["accumulation_steps"]: 1}, notes=derived + _notes(values))

    def changes(self, run: base.FileRun, plan: Plan, target: Target) -> dict[str, Any]:
        planned = base.planned(plan, target)
        out = {}
        for role, key in run.roles.items():
            field = role.rpartition(".")[2]
            old = run.values[key]
            if key in BATCH.values() or old == "auto" or planned.get(field) is None:
                continue
            if old is base.MISSING and role.startswith(("optimizer.", "scheduler.")):
                continue
            out[key] = planned[field]
        return out | _batch_changes(run, plan)

    def edit(self, text: str, changes: Mapping[str, Any]) -> str:
        for key, value in changes.items():
            text = editing.json_set(text, key, value)
        return text


def _batch_changes(run: base.FileRun, plan: Plan) -> dict[str, int]:
    """The batch keys the file gives, at the plan's values; gradient_accumulation_steps added where DeepSpeed's own
    resolution of them (accumulation 1) would miss the plan's. An "auto" key stays "auto", for the Trainer to fill."""
    planned = {"global_batch_size": plan.global_batch_size, "per_device_batch_size": plan.per_device_batch_size,
               "accumulation_steps": plan.accumulation_steps}
    given = [field for field, key in BATCH.items() if _number(run.values[key])]
    if any(run.values[key] == "auto" for key in BATCH.values()):
        return {BATCH[field]: planned[field] for field in given}
    # A file that gives no batch key (the reference's came from flags) gets the per-device batch.
    given = given or ["per_device_batch_size"]
    out = {BATCH[field]: planned[field] for field in given}
    resolved = resolve_batch(run.path, {field: planned[field] for field in given}, plan.data_parallel_size)
    if resolved["accumulation_steps"] != plan.accumulation_steps:
        out[BATCH["accumulation_steps"]] = plan.accumulation_steps
    return out

FORMAT = DeepSpeed()


def _parse(path: str, text: str, *, quiet: bool = False) -> Any:
    return base.parse(path, text, base.load_json, quiet=quiet, give="a DeepSpeed config")


def _number(value: Any) -> bool:
    return value not in (base.MISSING, "auto", None)


def _batch(path: str, values: dict[str, Any], given: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The reference's batch as DeepSpeed resolves the file's three keys (flags standing in for any of them), its
    world size where the three fix it, and a note where DeepSpeed derived a key."""
    numbers = {field: _positive(path, key, values[key]) for field, key in BATCH.items() if _number(values[key])}
    numbers |= {field: given[field] for field in BATCH if field in given}
    _check_given(path, values, numbers)
    out: dict[str, Any] = {}
    if "devices" not in given:
        out.update(devices=_world(path, numbers), nodes=1)
    dims = base.dims(given.get("devices", out.get("devices", 1)) * given.get("nodes", out.get("nodes", 1)),
                     {field: given[field] for field in DEGREES if field in given})
    world = base.data_parallel_size_of(path, BATCH["global_batch_size"], dims)
    resolved = resolve_batch(path, numbers, world)
    out.update(per_device_batch_size=resolved["per_device_batch_size"],
               accumulation_steps=resolved["accumulation_steps"])
    if "global_batch_size" in numbers:
        out["global_batch_size"] = numbers["global_batch_size"]
    return out, _resolution_note(values, numbers, resolved, world)


def _resolution_note(values: Mapping[str, Any], numbers: Mapping[str, int], resolved: Mapping[str, int],
                     world: int) -> tuple[str, ...]:
    """How the keys the file leaves out or "auto" came to their values on the reference's ranks."""
    derived = [f"{BATCH[field]} {resolved[field]}" for field in BATCH if field not in numbers]
    if not derived:
        return ()
    ranks = f"the reference's {world} data-parallel rank{'s' if world != 1 else ''}"
    given = " and ".join(f"{BATCH[field]} {numbers[field]}" for field in BATCH if field in numbers)
    if any(values[BATCH[field]] == "auto" for field in BATCH if field not in numbers):
        return (f"{' and '.join(derived)} on {ranks}: the only value{'s' if len(derived) > 1 else ''} DeepSpeed "
                f"accepts beside {given}, whatever fills \"auto\"",)
    return (f"DeepSpeed derives {' and '.join(derived)} on {ranks} ({_formula(numbers, world)})",)


DEGREES = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")


def resolve_batch(path: str, numbers: Mapping[str, int], world_size: int) -> dict[str, int]:
    """The three batch keys as DeepSpeed 0.19.8 resolves them (``DeepSpeedConfig._set_batch_related_parameters``,
    then ``_batch_assertion``) on ``world_size`` data-parallel ranks; refused in its words where it refuses."""
    batch, micro, accumulation = (numbers.get(field) for field in BATCH)
    if batch is not None and micro is not None and accumulation is not None:
        pass
    elif batch is not None and micro is not None:
        accumulation = batch // micro // world_size
    elif batch is not None and accumulation is not None:
        micro = batch // world_size // accumulation
    elif micro is not None and accumulation is not None:
        batch = micro * accumulation * world_size
    elif batch is not None:
        micro, accumulation = batch // world_size, 1
    elif micro is not None:
        batch, accumulation = micro * world_size, 1
    else:
        raise base.bad(path, BATCH["global_batch_size"], "and train_micro_batch_size_per_gpu are both missing, which "
                       "DeepSpeed refuses (it needs either): give one")
    resolved = {"global_batch_size": batch, "per_device_batch_size": micro, "accumulation_steps": accumulation}
    for field, value in resolved.items():
        if value <= 0:
            raise base.bad(path, BATCH[field], f"comes out as {value} on {world_size} data-parallel ranks "
                           f"({_formula(numbers, world_size)}), which DeepSpeed refuses: give numbers that divide")
    if batch != micro * accumulation * world_size:
        raise base.bad(path, BATCH["global_batch_size"], f"{batch} is not train_micro_batch_size_per_gpu {micro} × "
                       f"gradient_accumulation_steps {accumulation} × {world_size} data-parallel ranks = "
                       f"{micro * accumulation * world_size} ({_formula(numbers, world_size)}), which DeepSpeed "
                       "refuses: give numbers it accepts")
    return resolved


def _formula(numbers: Mapping[str, int], world_size: int) -> str:
    """How DeepSpeed derived the keys the file leaves out, as its own integer divisions."""
    batch, micro, accumulation = (numbers.get(field) for field in BATCH)
    given = [f"{BATCH[field]} {numbers[field]}" for field in BATCH if field in numbers]
    if len(given) == 3:
        return "all three given"
    if batch is not None and micro is not None:
        how = f"gradient_accumulation_steps = {batch} // {micro} // {world_size}"
    elif batch is not None and accumulation is not None:
        how = f"train_micro_batch_size_per_gpu = {batch} // {world_size} // {accumulation}"
    elif batch is not None:
        how = f"gradient_accumulation_steps 1, train_micro_batch_size_per_gpu = {batch} // {world_size}"
    else:
        return f"{' and '.join(given)} given"
    return f"{' and '.join(given)} given: {how}"


def _positive(path: str, key: str, value: Any) -> int:
    number = base.whole(path, key, value)
    if number <= 0:
        raise base.bad(path, key, f"is {number}, which DeepSpeed refuses: it must be greater than 0")
    return number


def _check_given(path: str, values: dict[str, Any], numbers: Mapping[str, int]) -> None:
    """What DeepSpeed refuses before resolving, and an "auto" key the other two do not fix (whatever the Trainer or
    Accelerate passes)."""
    if not numbers:
        raise base.bad(path, BATCH["per_device_batch_size"], "is \"auto\" or missing, as are train_batch_size and "
                       "gradient_accumulation_steps: give the reference's batch with {reference.per_device_batch_size}")
    if len(numbers) < 2:
        for field in ("accumulation_steps", "per_device_batch_size", "global_batch_size"):
            if values[BATCH[field]] == "auto" and field not in numbers:
                raise base.bad(path, BATCH[field], f"is \"auto\", which DeepSpeed does not resolve: the Transformers "
                               f"Trainer or Accelerate fills it from its own arguments, so give the reference's with "
                               f"{{reference.{field}}}")
    if "global_batch_size" not in numbers and "per_device_batch_size" not in numbers:
        raise base.bad(path, BATCH["accumulation_steps"], "is the only batch key, which DeepSpeed refuses (it needs "
                       "train_batch_size or train_micro_batch_size_per_gpu): give one")


def _world(path: str, numbers: Mapping[str, int]) -> int:
    """The data-parallel world the three batch keys imply, where the file gives all three."""
    if len(numbers) < 3:
        raise base.bad(path, BATCH["global_batch_size"], "does not fix the world size (a batch key is \"auto\" or "
                                                         "missing): pass {reference.devices} and {reference.nodes}")
    batch, micro, accumulation = (numbers[field] for field in BATCH)
    world, rest = divmod(batch, micro * accumulation)
    if rest:
        raise base.bad(path, BATCH["global_batch_size"], f"{batch} is not train_micro_batch_size_per_gpu {micro} × "
                       f"gradient_accumulation_steps {accumulation} × a world size: give numbers DeepSpeed accepts")
    return world


def _optimizer(path: str, values: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    kind = values["optimizer.type"]
    family = base.optimizer_family(kind) if isinstance(kind, str) else given.get("optimizer")
    if family is None:
        what = "is missing" if kind is base.MISSING else f"is {base.shown(kind)}"
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


def _stage(path: str, tree: dict) -> int:
    """The file's ZeRO stage (0 where it sets none, as DeepSpeed's default)."""
    stage = base.lookup(tree, "zero_optimization.stage")
    if stage is base.MISSING:
        return 0
    number = base.whole(path, "zero_optimization.stage", stage)
    if not 0 <= number <= 3:
        raise base.bad(path, "zero_optimization.stage", f"is {number}: DeepSpeed's ZeRO stages are 0 to 3")
    return number


# The plan's row each "auto" key stands for.
ROWS = {BATCH["global_batch_size"]: "global batch", BATCH["per_device_batch_size"]: "per-device batch",
        BATCH["accumulation_steps"]: "accumulation steps", OPTIMIZER["lr"]: "learning rate",
        SCHEDULER["lr"]: "learning rate", OPTIMIZER["betas"]: "Adam betas", OPTIMIZER["eps"]: "Adam eps",
        OPTIMIZER["weight_decay"]: "weight decay", SCHEDULER["warmup_steps"]: "warmup steps",
        SCHEDULER["total_steps"]: "total steps"}


def _notes(values: dict[str, Any]) -> tuple[str, ...]:
    auto = [key for key in values if values[key] == "auto"]
    if not auto:
        return ()
    rows = list(dict.fromkeys(ROWS[key] for key in auto if key in ROWS))
    return (f"{', '.join(auto)} stay{'s' if len(auto) == 1 else ''} \"auto\": DeepSpeed does not fill \"auto\", the "
            "Transformers Trainer or Accelerate does, from its own arguments: give those the plan's "
            f"{', '.join(rows)}",)
