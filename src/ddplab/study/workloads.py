"""What a study trains: a model, its data as tensors, a loss, and how a run is evaluated.

A workload is rebuilt from its ``source`` wherever it is needed (a spawned rank of
``--verify-ddp`` included), so nothing in it has to pickle.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from ddplab.errors import SpecError, UsageError, literal
from ddplab.runtime import spec as spec_files

Source = tuple[str, tuple[tuple[str, Any], ...]]
"""(kind, keyword arguments): 'digits', 'regression' or 'spec', and what rebuilds it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """A model, its data as tensors, a loss and how to evaluate."""

    name: str
    model: Callable[[], torch.nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor] | None = None
    """Validation inputs and targets, evaluated vectorized (accuracy or loss)."""
    evaluate: Callable[[torch.nn.Module, Any], float] | None = None
    """The spec's evaluate(model, dataset): called per run at each evaluation (slower)."""
    eval_dataset: Any = None
    source: Source
    """How to build this workload again (:func:`load`)."""
    fingerprint: str
    """What the study's cache depends on: the workload's name and, for a spec, its file's content."""
    optimizer: Any = None
    """The spec's optimizer() as an OptimizerConfig, when it defines one the vectorized engine trains."""
    lr: float | None = None
    """The lr of the spec's optimizer(): the study's reference lr unless one is given."""
    not_vectorized: str = ""
    """Why the vectorized engine cannot train this workload as the spec does ('' when it can)."""
    step: Callable[[torch.nn.Module, Any, Callable], torch.Tensor] | None = None
    """The spec's own step(model, batch, loss_fn), which only the DDP engine runs."""
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    """The spec's optimizer(params) when it is outside SGD, Adam and AdamW: the DDP engine builds it and scales
    its lrs by the grid's lr over ``lr``."""

    @property
    def train_size(self) -> int:
        return int(self.train[0].shape[0])


def load(source: Source) -> Workload:
    """The workload ``source`` describes."""
    kind, kwargs = source
    return {"digits": digits, "regression": regression, "spec": from_spec}[kind](**dict(kwargs))


