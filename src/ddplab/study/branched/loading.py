"""A checkpoint file read, unwrapped and checked against the workload's model and optimizer before anything
trains: a torch.save'd dict, or what the spec's ``load(path, model, optimizer)`` puts into a fresh pair.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch

from ddplab.errors import UsageError, literal
from ddplab.study.branched.checkpoint import Checkpoint, notes
from ddplab.study.config import StudyConfig
from ddplab.study.optim import torch_dtype
from ddplab.study.workloads import Workload, run_optimizer


def load_checkpoint(workload: Workload, config: StudyConfig, path: str) -> Checkpoint:
    """A checkpoint file, checked against the workload's model and optimizer before anything trains."""
    if not os.path.isfile(path):
        raise UsageError(f"{{branch_from}} {literal(path)} does not exist")
    if workload.load is not None:
        return _spec_loaded(workload, config, path)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same bad input
        raise UsageError(f"{{branch_from}} {literal(path)} cannot be read by torch.load ({literal(exc)})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise UsageError(f"{{branch_from}} {literal(path)} has no key 'model' (a state_dict): save "
                         "{{'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'samples_seen': n}}")
    if "samples_seen" in saved:
        samples = saved["samples_seen"]
    elif "step" in saved:
        samples = int(saved["step"]) * config.reference_global_batch_size
    else:
        raise UsageError(f"{{branch_from}} {literal(path)} has no key 'samples_seen' (nor 'step', counted in "
                         "{reference_global_batch_size} samples)")
    expected = workload.model().state_dict()
    checkpoint = Checkpoint(model=_unwrapped(saved["model"], set(expected)), optimizer=saved.get("optimizer"),
                            samples_seen=int(samples), source=path)
    check_checkpoint(workload, config, checkpoint, expected)
    return dataclasses.replace(checkpoint, notes=tuple(notes(config, checkpoint)))


WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""What DDP (``model.module``) and torch.compile (``model._orig_mod``) put before a state_dict's keys."""


def _unwrapped(state: dict, expected: set[str]) -> dict:
    """The state_dict as the bare model names its keys: a DDP or compiled model's (or both, in either order), saved
    wrapped, loses the prefixes every key carries; one whose keys are already the model's stays as it is."""
    while set(state) != expected:
        prefix = next((p for p in WRAPPER_PREFIXES
                       if state and all(isinstance(key, str) and key.startswith(p) for key in state)), None)
        if prefix is None:
            break
        state = {key[len(prefix):]: value for key, value in state.items()}
    return state


def _spec_loaded(workload: Workload, config: StudyConfig, path: str) -> Checkpoint:
    """What the spec's load(path, model, optimizer) puts into a fresh model and optimizer."""
    model = workload.model().to(torch_dtype(config))
    optimizer = run_optimizer(workload, config, model.parameters(), config.reference_lr)
    samples = workload.load(path, model, optimizer)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise UsageError(f"{{branch_from}} {literal(path)}: the spec's load(path, model, optimizer) must return the "
                         f"samples the run had seen, an integer ≥ 0, got {literal(repr(samples))}")
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    checkpoint = Checkpoint(model=state, optimizer=copy.deepcopy(optimizer.state_dict()), samples_seen=samples,
                            source=path)
    return dataclasses.replace(checkpoint, notes=tuple(notes(config, checkpoint)))


def check_checkpoint(workload: Workload, config: StudyConfig, checkpoint: Checkpoint, expected: dict) -> None:
    """Every key of the model's state_dict (``expected``) present with its shape, and nothing else; the optimizer's
    state of the study's family, one entry per parameter in ``model.parameters()`` order."""
    where = literal(checkpoint.source)
    for key, tensor in expected.items():
        if key not in checkpoint.model:
            raise UsageError(f"{{branch_from}} {where}: the model's state has no key {literal(repr(key))}")
        got = checkpoint.model[key]
        if not torch.is_tensor(got) or tuple(got.shape) != tuple(tensor.shape):
            shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
            raise UsageError(f"{{branch_from}} {where}: the model's key {literal(repr(key))} has shape "
                             f"{literal(shape)}, the workload's model {literal(tuple(tensor.shape))}")
    extra = [key for key in checkpoint.model if key not in expected]
    if extra:
        raise UsageError(f"{{branch_from}} {where}: the model's state has key {literal(repr(extra[0]))}, which the "
                         "workload's model lacks")
    _optimizer_state(workload, config, checkpoint)


def _optimizer_state(workload: Workload, config: StudyConfig, checkpoint: Checkpoint) -> dict[str, dict] | None:
    """{parameter name: its torch.optim state} of the checkpoint (None when it has none yet), checked."""
    saved = checkpoint.optimizer
    if not saved or not saved.get("state"):
        return None
    where = literal(checkpoint.source)
    groups = saved.get("param_groups") or []
    ids = [i for group in groups for i in group.get("params", [])]
    names = [name for name, _ in workload.model().named_parameters()]
    if len(ids) != len(names):
        raise UsageError(f"{{branch_from}} {where}: the optimizer's key 'param_groups' holds {len(ids)} parameters, "
                         f"the model has {len(names)}")
    # A spec's own optimizer (trained on ranks) keeps what it keeps: torch.optim reads its state as it is.
    needs = () if workload.make_optimizer is not None else ("exp_avg", "exp_avg_sq", "step") \
        if config.optimizer.adam else ("momentum_buffer",) if config.optimizer.momentum else ()
    out = {}
    for index, name in zip(ids, names):
        state = saved["state"].get(index, {})
        for key in needs:
            if state.get(key) is None:
                raise UsageError(f"{{branch_from}} {where}: the optimizer's state of parameter {index} "
                                 f"({literal(name)}) has no key {literal(repr(key))}, which "
                                 f"{config.optimizer.name} keeps: give the run's optimizer ({{optimizer.family}})")
        out[name] = state
    return out
