"""Flags generated from config dataclasses: a field's type, default, choices and docstring are its flag.

A field is written once, in its config: ``steps: int = 5`` with the one-line docstring under it
becomes ``--steps STEPS  optimizer steps to compare (default 5)``. Its flag is ``--`` and the field's
name with hyphens, unless :data:`RENAMES` says otherwise (``per_device_batch_size`` is ``--batch-size``);
``int``, ``float``, tuples of them and ``Literal`` choices parse as such; a ``bool`` is a switch (``--no-x``
when it defaults to True); a field without a default is required. Every flag parses to None when not
given, so the config's own default applies (:func:`fields_given`). Field names in double backticks in a
docstring show as their flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import typing
from typing import Any, Literal

from ddplab.cli.args import betas, integer, integers, mark, number, parse_bool

RENAMES: dict[str, str] = {
    # A dotted path names one config's field; a bare name that field in every config.
    "per_device_batch_size": "--batch-size", "accumulation_steps": "--accumulation",
    "pg_timeout_s": "--timeout", "deadline_s": "--deadline", "run_deadline_s": "--run-deadline", "spec_path": "SPEC.py",
    "reference.per_device_batch_size": "--ref-batch-size",
    "reference.lr": "--ref-lr", "reference.devices": "--ref-devices", "reference.nodes": "--ref-nodes",
    "reference.accumulation_steps": "--ref-accumulation", "reference.wrapper": "--ref-wrapper",
    "target.tensor_parallel_size": "--tp", "target.pipeline_parallel_size": "--pp",
    "target.context_parallel_size": "--cp", "target.data_parallel_replicate_size": "--replicate",
    "reference.tensor_parallel_size": "--ref-tp", "reference.pipeline_parallel_size": "--ref-pp",
    "reference.context_parallel_size": "--ref-cp",
    "reference.global_batch_size": "--ref-global-batch-size",
    "data.reference_steps": "--ref-steps", "data.reference_warmup_steps": "--ref-warmup-steps",
    "reference_global_batch_size": "--ref-global-batch-size",
    "reference_accumulation_steps": "--ref-accumulation", "reference_lr": "--ref-lr",
    "optimizer.family": "--optimizer", "deterministic=False": "--noisy",
}


def flag_for(path: str) -> str:
    """The flag that sets the field ``path`` (``"reference.lr"`` → ``--ref-lr``)."""
    name = path.rpartition(".")[2]
    return RENAMES.get(path) or RENAMES.get(name) or "--" + name.replace("_", "-")


def add_fields(parser, config: type, names: typing.Iterable[str], *, prefix: str = "",
               **custom: dict[str, Any]) -> None:
    """One flag per field in ``names`` (in that order); ``custom[name]`` adds argparse keywords to its flag."""
    for name in names:
        add_field(parser, config, name, prefix=prefix, **custom.get(name, {}))


def add_field(parser, config: type, name: str, *, prefix: str = "", optional_value: bool = False,
              **custom: Any) -> argparse.Action:
    """The flag for ``config``'s field ``name``; ``optional_value`` makes a bool ``--x [BOOL]``."""
    field = _field(config, name)
    path = f"{prefix}.{name}" if prefix else name
    flag, kind, default = flag_for(path), _kind(config, name), field.default
    text = help_text(config, name, prefix=prefix)
    if kind is bool:
        return _add_switch(parser, config, name, path, flag, text, optional_value, custom)
    parsing = {} if {"type", "choices"} & custom.keys() else _parsing(kind)
    keywords: dict[str, Any] = {"help": text, **parsing}
    if not flag.startswith("--"):
        return mark(parser.add_argument(path, metavar=flag, **keywords | custom), path, flag)
    if "choices" not in keywords | custom:
        keywords["metavar"] = flag[2:].replace("-", "_").upper()
    if default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
        keywords["required"] = True
    return mark(parser.add_argument(flag, dest=path, default=None, **keywords | custom), path, flag)


def _add_switch(parser, config: type, name: str, path: str, flag: str, text: str, optional_value: bool,
                custom: dict) -> argparse.Action:
    """A bool field: ``--x`` (or ``--x [BOOL]``), and ``--no-x`` where the field defaults to True."""
    default = _field(config, name).default
    group = parser.add_mutually_exclusive_group() if optional_value and default is True else parser
    action = None
    if optional_value:
        action = mark(group.add_argument(flag, dest=path, nargs="?", const=True, type=parse_bool, default=None,
                                         metavar=flag[2:].replace("-", "_").upper(),
                                         help=_with_default(text, default), **custom), path, flag)
    elif default is not True:
        action = mark(group.add_argument(flag, dest=path, action="store_const", const=True, default=None,
                                         help=text, **custom), path, flag)
    if default is not True:
        return action
    negation = [f"--no-{flag[2:]}", *filter(None, [RENAMES.get(f"{path}=False")])]
    # "x = 1, y = 0; False: noisy data, ..." says what the negation does after "False: ".
    when_false = text.partition("False: ")[2]
    said = f"the same as {flag} False" + (f": {when_false}" if when_false else "") if action else "do not " + text
    return mark(group.add_argument(*negation, dest=path, action="store_const", const=False, default=None, help=said),
                f"{path}=False", negation[-1])


