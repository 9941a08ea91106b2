"""Help that fits a screen (--help), every flag behind it (--help-all), a mistyped flag answered with the nearest."""

import os

import pytest
from _parsers import leaves

from ddplab.cli.help import COMMON, examples_of, nearest
from ddplab.cli.main import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCREEN_LINES = 40


LEAVES = dict(leaves(build_parser()))


def _help(argv, capsys, monkeypatch, columns=80) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    return capsys.readouterr().out


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_every_subcommand_has_common_flags_it_really_has():
    assert {" ".join(path) for path in LEAVES} == set(COMMON)
    for path, parser in LEAVES.items():
        names = {option for action in parser._actions for option in action.option_strings}
        names |= {part for action in parser._actions if not action.option_strings
                  for part in str(action.metavar or action.dest).split()}
        assert set(COMMON[" ".join(path)]) <= names, path


@pytest.mark.parametrize("path", sorted(LEAVES))
def test_the_short_help_fits_a_screen_and_says_what_where_and_how(path, capsys, monkeypatch):
    text = _help([*path, "--help"], capsys, monkeypatch)
    command = "ddplab " + " ".join(path)
    assert len(text.splitlines()) <= SCREEN_LINES, text
    assert text.startswith(f"usage: {command} ")
    shown = text.split("\nexamples:\n")[1].split("\n\n")[0]
    assert examples_of(text) == examples_of(LEAVES[path].description)[:2] and "ddplab" in shown
    for flag in COMMON[" ".join(path)]:
        assert flag in text, flag
    last = text.splitlines()[-1]
    assert f"{command} --help-all" in last
    page = last.rsplit(" ", 1)[1]
    assert page == f"docs/commands/{path[0]}.md" and os.path.exists(os.path.join(ROOT, page))


@pytest.mark.parametrize("path", [("study",), ("plan",)])
def test_the_long_helps_are_short_now_and_every_flag_is_behind_help_all(path, capsys, monkeypatch):
    # study --help was 204 lines and plan --help 129 at 80 columns.
    short = _help([*path, "-h"], capsys, monkeypatch)
    full = _help([*path, "--help-all"], capsys, monkeypatch)
    assert len(short.splitlines()) <= SCREEN_LINES < 120 < len(full.splitlines())
    options = {option for action in LEAVES[path]._actions for option in action.option_strings}
    assert all(option in full for option in options)
    assert len([option for option in options if option in short]) < len(options) / 2


def test_help_all_is_accepted_everywhere_and_the_top_level_help_is_whole(capsys, monkeypatch):
    top = _help(["--help"], capsys, monkeypatch)
    assert top == _help(["--help-all"], capsys, monkeypatch) and "COMMAND" in top
    assert _help(["sandbox", "--help_all"], capsys, monkeypatch).startswith("usage: ddplab sandbox")


def test_the_examples_are_read_whole_with_their_continuation_lines():
    text = "what\n\nexamples:\n  ddplab a \\\n      --b 1\n  ddplab c  # note\n\nmore\n"
    assert examples_of(text) == ["  ddplab a \\\n      --b 1", "  ddplab c  # note"]


def test_an_unknown_flag_names_the_nearest_one_before_what_it_left_missing(capsys):
    err = _error(["plan", "--gpus", "16"], capsys)
    assert err == "ddplab: error: unrecognized arguments: --gpus; did you mean --devices? (see 'ddplab plan --help')\n"
    assert "did you mean --batch-size?" in _error(["check", "spec.py", "--batch_siz", "8"], capsys)
    assert "did you mean --world-size?" in _error(["noise", "spec.py", "--batch-size", "8", "--gpus", "2"], capsys)
    assert "did you mean --global-batch-sizes?" in _error(["study", "--batch-sizes", "8,16"], capsys)
    assert "did you mean" not in _error(["plan", "--zzzz", "1"], capsys)


def test_what_is_no_flag_of_ours_is_not_judged(capsys):
    # A negative value, a value after its flag, and the audited command's own flags after --.
    argv = ["plan", "--ref-batch-size", "32", "--ref-lr", "0.1", "--devices", "8", "--warmup-steps", "-1"]
    assert "unrecognized" not in _error_or_none(argv, capsys)
    assert "unrecognized" not in _error_or_none(["audit", "--steps", "2", "--", "python", "--gpus", "2"], capsys,
                                                parse_only=True)
    assert "unrecognized" not in _error_or_none(["plan", "--ref-batch", "32", "--ref-lr", "0.1", "--devices", "8"],
                                                capsys, parse_only=True)


def _error_or_none(argv, capsys, parse_only=False) -> str:
    try:
        build_parser().parse_args(argv) if parse_only else main(argv)
    except SystemExit:
        pass
    return capsys.readouterr().err


def test_nearest_prefers_a_known_synonym_and_compares_without_dashes():
    options = ["--devices", "--pp", "--cp", "--nodes"]
    assert nearest("--gpus", options) == "--devices" and nearest("--nnodes", options) == "--nodes"
    assert nearest("--gpu", ["--pp", "--cp"]) is None


def test_a_flags_short_help_is_its_first_clause_with_its_default_once(capsys, monkeypatch):
    text = _help(["sandbox", "single", "--help"], capsys, monkeypatch, columns=200)
    assert "--noisy  " in text or "--noisy\n" in text
    assert "noisy data, x = 1 + N(0,1), y = N(0,1)" in text and "the same as" not in text
    plan = _help(["plan", "--help"], capsys, monkeypatch, columns=200)
    assert "nodes (default 1)\n" in plan and "what to hold fixed (default: decided from the batch)\n" in plan
    assert not any(line.count("default") > 1 for line in plan.splitlines())


def test_the_short_helps_say_what_runs_and_nothing_cut_in_half(capsys, monkeypatch):
    # noise's --steps: a command measures 40 steps unless given (200 is a spec's), as --help-all says.
    noise = _help(["noise", "-h"], capsys, monkeypatch, columns=200)
    steps = next(line for line in noise.splitlines() if line.lstrip().startswith("--steps"))
    assert "(40 unless given)" in steps and "200" not in steps
    # audit's description introduces a list the short help leaves out: it says where the list is.
    audit = _help(["audit", "-h"], capsys, monkeypatch, columns=100)
    intro = audit.split("\n\n")[1]
    assert not intro.endswith(":") and intro.endswith("(--help-all lists them).")
    # study's --rules names every rule whole at any width (a list without spaces was one word, cut anywhere).
    from ddplab.study.rules import registry

    for columns in (80, 100, 120, 160):
        study = _help(["study", "-h"], capsys, monkeypatch, columns=columns)
        block = study.split("--rules RULES")[1].split("\n  --")[0]
        words = set(block.replace(",", " ").split())
        assert set(registry.known()) <= words, (columns, block)


@pytest.mark.parametrize("command, usage", [
    ("noise", "usage: ddplab noise [FLAGS] [SPEC.py] [-- COMMAND ARGS...]"),
    ("check", "usage: ddplab check [FLAGS] [SPEC.py] [-- COMMAND ARGS...]"),
    ("study", "usage: ddplab study [FLAGS] [SPEC.py] [-- COMMAND ARGS...]"),
    ("audit", "usage: ddplab audit [FLAGS] -- COMMAND ARGS..."),
    ("plan", "usage: ddplab plan --devices DEVICES [FLAGS]"),
])
def test_the_usage_line_shows_where_a_command_goes(command, usage, capsys):
    with pytest.raises(SystemExit):
        main([command, "-h"])
    assert capsys.readouterr().out.splitlines()[0] == usage
