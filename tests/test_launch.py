"""The launch layer: failures end the run quickly and name the rank; nothing hangs."""

import time

import pytest
import torch
import torch.distributed as dist

from ddplab.launch import LaunchConfig, LaunchError, launch


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
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


def _sleep_forever(ctx):
    time.sleep(600)


def test_results_come_back_in_rank_order_with_one_thread_each():
    results = launch(_report, LaunchConfig(world_size=3))
    assert results == [(r, 3, "gloo", 3.0, 1) for r in range(3)]


def test_a_rank_that_raises_ends_the_run_and_is_named():
    started = time.monotonic()
    with pytest.raises(LaunchError, match="boom from the test") as info:
        launch(_raise_on_rank_one, LaunchConfig(world_size=2, pg_timeout_s=30))
    assert info.value.rank == 1
    assert "rank 1 raised" in str(info.value)
    assert time.monotonic() - started < 20


def test_a_collective_that_never_completes_times_out():
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_rank_one_never_joins, LaunchConfig(world_size=2, pg_timeout_s=2))
    assert info.value.rank == 1
    assert time.monotonic() - started < 30


def test_ranks_past_the_deadline_are_killed():
    started = time.monotonic()
    with pytest.raises(LaunchError, match="deadline"):
        launch(_sleep_forever, LaunchConfig(world_size=2, deadline_s=1.5))
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("kwargs", [dict(world_size=0), dict(world_size=2, backend="mpi"), dict(world_size=2, deadline_s=0)])
def test_bad_launch_config_is_rejected(kwargs):
    with pytest.raises(ValueError):
        LaunchConfig(**kwargs)


def _killed_by_signal(ctx):
    import os
    import signal

    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_a_signal_ends_the_run_and_is_named():
    started = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 died.*SIGKILL") as info:
        launch(_killed_by_signal, LaunchConfig(world_size=2, pg_timeout_s=30))
    assert info.value.rank == 1
    assert time.monotonic() - started < 20
