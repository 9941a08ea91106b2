"""The package's shape, checked: no import cycle, the library prints nothing, every error field has a flag."""

import ast
import os
import re

import pytest

from ddplab.cli.main import FLAGS

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "ddplab")
# Fields that only a Python caller can set (no command passes them): shown by their own name everywhere.
PYTHON_ONLY = {"dataset_size", "comm_hook", "via", "start_method", "backend", "reference.global_batch_size",
               # ddplab.adapt.AdaScale's arguments: a library API with no command of its own.
               "optimizer", "noise_scale", "scheduler", "reference_batch_size", "reference_steps", "smoothing",
               # ddplab.adapt.BatchRamp's.
               "max_accumulation_steps", "rule", "warmup_steps", "target_ratio", "interval",
               # ddplab.adapt.BatchSchedule's.
               "schedule", "samples_seen",
               # StudyConfig's lr the rules scale from: --ref-lr sets it with reference_lr, checked first.
               "rules_lr"}
# The guests' voice inside the user's program, where there is no command line to print for it.
MAY_PRINT = {"auditor/exchange.py", "guest/bootstrap/sitecustomize.py", "guest/extension_builds.py",
             "integrations/lightning.py", "runtime/op_builds.py"}
# A field in braces; doubled braces are a literal brace (a placeholder of the user's command), no field.
FIELD = re.compile(r"(?<!\{)\{([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*(?:=[A-Za-z0-9_]+)?)\}(?!\})")


def _modules(root: str = SRC, package: str = "ddplab"):
    """(path relative to ``root``, dotted module name, parsed tree) for every module of the package at ``root``."""
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, root)
                module = package + "." + relative[:-3].replace(os.sep, ".").removesuffix("__init__")
                with open(path) as fh:
                    yield relative, module.removesuffix("."), ast.parse(fh.read())


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``: the one block whose imports never run."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST):
    """Every import statement under ``node``, those inside functions and classes included, but not the body of an
    ``if TYPE_CHECKING:`` block (its ``else`` runs, so it counts)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif _type_checking(child):
            for other in child.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports, anywhere in its code, relative imports resolved."""
    found = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {_known_prefix(alias.name, known) for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else _known_prefix(base, known))
    # Importing a.b.c runs a.b's __init__ first: an arrow to each package above what is imported, bar the
    # importer's own packages (already running when it runs).
    own = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
    found |= {package for name in found for package in _packages_above(name) if package not in own}
    return {name for name in found if name in known and name != module}


def _packages_above(name: str) -> list[str]:
    """``a.b`` and ``a`` for ``a.b.c``."""
    return [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]


