"""Study engines as values: a new engine is one class and one registration, in this file alone, and the grid trains
on it and the products ask the registry what it is without another change."""

from __future__ import annotations

import dataclasses

import pytest

from ddplab.study import engines, workloads
from ddplab.study.config import StudyConfig, Target
from ddplab.study.engines.registry import EngineKind
from ddplab.study.engines.vmap import VmapEngine
from ddplab.study.grid import training


class OneByOne:
    """Each run of a group on the vmap engine by itself, one after the other (an engine no study needs: it only has
    to be an engine)."""

    name = "one-by-one"
    overhead = 1.0
    per_run = False

    def __init__(self):
        self.vmap, self.groups = VmapEngine(), 0

    def train(self, workload, config, group, progress=None):
        self.groups += 1
        out = []
        for i, run in enumerate(group.runs):
            one = dataclasses.replace(group, runs=(run,), variants=group.variants[i:i + 1],
                                      optimizers=group.optimizers[i:i + 1])
            out += self.vmap.train(workload, config, one)
        if progress:
            progress(config.max_steps)
        return out

    def seconds_per_step(self, workload, config, group):
        return len(group.runs) * self.vmap.seconds_per_step(workload, config, group)


def _branches(workload, config, device, options, launch_config, advance):
    raise AssertionError("no branches in this test")


@pytest.fixture
def one_by_one(monkeypatch):
    kind = EngineKind(name=OneByOne.name, vectorized=False, branches=_branches)
    monkeypatch.setitem(engines.ENGINES, kind.name, kind)
    return OneByOne()


def test_an_engine_registered_in_one_file_trains_the_grid_as_the_vectorized_one(one_by_one):
    workload = workloads.regression(dim=4, n_train=256, n_val=64)
    config = StudyConfig(target=Target(kind="loss", value=0.05), global_batch_sizes=(16, 32), rules=("tuned",),
                         reference_global_batch_size=16, reference_lr=0.05, seeds=2, max_steps=60, dtype="float64")
    alone = training.run_grid(workload, config, None, one_by_one)
    together = training.run_grid(workload, config, None, VmapEngine())
    assert one_by_one.groups >= 2
    # A vectorized group stops the sweep's slow lrs once they cannot win (a group of one never does): the rest agree.
    kept = {(b, r.lr, r.seed): r.steps_to_target for b, runs in together.items() for r in runs if not r.pruned}
    assert len(kept) >= 4 and sum(steps is not None for steps in kept.values()) >= 2
    assert {(b, r.lr, r.seed): r.steps_to_target for b, runs in alone.items() for r in runs
            if (b, r.lr, r.seed) in kept} == kept
    # The products ask the registry what it is, never its name.
    assert not engines.vectorized(one_by_one.name) and engines.vectorized(VmapEngine.name)
    assert list(engines.ENGINES)[-1] == one_by_one.name
