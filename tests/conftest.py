import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from ddplab.runtime.launch import TORCHRUN_VARS


@pytest.fixture(autouse=True)
def _clean_distributed_state():
    """Restore the launcher's environment variables and signal handlers; never leak a process group."""
    saved = {name: os.environ.get(name) for name in TORCHRUN_VARS}
    # torch's elastic agent (elastic_launch in-process) leaves its own SIGINT/SIGTERM handlers behind.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# torch's gloo can abort a rank that exits while one of its worker threads still holds a finished collective's work
# (docs/benchmarks.md, "Teardown"): the process dies of SIGABRT after its last line, whatever it computed. A training
# script run by a test that ends so, and only so, is run once more; any other failure, or a second abort, stands.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def _aborted_at_exit(returncode: int, stderr) -> bool:
    return returncode != 0 and isinstance(stderr, str) and GLOO_EXIT_ABORT in stderr


@pytest.fixture(autouse=True)
def _rerun_a_script_aborted_by_the_gloo_exit_race(monkeypatch):
    run = subprocess.run

    def run_once_more_after_an_exit_abort(*args, **kwargs):
        done = run(*args, **kwargs)
        return run(*args, **kwargs) if _aborted_at_exit(done.returncode, done.stderr) else done

    monkeypatch.setattr(subprocess, "run", run_once_more_after_an_exit_abort)


@pytest.fixture(autouse=True)
def _rerun_a_guest_command_aborted_by_the_gloo_exit_race(monkeypatch):
    """The same rule for a command that ``audit`` or ``noise`` runs: its ranks' output reaches the test's captured
    streams from the run that counts only, and a rerun starts from an empty guest folder."""
    from ddplab.auditor import runner

    run_guest = runner.run_guest

    def run_once_more_after_an_exit_abort(command, out_dir, *args, **kwargs):
        status, out, err = _held(lambda: run_guest(command, out_dir, *args, **kwargs))
        if _aborted_at_exit(status, err.decode(errors="replace")):
            shutil.rmtree(out_dir)
            os.makedirs(out_dir)
            status, out, err = _held(lambda: run_guest(command, out_dir, *args, **kwargs))
        os.write(1, out)
        os.write(2, err)
        return status

    monkeypatch.setattr(runner, "run_guest", run_once_more_after_an_exit_abort)


def _held(run) -> tuple[int, bytes, bytes]:
    """Run with fds 1 and 2 (which the command's processes inherit) sent to files; the status and what they got."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            status = run()
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        out.seek(0)
        err.seek(0)
        return status, out.read(), err.read()
