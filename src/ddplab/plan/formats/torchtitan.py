"""torchtitan's job TOML (its train script's job config): ``[training]``, ``[optimizer]``, ``[lr_scheduler]``,
``[parallelism]``.

Its releases through early 2026: ``training.local_batch_size`` (``training.batch_size`` before it),
``training.global_batch_size`` (-1: local × data-parallel degree, else gradient accumulation makes it), degrees in
``[parallelism]`` (in ``[training]`` and ``[experimental]`` in 2024), ``data_parallel_shard_degree = -1`` derived
from the world size, FSDP2 over the data-parallel ranks (HSDP with a replicate degree above 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddplab.plan.formats import base, editing
from ddplab.plan.inputs import Target
from ddplab.plan.result import Plan

DEGREES = {"tensor_parallel_size": "tensor_parallel_degree", "pipeline_parallel_size": "pipeline_parallel_degree",
           "context_parallel_size": "context_parallel_degree"}
# Where 2024's releases kept each degree before [parallelism] held them all.
OLD_SECTIONS = {"tensor_parallel_degree": "training", "pipeline_parallel_degree": "experimental",
                "context_parallel_degree": "experimental", "data_parallel_shard_degree": "training",
                "data_parallel_replicate_degree": "training"}


class Torchtitan:
    name = "torchtitan"
    label = "a torchtitan job TOML"

    def detect(self, path: str, text: str) -> bool:
        tree = _parse(path, text, quiet=True)
        return isinstance(tree, dict) and any(section in tree for section in ("training", "parallelism", "job"))

    def read(self, path: str, text: str, given: Mapping[str, Any]) -> base.FileRun:
        tree = _parse(path, text)
        keys = _keys(tree)
        values = {key: base.lookup(tree, key) for key in keys.values()}
        local = base.whole(path, keys["per_device_batch_size"], values[keys["per_device_batch_size"]]) \
            if values[keys["per_device_batch_size"]] is not base.MISSING else 8
        degrees = {field: _degree(path, key, values[key], 1) for field, key in keys.items() if field in DEGREES}
        shard = _degree(path, keys["data_parallel_shard"], values[keys["data_parallel_shard"]], -1)
        replicate = _degree(path, keys["data_parallel_replicate"], values[keys["data_parallel_replicate"]], 1)
        reference = {"per_device_batch_size": local, **{field: size for field, size in degrees.items()},
                     **_optimizer(path, tree, keys, values)}
        reference.update(_hardware(path, keys, given, degrees, shard, replicate))
        devices, nodes = reference.get("devices", given.get("devices")), reference.get("nodes", given.get("nodes", 1))
        reference.update(_accumulation(path, keys, values, local, devices, nodes, degrees))
        target = {**degrees, "strategy": "hsdp" if replicate > 1 else "fsdp"}
        if replicate > 1:
            target["data_parallel_replicate_size"] = replicate
        return base.FileRun(path=path, reference=reference, target=target, data=_data(path, keys, values),
                            keys=_field_keys(keys), roles=keys, values=values, defaults=_defaults(keys),
                            notes=_notes(keys, values))

    def changes(self, run: base.FileRun, plan: Plan, target: Target) -> dict[str, Any]:
        keys = run.roles
        roles = {role: keys[role] for role in ("per_device_batch_size", "lr", "beta1", "beta2", "eps", "weight_decay",
                                               "warmup_steps", "total_steps", *DEGREES)}
        out = base.by_role(roles, base.planned(plan, target))
        global_key = keys["global_batch_size"]
        # -1 stays derived when the plan accumulates nothing: local × data-parallel degree is the global batch.
        if run.values[global_key] in (base.MISSING, -1) and plan.accumulation_steps == 1:
            out.pop(global_key, None)
        else:
            out[global_key] = plan.global_batch_size
        if run.values[keys["data_parallel_shard"]] not in (base.MISSING, -1):
            out[keys["data_parallel_shard"]] = plan.data_parallel_shard_size or plan.data_parallel_size
        if plan.data_parallel_replicate_size and plan.strategy == "hsdp":
            out[keys["data_parallel_replicate"]] = plan.data_parallel_replicate_size
        return out

    def edit(self, text: str, changes: Mapping[str, Any]) -> str:
        for key, value in changes.items():
            text = editing.toml_set(text, key, value)
        return text


FORMAT = Torchtitan()


def _parse(path: str, text: str, *, quiet: bool = False) -> Any:
    return base.parse(path, text, base.load_toml, quiet=quiet, give="a torchtitan job TOML")


def _keys(tree: dict) -> dict[str, str]:
    """Each role's key in this file: the current release's where the file has neither spelling."""
    def where(name: str, sections: tuple[str, ...]) -> str:
        return next((f"{s}.{name}" for s in sections if base.lookup(tree, f"{s}.{name}") is not base.MISSING),
                    f"{sections[0]}.{name}")

    local = "training.local_batch_size" if base.lookup(tree, "training.batch_size") is base.MISSING \
        else "training.batch_size"
    keys = {"per_device_batch_size": local, "global_batch_size": "training.global_batch_size",
            "lr": "optimizer.lr", "beta1": "optimizer.beta1", "beta2": "optimizer.beta2", "eps": "optimizer.eps",
            "weight_decay": "optimizer.weight_decay", "optimizer": "optimizer.name",
            "warmup_steps": "lr_scheduler.warmup_steps", "total_steps": "training.steps",
            "seq_len": "training.seq_len"}
    for field, name in {**DEGREES, "data_parallel_shard": "data_parallel_shard_degree",
                        "data_parallel_replicate": "data_parallel_replicate_degree"}.items():
        keys[field] = where(name, ("parallelism", OLD_SECTIONS[name]))
    return keys


def _defaults(keys: dict[str, str]) -> dict[str, Any]:
    """torchtitan's defaults for the keys a file may leave out."""
    return {keys["global_batch_size"]: -1, keys["beta1"]: 0.9, keys["beta2"]: 0.95, keys["eps"]: 1e-8,
            keys["weight_decay"]: 0.1, keys["warmup_steps"]: 200, keys["total_steps"]: 10000,
            **{keys[field]: 1 for field in DEGREES}, keys["data_parallel_shard"]: -1,
            keys["data_parallel_replicate"]: 1}


