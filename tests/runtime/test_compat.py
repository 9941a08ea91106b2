"""torch's private APIs behind fallbacks, and specs and workloads that cross a spawn."""

import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddplab.runtime import compat
from ddplab.runtime.launch import LaunchConfig, launch
from ddplab.runtime.timescale import scaled

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specs")


def test_each_private_api_has_a_fallback(monkeypatch):
    import torch.distributed.distributed_c10d as c10d
    import torch.multiprocessing

    # Without torch's helper, the same prctl through libc (the test process keeps SIGKILL-on-parent-death off).
    monkeypatch.delattr(torch.multiprocessing, "_prctl_pr_set_pdeathsig", raising=False)
    if hasattr(signal, "SIGKILL") and os.uname().sysname == "Linux":
        assert compat.set_parent_death_signal(0) is True
    monkeypatch.delattr(c10d, "_get_default_store")
    assert compat.default_store() is None
    monkeypatch.delattr(c10d, "_world")
    assert compat.collectives_issued() is None
    monkeypatch.delattr(torch.autograd.Variable, "_execution_engine")
    assert compat.queue_backward_callback(lambda: None) is False
    compat._init_takes_device_id.cache_clear()
    monkeypatch.setattr(dist, "init_process_group", lambda backend, store=None, rank=-1, world_size=-1,
                        timeout=None: None)
    assert compat.init_process_group_kwargs(torch.device("cpu")) == {}
    compat._init_takes_device_id.cache_clear()


def _audited_accumulation_without_backward_callbacks(ctx, sync_every_micro_step):
    """Accumulation audited on a torch that cannot report the end of a backward pass."""
    import ddplab
    from ddplab.runtime import compat as rank_compat

    rank_compat.queue_backward_callback = lambda callback: False
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    handle = ddplab.audit(ddp, steps=3)
    generator = torch.Generator().manual_seed(ctx.rank)
    for _ in range(3):
        optimizer.zero_grad()
        for micro in range(2):
            x = torch.randn(8, 4, generator=generator)
            quiet = micro == 0 and not sync_every_micro_step
            with ddp.no_sync() if quiet else torch.enable_grad():
                (torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True)) / 2).backward()
        optimizer.step()
    collectives = compat.collectives_issued()
    return {f.code for f in handle.report(timeout=scaled(30)).problems}, handle.steps, collectives


@pytest.mark.parametrize("sync_every_micro_step, expected", [(False, set()), (True, {"ACCUMULATION_SYNCS_EVERY_STEP"})])
def test_the_audit_holds_without_backward_callbacks(sync_every_micro_step, expected):
    for problems, steps, collectives in launch(_audited_accumulation_without_backward_callbacks,
                                               LaunchConfig(world_size=2), sync_every_micro_step):
        assert problems == expected and steps == 3 and collectives >= 3


class _Marker:
    """Stands in for anything a rank returns that the parent must unpickle."""


def _load_spec_and_return_its_object(ctx, path):
    from ddplab.runtime.spec import load_spec, spec_module

    spec = load_spec(path)
    return spec_module(spec).Batch(ctx.rank)


def test_a_spec_loads_as_the_same_module_in_spawned_ranks(tmp_path):
    from ddplab.runtime.spec import load_spec, module_name

    path = tmp_path / "spec_with_a_class.py"
    with open(os.path.join(SPECS, "correct.py")) as fh:
        path.write_text(fh.read() + "\n\nclass Batch:\n    def __init__(self, rank):\n        self.rank = rank\n")
    load_spec(str(path))
    # Spawned ranks start with a fresh hash seed: the module's name comes from a digest of its path.
    results = launch(_load_spec_and_return_its_object, LaunchConfig(world_size=2, start_method="spawn"), str(path))
    assert [type(r).__module__ for r in results] == [module_name(str(path))] * 2
    assert [r.rank for r in results] == [0, 1]


@pytest.mark.timeout(120)
def test_verify_ddp_rebuilds_its_workload_in_spawned_ranks():
    from ddplab.study import workloads
    from ddplab.study.config import StudyConfig, Target
    from ddplab.study.grid import verify

    for workload in (workloads.regression(dim=4, n_train=256, n_val=64),
                     workloads.from_spec(os.path.join(SPECS, "study_eval.py"))):
        config = StudyConfig(target=Target(kind="loss", value=1e-3), global_batch_sizes=(16, 32), seeds=1,
                             dtype="float64")
        # Spawned ranks, as NCCL ranks are: the workload travels as its source, never as closures.
        result = verify.verify_ddp(workload, config, 2, world_size=2, steps=5,
                                   launch_config=LaunchConfig(start_method="spawn"))
        assert len(result.points) == 2 and result.max_abs_diff < 1e-12