def digits() -> Workload:
    """sklearn's digits (1797 × 64, 10 classes), 80/20 split, an MLP with one hidden layer of 64."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UsageError("the built-in workload needs scikit-learn: pip install 'ddplab[study]'") from None
    data = load_digits()
    inputs = torch.tensor(data.data, dtype=torch.float32) / 16.0
    targets = torch.tensor(data.target, dtype=torch.long)
    # A fixed split, independent of the run seeds.
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(1234))
    n_val = len(targets) // 5
    val, train = order[:n_val], order[n_val:]
    return Workload(name="digits-mlp", model=_digits_mlp, loss=torch.nn.functional.cross_entropy,
                    train=(inputs[train], targets[train]), val=(inputs[val], targets[val]),
                    source=("digits", ()), fingerprint="digits-mlp")


def _digits_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def regression(*, dim: int = 16, n_train: int = 4096, n_val: int = 4096, seed: int = 0) -> Workload:
    """Noiseless linear regression with x ~ N(0, I): the problem whose answers are known exactly.

    With MSE loss and error e = w − w*, the per-sample gradient 2x(x·e) has mean 2e and covariance
    4(e eᵀ + |e|² I): B_simple = tr Σ/|G|² = dim + 1 at every step, and the expected |e|² after a
    step of SGD (no momentum) at lr η with batch B is |e|²·((1 − 2η)² + 4η²(dim + 1)/B).
    """
    generator = torch.Generator().manual_seed(seed)
    w_star = torch.randn(dim, 1, generator=generator) / math.sqrt(dim)
    inputs = torch.randn(n_train + n_val, dim, generator=generator)
    targets = inputs @ w_star
    kwargs = (("dim", dim), ("n_train", n_train), ("n_val", n_val), ("seed", seed))
    name = f"gaussian-regression-{dim}"
    return Workload(name=name, model=functools.partial(_zero_linear, dim), loss=torch.nn.functional.mse_loss,
                    train=(inputs[:n_train], targets[:n_train]), val=(inputs[n_train:], targets[n_train:]),
                    source=("regression", kwargs), fingerprint=f"{name}-{n_train}-{n_val}-{seed}")


def _zero_linear(dim: int) -> torch.nn.Module:
    layer = torch.nn.Linear(dim, 1, bias=False)
    torch.nn.init.zeros_(layer.weight)
    return layer


def regression_expected_steps(*, dim: int, global_batch: int, lr: float, start: float, target: float,
                              eval_every: int = 1, max_steps: int = 100_000) -> int | None:
    """Steps until E|e|² first falls to ``target`` (checked every ``eval_every``), from the exact recursion."""
    factor = (1 - 2 * lr) ** 2 + 4 * lr ** 2 * (dim + 1) / global_batch
    if factor >= 1:
        return None
    steps = math.ceil(math.log(target / start) / math.log(factor))
    steps = -(-steps // eval_every) * eval_every
    return steps if steps <= max_steps else None


def from_spec(path: str) -> Workload:
    """A spec file (see ddplab.runtime.spec) plus val_dataset() or evaluate(model, dataset)."""
    spec = spec_files.load_spec(path)
    module = spec_files.spec_module(spec)
    evaluate = getattr(module, "evaluate", None)
    val_dataset = getattr(module, "val_dataset", None)
    if not callable(evaluate) and not callable(val_dataset):
        raise spec.error("defines neither evaluate(model, dataset) nor val_dataset(): the study needs one to know "
                         "when a run reaches the target")
    optimizer, lr, why = _spec_optimizer(spec, module)
    # What only the DDP engine can train: the spec's own step(), an optimizer the stacked engine lacks.
    why = "; ".join(filter(None, ["it defines step()" if spec.custom_step else "", why]))
    train = _as_tensors(spec, spec.dataset(), "dataset()")
    with spec.guard("val_dataset()"):
        eval_dataset = val_dataset() if callable(val_dataset) else spec.dataset()
    common = dict(name=os.path.basename(path), model=spec.model, loss=spec.loss, train=train,
                  source=("spec", (("path", spec.path),)), fingerprint=_file_fingerprint(spec.path),
                  optimizer=optimizer, lr=lr, not_vectorized=why, step=spec.step if spec.custom_step else None,
                  make_optimizer=spec.optimizer if optimizer is None and lr is not None else None)
    if callable(evaluate):
        return Workload(evaluate=_guarded_evaluate(spec, evaluate), eval_dataset=eval_dataset, **common)
    return Workload(val=_as_tensors(spec, eval_dataset, "val_dataset()"), **common)


def _spec_optimizer(spec, module) -> tuple[Any, float | None, str]:
    """(OptimizerConfig or None, its lr, why it cannot be vectorized) of the spec's own optimizer(), if any."""
    if not callable(getattr(module, "optimizer", None)):
        return None, None, ""
    from ddplab.study.optim import from_torch

    with spec.guard("optimizer(params)"):
        built = spec.optimizer(spec.model().parameters())
    if not isinstance(built, torch.optim.Optimizer):
        raise spec.error(f"optimizer(params) must return a torch.optim.Optimizer, got {literal(type(built).__name__)}")
    config, lr, why = from_torch(built)
    return config, lr, (f"its optimizer() ({why})" if why else "")


def _guarded_evaluate(spec, evaluate):
    def call(model, dataset) -> float:
        with spec.guard("evaluate(model, dataset)"):
            value = float(evaluate(model, dataset))
        return value

    return call


def _file_fingerprint(path: str) -> str:
    with open(path, "rb") as fh:
        return f"{os.path.basename(path)}-{hashlib.sha256(fh.read()).hexdigest()[:16]}"


def _as_tensors(spec, dataset, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.utils.data import default_collate

    try:
        inputs, targets = default_collate([dataset[i] for i in range(len(dataset))])
    except SpecError:
        raise
    except (TypeError, RuntimeError, IndexError, ValueError) as exc:
        raise spec.error(f"{literal(what)} must hold (input, target) tensor pairs of one shape "
                         f"({literal(exc)})") from None
    return inputs, targets