def _known_prefix(name: str, known: set[str]) -> str:
    """``name`` or the longest dotted prefix of it that is one of the package's modules."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def import_graph(root: str = SRC, package: str = "ddplab") -> dict[str, set[str]]:
    """{module: the modules it imports} over every module of the package at ``root``."""
    modules = [(path, module, tree) for path, module, tree in _modules(root, package)]
    known = {module for _, module, _ in modules}
    return {module: _imports(tree, module, path.endswith("__init__.py"), known) for path, module, tree in modules}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle as one path around it (first module repeated last), one per strongly connected set."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def connect(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            members = set(stack[stack.index(module):])
            del stack[stack.index(module):]
            if len(members) > 1:
                circles.append(_path_around(graph, members))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return circles


def _path_around(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """The shortest path from the first member back to itself through members only."""
    start = min(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        module = frontier.pop(0)
        for target in sorted(graph[module] & members):
            if target == start:
                return paths[module] + [start]
            if target not in paths:
                paths[target] = paths[module] + [target]
                frontier.append(target)
    raise AssertionError("a strongly connected set has a path around it")


def assert_no_import_cycle(graph: dict[str, set[str]]) -> None:
    """Fail naming every circle, module by module."""
    circles = import_cycles(graph)
    if circles:
        pytest.fail("import cycle: " + "; import cycle: ".join(" -> ".join(circle) for circle in circles))


def test_no_import_cycle():
    assert_no_import_cycle(import_graph())


def test_the_cycle_finder_sees_a_circle_closed_inside_a_function(tmp_path):
    package = tmp_path / "planted"
    (package / "inner").mkdir(parents=True)
    files = {
        "__init__.py": "",
        # A circle closed by a late import, through a relative one.
        "a.py": "from planted.inner import b\n",
        "inner/__init__.py": "",
        "inner/b.py": "def late():\n    from ..a import x\n    return x\n",
        # Imports under TYPE_CHECKING never run: no arrow, so c and a make no circle.
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
        "d.py": "import planted.c\nclass D:\n    def f(self):\n        from .c import TYPE_CHECKING\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(str(package), "planted")
    assert graph["planted.inner.b"] == {"planted.a"} and graph["planted.c"] == set()
    assert graph["planted.d"] == {"planted.c"}
    assert import_cycles(graph) == [["planted.a", "planted.inner.b", "planted.a"]]
    # Importing a module runs its package's __init__: one that imports, through a sibling, what imported it, is a
    # circle too (no import statement of the circle names the package itself).
    other = tmp_path / "other"
    (other / "inner").mkdir(parents=True)
    files = {"__init__.py": "", "c.py": "from other.inner import f\n", "inner/e.py": "from other import c\n",
             "inner/__init__.py": "from other.inner import e\n", "inner/f.py": ""}
    for name, text in files.items():
        (other / name).write_text(text)
    assert import_cycles(import_graph(str(other), "other")) == [["other.c", "other.inner", "other.inner.e", "other.c"]]
    with pytest.raises(pytest.fail.Exception, match="import cycle: planted.a -> planted.inner.b -> planted.a$"):
        assert_no_import_cycle(graph)


def _prints(tree) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "print":
                lines.append(node.lineno)
            elif isinstance(func, ast.Attribute) and func.attr in ("print", "write") and \
                    isinstance(func.value, ast.Attribute) and func.value.attr in ("stdout", "stderr"):
                lines.append(node.lineno)
    return lines


def test_nothing_outside_the_command_line_prints():
    offenders = [f"{path}:{line}" for path, _, tree in _modules() if not path.startswith("cli" + os.sep)
                 and path not in MAY_PRINT for line in _prints(tree)]
    assert offenders == []


# ddplab.validation's checks: their first argument is the field their sentence names.
RANGE_CHECKS = {"at_least", "positive", "zero_or_more", "within", "one_of"}


def _templates(tree):
    """The first argument of every UsageError(...), SpecError(...) and spec.error(...): its literal text; a range
    check's field as ``{field}``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        first = node.args[0]
        if name in RANGE_CHECKS and isinstance(first, ast.Constant) and isinstance(first.value, str):
            yield node.lineno, "{" + first.value + "}"
        if name not in ("UsageError", "SpecError", "error"):
            continue
        parts = first.values if isinstance(first, ast.JoinedStr) else [first]
        yield node.lineno, "".join(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))


def test_every_field_an_error_names_has_a_flag_or_is_python_only():
    fields = {}
    for path, _, tree in _modules():
        for line, text in _templates(tree):
            for field in FIELD.findall(text):
                fields.setdefault(field, f"{path}:{line}")
    assert len(fields) > 40  # the scan sees the library's errors
    unmapped = {field: where for field, where in fields.items() if field not in FLAGS and field not in PYTHON_ONLY}
    assert unmapped == {}
    assert all(flag.startswith("--") or flag.isupper() or flag.endswith(".py") for flag in FLAGS.values())


