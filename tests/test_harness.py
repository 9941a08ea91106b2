"""The test harness's one rerun (tests/conftest.py): only a command that gloo aborted at exit runs again, and only
the run that counts reaches the test's output."""

import sys

from ddplab.cli.main import main

# First run: the gloo abort's words on stderr and a failing exit; a second run succeeds.
ABORTS_ONCE = """
import os, sys
marker = sys.argv[1]
first = not os.path.exists(marker)
open(marker, "a").write("run\\n")
print("first" if first else "second")
if first:
    sys.stderr.write("terminate called without an active exception\\n")
    sys.exit(1)
"""


def test_a_guest_command_aborted_at_exit_runs_once_more_and_only_its_last_output_is_seen(tmp_path, capfd):
    marker = tmp_path / "runs"
    assert main(["audit", "--", sys.executable, "-c", ABORTS_ONCE, str(marker)]) == 0
    assert marker.read_text() == "run\nrun\n"
    out, err = capfd.readouterr()
    assert out == "second\n" and "terminate called" not in err


def test_any_other_failure_stands(tmp_path, capfd):
    marker = tmp_path / "runs"
    failing = ABORTS_ONCE.replace("terminate called without an active exception", "a real error")
    assert main(["audit", "--", sys.executable, "-c", failing, str(marker)]) == 1
    assert marker.read_text() == "run\n"
    out, err = capfd.readouterr()
    assert out == "first\n" and "a real error" in err
