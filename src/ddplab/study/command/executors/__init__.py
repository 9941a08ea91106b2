"""Where a command study's runs start: :mod:`~ddplab.study.command.executors.registry` names each executor's
module, imported when a study builds it."""

from ddplab.study.command.executors.registry import EXECUTORS, Executor, Listener, build

__all__ = ["EXECUTORS", "Executor", "Listener", "build"]
