"""Where a command study's runs start: each executor's module registers itself when it is imported."""

# ruff: noqa: I001
from ddplab.study.command.executors import local, ray_tasks, slurm_jobs  # noqa: F401
from ddplab.study.command.executors.registry import EXECUTORS, Executor, Listener, build

__all__ = ["EXECUTORS", "Executor", "Listener", "build"]
