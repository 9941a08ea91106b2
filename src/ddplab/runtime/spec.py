"""Load a training spec: a Python file of plain functions describing what to train.

Required: ``model()`` → nn.Module, ``dataset()`` → Dataset of (input, target) pairs,
``loss(output, target)`` → scalar. Optional: ``optimizer(params)`` (default SGD lr 0.1),
``step(model, batch, loss_fn)`` → loss, when the forward is more than ``loss(model(x), y)``, and
``collate(items)`` → batch, for items that do not stack (sequences of different lengths, padded), which
``ddplab check`` and ``ddplab study`` build every batch with (:func:`ddplab.runtime.ranks.collate`).
Used by ``ddplab check``, ``ddplab noise`` and ``ddplab study``.

The spec is someone else's code: every call into it is guarded, so whatever it raises (or a
``sys.exit``) becomes one :class:`~ddplab.errors.SpecError` sentence naming the file and the function.
Importing this module imports no torch, so a wrong path is said at once (:func:`check_spec_path`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from ddplab.errors import SpecError, UsageError, literal

REQUIRED = ("model", "dataset", "loss")


class _Contract(Exception):
    """What a spec function returned breaks the contract; the guard prefixes the spec file."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """The spec file's functions, each guarded so a failure names the file and the function."""

    path: str
    model: Callable[[], Any]
    dataset: Callable[[], Any]
    loss: Callable[[Any, Any], Any]
    optimizer: Callable[[Any], Any]
    step: Callable[[Any, Any, Callable], Any]
    custom_step: bool = False
    """The spec defines its own step(); otherwise step is loss(model(x), y)."""
    collate: Callable[[list], Any] | None = None
    """The spec's collate(items) → batch (for items of different lengths); None: torch's default_collate."""

    @property
    def shown(self) -> str:
        return shown_path(self.path)

    def error(self, template: str) -> SpecError:
        """A SpecError about this spec: ``template`` (a UsageError template) after the file's name."""
        return SpecError(f"spec file {literal(self.shown)}: {template}")

    def guard(self, what: str):
        """A context in which any error becomes a SpecError saying ``what`` failed."""
        return _guard(self.path, what)


def shown_path(path: str) -> str:
    """``path`` as a person would type it: relative when under the working directory."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def describe(exc: BaseException) -> str:
    """One line for an exception, as plain text: 'raised KeyError: x', or 'called sys.exit(7)'."""
    from ddplab.runtime.failures import unused_parameters

    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}); a spec must return, not exit"
    if unused_parameters(exc):
        # DDP's own wording runs to a paragraph; its cause in a sentence.
        return (f"raised {type(exc).__name__}: DDP expected a gradient for every parameter, but a previous step "
                "left some without one (the forward uses parameters conditionally)")
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"raised {type(exc).__name__}" + (f": {lines[0].strip()}" if lines else "")


@contextlib.contextmanager
def _guard(path: str, what: str) -> Iterator[None]:
    try:
        yield
    except SpecError:
        raise
    except UsageError as exc:
        # ddplab's own check inside a guarded call: its fields stay fields.
        raise SpecError(f"spec file {literal(shown_path(path))}: {exc.template}") from None
    except _Contract as exc:
        raise SpecError(f"spec file {literal(shown_path(path))}: {literal(exc)}") from None
    except Exception as exc:
        from ddplab.runtime.failures import in_collective

        if in_collective(exc):
            raise  # another rank failed or stopped: not the spec's fault, and the launch layer names who
        raise SpecError(f"spec file {literal(shown_path(path))}: {literal(what)} {literal(describe(exc))}") from exc
    except SystemExit as exc:
        raise SpecError(f"spec file {literal(shown_path(path))}: {literal(what)} {literal(describe(exc))}") from exc


def _guarded(path: str, what: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _guard(path, what):
            return fn(*args, **kwargs)

    return call


def _default_optimizer(params):
    import torch

    return torch.optim.SGD(params, lr=0.1)


def default_step(model, batch, loss_fn):
    """The step of a spec without step(): the loss of the model on an (input, target) batch."""
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
        raise _Contract("dataset() items must be (input, target) pairs when the spec defines no step(model, batch, "
                        f"loss_fn); got a batch of type {type(batch).__name__}")
    inputs, target = batch
    return loss_fn(model(inputs), target)


def _checked_model(model_fn: Callable) -> Callable:
    def model():
        import torch

        module = model_fn()
        if not isinstance(module, torch.nn.Module):
            raise _Contract(f"model() must return a torch.nn.Module, got {type(module).__name__}")
        if not any(p.requires_grad for p in module.parameters()):
            raise _Contract("model() returned a module with no parameters that require gradients, so there is "
                            "nothing to train")
        return module

    return model


def _checked_dataset(path: str, dataset_fn: Callable) -> Callable:
    def dataset():
        data = dataset_fn()
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise _Contract("dataset() must return a map-style dataset (len() and indexing, e.g. TensorDataset), "
                            f"got {type(data).__name__}")
        with _guard(path, "len(dataset())"):
            size = len(data)
        if size == 0:
            raise _Contract("dataset() is empty")
        return GuardedDataset(data, path, size)

    return dataset


class GuardedDataset:
    """The spec's dataset, read through a guard so a failing item names the spec file."""

    def __init__(self, data, path: str, size: int):
        self.data, self.spec_path, self.size = data, path, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        with _guard(self.spec_path, f"dataset()[{index}]"):
            return self.data[index]


