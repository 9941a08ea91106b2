"""Transformers' ``TrainingArguments`` as a JSON or YAML file (``HfArgumentParser.parse_json_file``/
``parse_yaml_file``; TRL's and the alignment handbook's recipes mix them with model and data keys):
``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``learning_rate``, ``warmup_steps`` (a float
below 1 is a ratio since v5) or ``warmup_ratio``, ``max_steps``, ``num_train_epochs``, ``adam_beta1``/``2``,
``adam_epsilon``, ``weight_decay`` and ``optim``. The processes that ran are not in the file: the flags give them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddplab.plan.formats import base, editing
from ddplab.plan.inputs import Target
from ddplab.plan.result import Plan

ROLES = {"per_device_batch_size": "per_device_train_batch_size", "accumulation_steps": "gradient_accumulation_steps",
         "lr": "learning_rate", "beta1": "adam_beta1", "beta2": "adam_beta2", "eps": "adam_epsilon",
         "weight_decay": "weight_decay", "warmup_steps": "warmup_steps", "total_steps": "max_steps"}
# TrainingArguments' defaults.
DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "learning_rate": 5e-5,
            "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "weight_decay": 0.0, "warmup_steps": 0,
            "max_steps": -1, "num_train_epochs": 3.0, "optim": "adamw_torch"}
SEQ_LEN_KEYS = ("max_length", "max_seq_length")


class Transformers:
    name = "transformers"
    label = "Transformers TrainingArguments"

    def detect(self, path: str, text: str) -> bool:
        tree = _parse(path, text, quiet=True)
        return isinstance(tree, dict) and any(k in tree for k in ("per_device_train_batch_size", "learning_rate",
                                                                   "gradient_accumulation_steps", "num_train_epochs"))

    def read(self, path: str, text: str, given: Mapping[str, Any]) -> base.FileRun:
        tree = _parse(path, text)
        values = {key: tree.get(key, base.MISSING) for key in ROLES.values()}
        pick = {role: values[key] if values[key] is not base.MISSING else DEFAULTS[key] for role, key in ROLES.items()}
        if "devices" not in given:
            raise base.bad(path, "", "is TrainingArguments, which do not say how many processes ran: pass "
                                     "{reference.devices} and {reference.nodes}")
        optim = tree.get("optim", DEFAULTS["optim"])
        family = base.optimizer_family(optim) if isinstance(optim, str) else None
        if family is None:
            raise base.bad(path, "optim", f"is {base.shown(optim)}: the plan scales SGD, Adam and AdamW")
        reference = {"per_device_batch_size": base.whole(path, ROLES["per_device_batch_size"],
                                                         pick["per_device_batch_size"]),
                     "accumulation_steps": base.whole(path, ROLES["accumulation_steps"], pick["accumulation_steps"]),
                     "lr": base.real(path, ROLES["lr"], pick["lr"]), "optimizer": family}
        if family != "sgd":
            reference.update(betas=(base.real(path, "adam_beta1", pick["beta1"]),
                                    base.real(path, "adam_beta2", pick["beta2"])),
                             eps=base.real(path, "adam_epsilon", pick["eps"]),
                             weight_decay=base.real(path, "weight_decay", pick["weight_decay"]))
        keys = {f"{side}.{field}": ROLES[field] for field in ("per_device_batch_size", "accumulation_steps")
                for side in ("reference", "target")}
        keys |= {"reference.lr": "learning_rate", "reference.betas": "adam_beta1/adam_beta2",
                 "reference.eps": "adam_epsilon", "reference.weight_decay": "weight_decay", "reference.optimizer":
                 "optim", "data.epochs": "num_train_epochs", "data.reference_steps": "max_steps",
                 "data.reference_warmup_steps": "warmup_steps"}
        return base.FileRun(path=path, reference=reference, data=_data(path, tree, pick), keys=keys, roles=ROLES,
                            values=values, defaults=DEFAULTS, notes=_notes(tree, pick))

    def changes(self, run: base.FileRun, plan: Plan, target: Target) -> dict[str, Any]:
        out = base.by_role(run.roles, base.planned(plan, target))
        if run.values["max_steps"] in (base.MISSING, -1):
            out.pop("max_steps", None)
        if _ratio(run.values["warmup_steps"]) or any("warmup_ratio" in note for note in run.notes):
            out.pop("warmup_steps", None)  # a share of the run stays a share
        return out

    def edit(self, text: str, changes: Mapping[str, Any]) -> str:
        setter = editing.json_set if text.lstrip().startswith("{") else editing.yaml_set
        for key, value in changes.items():
            text = setter(text, key, value)
        return text


FORMAT = Transformers()


def _parse(path: str, text: str, *, quiet: bool = False) -> Any:
    if text.lstrip().startswith("{"):
        return base.parse(path, text, base.load_json, quiet=quiet, give="TrainingArguments")
    return base.parse_yaml(path, text, quiet=quiet)


def _ratio(value: Any) -> bool:
    """A warmup given as a share of the run (``warmup_steps`` below 1, as v5 reads it)."""
    return isinstance(value, float) and 0 < value < 1


def _data(path: str, tree: dict, pick: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if pick["total_steps"] not in (-1, None):
        out["reference_steps"] = base.whole(path, "max_steps", pick["total_steps"])
    else:
        out["epochs"] = base.real(path, "num_train_epochs", tree.get("num_train_epochs", DEFAULTS["num_train_epochs"]))
    warmup = pick["warmup_steps"]
    if not _ratio(warmup) and warmup:
        out["reference_warmup_steps"] = base.whole(path, "warmup_steps", warmup)
    seq_key = next((k for k in SEQ_LEN_KEYS if tree.get(k) is not None), None)
    if seq_key:
        out["seq_len"] = base.whole(path, seq_key, tree[seq_key])
    return out


def _notes(tree: dict, pick: dict[str, Any]) -> tuple[str, ...]:
    ratio = tree.get("warmup_ratio") or (pick["warmup_steps"] if _ratio(pick["warmup_steps"]) else None)
    if ratio:
        key = "warmup_ratio" if tree.get("warmup_ratio") else "warmup_steps"
        return (f"{key} {ratio:g} is a share of the run, which the plan cannot give in steps: kept, so the warmup "
                "stays that share of the planned run (the Trainer's ramp starts from 0, not from the reference lr)",)
    return ()
