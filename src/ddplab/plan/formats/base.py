"""What every config format shares: the run it reads from a file, the protocol it follows, and checked values.

A format reads a file into a :class:`FileRun` (the fields of ``Reference``, ``Target`` and ``Data`` the file gives,
and the file's own key for each), and writes a plan back as ``{key: new value}`` edits on the original text, so
everything else (comments, order, keys ddplab does not know) stays byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import reprlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from ddplab.errors import UsageError, literal
from ddplab.parallel_dims import ParallelDims
from ddplab.plan.inputs import Target
from ddplab.plan.result import Plan
from ddplab.text import count

MISSING: Any = object()
"""A key the file does not have."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileRun:
    """A training run as one config file states it."""

    path: str
    """The file, as the user named it."""
    reference: dict[str, Any]
    """``Reference`` fields the file gives (its per-device batch, lr, betas, hardware where it says it)."""
    target: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``Target`` fields the file implies unless flags say otherwise (its mesh degrees, its strategy)."""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``Data`` fields the file gives (sequence length, epochs, its steps and warmup)."""
    keys: dict[str, str] = dataclasses.field(default_factory=dict)
    """Each field the file sets, as its key there: the plan's reasons name it (``reference.lr``: ``optimizer.lr``)."""
    roles: dict[str, str] = dataclasses.field(default_factory=dict)
    """The file's key for each value the plan writes (``lr``: ``optimizer.lr``), as :func:`planned` names them."""
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Every key the plan may write, with its value in the file (MISSING where absent)."""
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the framework assumes for a key the file leaves out: a plan that keeps it adds no line."""
    notes: tuple[str, ...] = ()
    """What the file says that the plan carries over in its own way, or cannot express."""


class ConfigFormat(Protocol):
    """One framework's config file: how to recognise it, read a run from it, and write a plan back into it."""

    name: str
    """Its registry name, as the command line's format choice takes it."""
    label: str
    """How a sentence names it (``a torchtitan job TOML``)."""

    def detect(self, path: str, text: str) -> bool:
        """Whether the file is of this format (from its name and its keys)."""

    def read(self, path: str, text: str, given: Mapping[str, Any]) -> FileRun:
        """The run the file states; ``given`` holds the reference fields flags set (its hardware, say)."""

    def changes(self, run: FileRun, plan: Plan, target: Target) -> dict[str, Any]:
        """``{key: new value}`` for every key the plan sets (unchanged ones are dropped later)."""

    def edit(self, text: str, changes: Mapping[str, Any]) -> str:
        """``text`` with each key's value replaced in place (added where the file lacks it)."""


class NotWritten(Exception):
    """A planned value the format cannot place where the file sets it (the plan then refuses to write the file)."""


def bad(path: str, key: str, what: str) -> UsageError:
    """An error naming the file and its key, then what to give."""
    return UsageError(f"{literal(path)}: {literal(key)} {what}" if key else f"{literal(path)} {what}")


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 2, 40, 40, 4, 4


def shown(value: Any) -> str:
    """A value as an error shows it: short, whatever the file put there (a YAML alias's million-fold list included)."""
    return literal(_SHOWN.repr(value))


def whole(path: str, key: str, value: Any) -> int:
    """``value`` as a whole number, or an error that names the file's key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            value != int(value):
        raise bad(path, key, f"must be a whole number, got {shown(value)}")
    return int(value)


def real(path: str, key: str, value: Any) -> float:
    """``value`` as a finite number (a TOML or YAML string such as "3e-4" included)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise bad(path, key, f"must be a number, got {shown(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(path, key, f"must be a number, got {shown(value)}")
    return float(value)


def pair(path: str, key: str, value: Any) -> tuple[float, float]:
    """Adam's betas as two numbers."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise bad(path, key, f"must be two numbers, got {shown(value)}")
    return real(path, key, value[0]), real(path, key, value[1])


def lookup(tree: Any, key: str) -> Any:
    """The value at a dotted key of nested mappings, or MISSING."""
    for part in key.split("."):
        if not isinstance(tree, Mapping) or part not in tree:
            return MISSING
        tree = tree[part]
    return tree


def optimizer_family(name: str) -> str | None:
    """'sgd', 'adam' or 'adamw' from a class path or name (``torch.optim.AdamW``, ``adamw_torch``, ``FusedAdam``)."""
    lowered = name.rsplit(".", 1)[-1].lower()
    if "adamw" in lowered or lowered.startswith("adam_w"):
        return "adamw"
    if "adam" in lowered:
        return "adam"
    return "sgd" if "sgd" in lowered else None


def dims(world_size: int, degrees: Mapping[str, int]) -> ParallelDims:
    """The file's world with its model-parallel degrees (``tensor_parallel_size`` … by field)."""
    return ParallelDims(devices=world_size, **degrees)


def data_parallel_size_of(path: str, key: str, dims: ParallelDims) -> int:
    """The data-parallel degree the file's batch keys are read over, refused where the degrees do not fit the world.

    Refused in the words of a file read without its hardware: ``tp 8 × pp 16 = 128 ranks do not fit on 8``.
    """
    if dims.divides:
        return dims.data_parallel_size
    raise bad(path, key, f"cannot be split: {dims.degrees} = {count(dims.model_parallel_size, 'rank')} "
                         f"{'does' if dims.model_parallel_size == 1 else 'do'} not fit on {dims.world_size}: give "
                         "{reference.devices} and {reference.nodes} of the run this file trained")


def planned(plan: Plan, target: Target) -> dict[str, Any]:
    """The plan's values by role, in the vocabulary every format maps to its keys."""
    adam = plan.betas is not None
    return {"per_device_batch_size": plan.per_device_batch_size, "accumulation_steps": plan.accumulation_steps,
            "global_batch_size": plan.global_batch_size, "lr": plan.lr,
            "betas": list(plan.betas) if adam else None, "beta1": plan.betas[0] if adam else None,
            "beta2": plan.betas[1] if adam else None, "eps": plan.eps, "weight_decay": plan.weight_decay,
            "warmup_steps": plan.warmup_steps if plan.warmup_recommended or plan.warmup_steps else None,
            "total_steps": plan.total_steps, "devices": target.devices, "nodes": target.nodes,
            "tensor_parallel_size": target.tensor_parallel_size,
            "pipeline_parallel_size": target.pipeline_parallel_size,
            "context_parallel_size": target.context_parallel_size}


def by_role(roles: Mapping[str, str], values: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: value}`` for each role the file has a key for and the plan a value."""
    return {key: values[role] for role, key in roles.items() if values.get(role) is not None}


def same(old: Any, new: Any) -> bool:
    """Whether a written value equals the file's (numbers compared as numbers)."""
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return len(old) == len(new) and all(same(a, b) for a, b in zip(old, new))
    if isinstance(old, bool) or isinstance(new, bool):
        return old == new
    if isinstance(old, (int, float)) and isinstance(new, (int, float)):
        return math.isclose(old, new, rel_tol=1e-9, abs_tol=0)
    return old == new


# libyaml's scanner where PyYAML has it (the same safe constructor, several times faster on a long file).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_yaml(path: str, text: str, *, quiet: bool = False) -> Any:
    """The YAML file's tree (None when ``quiet`` and it is not YAML)."""
    def load(text: str) -> Any:
        try:
            return yaml.load(text, Loader=_YAML_LOADER)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"is not YAML ({where}{what})") from None

    return parse(path, text, load, quiet=quiet, give="a config file")


