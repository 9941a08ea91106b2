"""DeepSpeed's CPU communication op, compiled (or found in the suite's cache, tests/conftest.py) once per test module
of this folder, before any test's own bound starts: the first build takes about 3 minutes here."""

import os
import subprocess
import sys

import pytest

import ddplab
from ddplab.runtime import timescale

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ddplab.__file__)))
COMPILE_S = 900


@pytest.fixture(scope="module", autouse=True)
def _compiled_op():
    """One tiny initialisation on one rank; a second test process waits on the first one's build lock."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           "compile_op.py"], cwd=CORPUS, env=env, capture_output=True, text=True,
                          timeout=timescale.scaled(COMPILE_S))
    assert done.returncode == 0, done.stderr[-3000:]
