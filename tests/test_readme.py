"""The README and the manual as a new user reads them: their Python runs as written, their commands name files
that exist, their pasted outputs are whole blocks that tools/refresh_docs.py can regenerate."""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import refresh_docs

from ddplab.runtime.timescale import scaled

README_PATH = os.path.join(ROOT, "README.md")
PAGES = refresh_docs.pages()


def read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


README = read(README_PATH)
TEXTS = {os.path.relpath(path, ROOT): read(path) for path in PAGES}


def test_the_pages_are_the_readme_and_every_page_of_the_manual():
    assert PAGES[0] == README_PATH
    assert set(PAGES[1:]) == set(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    assert len(PAGES) > 10


@pytest.mark.parametrize("page", sorted(TEXTS))
def test_every_python_block_marked_runnable_runs_and_prints_what_its_comment_says(page):
    blocks = re.findall(r"<!-- python -->\n```python\n(.*?)```", TEXTS[page], re.S)
    for code in blocks:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120),
                              check=False, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        promised = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")]
        assert done.stdout.split("\n")[:len(promised)] == promised


def test_some_page_has_a_runnable_python_block():
    assert any("<!-- python -->\n```python\n" in text for text in TEXTS.values())


def test_the_two_commands_come_first_and_ci_runs_the_test_command():
    head = README[:README.index("## One vocabulary")]
    demo, tests = re.findall(r"```bash\n(.*?)\n```", head)
    assert "python3 -m venv .venv " in demo and ".venv/bin/ddplab sandbox table" in demo
    assert "<!-- test-command -->" in head and "python3 -m venv .venv-test " in tests and "pytest" in tests
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        assert "<!-- test-command -->" in fh.read()


def test_the_test_command_installs_the_docs_tools():
    # The test command installs requirements-dev.txt; tests/test_docs.py needs mkdocs from the docs extra.
    extras = re.search(r"^-e \.\[(.*)\]$", read(os.path.join(ROOT, "requirements-dev.txt")), re.M)
    assert extras and "docs" in extras[1].split(",")
    assert "torch==2.13.0" in read(os.path.join(ROOT, "requirements-dev.txt")).split("\n")


def test_the_readme_is_a_front_door_of_at_most_300_lines():
    assert len(README.splitlines()) <= 300
    for command in ("sandbox", "plan", "check", "audit", "noise", "study"):
        assert re.search(rf"^### {command}: ", README, re.M), command
        assert f"](docs/commands/{command}.md)" in README, command


def test_the_readmes_links_name_files_that_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert len(links) > 15
    for link in links:
        if "://" not in link:
            assert os.path.exists(os.path.join(ROOT, link)), link


def test_every_quoted_command_names_files_that_exist():
    commands = [match["cmd"] for text in TEXTS.values() for match in refresh_docs.MARKER.finditer(text)]
    assert len(commands) > 15
    for command in commands:
        for word in shlex.split(command):
            if word.endswith(".py") or word.startswith(("tests/", "examples/")):
                assert os.path.exists(os.path.join(ROOT, word)), f"{word} in: {command}"


@pytest.mark.parametrize("page", sorted(TEXTS))
def test_every_output_marker_opens_a_whole_block_the_refresh_can_replace(page):
    # A marker whose block is malformed would be skipped by the refresh and keep stale output forever.
    text = TEXTS[page]
    assert len(refresh_docs.BLOCK.findall(text)) == len(refresh_docs.MARKER.findall(text)) == text.count("<!-- output")
    assert text.count("<!-- /output -->") == text.count("<!-- output")


def pasted_outputs(text: str):
    for match in refresh_docs.BLOCK.finditer(text):
        lines = match.group(0).split("\n")
        assert lines[2] == f"$ {match['cmd']}"
        yield match, "\n".join(lines[3:-2])


def test_a_trimmed_output_is_a_cut_of_the_same_commands_whole_output_on_a_page():
    whole = {match["cmd"]: output for text in TEXTS.values() for match, output in pasted_outputs(text)
             if not (match["skip"] or match["head"] or match["tail"])}
    trimmed = [(match, output) for text in TEXTS.values() for match, output in pasted_outputs(text)
               if match["skip"] or match["head"] or match["tail"]]
    assert len(trimmed) >= 3
    for match, output in trimmed:
        assert match["cmd"] in whole, f"no page shows the whole output of: {match['cmd']}"
        cut = refresh_docs.trim(whole[match["cmd"]], *(int(match[n]) if match[n] else None
                                                        for n in ("skip", "head", "tail")))
        assert output == cut, match["cmd"]
        assert "lines trimmed)" in output


