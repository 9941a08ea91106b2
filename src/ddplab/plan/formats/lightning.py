"""Lightning's CLI YAML (the config file of ``python main.py fit``): ``trainer.devices``/``num_nodes``/
``accumulate_grad_batches``/``max_steps``, the datamodule's and model's ``init_args`` (its ``batch_size``, its lr),
and an ``optimizer`` given by ``class_path`` and ``init_args``. Where the file has no ``optimizer`` block the
LightningModule builds its own from its init args: their usual spellings of Adam's settings are read and written there
(``beta1``/``beta_1``/``b1``, ``betas``, ``eps``/``epsilon``, ``weight_decay``/``wd``), and a note says which.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ddplab.plan.formats import base, editing
from ddplab.plan.inputs import Target
from ddplab.plan.result import Plan

BATCH_KEYS = ("data.init_args.batch_size", "data.batch_size", "model.init_args.batch_size", "model.batch_size")
LR_KEYS = ("optimizer.init_args.lr", "optimizer.lr", "model.init_args.lr", "model.init_args.learning_rate",
           "model.lr", "model.learning_rate")
ROLES = {"devices": "trainer.devices", "nodes": "trainer.num_nodes", "accumulation_steps":
         "trainer.accumulate_grad_batches", "total_steps": "trainer.max_steps", "betas": "optimizer.init_args.betas",
         "eps": "optimizer.init_args.eps", "weight_decay": "optimizer.init_args.weight_decay"}
# torch's defaults for the optimizer's keys a file leaves out (AdamW's decay; Adam's is 0).
TORCH = {"betas": [0.9, 0.999], "eps": 1e-8}
# How a LightningModule's init args spell the optimizer's settings it builds its optimizer from, and what each is.
MODEL_SPELLINGS = {"beta1": ("beta1", "beta_1", "b1", "adam_beta1"), "beta2": ("beta2", "beta_2", "b2", "adam_beta2"),
                   "betas": ("betas",), "eps": ("eps", "epsilon", "adam_epsilon", "adam_eps"),
                   "weight_decay": ("weight_decay", "wd"), "optimizer": ("optimizer", "optimizer_name", "optim")}
MEANING = {"beta1": "Adam's β₁", "beta2": "β₂", "betas": "Adam's betas", "eps": "ε", "weight_decay": "the weight decay",
           "optimizer": "the optimizer"}


class Lightning:
    name = "lightning"
    label = "a Lightning CLI YAML"

    def detect(self, path: str, text: str) -> bool:
        tree = base.parse_yaml(path, text, quiet=True)
        return isinstance(tree, dict) and isinstance(tree.get("trainer"), dict)

    def read(self, path: str, text: str, given: Mapping[str, Any]) -> base.FileRun:
        tree = base.parse_yaml(path, text)
        batch_key = next((k for k in BATCH_KEYS if base.lookup(tree, k) is not base.MISSING), BATCH_KEYS[0])
        lr_keys = [k for k in LR_KEYS if base.lookup(tree, k) is not base.MISSING]
        own = _model_optimizer_keys(tree)
        roles = {**ROLES, "per_device_batch_size": batch_key, **{f"lr{i}": k for i, k in enumerate(lr_keys)}}
        if own is not None:
            # The model builds its optimizer: its settings are its init args, not an optimizer block's.
            roles = {role: key for role, key in roles.items() if role not in ("betas", "eps", "weight_decay")}
            roles |= {role: key for role, key in own.items() if role != "optimizer"}
        values = {key: base.lookup(tree, key) for key in (*roles.values(), "optimizer.class_path")}
        reference: dict[str, Any] = {}
        if values[batch_key] is not base.MISSING:
            reference["per_device_batch_size"] = base.whole(path, batch_key, values[batch_key])
        elif "per_device_batch_size" not in given:
            raise base.bad(path, batch_key, "is missing: give the reference's batch with "
                                            "{reference.per_device_batch_size}")
        if lr_keys:
            reference["lr"] = base.real(path, lr_keys[0], values[lr_keys[0]])
        elif "lr" not in given:
            raise base.bad(path, LR_KEYS[0], "is missing: give the reference lr with {reference.lr}")
        family = _family(path, tree, given) if own is None else _model_family(path, tree, own, given)
        settings = _optimizer(path, values, family) if own is None else _model_optimizer(path, values, own, family)
        reference.update(settings, **_hardware(path, values, given))
        accumulation = values[ROLES["accumulation_steps"]]
        if accumulation is not base.MISSING:
            reference["accumulation_steps"] = base.whole(path, ROLES["accumulation_steps"], accumulation)
        data = _data(path, tree, values)
        strategy = base.lookup(tree, "trainer.strategy")
        target = _strategy(strategy)
        keys = {"reference.per_device_batch_size": batch_key, "target.per_device_batch_size": batch_key,
                "reference.devices": ROLES["devices"], "reference.nodes": ROLES["nodes"],
                "reference.accumulation_steps": ROLES["accumulation_steps"],
                "target.accumulation_steps": ROLES["accumulation_steps"],
                **_setting_keys(roles),
                "reference.optimizer": "optimizer.class_path", "data.epochs": "trainer.max_epochs",
                "data.reference_steps": ROLES["total_steps"]}
        if lr_keys:
            keys["reference.lr"] = lr_keys[0]
        notes = _notes(tree) + (_model_note(own, family, inferred=_inferred(tree, own, given)) if own else ())
        return base.FileRun(path=path, reference=reference, target=target, data=data, keys=keys, roles=roles,
                            values=values, defaults=_defaults(family), notes=notes)

    def changes(self, run: base.FileRun, plan: Plan, target: Target) -> dict[str, Any]:
        planned = base.planned(plan, target)
        out = {}
        for role, key in run.roles.items():
            value = planned["lr"] if role.startswith("lr") else planned.get(role)
            if value is None or (role == "total_steps" and run.values[key] in (base.MISSING, -1)):
                continue
            if role in ("betas", "beta1", "beta2", "eps", "weight_decay") and run.values[key] is base.MISSING and \
                    run.values["optimizer.class_path"] is base.MISSING:
                continue  # the model's own optimizer takes only the init args it declares: none is added
            if role == "devices" and not isinstance(run.values[key], int):
                continue  # "auto" or a list of device ids: the user's choice of devices stays
            out[key] = value
        return out

    def edit(self, text: str, changes: Mapping[str, Any]) -> str:
        for key, value in changes.items():
            text = editing.yaml_set(text, key, value)
        return text


FORMAT = Lightning()


def _family(path: str, tree: dict, given: Mapping[str, Any]) -> str | None:
    optimizer = tree.get("optimizer")
    name = optimizer.get("class_path") if isinstance(optimizer, dict) else optimizer
    if name is None:
        return given.get("optimizer")
    family = base.optimizer_family(name) if isinstance(name, str) else None
    if family is None:
        raise base.bad(path, "optimizer.class_path", f"is {base.shown(name)}: give SGD, Adam or AdamW")
    return family


def _optimizer(path: str, values: dict[str, Any], family: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {} if family is None else {"optimizer": family}
    if family in ("adam", "adamw"):
        for field, reader in (("betas", base.pair), ("eps", base.real), ("weight_decay", base.real)):
            value = values[ROLES[field]]
            if value is not base.MISSING:
                out[field] = reader(path, ROLES[field], value)
    return out


def _hardware(path: str, values: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    if "devices" in given:
        return {}
    devices, nodes = values[ROLES["devices"]], values[ROLES["nodes"]]
    if isinstance(devices, list):
        devices = len(devices)
    elif isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or devices < 1:
        raise base.bad(path, ROLES["devices"], f"is {base.shown(devices)}, which does not say how many devices ran: "
                                               "pass {reference.devices} and {reference.nodes}")
    return {"devices": devices, "nodes": 1 if nodes is base.MISSING else base.whole(path, ROLES["nodes"], nodes)}


def _data(path: str, tree: dict, values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    steps, epochs = values[ROLES["total_steps"]], base.lookup(tree, "trainer.max_epochs")
    if steps not in (base.MISSING, -1, None):
        out["reference_steps"] = base.whole(path, ROLES["total_steps"], steps)
    elif epochs not in (base.MISSING, None, -1):
        out["epochs"] = base.real(path, "trainer.max_epochs", epochs)
    return out


def _defaults(family: str | None) -> dict[str, Any]:
    decay = 0.01 if family == "adamw" else 0.0
    return {ROLES["nodes"]: 1, ROLES["accumulation_steps"]: 1, ROLES["betas"]: TORCH["betas"],
            ROLES["eps"]: TORCH["eps"], ROLES["weight_decay"]: decay}


def _notes(tree: dict) -> tuple[str, ...]:
    if tree.get("lr_scheduler") is not None:
        return ("lr_scheduler is kept as it is: the plan's warmup, where it recommends one, is for the scheduler to "
                "carry out",)
    return ()


def _strategy(strategy: Any) -> dict[str, str]:
    """The plan's strategy for the Trainer's: FSDP, or DeepSpeed at its ZeRO stage (Lightning's "deepspeed" is 2)."""
    if not isinstance(strategy, str):
        return {}
    if strategy.startswith("fsdp"):
        return {"strategy": "fsdp"}
    stage = re.fullmatch(r"deepspeed(?:_stage_([0-3])\w*)?", strategy)
    return {"strategy": f"deepspeed-zero{stage[1] or 2}"} if stage else {}


def _model_optimizer_keys(tree: dict) -> dict[str, str] | None:
    """``{role: key}`` of the optimizer settings among the model's init args, where the file has no optimizer block
    (None where it has one: the settings are there)."""
    if tree.get("optimizer") is not None:
        return None
    model = tree.get("model")
    if not isinstance(model, dict):
        return {}
    prefix = "model.init_args" if isinstance(model.get("init_args"), dict) else "model"
    args = model.get("init_args") if prefix == "model.init_args" else model
    found = {}
    for role, spellings in MODEL_SPELLINGS.items():
        key = next((name for name in spellings if name in args), None)
        if key is not None:
            found[role] = f"{prefix}.{key}"
    return found


def _model_family(path: str, tree: dict, own: dict[str, str], given: Mapping[str, Any]) -> str | None:
    """The optimizer the model builds: the flag's, else its init args' name for it; Adam's settings need one."""
    if "optimizer" in given:
        return given["optimizer"]
    name = base.lookup(tree, own["optimizer"]) if "optimizer" in own else None
    if isinstance(name, dict):
        name = name.get("class_path")  # an optimizer init arg given as a class, as jsonargparse takes it
    family = base.optimizer_family(name) if isinstance(name, str) else None
    if family is None and _adam_settings(own):
        # Its betas say Adam's family, and Adam and AdamW share the lr rule: planned as Adam, and said so.
        return "adam"
    return family


def _adam_settings(own: dict[str, str]) -> list[str]:
    return [own[role] for role in ("beta1", "beta2", "betas", "eps") if role in own]


def _model_optimizer(path: str, values: dict[str, Any], own: dict[str, str], family: str | None) -> dict[str, Any]:
    """Adam's settings from the model's init args (torch's default for a β the model does not take)."""
    out: dict[str, Any] = {} if family is None else {"optimizer": family}
    if family not in ("adam", "adamw"):
        return out
    if "betas" in own:
        out["betas"] = base.pair(path, own["betas"], values[own["betas"]])
    elif "beta1" in own or "beta2" in own:
        out["betas"] = tuple(base.real(path, own[role], values[own[role]]) if role in own else TORCH["betas"][index]
                             for index, role in enumerate(("beta1", "beta2")))
    for field in ("eps", "weight_decay"):
        if field in own:
            out[field] = base.real(path, own[field], values[own[field]])
    return out


def _setting_keys(roles: Mapping[str, str]) -> dict[str, str]:
    """The reference's Adam fields as the file names them, for the reasons."""
    betas = roles.get("betas") or "/".join(roles[role] for role in ("beta1", "beta2") if role in roles)
    keys = {"reference.betas": betas} if betas else {}
    return keys | {f"reference.{field}": roles[field] for field in ("eps", "weight_decay") if field in roles}


def _inferred(tree: dict, own: dict[str, str], given: Mapping[str, Any]) -> str | None:
    """The init arg that made the plan take the model's optimizer for Adam's family, where nothing named it."""
    if "optimizer" in given or "optimizer" in own or not _adam_settings(own):
        return None
    return _adam_settings(own)[0]


def _model_note(own: dict[str, str], family: str | None, *, inferred: str | None = None) -> tuple[str, ...]:
    """Which of the model's init args were taken as which optimizer setting."""
    taken = [f"{key} as {MEANING[role]}" for role, key in own.items()
             if role == "optimizer" or family in ("adam", "adamw")]
    if not taken:
        return ()
    said = (f"the file has no optimizer block, so the model builds its own optimizer from its init args: "
            f"{', '.join(taken)}; the plan writes only the keys the model already takes")
    if inferred:
        said += (f"; nothing names that optimizer, and {inferred} is Adam's: planned as Adam (AdamW shares its lr "
                 "rule; name the optimizer adamw where the model builds AdamW, whose weight decay then follows "
                 "AdamW's timescale)")
    return (said,)
