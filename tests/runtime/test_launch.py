"""The launch layer: failures end the run quickly and name the rank; nothing hangs."""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ddplab
from ddplab.cli.main import build_parser, main
from ddplab.cli.options import launch_config
from ddplab.errors import LaunchError, UsageError
from ddplab.runtime.deadline import Deadline
from ddplab.runtime.launch import LaunchConfig, launch
from ddplab.runtime.timescale import scaled


def _report(ctx):
    value = torch.tensor([float(ctx.rank)])
    dist.all_reduce(value)
    return ctx.rank, ctx.world_size, ctx.backend, value.item(), torch.get_num_threads()


def _raise_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from the test")
    dist.barrier()


def _rank_one_never_joins(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def _sleep_forever(ctx):
    time.sleep(600)


def test_results_come_back_in_rank_order_with_one_thread_each():
    results = launch(_report, LaunchConfig(world_size=3))
    assert results == [(r, 3, "gloo", 3.0, 1) for r in range(3)]


def test_a_rank_that_raises_ends_the_run_and_is_named():
    started, timeout_s = time.monotonic(), scaled(30)
    with pytest.raises(LaunchError, match="boom from the test") as info:
        launch(_raise_on_rank_one, LaunchConfig(world_size=2, pg_timeout_s=timeout_s))
    assert info.value.rank == 1
    assert "rank 1 raised" in str(info.value)
    # Ended by the failure itself: no collective had the time to time out.
    assert time.monotonic() - started < timeout_s


def test_a_collective_that_never_completes_times_out():
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_rank_one_never_joins, LaunchConfig(world_size=2, pg_timeout_s=2))
    assert info.value.rank == 1
    assert time.monotonic() - started < scaled(30)


def test_ranks_past_the_deadline_are_killed():
    started = time.monotonic()
    with pytest.raises(LaunchError, match="deadline"):
        launch(_sleep_forever, LaunchConfig(world_size=2, deadline_s=1.5))
    assert time.monotonic() - started < scaled(10)


@pytest.mark.parametrize("kwargs", [dict(world_size=0), dict(world_size=2, backend="mpi"),
                                    dict(world_size=2, deadline_s=0)])
def test_bad_launch_config_is_rejected(kwargs):
    with pytest.raises(UsageError):
        LaunchConfig(**kwargs)


def _killed_by_signal(ctx):
    import os
    import signal

    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_a_signal_ends_the_run_and_is_named():
    started, timeout_s = time.monotonic(), scaled(30)
    with pytest.raises(LaunchError, match="rank 1 died.*SIGKILL") as info:
        launch(_killed_by_signal, LaunchConfig(world_size=2, pg_timeout_s=timeout_s))
    assert info.value.rank == 1
    assert time.monotonic() - started < timeout_s


def _publish_then_hang(ctx):
    for step in range(1, 4):
        ctx.checkpoint({"rank": ctx.rank, "step": step})
    dist.barrier()
    time.sleep(600)


def test_the_deadline_keeps_the_ranks_partial_results():
    with pytest.raises(LaunchError, match="deadline") as info:
        # The deadline passes once both ranks have published, however long starting them took here.
        launch(_publish_then_hang, LaunchConfig(world_size=2, deadline_s=scaled(4)))
    assert info.value.partial == {0: {"rank": 0, "step": 3}, 1: {"rank": 1, "step": 3}}


def _rank_two_hangs_in_loss(ctx):
    if ctx.rank == 2:
        _slow_loss()
    dist.all_reduce(torch.ones(1))


def _slow_loss():
    time.sleep(600)


def test_the_rank_that_never_reaches_the_collective_is_named_with_where_it_hangs():
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_rank_two_hangs_in_loss, LaunchConfig(world_size=3, pg_timeout_s=3))
    message = str(info.value)
    assert info.value.rank == 2
    assert message.startswith("rank 2 stopped answering: ranks 0, 1 waited in a collective")
    assert "in _slow_loss" in message
    assert time.monotonic() - started < scaled(30)


def _rank_one_returns_early(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))


def test_a_rank_that_skips_a_collective_is_named():
    with pytest.raises(LaunchError, match="rank 1 stopped answering") as info:
        launch(_rank_one_returns_early, LaunchConfig(world_size=2, pg_timeout_s=2))
    assert info.value.rank == 1


def test_forking_after_cuda_was_initialised_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(UsageError, match="CUDA is already initialised in this process"):
        launch(_report, LaunchConfig(world_size=2))
    assert list(tmp_path.iterdir()) == []


# --- cancellation: the parent is signalled from outside, as a job runner would ---