def load_json(text: str) -> Any:
    """A JSON text's tree; ValueError saying where it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"is not JSON ({exc})") from None


def load_toml(text: str) -> Any:
    """A TOML text's tree; ValueError saying where it is not TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"is not TOML ({exc})") from None


def check_syntax(path: str, text: str) -> None:
    """A file no format recognised, refused in its parser's own words where its name says JSON, TOML or YAML and it
    is not (a missing comma is the error to show, not the format guess)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in (".yaml", ".yml"):
        parse_yaml(path, text)
    elif suffix in SYNTAX:
        parse(path, text, SYNTAX[suffix], quiet=False, give="a config file")


def misspelt(path: str, text: str, run: FileRun, label: str) -> list[str]:
    """A warning for each key the file sets that its framework does not read, one or two edits from a key the plan
    reads and the file leaves out (``gradient_acumulation_steps``): the framework ignores it, and so did the plan."""
    known = {*run.values, *run.keys.values(), *run.roles.values()}
    given = set(spelled_keys(path, text))
    missing = sorted(known - given)
    said = []
    for key in sorted(given - known):
        parent, _, leaf = key.rpartition(".")
        near = [k for k in missing if k.rpartition(".")[0] == parent and len(leaf) >= 5
                and edits(leaf, k.rpartition(".")[2]) <= 2]
        if near:
            said.append(f"{literal(path)}: {literal(key)} is not a key of {label}, and {literal(near[0])} is missing: "
                        "a misspelling? It was ignored, as the framework ignores it")
    return said


def spelled_keys(path: str, text: str) -> list[str]:
    """Every key the file sets: dotted paths in a JSON, TOML or YAML tree, a launch script's double-dash flags."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in (".sh", ".bash", ""):
        return re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", text)
    try:
        tree = parse_yaml(path, text, quiet=True) if suffix in (".yaml", ".yml") else SYNTAX[suffix](text)
    except (KeyError, ValueError, RecursionError):
        return []
    return list(_paths(tree, ""))


def _paths(tree: Any, prefix: str):
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield f"{prefix}{key}"
            yield from _paths(value, f"{prefix}{key}.")


def edits(a: str, b: str) -> int:
    """Levenshtein's distance: the insertions, deletions and substitutions that make ``a`` into ``b``.

    >>> edits("gradient_acumulation_steps", "gradient_accumulation_steps"), edits("weight_decya", "weight_decay")
    (1, 2)
    """
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


SYNTAX = {".json": load_json, ".toml": load_toml}
"""The parsers a file's name asks for (YAML's is :func:`parse_yaml`)."""


def parse(path: str, text: str, load: Callable[[str], Any], *, quiet: bool, give: str) -> Any:
    """``load(text)``, or an error naming the file and what the parser said (a ValueError's message, which says
    where), or None when ``quiet``; a file nested too deeply for any parser is refused in one line too."""
    try:
        return load(text)
    except RecursionError:
        if quiet:
            return None
        raise bad(path, "", f"nests its values too deeply to read (thousands of levels): give {give}") from None
    except ValueError as exc:
        if quiet:
            return None
        raise bad(path, "", f"{literal(str(exc))}: give {give}") from None


def accumulation(path: str, key: str, global_batch: int, per_device_batch_size: int, dims: ParallelDims,
                 what: str) -> int:
    """The accumulation steps a framework takes to reach ``global_batch`` from its per-device batch."""
    data_parallel_size = data_parallel_size_of(path, key, dims)
    if global_batch % (per_device_batch_size * data_parallel_size):
        raise bad(path, key, f"{global_batch} is not a multiple of {what} {per_device_batch_size} × the data-parallel "
                             f"degree {data_parallel_size}: give a global batch it can accumulate to")
    return global_batch // (per_device_batch_size * data_parallel_size)
