"""Ranks that ddplab starts or joins leave through one barrier: no abort at exit, and no wait without an end.

A rank that exits the instant its last collective returns can abort in gloo ("terminate called without an
active exception"). `benchmarks/teardown.py` measures how often, per launch path, over many runs
(`docs/benchmarks.md`); these loops are the short version, and the barrier's order and bounds are checked here.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import ddplab
from ddplab.errors import LaunchError
from ddplab.runtime.launch import LaunchConfig, launch
from ddplab.runtime.timescale import scaled

ABORT = "terminate called"


def _last_act_all_reduce(ctx):
    # The shape of the abort first seen: a DDP step, a last collective, rank 1 leaving while rank 0 goes on.
    _one_ddp_step()
    value = torch.ones(1)
    dist.all_reduce(value)
    if ctx.rank == 0:
        time.sleep(0.3)


def _one_ddp_step():
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    model(torch.randn(2, 4)).sum().backward()


def _launch_many(start_method, runs, capfd):
    for run in range(runs):
        launch(_last_act_all_reduce, LaunchConfig(world_size=2, start_method=start_method, pg_timeout_s=scaled(30),
                                                  deadline_s=scaled(60)))
        # The ranks write to this process's file descriptor 2.
        assert ABORT not in capfd.readouterr().err, f"run {run} aborted at exit"


@pytest.mark.timeout(60)
def test_forked_ranks_leave_cleanly_right_after_their_last_collective(capfd):
    _launch_many("fork", 6, capfd)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spawned_ranks_leave_cleanly_right_after_their_last_collective(capfd):
    # A spawned rank finalizes its interpreter at exit, where the abort happens.
    _launch_many("spawn", 2, capfd)


_JOINS_TORCHRUN = """
import time

import torch
import torch.distributed as dist
from ddplab.runtime.launch import LaunchConfig, launch
from ddplab.runtime.timescale import scaled

def last_act_all_reduce(ctx):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    model(torch.randn(2, 4)).sum().backward()
    del model
    value = torch.ones(1)
    dist.all_reduce(value)
    if ctx.rank == 0:
        time.sleep(0.3)

launch(last_act_all_reduce, LaunchConfig(pg_timeout_s=30))
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_that_join_torchrun_leave_cleanly_right_after_their_last_collective(tmp_path):
    script = tmp_path / "joins_torchrun.py"
    script.write_text(_JOINS_TORCHRUN)
    src = os.path.dirname(os.path.dirname(ddplab.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    for run in range(2):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               str(script)], env=env, capture_output=True, text=True, timeout=scaled(120))
        assert done.returncode == 0 and ABORT not in done.stderr, f"run {run}:\n{done.stderr[-2000:]}"


def _timed_destroy(out):
    """A destroy_process_group that first writes when this rank called it (forked ranks inherit it)."""
    real = dist.destroy_process_group

    def destroy(*args, **kwargs):
        with open(os.path.join(out, f"destroyed-{dist.get_rank()}"), "w") as fh:
            fh.write(repr(time.time()))
        return real(*args, **kwargs)

    return destroy


def _rank_one_returns_late(ctx, out, delay_s):
    dist.all_reduce(torch.ones(1))
    if ctx.rank == 1:
        time.sleep(delay_s)
        with open(os.path.join(out, "returned-1"), "w") as fh:
            fh.write(repr(time.time()))
    return ctx.rank


@pytest.mark.timeout(60)
def test_no_rank_destroys_the_group_before_every_rank_returned(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "destroy_process_group", _timed_destroy(str(tmp_path)))
    config = LaunchConfig(world_size=2, pg_timeout_s=scaled(30))
    assert launch(_rank_one_returns_late, config, str(tmp_path), 1.0) == [0, 1]
    returned = float((tmp_path / "returned-1").read_text())
    # Rank 0 returned a second earlier, and waited for rank 1 at the barrier.
    assert float((tmp_path / "destroyed-0").read_text()) >= returned
    assert float((tmp_path / "destroyed-1").read_text()) >= returned


@pytest.mark.timeout(60)
def test_the_barrier_gives_up_after_the_collective_timeout(tmp_path, monkeypatch):
    # Rank 0 returns only once rank 1 has left, past the 1.5 s timeout: rank 1 leaves without it, and nothing hangs.
    monkeypatch.setattr(dist, "destroy_process_group", _timed_destroy(str(tmp_path)))
    assert launch(_rank_zero_returns_late, LaunchConfig(world_size=2, pg_timeout_s=1.5), str(tmp_path)) == [0, 1]
    left, destroyed = (float((tmp_path / name).read_text()) for name in ("returned-1", "destroyed-1"))
    assert destroyed < float((tmp_path / "returned-0").read_text())
    # Timed from rank 1's own return, so starting the ranks on a loaded machine is not counted.
    assert 1.5 <= destroyed - left < scaled(15)


def _rank_zero_returns_late(ctx, out):
    dist.all_reduce(torch.ones(1))
    if ctx.rank == 1:
        with open(os.path.join(out, "returned-1"), "w") as fh:
            fh.write(repr(time.time()))
    if ctx.rank == 0:
        # Until rank 1 has given up at the barrier and destroyed the group (at most a generous while: a barrier
        # that never gives up fails the test, not hangs it).
        end = time.monotonic() + scaled(60)
        while not os.path.exists(os.path.join(out, "destroyed-1")) and time.monotonic() < end:
            time.sleep(0.05)
        with open(os.path.join(out, "returned-0"), "w") as fh:
            fh.write(repr(time.time()))
    return ctx.rank


def _raise_on_rank_one_after_a_collective(ctx):
    dist.all_reduce(torch.ones(1))
    if ctx.rank == 1:
        raise ValueError("boom at the end")


@pytest.mark.timeout(60)
def test_a_rank_whose_peer_failed_is_not_held_at_the_barrier():
    started, timeout_s = time.monotonic(), scaled(30)
    with pytest.raises(LaunchError, match="boom at the end") as info:
        launch(_raise_on_rank_one_after_a_collective, LaunchConfig(world_size=2, pg_timeout_s=timeout_s))
    # Held at the barrier, it would have left only after the collective timeout.
    assert info.value.rank == 1 and time.monotonic() - started < timeout_s


def _rank_one_returns_at_once(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))


@pytest.mark.timeout(60)
def test_a_rank_waiting_at_the_leaving_barrier_is_said_to_have_returned():
    # Rank 1 returned and waits at the leaving barrier while rank 0 times out in a collective rank 1 never joined.
    with pytest.raises(LaunchError, match="rank 1 stopped answering") as info:
        launch(_rank_one_returns_at_once, LaunchConfig(world_size=2, pg_timeout_s=2))
    assert "rank 1 had returned without joining that collective" in str(info.value)