_SLEEPING_LAUNCH = """
import os, sys, time
from ddplab.runtime.deadline import Deadline
from ddplab.runtime.launch import LaunchConfig, launch

def sleeper(ctx, out):
    with open(os.path.join(out, f"pid-{ctx.rank}.tmp"), "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid-{ctx.rank}.tmp"), os.path.join(out, f"pid-{ctx.rank}"))
    time.sleep(600)

launch(sleeper, LaunchConfig(world_size=2), sys.argv[1])
"""


def _alive(pid: int) -> bool:
    # A zombie has ended; only init may be left to reap it.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_sleeping_launch(tmp_path):
    script, out, tmp = tmp_path / "job.py", tmp_path / "out", tmp_path / "tmp"
    script.write_text(_SLEEPING_LAUNCH)
    out.mkdir()
    tmp.mkdir()
    src = os.path.dirname(os.path.dirname(ddplab.__file__))
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    # SIGINT ignored by inheritance, as under nohup or in a CI job.
    parent = subprocess.Popen([sys.executable, str(script), str(out)], env=env,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + scaled(60)
    while not all((out / f"pid-{r}").exists() for r in range(2)):
        assert parent.poll() is None and time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    ranks = [int((out / f"pid-{r}").read_text()) for r in range(2)]
    assert len(list(tmp.glob("ddplab-launch-*"))) == 1
    return parent, ranks, tmp


def _wait_until_gone(pids, seconds):
    end = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_to_the_parent_ends_every_rank_and_removes_the_launch_directory(tmp_path):
    parent, ranks, tmp = _start_sleeping_launch(tmp_path)
    parent.send_signal(signal.SIGTERM)
    # Ended by the signal it got, as if it had never caught it (a shell shows exit status 143).
    assert parent.wait(timeout=scaled(10)) == -signal.SIGTERM
    assert _wait_until_gone(ranks, scaled(5)) == []
    assert list(tmp.glob("ddplab-launch-*")) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_to_the_parent_ends_every_rank(tmp_path):
    parent, ranks, _ = _start_sleeping_launch(tmp_path)
    parent.kill()
    parent.wait(timeout=scaled(10))
    # Nothing can remove the launch directory after a SIGKILL, but no rank outlives the parent.
    assert _wait_until_gone(ranks, scaled(5)) == []


_MANY_RANKS = """
import os, sys, time
from ddplab.runtime.deadline import Deadline
from ddplab.runtime.launch import LaunchConfig, launch

def sleeper(ctx, out):
    open(os.path.join(out, f"pid-{ctx.rank}"), "w").write(str(os.getpid()))
    time.sleep(600)

launch(sleeper, LaunchConfig(world_size=int(sys.argv[2])), sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_while_ranks_are_being_started_stops_everything_at_once(tmp_path):
    script, out = tmp_path / "many.py", tmp_path / "out"
    script.write_text(_MANY_RANKS)
    out.mkdir()
    src = os.path.dirname(os.path.dirname(ddplab.__file__))
    path = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    started = time.monotonic()
    parent = subprocess.Popen([sys.executable, str(script), str(out), "64"],
                              env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": path})
    while len(list(out.iterdir())) < 3:  # the first ranks are up; the others are still being forked
        assert parent.poll() is None and time.monotonic() < started + scaled(60)
        time.sleep(0.01)
    parent.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert parent.wait(timeout=scaled(60)) == -signal.SIGTERM
    # "At once" measured against this machine as it is now: stopping takes less than starting the parent and its
    # first three ranks did, not the time the other 61 would take.
    assert time.monotonic() - signalled < max(scaled(2.0), signalled - started)
    ranks = [int(path.read_text()) for path in out.iterdir() if path.read_text()]
    assert _wait_until_gone(ranks, scaled(30)) == [] and list(tmp_path.glob("ddplab-launch-*")) == []


# --- the launch flags, and a command that keeps what it measured ---

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("argv", [["sandbox", "multi"], ["sandbox", "table"], ["check", "s.py", "--batch-size", "2"],
                                  ["noise", "s.py", "--batch-size", "2"]])
def test_every_command_that_starts_ranks_takes_the_launch_flags(argv):
    args = build_parser().parse_args([*argv, "--timeout", "5", "--deadline", "7.5"])
    assert launch_config(args) == LaunchConfig(pg_timeout_s=5, deadline_s=7.5)
    defaults = build_parser().parse_args(argv)
    assert launch_config(defaults) == LaunchConfig()
    assert launch_config(defaults).for_ranks(2) == LaunchConfig(world_size=2)


def test_a_zero_timeout_is_refused_with_one_sentence(capsys):
    # Validated once, by LaunchConfig, in its own words; the command line shows the field as its flag.
    assert main(["check", "s.py", "--batch-size", "2", "--timeout", "0"]) == 2
    assert capsys.readouterr().err == "ddplab: error: --timeout must be a positive number, got 0.0\n"
    with pytest.raises(UsageError, match=r"^pg_timeout_s must be a positive number"):
        LaunchConfig(pg_timeout_s=0)


def test_the_deadline_bounds_the_commands_own_work_too():
    # A block in this process is woken even from a blocking sleep, and said to be past the deadline.
    deadline = Deadline(0.5)
    start = time.monotonic()
    with pytest.raises(LaunchError, match="a hung dataset was still running after the 0.5 s deadline") as info:
        with deadline.guard("a hung dataset"):
            time.sleep(30)
    assert info.value.kind == "deadline" and time.monotonic() - start < scaled(5)
    # The launch after it gets only what is left; with nothing left it never starts.
    with pytest.raises(LaunchError, match="the ranks never started after the 0.5 s deadline"):
        deadline.for_launch(LaunchConfig(world_size=2))
    before = time.monotonic()
    roomy = Deadline(60)
    with roomy.guard("quick work"):
        pass
    left = roomy.for_launch(LaunchConfig(world_size=2)).deadline_s
    assert 60 - (time.monotonic() - before) <= left <= 60
    assert Deadline.of(LaunchConfig()).for_launch(LaunchConfig()) == LaunchConfig()
    # Ctrl-C inside the block stays Ctrl-C, and the disarmed alarm never fires later.
    with pytest.raises(KeyboardInterrupt):
        with Deadline(0.5).guard("work"):
            raise KeyboardInterrupt
    time.sleep(0.8)


@pytest.mark.timeout(60)
def test_check_past_its_deadline_in_the_spec_stops(tmp_path, capsys):
    spec = tmp_path / "slow_spec.py"
    spec.write_text(open(os.path.join(ROOT, "tests", "specs", "correct.py")).read().replace(
        "def dataset():\n", "def dataset():\n    import time\n    time.sleep(600)\n"))
    start = time.monotonic()
    assert main(["check", str(spec), "--batch-size", "8", "--world-size", "2", "--deadline", "2"]) == 1
    err = capsys.readouterr().err
    assert "loading the spec (its model() and dataset()) was still running after the 2 s deadline" in err
    assert time.monotonic() - start < scaled(20)


def _say_pid_then_sleep(ctx, out):
    with open(os.path.join(out, f"pid-{ctx.rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)


@pytest.mark.timeout(60)
def test_the_callers_sigterm_handler_runs_once_the_ranks_are_stopped(tmp_path, monkeypatch):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    # torch makes its compile cache in the temp folder the first time a process asks (here, when run alone).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    pid_files = [out / f"pid-{r}" for r in range(2)]

    def ranks():
        return [int(path.read_text()) for path in pid_files if path.exists() and path.read_text()]

    seen = []

    def callers_handler(signum, frame):
        seen.append((signum, [pid for pid in ranks() if _alive(pid)], list(tmp.iterdir())))

    def signal_when_started():
        while len(ranks()) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:
        threading.Thread(target=signal_when_started, daemon=True).start()
        with pytest.raises(LaunchError, match="cancelled by SIGTERM"):
            launch(_say_pid_then_sleep, LaunchConfig(world_size=2), str(out))
        assert signal.getsignal(signal.SIGTERM) is callers_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    # Delivered once, after every rank ended and the launch directory was gone.
    assert seen == [(signal.SIGTERM, [], [])]


def test_a_driver_whose_own_sigterm_handler_returns_gets_cancelled_after_it_ran_once():
    """``ddplab study -- COMMAND`` unwinds on SIGTERM to stop its runs; a caller's handler that returns leaves it no
    result, so the unwinding goes on to the caller."""
    from ddplab.runtime.signals import Cancelled, RaiseOnSignals

    seen = []

    def callers_handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:
        with pytest.raises(Cancelled):
            with RaiseOnSignals():
                signal.raise_signal(signal.SIGTERM)
                time.sleep(5)  # not reached: the handler raises at once
        assert signal.getsignal(signal.SIGTERM) is callers_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]


def test_the_time_scale_is_one_factor_of_at_least_one(monkeypatch):
    from ddplab.runtime import timescale

    for value, factor in (("3.5", 3.5), ("0.2", 1.0), ("nan", 1.0), ("slow", 1.0)):
        monkeypatch.setenv(timescale.ENV, value)
        assert timescale.factor() == factor and timescale.scaled(2.0) == 2.0 * factor
    monkeypatch.delenv(timescale.ENV)
    assert timescale.scaled(10.0) == 10.0
