"""One CLI policy for every subcommand: spellings, error sentences, help hints, and tables that never split a number."""

import contextlib
import io
import re

import pytest
from _parsers import leaves

from ddplab.cli import render
from ddplab.cli.main import build_parser, main

# What each (sub)command needs besides the flag under test; flags come first, then these.
REQUIRED = {
    ("sandbox", "single"): [], ("sandbox", "multi"): [], ("sandbox", "table"): [],
    ("plan",): ["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8"],
    ("check",): ["spec.py", "--batch-size", "8"],
    ("noise",): ["spec.py", "--batch-size", "8"],
    ("audit",): ["--", "python", "train.py"],
    ("study",): [],
}
CANDIDATE_VALUES = ("1", "0.5", "0.9,0.99", "x")


def _outcome(argv):
    """The parsed namespace without its callables, or the error text."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
    except SystemExit:
        return "error: " + err.getvalue()
    return {k: v for k, v in vars(args).items() if not callable(v)}


def _hyphenated_flags(parser):
    for action in parser._actions:
        for option in action.option_strings:
            # --help-all prints and exits: tests/cli/test_help.py checks its underscore spelling.
            if option.startswith("--") and "-" in option[2:] and option != "--help-all":
                yield action, option


def test_every_subcommand_has_a_known_required_set():
    assert {path for path, _ in leaves(build_parser())} == set(REQUIRED)


def test_underscores_are_accepted_on_every_subcommands_flags():
    checked = []
    for path, parser in leaves(build_parser()):
        for action, option in _hyphenated_flags(parser):
            underscored = "--" + option[2:].replace("-", "_")
            values = [None] if action.nargs == 0 else [str(action.choices[0])] if action.choices else CANDIDATE_VALUES
            for value in values:
                tokens = [option] if value is None else [option, value]
                expected = _outcome([*path, *tokens, *REQUIRED[path]])
                if isinstance(expected, dict):
                    assert _outcome([*path, underscored, *tokens[1:], *REQUIRED[path]]) == expected, underscored
                    assert _outcome([*path, f"{underscored}={value}" if value else underscored,
                                     *REQUIRED[path]]) == expected, underscored
                    checked.append((path, option))
                    break
            else:
                pytest.fail(f"no candidate value parses for {' '.join(path)} {option}")
    assert {path for path, _ in checked} >= {("plan",), ("check",), ("noise",), ("sandbox", "multi")}


def test_underscores_leave_the_audited_command_alone():
    args = build_parser().parse_args(["audit", "--", "python", "train.py", "--batch_size", "8"])
    assert args.command[-2:] == ["--batch_size", "8"]


def _number_flags():
    from ddplab.cli import args

    number_types = {int, float, args.integer, args.number}
    for path, parser in leaves(build_parser()):
        for action in parser._actions:
            if action.type in number_types and action.option_strings:
                yield path, action.option_strings[0]


def test_number_flags_exist_on_every_subcommand():
    assert {path[0] for path, _ in _number_flags()} == {"sandbox", "plan", "check", "noise", "audit", "study"}


@pytest.mark.parametrize("path, flag", list(_number_flags()))
def test_a_bad_number_is_a_sentence(path, flag, capsys):
    with pytest.raises(SystemExit) as info:
        main([*path, flag, "abc", *REQUIRED[path]])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected " in err and "got 'abc'" in err, err
    assert not re.search(r"positive_int|positive_float|invalid \w+ value|Traceback", err), err
    assert f"(see 'ddplab {' '.join(path)} --help')" in err and err.count("\n") == 1


@pytest.mark.parametrize("path", [("check",), ("noise",), ("plan",), ("sandbox", "multi")])
def test_an_unknown_flag_points_at_the_subcommands_help(path, capsys):
    with pytest.raises(SystemExit) as info:
        main([*path, "--no-such-flag", *REQUIRED[path]])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in err and f"(see 'ddplab {' '.join(path)} --help')" in err


NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def _render(renderable, width: int) -> list[str]:
    from rich.console import Console

    out = io.StringIO()
    Console(width=width, file=out, highlight=False, color_system=None).print(renderable)
    return out.getvalue().splitlines()


def _assert_numbers_whole(rows, lines):
    assert not _numbers_split(rows, lines), "\n".join(lines)


def _plan_output(argv, width, monkeypatch, capsys):
    """(table rows, printed lines) of `ddplab plan` on a terminal of ``width`` columns (COLUMNS, piped)."""
    tables = []
    real_table = render.table
    monkeypatch.setattr(render, "table",
                        lambda title, columns, rows: tables.append(rows) or real_table(title, columns, rows))
    monkeypatch.setenv("COLUMNS", str(width))
    capsys.readouterr()
    assert main(["plan", *argv]) == 0
    return tables[0], capsys.readouterr().out.splitlines()


PLAN_ARGVS = [
    ["--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8", "--dataset-size", "1281167", "--epochs", "90"],
    ["--ref-batch-size", "32", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "8", "--nodes", "2",
     "--dataset-size", "100000", "--epochs", "3"],
    ["--ref-batch-size", "64", "--ref-lr", "0.1", "--devices", "8", "--nodes", "4", "--critical-batch-size", "500"],
    ["--ref-batch-size", "8", "--ref-lr", "3e-4", "--optimizer", "adamw", "--devices", "8", "--nodes", "2", "--tp", "2",
     "--strategy", "hsdp", "--replicate", "2", "--accumulation", "4", "--seq-len", "4096"],
]


@pytest.mark.parametrize("argv", PLAN_ARGVS)
def test_a_plan_table_at_sixty_columns_never_splits_a_number(argv, monkeypatch, capsys):
    rows, lines = _plan_output(argv, 60, monkeypatch, capsys)
    assert max(len(line) for line in lines) <= 60
    _assert_numbers_whole(rows, lines)


SANDBOX_ROWS = [  # the README's `ddplab sandbox table`, which a 60-column terminal printed as "8.304e-0" / "9"
    ["1", "single B=128, lr 1e-3, deterministic", "0.99800003", "0.99800000", "0", "0"],
    ["3", "single B=128, lr 1e-3, noisy ×10,000", "0.99808125", "0.99808053", "8.304e-09", "8.429e-09"],
    ["9", "multi 8×16, lr 2.8284e-3 (sqrt), noisy ×1,000", "0.99456692", "0.99457257", "6.525e-08", "6.747e-08"],
]
SANDBOX_COLUMNS = ["#", "run", "w", "w theory", "update var", "var theory"]


def _numbers_split(rows, lines):
    return [n for row in rows for cell in row for n in NUMBER.findall(cell) if not any(n in line for line in lines)]


def test_the_split_from_the_issue_no_longer_happens():
    from rich.table import Table

    plain = Table()  # what render.table built before: rich's own widths, long words folded
    for column in SANDBOX_COLUMNS:
        plain.add_column(column, overflow="fold")
    for row in SANDBOX_ROWS:
        plain.add_row(*row)
    assert "8.304e-09" in _numbers_split(SANDBOX_ROWS, _render(plain, 60))
    table = render.table("ddplab sandbox table", SANDBOX_COLUMNS, SANDBOX_ROWS)
    for width in (40, 60, 80, 104, 120):
        lines = _render(table, width)
        assert max(len(line) for line in lines) <= width
        _assert_numbers_whole(SANDBOX_ROWS, lines)
    # Wide enough, the table is side by side (one line per row), as rich would draw it.
    assert sum("│ 3 │" in line for line in _render(table, 104)) == 1


@pytest.mark.parametrize("width", [45, 52, 70, 90, 120, 160])
@pytest.mark.parametrize("argv", PLAN_ARGVS)
def test_plan_tables_keep_numbers_whole_at_other_widths(argv, width, monkeypatch, capsys):
    rows, lines = _plan_output(argv, width, monkeypatch, capsys)
    _assert_numbers_whole(rows, lines)


def test_console_honours_columns_when_piped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "70")
    assert render.console().width == 70
    monkeypatch.delenv("COLUMNS")
    assert render.console().width == 120


@pytest.mark.parametrize("path", [("sandbox", "single"), ("sandbox", "multi"), ("sandbox", "table"), ("plan",),
                                  ("check",), ("noise",), ("audit",), ("study",)])
def test_every_help_teaches_with_examples_and_states_its_defaults(path, capsys):
    with pytest.raises(SystemExit):
        main([*path, "--help-all"])
    text = capsys.readouterr().out
    assert "examples:" in text and "ddplab " + path[0] in text.split("examples:")[1]
    if path[0] in ("check", "noise"):
        assert "ranks (default 2; under torchrun its WORLD_SIZE)" in " ".join(text.split())
    if path == ("sandbox", "multi"):
        assert "else 8 CPU ranks" in " ".join(text.split())
    if path == ("study",):
        flat = " ".join(text.split())
        assert "(default study-out)" in flat and "--global-batch-sizes" in flat and "--ref-global-batch-size" in flat


# Flags generated from the configs: a field's type, default, choices and docstring are its flag.

def _toy_parser():
    import dataclasses
    from typing import Literal

    from ddplab.cli.main import Parser
    from ddplab.cli.options import add_fields

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Toy:
        per_device_batch_size: int
        """Per-device batch."""
        lr: float = 0.5
        """Learning rate (no momentum)."""
        mode: Literal["fast", "slow"] = "fast"
        """How to run."""
        sizes: tuple[int, ...] = (8, 16)
        """Batch sizes, comma-separated."""
        plots: bool = True
        """Write the plots."""
        fresh: bool = False
        """Start over, discarding ``sizes``."""
        cap: int | None = None
        """Largest batch (default: no cap)."""

    parser = Parser(prog="toy")
    add_fields(parser, Toy, ("per_device_batch_size", "lr", "mode", "sizes", "plots", "fresh", "cap"))
    return Toy, parser


def test_a_field_is_its_flag():
    from ddplab.cli.options import fields_given

    toy, parser = _toy_parser()
    actions = {action.option_strings[0]: action for action in parser._actions if action.option_strings}
    assert set(actions) == {"-h", "--help-all", "--batch-size", "--lr", "--mode", "--sizes", "--no-plots", "--fresh",
                            "--cap"}
    helps = {flag: action.help for flag, action in actions.items()}
    assert helps["--batch-size"] == "per-device batch" and actions["--batch-size"].required
    assert helps["--lr"] == "learning rate (no momentum; default 0.5)"
    assert helps["--mode"] == "how to run (default fast)" and actions["--mode"].choices == ("fast", "slow")
    assert helps["--sizes"] == "batch sizes, comma-separated (default 8,16)"
    assert helps["--no-plots"] == "do not write the plots" and helps["--fresh"] == "start over, discarding --sizes"
    assert helps["--cap"] == "largest batch (default: no cap)"
    # Nothing given: only the required field, and every other default is the config's.
    args = parser.parse_args(["--batch_size", "4"])
    assert toy(**fields_given(args, toy)) == toy(per_device_batch_size=4)
    args = parser.parse_args(["--batch-size", "4", "--lr", "0.1", "--mode", "slow", "--sizes", "1,2", "--no-plots",
                              "--fresh", "--cap", "3"])
    assert fields_given(args, toy) == {"per_device_batch_size": 4, "lr": 0.1, "mode": "slow", "sizes": (1, 2),
                                       "plots": False, "fresh": True, "cap": 3}


def test_a_field_without_a_docstring_has_no_flag():
    import dataclasses

    from ddplab.cli.main import Parser
    from ddplab.cli.options import add_field

    @dataclasses.dataclass
    class Bare:
        steps: int = 1

    with pytest.raises(TypeError, match="Bare.steps has no docstring"):
        add_field(Parser(prog="bare"), Bare, "steps")


def test_help_quotes_the_defaults_the_configs_hold():
    from ddplab.check.config import FLOAT32_TOLERANCE, FLOAT64_TOLERANCE, CheckConfig
    from ddplab.noise.config import NoiseConfig
    from ddplab.plan.planner import Data, Reference
    from ddplab.study.config import StudyConfig, StudyOptions

    helps = {path: {option: action.help for action in parser._actions for option in action.option_strings}
             for path, parser in leaves(build_parser())}
    assert f"(default {CheckConfig.steps})" in helps[("check",)]["--steps"]
    assert f"(default {NoiseConfig.steps})" in helps[("noise",)]["--steps"]
    assert f"default {FLOAT64_TOLERANCE:g} in float64, {FLOAT32_TOLERANCE:g} under deepspeed" in \
        helps[("check",)]["--tolerance"]
    assert CheckConfig(spec_path="s.py", per_device_batch_size=1).tolerance == FLOAT64_TOLERANCE
    assert CheckConfig(spec_path="s.py", per_device_batch_size=1, strategy="deepspeed").tolerance == FLOAT32_TOLERANCE
    assert f"(default {Reference.devices})" in helps[("plan",)]["--ref-devices"]
    assert f"(default {Data.warmup_threshold:g})" in helps[("plan",)]["--warmup-threshold"]
    assert f"(default {StudyOptions.out})" in helps[("study",)]["--out"]
    batches = ",".join(map(str, StudyConfig.global_batch_sizes))
    assert f"(default {batches})" in helps[("study",)]["--global-batch-sizes"]


def test_the_rules_help_names_every_rule_and_both_defaults():
    from ddplab.study.config import ADAM_RULES, FIXED_RULES
    from ddplab.study.rules import registry

    rules = next(a.help for a in dict(leaves(build_parser()))[("study",)]._actions if "--rules" in a.option_strings)
    assert all(rule in rules for rule in registry.known())
    assert f"default {','.join(FIXED_RULES)} for SGD, {','.join(ADAM_RULES)} for Adam/AdamW" in rules


def test_the_flag_table_is_read_off_the_parsers():
    from ddplab.cli.main import FLAGS, flags
    from ddplab.cli.options import RENAMES

    assert FLAGS == flags()
    assert {FLAGS[field] for field in ("per_device_batch_size", "target.per_device_batch_size")} == {"--batch-size"}
    assert (FLAGS["reference.per_device_batch_size"], FLAGS["plots=False"], FLAGS["deterministic=False"],
            FLAGS["spec_path"], FLAGS["mode"], FLAGS["command"]) == ("--ref-batch-size", "--no-plots", "--noisy",
                                                                       "SPEC.py", "MODE", "COMMAND")
    # Every rename names a field some command sets: no stale entry.
    assert set(RENAMES) - set(FLAGS) == set()
    # Every flag a parser has is in the table, unless it sets no config field.
    options = {option for _, parser in leaves(build_parser()) for action in parser._actions
               for option in action.option_strings}
    unmapped = options - set(FLAGS.values()) - {"-h", "--help", "--help-all", "--json", "--strict", "--plot",
                                                "--no-deterministic"}
    assert unmapped == set()
