import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

_import_began = time.perf_counter()
import torch  # noqa: E402  (timed: how slow this machine is now)

TORCH_IMPORT_S = time.perf_counter() - _import_began
"""How long ``import torch`` took in this process (about 0 where a plugin imported it first)."""
QUICK_TORCH_IMPORT_S = 2.0
"""``import torch`` on a quick, idle machine: the machine a bound of this suite is written for."""

from ddplab.runtime import timescale  # noqa: E402

# pytest-xdist runs one worker per core, and a test's own computing (a study group, torch.optim alone) in small ops:
# a second intra-op thread per worker only oversubscribes the cores, and under load its spinning waits made one such
# test 10x slower. The processes a test starts choose their own threads, as they would for a user.
torch.set_num_threads(1)

# A process a test starts computes with the CPU kernels this one does (``ddplab study`` fixes its own unless these
# say otherwise: ddplab.study.kernels), so a test may compare its numbers with this process's to the last bit.
os.environ.setdefault("ATEN_CPU_CAPABILITY", torch.backends.cpu.get_cpu_capability().lower())
os.environ.setdefault("MKL_CBWR", "AUTO")


def _extensions_dir() -> str:
    """Where DeepSpeed's CPU op is built (2-3 minutes) and found again: a cache outside the clone, one folder per
    torch and DeepSpeed version and per interpreter (torch rebuilds an op built against another one's headers), so
    a fresh clone whose virtualenv stands where the last one stood builds nothing."""
    import hashlib
    import importlib.metadata

    try:
        deepspeed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed = "none"
    where = hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ddplab-tests", f"torch-{torch.__version__}-deepspeed-{deepspeed}-{where}")


os.environ.setdefault("TORCH_EXTENSIONS_DIR", _extensions_dir())
from ddplab.runtime.launch import TORCHRUN_VARS  # noqa: E402


def _time_scale() -> float:
    """How many times longer than a quick machine this one may take: DDPLAB_TIME_SCALE where CI sets it, else from
    how long ``import torch`` took here (never below 1). Every bound the suite waits with is its usual value times
    this; the waits themselves end on events (a file, a line, a process's exit), so a bound only decides how long a
    test that hangs takes to fail."""
    if timescale.ENV in os.environ:
        return timescale.factor()
    return max(1.0, round(TORCH_IMPORT_S / QUICK_TORCH_IMPORT_S, 1))


# A suite started in the background (`cmd &` in a script, nohup, some CI runners) inherits SIGINT ignored, and so
# would every command a test interrupts with it: each process of the suite takes Ctrl-C as a foreground run does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SESSION_TIME_SCALE = _time_scale()
"""The factor the session starts with; each test raises it to the load it starts under (:func:`_scale_now`)."""
os.environ[timescale.ENV] = str(SESSION_TIME_SCALE)


def _scale_now() -> float:
    """The session's factor, or more where more processes now want each core than there are cores: ``import torch``
    at the start cannot see load that comes later, and a bound set from it alone failed tests that a rising load
    had made 6x slower (three suites at once, docs/benchmarks.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(SESSION_TIME_SCALE, round(os.getloadavg()[0] / cores, 1))


def pytest_report_header(config):
    return (f"DDPLAB_TIME_SCALE={SESSION_TIME_SCALE} (import torch took {TORCH_IMPORT_S:.1f} s), raised at each "
            f"test's start to the load per core then")


_BASE_TIMEOUT = pytest.StashKey[float]()


def pytest_collection_modifyitems(config, items):
    """Keep each test's pytest-timeout bound (its marker's, else the ini's): its start scales it."""
    default = getattr(config, "_env_timeout", None)
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = marker.args[0] if marker is not None and marker.args else default
        if seconds:
            item.stash[_BASE_TIMEOUT] = seconds


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item):
    """Before pytest-timeout arms its timer: the factor this test, ddplab and every process it starts read, and
    its timeout, both from the load the test starts under."""
    scale = _scale_now()
    os.environ[timescale.ENV] = str(scale)
    if _BASE_TIMEOUT in item.stash:
        item.add_marker(pytest.mark.timeout(item.stash[_BASE_TIMEOUT] * scale), append=False)
    yield


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
    from ddplab.guest import runner

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