def _degree(path: str, key: str, value: Any, default: int) -> int:
    if value is base.MISSING:
        return default
    degree = base.whole(path, key, value)
    if degree == 0 or degree < -1:
        raise base.bad(path, key, f"must be a positive degree (or -1 where derived), got {degree}")
    return degree


def _optimizer(path: str, tree: dict, keys: dict[str, str], values: dict[str, Any]) -> dict[str, Any]:
    name = values[keys["optimizer"]]
    family = base.optimizer_family(name) if isinstance(name, str) else "adamw"
    if family is None:
        raise base.bad(path, keys["optimizer"], f"names {base.shown(name)}, which the plan cannot scale: use "
                                                "Adam or AdamW")
    out: dict[str, Any] = {"optimizer": family}
    lr = values[keys["lr"]]
    if lr is base.MISSING:
        raise base.bad(path, keys["lr"], "is missing: give the reference lr there")
    out["lr"] = base.real(path, keys["lr"], lr)
    if family != "sgd":
        beta1, beta2 = (values[keys[b]] for b in ("beta1", "beta2"))
        out["betas"] = (0.9 if beta1 is base.MISSING else base.real(path, keys["beta1"], beta1),
                        0.95 if beta2 is base.MISSING else base.real(path, keys["beta2"], beta2))
        eps, decay = values[keys["eps"]], values[keys["weight_decay"]]
        out["eps"] = 1e-8 if eps is base.MISSING else base.real(path, keys["eps"], eps)
        out["weight_decay"] = 0.1 if decay is base.MISSING else base.real(path, keys["weight_decay"], decay)
    return out


def _hardware(path: str, keys: dict[str, str], given: Mapping[str, Any], degrees: dict[str, int], shard: int,
              replicate: int) -> dict[str, Any]:
    """The reference's world: the product of the degrees where none is derived, else the flags'."""
    if "devices" in given:
        return {}
    if shard == -1:
        raise base.bad(path, keys["data_parallel_shard"], "is -1 (derived from the world size, which the file does "
                                                          "not give): pass {reference.devices} and {reference.nodes}")
    world = shard * replicate
    for size in degrees.values():
        world *= size
    return {"devices": world, "nodes": 1}


def _accumulation(path: str, keys: dict[str, str], values: dict[str, Any], local: int, devices: int | None,
                  nodes: int, degrees: dict[str, int]) -> dict[str, Any]:
    """torchtitan accumulates gradients to reach ``global_batch_size`` when it is set (not -1)."""
    key = keys["global_batch_size"]
    value = values[key]
    if value is base.MISSING or value == -1 or devices is None:
        return {}
    dims = base.dims(devices * nodes, degrees)
    return {"accumulation_steps": base.accumulation(path, key, base.whole(path, key, value), local, dims,
                                                    keys["per_device_batch_size"])}


def _data(path: str, keys: dict[str, str], values: dict[str, Any]) -> dict[str, Any]:
    """Its sequence length, and its steps and warmup (torchtitan's defaults where the file leaves them out)."""
    defaults = _defaults(keys)
    out = {}
    for field, role in (("seq_len", "seq_len"), ("reference_steps", "total_steps"),
                        ("reference_warmup_steps", "warmup_steps")):
        value = values[keys[role]]
        if value is base.MISSING:
            value = defaults.get(keys[role], base.MISSING)
        if value is not base.MISSING:
            out[field] = base.whole(path, keys[role], value)
    return out


def _field_keys(keys: dict[str, str]) -> dict[str, str]:
    out = {f"{side}.{field}": keys[field] for field in ("per_device_batch_size", *DEGREES)
           for side in ("reference", "target")}
    out.update({"reference.lr": keys["lr"], "reference.eps": keys["eps"], "reference.weight_decay":
                keys["weight_decay"], "reference.optimizer": keys["optimizer"],
                "reference.betas": f"{keys['beta1']}/{keys['beta2']}", "target.global_batch_size":
                keys["global_batch_size"], "data.seq_len": keys["seq_len"], "data.reference_steps":
                keys["total_steps"], "data.reference_warmup_steps": keys["warmup_steps"],
                "target.data_parallel_replicate_size": keys["data_parallel_replicate"]})
    return out


def _notes(keys: dict[str, str], values: dict[str, Any]) -> tuple[str, ...]:
    notes = []
    if values[keys["data_parallel_shard"]] == -1:
        notes.append(f"{keys['data_parallel_shard']} = -1 stays derived: torchtitan sets it from the world size")
    return tuple(notes)