def check_spec_path(path: str) -> None:
    """SpecError unless ``path`` is an existing ``.py`` file: said before anything imports torch (seconds)."""
    if os.path.isdir(path):
        raise SpecError(f"spec file {literal(path)} is a directory: give the Python file that defines model(), "
                        "dataset() and loss()")
    if not os.path.isfile(path):
        raise SpecError(f"spec file {literal(path)} does not exist")
    if not path.endswith(".py"):
        raise SpecError(f"spec file {literal(path)} is not a Python file: give a .py file that defines model(), "
                        "dataset() and loss()")


def load_spec(path: str) -> Spec:
    """Import ``path`` as a module and collect its functions; SpecError (a UsageError) says what is wrong."""
    check_spec_path(path)
    module = _import(path)
    missing = [fn for fn in REQUIRED if not callable(getattr(module, fn, None))]
    if missing:
        raise SpecError(f"spec file {literal(shown_path(path))} must define {', '.join(f'{m}()' for m in missing)}")
    path = os.path.abspath(path)
    user_step = getattr(module, "step", None)
    user_collate = getattr(module, "collate", None)
    return Spec(path=path,
                model=_guarded(path, "model()", _checked_model(module.model)),
                dataset=_guarded(path, "dataset()", _checked_dataset(path, module.dataset)),
                loss=_guarded(path, "loss()", module.loss),
                optimizer=_guarded(path, "optimizer()", getattr(module, "optimizer", _default_optimizer)),
                step=_guarded(path, "step()" if user_step else "the forward pass", user_step or default_step),
                custom_step=callable(user_step),
                collate=_guarded(path, "collate()", user_collate) if callable(user_collate) else None)


def module_name(path: str) -> str:
    """The module a spec file loads as: the same in every process (a digest, not ``hash()``, which is salted)."""
    digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    return f"ddplab_spec_{digest}"


def spec_module(spec: Spec):
    """The loaded module of ``spec`` (for optional functions beyond the required ones)."""
    return sys.modules[module_name(spec.path)]


def _import(path: str):
    path = os.path.abspath(path)
    name = module_name(path)
    # Specs may import helpers that sit beside them, as a script would.
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    module = sys.modules.get(name)
    if module is not None:
        return module
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"spec file {literal(shown_path(path))} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    # Registered so forked and spawned ranks can unpickle what the spec defines.
    sys.modules[name] = module
    try:
        with _no_hard_exit():
            module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        # A half-run module must not be found by the next load.
        del sys.modules[name]
        raise SpecError(f"spec file {literal(shown_path(path))} does not load: "
                        f"{literal(_load_failure(exc, path))}") from None
    return module


class _HardExit(SystemExit):
    """os._exit called by a spec: it would end the whole command at once, without a word."""


@contextlib.contextmanager
def _no_hard_exit() -> Iterator[None]:
    # os._exit skips every handler; while a spec loads it raises instead, so the command can say what happened.
    real = os._exit

    def refuse(code: int = 0):
        raise _HardExit(code)

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def _load_failure(exc: BaseException, path: str) -> str:
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__} at line {exc.lineno}: {exc.msg}"
    # The spec's own line that the failure passed through last.
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == path]
    where = f"line {lines[-1]} " if lines else ""
    if isinstance(exc, SystemExit):
        call = "os._exit" if isinstance(exc, _HardExit) else "sys.exit"
        return f"{where}calls {call}({exc.code!r}) at import; a spec must define functions, not exit"
    return f"{where}{describe(exc)}"
