"""litgpt's YAML (the config file of ``litgpt finetune`` and ``litgpt pretrain``): top-level ``devices``
and ``num_nodes``, ``train.global_batch_size`` and ``train.micro_batch_size`` (litgpt accumulates
``global ÷ world ÷ micro`` micro-batches), ``train.lr_warmup_steps``, ``train.max_steps``/``epochs``,
``train.max_seq_length``, and ``optimizer`` as a class path with ``init_args`` (``train.learning_rate`` and
``train.beta1``/``beta2`` in older releases).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddplab.plan.formats import base, editing
from ddplab.plan.inputs import Target
from ddplab.plan.result import Plan

ROLES = {"devices": "devices", "nodes": "num_nodes", "global_batch_size": "train.global_batch_size",
         "per_device_batch_size": "train.micro_batch_size", "warmup_steps": "train.lr_warmup_steps",
         "total_steps": "train.max_steps"}
NEW_OPTIMIZER = {"lr": "optimizer.init_args.lr", "betas": "optimizer.init_args.betas",
                 "eps": "optimizer.init_args.eps", "weight_decay": "optimizer.init_args.weight_decay"}
OLD_OPTIMIZER = {"lr": "train.learning_rate", "beta1": "train.beta1", "beta2": "train.beta2",
                 "weight_decay": "train.weight_decay"}
# litgpt's TrainArgs defaults, and torch's AdamW's.
DEFAULTS = {"num_nodes": 1, "train.global_batch_size": 64, "train.micro_batch_size": 4,
            "optimizer.init_args.betas": [0.9, 0.999], "optimizer.init_args.eps": 1e-8,
            "optimizer.init_args.weight_decay": 0.01}


class Litgpt:
    name = "litgpt"
    label = "a litgpt YAML"

    def detect(self, path: str, text: str) -> bool:
        tree = base.parse_yaml(path, text, quiet=True)
        train = tree.get("train") if isinstance(tree, dict) else None
        return isinstance(train, dict) and any(k in train for k in ("micro_batch_size", "global_batch_size"))

    def read(self, path: str, text: str, given: Mapping[str, Any]) -> base.FileRun:
        tree = base.parse_yaml(path, text)
        old = base.lookup(tree, OLD_OPTIMIZER["lr"]) is not base.MISSING
        roles = {**ROLES, **(OLD_OPTIMIZER if old else NEW_OPTIMIZER)}
        values = {key: base.lookup(tree, key) for key in roles.values()}
        pick = {role: values[key] if values[key] is not base.MISSING else DEFAULTS.get(key, base.MISSING)
                for role, key in roles.items()}
        micro = base.whole(path, roles["per_device_batch_size"], pick["per_device_batch_size"])
        global_batch = base.whole(path, roles["global_batch_size"], pick["global_batch_size"])
        hardware = _hardware(path, pick, given)
        world = given.get("devices", hardware.get("devices", 1)) * given.get("nodes", hardware.get("nodes", 1))
        reference = {"per_device_batch_size": micro, **hardware, **_optimizer(path, tree, roles, pick),
                     "accumulation_steps": base.accumulation(path, roles["global_batch_size"], global_batch, micro,
                                                             base.dims(world, {}), "train.micro_batch_size")}
        keys = {f"{side}.{field}": roles[field] for field in ("per_device_batch_size", "global_batch_size")
                for side in ("reference", "target")}
        keys |= {"reference.devices": "devices", "reference.nodes": "num_nodes", "reference.lr": roles["lr"],
                 "data.reference_steps": roles["total_steps"], "data.reference_warmup_steps": roles["warmup_steps"],
                 "data.epochs": "train.epochs", "data.seq_len": "train.max_seq_length"}
        return base.FileRun(path=path, reference=reference, data=_data(path, tree, values), keys=keys, roles=roles,
                            values=values, defaults=DEFAULTS)

    def changes(self, run: base.FileRun, plan: Plan, target: Target) -> dict[str, Any]:
        out = base.by_role(run.roles, base.planned(plan, target))
        for role in ("total_steps", "warmup_steps"):
            if run.values[run.roles[role]] is base.MISSING:
                out.pop(run.roles[role], None)
        return out

    def edit(self, text: str, changes: Mapping[str, Any]) -> str:
        for key, value in changes.items():
            text = editing.yaml_set(text, key, value)
        return text


FORMAT = Litgpt()


def _hardware(path: str, pick: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    if "devices" in given:
        return {}
    devices = pick["devices"]
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        shown = "missing" if devices is base.MISSING else base.shown(devices)
        raise base.bad(path, "devices", f"is {shown}, which does not say how many devices ran: pass "
                                        "{reference.devices} and {reference.nodes}")
    return {"devices": devices, "nodes": base.whole(path, "num_nodes", pick["nodes"])}


def _optimizer(path: str, tree: dict, roles: dict[str, str], pick: dict[str, Any]) -> dict[str, Any]:
    optimizer = tree.get("optimizer", "AdamW")
    name = optimizer.get("class_path", "") if isinstance(optimizer, dict) else optimizer
    family = base.optimizer_family(name) if isinstance(name, str) else None
    if family is None:
        raise base.bad(path, "optimizer", f"is {base.shown(name)}: give SGD, Adam or AdamW")
    if pick["lr"] is base.MISSING:
        raise base.bad(path, roles["lr"], "is missing: give the reference lr there")
    out: dict[str, Any] = {"optimizer": family, "lr": base.real(path, roles["lr"], pick["lr"])}
    if family == "sgd":
        return out
    if "betas" in roles:
        out["betas"] = base.pair(path, roles["betas"], pick["betas"])
        out["eps"] = base.real(path, roles["eps"], pick["eps"])
    else:
        out["betas"] = tuple(base.real(path, roles[b], pick[b]) for b in ("beta1", "beta2"))
    out["weight_decay"] = base.real(path, roles["weight_decay"], pick["weight_decay"])
    return out


def _data(path: str, tree: dict, values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    steps, warmup = values[ROLES["total_steps"]], values[ROLES["warmup_steps"]]
    epochs, seq_len = base.lookup(tree, "train.epochs"), base.lookup(tree, "train.max_seq_length")
    if steps not in (base.MISSING, None):
        out["reference_steps"] = base.whole(path, ROLES["total_steps"], steps)
    elif epochs not in (base.MISSING, None):
        out["epochs"] = base.real(path, "train.epochs", epochs)
    if warmup not in (base.MISSING, None):
        out["reference_warmup_steps"] = base.whole(path, ROLES["warmup_steps"], warmup)
    if seq_len not in (base.MISSING, None):
        out["seq_len"] = base.whole(path, "train.max_seq_length", seq_len)
    return out