def fields_given(args: argparse.Namespace, config: type, *, prefix: str = "",
                 only: typing.Container[str] | None = None) -> dict[str, Any]:
    """{field: value} for ``config``'s flags the user gave (not given: the config's default applies)."""
    out = {}
    for field in dataclasses.fields(config):
        value = getattr(args, f"{prefix}.{field.name}" if prefix else field.name, None)
        if value is not None and (only is None or field.name in only):
            out[field.name] = value
    return out


def help_text(config: type, name: str, *, prefix: str = "", doc: str | None = None) -> str:
    """The field's docstring (or ``doc``, written as one) as a flag's help: fields as flags, lower case, and its
    default."""
    doc = doc or docstrings(config).get(name)
    if not doc:
        raise TypeError(f"{config.__name__}.{name} has no docstring to be its flag's help")
    names = {f.name for f in dataclasses.fields(config)}
    text = re.sub(r"``([a-z_][a-z0-9_]*)``", lambda m: flag_for(f"{prefix}.{m[1]}" if prefix else m[1])
                  if m[1] in names else m[1], " ".join(doc.split())).removesuffix(".")
    first = text.split(" ", 1)[0]
    if first[:1].isupper() and first[1:] == first[1:].lower():
        text = text[0].lower() + text[1:]
    default = _field(config, name).default
    return text if isinstance(default, bool) else _with_default(text, default)


def _with_default(text: str, default: Any) -> str:
    # By identity: a default of 0 is quoted, a switch's False is not.
    if default is None or default is False or default is dataclasses.MISSING or "(default" in text:
        return text
    # A closing remark in parentheses takes the default in: "(the process-group timeout; default 60)".
    remark = text[text.rfind("(") + 1:-1] if text.endswith(")") else ""
    if " " in remark and "(" not in remark and ")" not in remark:
        return f"{text[:-1]}; default {show(default)})"
    return f"{text} (default {show(default)})"


def show(value: Any) -> str:
    """A default as --help quotes it: 1e-09, 0.9,0.999, 8,16,32."""
    if isinstance(value, tuple):
        return ",".join(map(show, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


@functools.cache
def docstrings(config: type) -> dict[str, str]:
    """{field: docstring} of a dataclass and its bases (the string literal under each field)."""
    out: dict[str, str] = {}
    for cls in reversed(config.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                out[node.target.id] = inspect.cleandoc(after.value.value)
    return out


def _field(config: type, name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(config)}[name]


def _kind(config: type, name: str) -> Any:
    """The field's type, None stripped from an optional one."""
    kind = typing.get_type_hints(config)[name]
    options = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if type(None) in typing.get_args(kind) and len(options) == 1:
        return options[0]
    return kind


def _parsing(kind: Any) -> dict[str, Any]:
    """argparse's ``type`` (a parser that only parses) or ``choices`` for a field's type."""
    if typing.get_origin(kind) is Literal:
        return {"choices": typing.get_args(kind)}
    if typing.get_origin(kind) is tuple:
        items = typing.get_args(kind)
        if items[-1] is Ellipsis and items[0] is int:
            return {"type": integers}
        if items == (float, float):
            return {"type": betas}
    simple = {int: integer, float: number, str: None}
    if kind in simple:
        return {"type": simple[kind]} if simple[kind] else {}
    raise TypeError(f"no flag for a field of type {kind!r}: give it a type= of its own")


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """--timeout and --deadline, for every command that starts ranks."""
    from ddplab.runtime.launch_config import LaunchConfig

    group = parser.add_argument_group("launch")
    seconds = {"metavar": "SECONDS"}
    add_fields(group, LaunchConfig, ("pg_timeout_s", "deadline_s"), pg_timeout_s=seconds, deadline_s=seconds)


def launch_config(args: argparse.Namespace):
    """The LaunchConfig the launch flags ask for (the world size is the command's to choose)."""
    from ddplab.runtime.launch_config import LaunchConfig

    return LaunchConfig(**fields_given(args, LaunchConfig, only=("pg_timeout_s", "deadline_s")))
