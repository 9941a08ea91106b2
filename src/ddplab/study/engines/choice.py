"""The one chooser of what trains a study's runs, for the grid and for the branches alike: the engine asked for
or the one the workload, the strategy and torchrun allow, with the reason in words; and the engine built on its
device.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from ddplab.errors import UsageError, literal
from ddplab.runtime import strategies
from ddplab.runtime.launch import LaunchConfig, world_size_for
from ddplab.runtime.launch_config import under_torchrun
from ddplab.study.config import StudyConfig, StudyOptions
from ddplab.study.engines.base import Engine
from ddplab.study.engines.ddp import DdpEngine
from ddplab.study.engines.fastest import Fastest
from ddplab.study.engines.vmap import VmapEngine
from ddplab.study.rules import registry
from ddplab.study.workloads import Workload

BranchEngine = Literal["vmap", "ddp"]


def engine_for(workload: Workload, options: StudyOptions) -> tuple[BranchEngine, str]:
    """(engine, why): vectorized where the spec allows it and nothing asks for ranks, else on real ranks."""
    ranks = _needs_ranks(workload, options)
    if options.engine == "ddp":
        return "ddp", "asked for"
    if ranks and options.engine == "vmap":
        raise UsageError(f"{{engine}} vmap cannot train these branches: {ranks}; use {{engine}} ddp (or auto)")
    if ranks:
        return "ddp", ranks
    return "vmap", ("asked for" if options.engine == "vmap" else
                    "the model and optimizer vectorize: every run of a batch trains at once in this process")


def _needs_ranks(workload: Workload, options: StudyOptions) -> str:
    """Why the branches must train on ranks ('' when nothing says so)."""
    if under_torchrun():
        return "under torchrun the branches train across the job's ranks"
    if not options.wraps_in_ddp:
        return f"the {options.strategy} strategy wraps the model on ranks"
    if workload.not_vectorized:
        return f"the spec cannot be vectorized: {workload.not_vectorized}"
    return ""


def choose_engine(workload: Workload, config: StudyConfig, options: StudyOptions) -> tuple[str, str]:
    """(engine, why): what trains the grid, and the reason in words. ``auto`` is a fixed choice (vmap wherever it can
    train the grid), never a timing, so the same command gives the same numbers on any machine and under any load."""
    if options.engine == "vmap" or (options.engine in ("auto", "fastest") and not workload.not_vectorized
                                    and not under_torchrun() and options.wraps_in_ddp):
        if not options.wraps_in_ddp:
            raise UsageError(f"{{strategy}} {options.strategy} wraps the model on ranks, which only the DDP engine "
                             "starts: use {engine} ddp (or auto)")
        if workload.not_vectorized:
            raise UsageError(f"{{engine}} vmap cannot train {literal(workload.name)}: "
                             f"{literal(workload.not_vectorized)}; use {{engine}} ddp (or auto)")
        if under_torchrun():
            raise UsageError("under torchrun the grid runs across the job's ranks: use {engine} ddp (or auto)")
        if options.engine == "fastest":
            if not _has_buffers(workload):
                return "fastest", "timed per batch size"
            return "vmap", ("not timed: the model has buffers (BatchNorm normalizes over the global batch when "
                            "vectorized, per rank on DDP), so one engine trains every batch size")
        return "vmap", ("asked for" if options.engine == "vmap" else
                        "the model and optimizer vectorize: every run of a batch size trains at once in one process")
    strategy = strategies.get(options.strategy, **options.strategy_options())
    if config.dtype == "float64" and not strategy.reduces_float64:
        raise UsageError(f"the {options.strategy} strategy reduces no float64 gradients: give {{dtype}} float32")
    for rule in registry.of(config):
        if rule.multi_rank and not strategy.taps_local_gradients:
            raise UsageError(f"the rule {rule.name} measures the noise scale across ranks, which the "
                             f"{options.strategy} strategy does not show: drop it from {{rules}}")
        if rule.multi_rank and world_size_for(None, default=options.world_size) < 2:
            raise UsageError(f"the rule {rule.name} on the DDP engine measures the noise scale across ranks: give "
                             "{world_size} 2 or more, or drop it from {rules}")
        if rule.single_process and under_torchrun():
            raise UsageError(f"the rule {rule.name} trains in one process: drop it from {{rules}} under torchrun")
    if options.engine == "ddp":
        return "ddp", "asked for" + (f", on {_strategy_words(options)}" if not options.wraps_in_ddp else "")
    if not options.wraps_in_ddp:
        return "ddp", f"the {_strategy_words(options)} strategy wraps the model on ranks"
    if under_torchrun():
        return "ddp", "under torchrun: the grid's runs train across the job's ranks"
    return "ddp", f"the spec cannot be vectorized: {workload.not_vectorized}"


def _strategy_words(options: StudyOptions) -> str:
    """The strategy as the engine line names it: fsdp, hsdp: 2 replicas × 2 shards, DeepSpeed ZeRO-2."""
    return options.strategy_text(world_size_for(None, default=options.world_size)) or options.strategy


def _has_buffers(workload: Workload) -> bool:
    # BatchNorm normalizes over the global batch when vectorized, per rank on DDP: one engine for all batches.
    return any(True for _ in workload.model().buffers())


def resolve_device(device: str) -> torch.device:
    """The device runs train on: ``auto`` is CUDA where there is one."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("{device} cuda, but torch sees no CUDA device here: use {device} cpu (or auto)")
    return torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")


def build_engine(name: str, device: torch.device, options: StudyOptions, launch_config: LaunchConfig | None):
    """The engine ``name`` (vmap, ddp, or fastest over both) on ``device``."""
    vectorized = VmapEngine(device)
    if name == "vmap":
        return vectorized
    world_size = world_size_for(None, default=options.world_size)
    if device.type == "cuda" and not under_torchrun() and world_size > torch.cuda.device_count():
        if name == "fastest":
            # No rank could have a GPU of its own: the grid stays vectorized rather than fail mid-study.
            return Fastest([vectorized])
        raise UsageError(f"the DDP engine gives each of its {world_size} ranks a GPU of its own, but torch sees "
                         f"{torch.cuda.device_count()}: give {{world_size}} {torch.cuda.device_count()} or fewer, or "
                         "{device} cpu")
    launch_config = dataclasses.replace(launch_config or LaunchConfig(), world_size=world_size,
                                        backend="nccl" if device.type == "cuda" else "gloo")
    strategy = strategies.get(options.strategy, **options.strategy_options())
    strategy.check_runnable(world_size)
    on_ranks: Engine = DdpEngine(launch_config, max_per_device=options.max_batch_size_per_device, device=device,
                                 strategy=strategy)
    return on_ranks if name == "ddp" else Fastest([vectorized, on_ranks])