def _strings(tree):
    """Every string literal's text (an f-string's literal parts joined), with its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(p.value for p in node.values if isinstance(p, ast.Constant))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_the_plans_prose_names_fields_that_have_flags_and_no_flag_itself():
    # The prose is a template: a Python caller reads the fields, the command line their flags (one table).
    named, flags = {}, []
    for path, _, tree in _modules():
        # Megatron-LM's own arguments (and the launch scripts that hold them) are its file's keys
        # (--micro-batch-size), not ddplab's flags.
        if not path.startswith("plan" + os.sep) or path in (os.path.join("plan", "formats", "megatron.py"),
                                                             os.path.join("plan", "formats", "shell.py")):
            continue
        for line, text in _strings(tree):
            for field in FIELD.findall(text):
                named.setdefault(field, f"{path}:{line}")
            flags += [f"{path}:{line}: {text}" for _ in re.findall(r"(?<![\w-])--[a-z]", text)]
    assert len(named) > 15  # the scan sees the prose
    assert flags == []
    assert {field: where for field, where in named.items() if field not in FLAGS and field not in PYTHON_ONLY} == {}


def test_launch_state_lives_in_objects_not_module_globals():
    import threading

    from ddplab.runtime import launch, signals

    for module in (launch, signals):
        mutable = [name for name, value in vars(module).items() if not name.startswith("__")
                   and isinstance(value, (dict, list, set, threading.Event))]
        assert mutable == [], module.__name__


def _rule_name_branches(tree, names: set[str], keys: bool = True) -> list[int]:
    """Lines that spell a study rule's name where code decides by it: compared (==, !=, in, not in, a literal
    collection of names), or, with ``keys``, used as a key (a subscript, a dict literal's key, ``.get(name)``) or
    handed to ``registry.get``/``color``."""
    lines = []
    for node in ast.walk(tree):
        spelled = []
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                spelled += operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        elif keys and isinstance(node, ast.Subscript) and not _annotation(node):
            spelled.append(node.slice)
        elif keys and isinstance(node, ast.Dict):
            spelled += [key for key in node.keys if key is not None]
        elif keys and isinstance(node, ast.Call) and node.args and \
                (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in ("get", "color", "colour"):
            spelled.append(node.args[0])
        if any(isinstance(item, ast.Constant) and item.value in names for item in spelled):
            lines.append(node.lineno)
    return lines


def _annotation(node: ast.Subscript) -> bool:
    """``Literal[...]``: a type's choices, not a key."""
    return getattr(node.value, "id", None) == "Literal" or getattr(node.value, "attr", None) == "Literal"


# Words that are a rule's name and another thing's too: the branched measurement's batch schedule (its JSON key,
# StudyConfig's field) is spelled "schedule" as a key; comparing with it still counts.
ALSO_NOT_A_RULE = {"schedule"}


def test_only_the_rules_spell_a_rules_name():
    from ddplab.study.rules import registry

    names = set(registry.known())
    offenders = [f"{path}:{line}" for path, _, tree in _modules()
                 if path.startswith(("study" + os.sep, os.path.join("cli", "study.py")))
                 and not path.startswith(os.path.join("study", "rules") + os.sep)
                 for line in sorted(set(_rule_name_branches(tree, names - ALSO_NOT_A_RULE))
                                    | set(_rule_name_branches(tree, names & ALSO_NOT_A_RULE, keys=False)))]
    assert offenders == []
    # The scan sees a name where code decides by it, and not in a type's choices.
    assert _rule_name_branches(ast.parse('if rule == "tuned" or "ramp" in rules: pass'), names) == [1, 1]
    spelled = 'x = {"ramp": 1}[k]\ny = values["adascale"]\nz = values.get("surge")\nw = color("tuned")\n' \
              'v: Literal["linear", "sqrt"]\nu = ("linear", "sqrt")'
    assert sorted(_rule_name_branches(ast.parse(spelled), names)) == [1, 2, 3, 4]


def test_only_the_engines_spell_an_engines_name():
    from typing import get_args

    from ddplab.study import engines
    from ddplab.study.config import Engine

    names = set(engines.ENGINES) | {engine.name for engine in engines.CLAIMING}
    offenders = [f"{path}:{line}" for path, _, tree in _modules()
                 if path.startswith(("study" + os.sep, os.path.join("cli", "study.py")))
                 and not path.startswith(os.path.join("study", "engines") + os.sep)
                 for line in _rule_name_branches(tree, names)]
    assert offenders == []
    # --engine offers auto, fastest and every engine registered, and no other.
    assert set(get_args(Engine)) == {"auto", "fastest", *engines.ENGINES}
    assert names - set(engines.ENGINES) == {"changing"}


def _constructs_ddp(tree, wrapper: str = "DistributedDataParallel") -> list[int]:
    """Lines calling ``wrapper(...)`` by name or attribute (imports and isinstance do not count)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and
            (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == wrapper]


@pytest.mark.parametrize("wrapper", ["DistributedDataParallel", "fully_shard"])
def test_only_the_runtime_constructs_distributed_data_parallel(wrapper):
    found = {path: lines for path, _, tree in _modules() if (lines := _constructs_ddp(tree, wrapper))}
    assert any(path.startswith("runtime" + os.sep) for path in found)  # the scan sees the one that does
    outside = {path: lines for path, lines in found.items() if not path.startswith("runtime" + os.sep)}
    assert outside == {}


def test_the_strategy_registry_holds_every_strategy_with_every_member_of_the_protocol():
    import inspect

    from ddplab.runtime import strategies
    from ddplab.runtime.strategies.base import Strategy

    members = {"name", "wrap", "owns", "module", "data_parallel_group", "data_parallel_size", "data_parallel_rank",
               "no_sync", "syncs", "syncs_buffers", "tap_local_gradients", "reduced_gradient_share",
               "check_runnable", "divide_factors", "training"}
    flags = {"collective_forward", "reduces_float64", "owns_optimizer", "taps_local_gradients"}
    declared = {name for name, _ in inspect.getmembers(Strategy) if not name.startswith("_")}
    assert declared == members - {"name"} | flags  # name is a ClassVar: declared by annotation only
    assert "name" in Strategy.__annotations__
    assert set(strategies.STRATEGIES) == {"ddp", "fsdp", "hsdp", "deepspeed"}
    for name, strategy in strategies.STRATEGIES.items():
        assert isinstance(strategy, Strategy) and strategy.name == name
        assert not inspect.isabstract(type(strategy))
        assert all(callable(getattr(strategy, member)) for member in members - {"name"})
        assert all(isinstance(getattr(strategy, flag), bool) for flag in flags)
    # The configs' choices are the registry's names, so a flag offers every strategy and no other.
    from typing import get_args

    from ddplab.runtime.config import DEFAULT_STRATEGY, StrategyName

    assert set(get_args(StrategyName)) == set(strategies.STRATEGIES) and strategies.DEFAULT == DEFAULT_STRATEGY


TORCH_FREE = ("import sys\nfrom ddplab.cli.main import main\ncode = main(sys.argv[1:])\n"
              "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(code)\n")


@pytest.mark.parametrize("argv", [
    ["study", "--seeds", "0", "--target-loss", "1", "--optimizer", "sgd", "--ref-lr", "0.1", "--", "python", "train.py",
     "--lr", "{lr}"],
    ["check", "--global-batch-size", "15", "--", "python", "train.py", "{world_size}", "{per_device_batch_size}"],
])
def test_a_drivers_bad_flag_is_refused_before_torch_is_imported(argv):
    # The drivers of the user's own command train nothing themselves: a refusal costs no torch import (2.5 s).
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TORCH_FREE, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "ddplab: error:" in done.stderr and "torch was imported" not in done.stderr


def test_the_command_drivers_import_no_torch():
    import subprocess
    import sys

    code = ("import sys\nimport ddplab.study.command.study, ddplab.check.command.run, ddplab.noise.command.run\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_registries_are_tables_loaded_when_asked():
    # A registry's package imports none of its entries: the rules load when one is asked for, an executor when a
    # study builds it (a local study never imports Ray or submitit).
    import subprocess
    import sys

    code = ("import sys\nfrom typing import get_args\n"
            "from ddplab.study.rules import registry\nfrom ddplab.study.command import executors\n"
            "from ddplab.study.command.config import Executor\n"
            "from ddplab.study.command.executors.registry import BUILT_IN\n"
            "assert not any(m in sys.modules for m in registry.BUILT_IN), 'a rule was imported'\n"
            "assert set(BUILT_IN) == set(get_args(Executor)), BUILT_IN\n"
            "names = list(registry.known())\n"
            "assert {type(r).__module__ for r in registry.known().values()} == set(registry.BUILT_IN)\n"
            "assert names[:3] == ['constant', 'linear', 'sqrt'] and 'tuned' in names, names\n"
            "assert not any(m in sys.modules for m in BUILT_IN.values()), 'an executor was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
