"""The README as a new user reads it: its Python runs as written, its commands name files that exist."""

import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md")) as fh:
    README = fh.read()


def test_every_python_block_marked_runnable_runs_and_prints_what_its_comment_says():
    blocks = re.findall(r"<!-- python -->\n```python\n(.*?)```", README, re.S)
    assert blocks
    for code in blocks:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        promised = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")]
        assert done.stdout.split("\n")[:len(promised)] == promised


def test_the_two_commands_come_first_and_ci_runs_the_test_command():
    head = README[:README.index("## One vocabulary")]
    demo, tests = re.findall(r"```bash\n(.*?)\n```", head)
    assert "python3 -m venv .venv " in demo and ".venv/bin/ddplab sandbox table" in demo
    assert "<!-- test-command -->" in head and "python3 -m venv .venv-test " in tests and "pytest" in tests
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        assert "<!-- test-command -->" in fh.read()


def test_every_quoted_command_names_files_that_exist():
    commands = re.findall(r"<!-- output: (.+?) -->", README)
    assert len(commands) > 15
    for command in commands:
        for word in shlex.split(command):
            if word.endswith(".py") or word.startswith(("tests/", "examples/")):
                assert os.path.exists(os.path.join(ROOT, word)), f"{word} in: {command}"
