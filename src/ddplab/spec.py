"""Load a training spec: a Python file of plain functions describing what to train.

Required: ``model()`` → nn.Module, ``dataset()`` → Dataset of (input, target) pairs,
``loss(output, target)`` → scalar. Optional: ``optimizer(params)`` (default SGD lr 0.1) and
``step(model, batch, loss_fn)`` → loss, when the forward is more than ``loss(model(x), y)``.
Used by ``ddplab check`` and ``ddplab noise``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

REQUIRED = ("model", "dataset", "loss")


@dataclasses.dataclass(frozen=True)
class Spec:
    """The spec file's functions."""

    path: str
    model: Callable[[], Any]
    dataset: Callable[[], Any]
    loss: Callable[[Any, Any], Any]
    optimizer: Callable[[Any], Any]
    step: Callable[[Any, Any, Callable], Any]


def _default_optimizer(params):
    import torch

    return torch.optim.SGD(params, lr=0.1)


def _default_step(model, batch, loss_fn):
    inputs, target = batch
    return loss_fn(model(inputs), target)


def load_spec(path: str) -> Spec:
    """Import ``path`` as a module and collect its functions; ValueError names what is missing."""
    if not os.path.isfile(path):
        raise ValueError(f"spec file {path!r} does not exist")
    name = f"ddplab_spec_{abs(hash(os.path.abspath(path)))}"
    # Specs may import helpers that sit beside them, as a script would.
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)
    module = sys.modules.get(name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"spec file {path!r} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        # Registered so forked and spawned ranks can unpickle what the spec defines.
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    missing = [fn for fn in REQUIRED if not callable(getattr(module, fn, None))]
    if missing:
        raise ValueError(f"spec file {path!r} must define {', '.join(f'{m}()' for m in missing)}")
    return Spec(path=os.path.abspath(path), model=module.model, dataset=module.dataset, loss=module.loss,
                optimizer=getattr(module, "optimizer", _default_optimizer), step=getattr(module, "step", _default_step))