def test_trim_cuts_and_says_how_many_lines_it_left_out():
    text = "\n".join(f"line {i}" for i in range(1, 11))
    assert refresh_docs.trim(text) == text
    assert refresh_docs.trim(text, head=2, tail=1) == "line 1\nline 2\n… (7 lines trimmed)\nline 10"
    assert refresh_docs.trim(text, skip=3, head=2) == "… (3 lines trimmed)\nline 4\nline 5\n… (5 lines trimmed)"
    assert refresh_docs.trim(text, head=6, tail=4) == text


def test_a_run_in_a_root_of_its_own_writes_there_and_prints_the_folders_the_command_names(tmp_path):
    command = "mkdir -p /tmp/x-out && echo made /tmp/x-out/a.json && ls /tmp/x-out/.."
    output = refresh_docs.run(command, root=str(tmp_path))
    assert output == "made /tmp/x-out/a.json\nx-out" and (tmp_path / "x-out").is_dir()


def test_the_refresh_pastes_a_commands_output_under_it_and_keeps_the_rest(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- output head=1: printf 'a\\nb\\nc\\n' -->\n```text\nold\n```\n<!-- /output -->\n"
                    "<!-- output: printf 'a\\nb\\nc\\n' -->\n```text\n```\n<!-- /output -->\nafter\n")
    outputs = {}
    refresh_docs.refresh(str(page), outputs)
    assert page.read_text() == (
        "before\n<!-- output head=1: printf 'a\\nb\\nc\\n' -->\n```text\n$ printf 'a\\nb\\nc\\n'\na\n"
        "… (2 lines trimmed)\n```\n<!-- /output -->\n<!-- output: printf 'a\\nb\\nc\\n' -->\n```text\n"
        "$ printf 'a\\nb\\nc\\n'\na\nb\nc\n```\n<!-- /output -->\nafter\n")
    assert list(outputs) == ["printf 'a\\nb\\nc\\n'"]
    # refresh_all writes a page once its commands ran, in the order their --out folders need.
    first, second = tmp_path / "a.md", tmp_path / "b.md"
    first.write_text("<!-- output: echo one -->\n```text\n```\n<!-- /output -->\n")
    second.write_text("<!-- output: echo two -->\n```text\n```\n<!-- /output -->\n")
    refresh_docs.refresh_all([str(first), str(second)])
    assert "$ echo one\none\n" in first.read_text() and "$ echo two\ntwo\n" in second.read_text()


def test_the_refresh_runs_a_command_after_the_one_whose_out_folder_it_reads():
    schedule = "ddplab study --schedule /tmp/x-branched/branched.json --out /tmp/x-schedule"
    branched = "ddplab study --branch-at 0.1 --out /tmp/x-branched"
    later = "ddplab study --out /tmp/x-branched-2"
    assert refresh_docs.in_order([schedule, later, branched]) == [branched, schedule, later]
    assert refresh_docs.in_order([later, schedule]) == [later, schedule]
    # Every page's commands can run in the order the refresh takes.
    ordered = refresh_docs.in_order(refresh_docs.commands_in(PAGES))
    writes: dict[str, int] = {}
    for i, command in enumerate(ordered):
        for match in refresh_docs.OUT_DIR.finditer(command):
            writes.setdefault(match[1], i)
    assert all(writes.get(path, -1) <= i for i, c in enumerate(ordered) for path in refresh_docs.TMP_PATH.findall(c))


# A duration depends on the machine and its load: "942 s", "1.2 ms", "(4.09 s)"; everything else must match.
DURATION = re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|s|min)\b")


def _unclocked(text: str) -> str:
    """``text`` with its durations blanked, and its spacing (a table's padding, a line's wrap) made one space: a
    shorter duration narrows a column or moves a wrap, and changes no figure."""
    return " ".join(re.sub(r"[━─═]+", " ", DURATION.sub("<duration>", text)).split())


README_COMMANDS = [match["cmd"] for match, _ in pasted_outputs(README)]


def test_the_readme_pastes_the_output_of_every_command_it_shows():
    assert len(README_COMMANDS) >= 6 and len(set(README_COMMANDS)) == len(README_COMMANDS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("command", README_COMMANDS, ids=[c.split(" -- ")[0][:40] for c in README_COMMANDS])
def test_the_readmes_pasted_outputs_are_what_the_current_code_prints(tmp_path, command):
    """Each README command run again (one test each, so the suite's workers share them; none reads another's
    folders): its whole pasted output (in the README, or on the page its trimmed block is cut from) is what the
    current code prints, durations aside. A figure left from older code fails here; run ``python
    tools/refresh_docs.py`` after a change that moves one. A command's /tmp folders are this test's own (another run
    of the suite, or a refresh of the docs, may be writing the folders the README names)."""
    whole = {match["cmd"]: output for text in TEXTS.values() for match, output in pasted_outputs(text)
             if not (match["skip"] or match["head"] or match["tail"])}
    fresh = refresh_docs.run(command, root=str(tmp_path))
    assert _unclocked(fresh) == _unclocked(whole[command]), f"stale pasted output of: {command}"
