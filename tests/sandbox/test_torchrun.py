"""Under torchrun's elastic agent, ddplab joins the launcher's process group instead of forking."""

import uuid

import pytest
from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
from torch.distributed.launcher.api import elastic_launch


def _sandbox_under_torchrun():
    import os

    from ddplab.runtime.launch import LaunchConfig, under_torchrun
    from ddplab.sandbox import train as sandbox
    from ddplab.sandbox.config import SandboxConfig

    assert under_torchrun()
    cfg = SandboxConfig(mode="multi", per_device_batch_size=16, world_size=int(os.environ["WORLD_SIZE"]),
                                deterministic=False, n_experiments=50, seed=5)
    result = sandbox.run(cfg, LaunchConfig(world_size=cfg.world_size))
    return None if result is None else (result.w, result.allreduces, result.config.world_size)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sandbox_joins_the_torchrun_group():
    config = ElasticConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                           rdzv_endpoint="localhost:0", run_id=uuid.uuid4().hex, max_restarts=0,
                           monitor_interval=0.1, start_method="spawn")
    results = elastic_launch(config, _sandbox_under_torchrun)()
    assert results[1] is None  # only rank 0 reports
    w, allreduces, world_size = results[0]
    from ddplab.sandbox import train as sandbox
    from ddplab.sandbox.config import SandboxConfig

    single = sandbox.train(SandboxConfig(mode="single", per_device_batch_size=32, deterministic=False,
                                                 n_experiments=50, seed=5))
    assert world_size == 2 and allreduces == 8
    assert w == pytest.approx(single.w, abs=1e-6)
