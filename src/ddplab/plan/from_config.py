"""Plan from a framework's config file and write the plan back into it, changing only the keys the plan changes.

    result = plan_config("train.toml", reference={}, target={"devices": 8, "nodes": 4}, data={})
    result.config_changes   # {"training.local_batch_size": (8, 4), "optimizer.lr": (0.0003, 0.0006), ...}
    write_config(result, "train-32gpu.toml")

The file gives the reference (and its mesh degrees, unless the target's are given); the reasons name the file's keys.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from ddplab.errors import UsageError, literal
from ddplab.plan import formats, planner
from ddplab.plan.formats.base import MISSING, FileRun, NotWritten, misspelt, same
from ddplab.plan.inputs import Data, Reference, Target
from ddplab.plan.result import Plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigPlan:
    """A plan read from a config file, and that file with the plan written into it."""

    plan: Plan
    config: str
    """The file read."""
    config_format: str
    config_changes: dict[str, tuple[Any, Any]]
    """``{key: (old, new)}`` for every key the plan changes (old is None where the file lacked the key)."""
    config_keys: dict[str, str]
    """The file's key for each of the plan's values it holds (``lr``: ``optimizer.lr``)."""
    config_notes: tuple[str, ...]
    """What the file says that the plan carries over in its own way, or cannot express."""
    original_text: str
    text: str
    """The file with the plan's values: the original text, only the changed values replaced."""

    def to_json(self) -> dict[str, Any]:
        changes = {key: [None if old is MISSING else old, new] for key, (old, new) in self.config_changes.items()}
        return {**self.plan.to_json(), "config": self.config, "config_format": self.config_format,
                "config_changes": changes, "config_keys": dict(self.config_keys),
                "config_notes": list(self.config_notes)}


def plan_config(path: str, *, config_format: str | None = None, reference: Mapping[str, Any],
                target: Mapping[str, Any], data: Mapping[str, Any], names: Mapping[str, str] | None = None,
                write_to: str | None = None, force: bool = False) -> ConfigPlan:
    """The plan for the run ``path`` states, on the target; ``reference``, ``target`` and ``data`` hold the fields
    given besides the file (they win over it). ``write_to`` is checked before anything is planned."""
    if write_to is not None and not force and _same_file(path, write_to):
        raise UsageError(f"{{write_config}} {literal(write_to)} is the file read: pass {{force}} to overwrite it, or "
                         "write elsewhere")
    text = _read(path)
    fmt = formats.choose(path, text, config_format)
    run = fmt.read(path, text, reference)
    given = {f"{side}.{name}" for side, fields in (("reference", reference), ("target", target), ("data", data))
             for name in fields}
    try:
        ref, tgt, dat = (Reference(**{**run.reference, **reference}), Target(**{**run.target, **target}),
                         Data(**{**run.data, **data}))
        result = planner.plan(ref, tgt, dat, names={**(names or {}), **_file_keys(run, given)})
    except UsageError as exc:
        # The file's own keys for what it set; flags for what the command line gave.
        raise UsageError(f"{literal(run.path)}: {_with_keys(exc.template, _file_keys(run, given))}") from None
    changes = _changes(run, fmt.changes(run, result, tgt))
    try:
        new_text = fmt.edit(text, {key: new for key, (_, new) in changes.items()})
    except (RecursionError, NotWritten):
        new_text = ""  # nested deeper than the editor reaches, or a value it cannot place: refused below
    if not new_text or not fmt.detect(path, new_text):
        # An edit this format's layout defeats (a flow mapping, say) must not reach a file.
        raise UsageError(f"{literal(path)}: the planned values could not be written into its layout "
                         f"({', '.join(map(literal, changes))}); set them by hand from the table")
    keys = _plan_keys(run)
    result = dataclasses.replace(result, warnings=(*misspelt(path, text, run, fmt.label), *result.warnings))
    return ConfigPlan(plan=result, config=path, config_format=fmt.name, config_changes=changes, config_keys=keys,
                      config_notes=run.notes + _unwritten_warmup(result, keys), original_text=text, text=new_text)


def write_config(result: ConfigPlan, path: str) -> None:
    """Write the planned file (the original text with the changed values) to ``path``."""
    with open(path, "w") as fh:
        fh.write(result.text)


MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read: framework configs are kilobytes, and a parse's time grows with the file."""


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{{config}} {literal(path)} cannot be read ({literal(exc.strerror or str(exc))}): give a "
                         "config file") from None
    except UnicodeDecodeError:
        raise UsageError(f"{{config}} {literal(path)} is not text: give a config file") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise UsageError(f"{{config}} {literal(path)} is over {MAX_CONFIG_BYTES >> 20} MiB, which no framework's "
                         "config is: give the config file itself")
    return text


def _same_file(path: str, other: str) -> bool:
    return os.path.exists(other) and os.path.exists(path) and os.path.samefile(path, other)


def _file_keys(run: FileRun, given: set[str]) -> dict[str, str]:
    """The fields the file set, by its keys; the rest keep the flags that change them (the target's batch, say)."""
    return {field: key for field, key in run.keys.items() if field not in given and (
        not field.startswith("target.") or field.partition(".")[2] in run.target)}


def _with_keys(template: str, keys: Mapping[str, str]) -> str:
    """A template whose fields the file sets are shown as the file's keys."""
    return re.sub(r"\{([a-z_.]+)\}", lambda m: literal(keys[m[1]]) if m[1] in keys else m[0], template)


def _unwritten_warmup(result: Plan, keys: Mapping[str, str]) -> tuple[str, ...]:
    """A recommended warmup the file has no key for is said, not dropped."""
    if not result.warmup_recommended or "warmup_steps" in keys:
        return ()
    length = f"{result.warmup_steps:,} steps" if result.warmup_steps else "a length the plan cannot count yet"
    return (f"the plan recommends a warmup ({length}, from the reference lr to {result.lr:.4g}) and the file has no "
            "key for one: add it to the run's lr scheduler",)


def _plan_keys(run: FileRun) -> dict[str, str]:
    """The plan's fields as the file names them: ``lr`` is ``optimizer.params.lr`` (its first key where several)."""
    out: dict[str, str] = {}
    for role, key in run.roles.items():
        field = re.sub(r"^lr\d+$", "lr", role.rpartition(".")[2])  # lr0, lr1: a file's several keys for its lr
        if field in ("beta1", "beta2"):
            out["betas"] = f"{out['betas']}/{key}" if "betas" in out else key
        elif field in PLAN_FIELDS:
            out.setdefault(field, key)
    return out


PLAN_FIELDS = frozenset({"per_device_batch_size", "accumulation_steps", "global_batch_size", "lr", "betas", "eps",
                         "weight_decay", "warmup_steps", "total_steps", "tensor_parallel_size",
                         "pipeline_parallel_size", "context_parallel_size"})


def _changes(run: FileRun, planned: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (old, new)}`` for the keys whose value the plan changes (a key the file lacks: against its default)."""
    out = {}
    for key, new in planned.items():
        old = run.values.get(key, MISSING)
        effective = run.defaults.get(key, MISSING) if old is MISSING else old
        if not same(effective, new):
            out[key] = (old, new)
    return out
