"""What a study trains: a model, its data (as tensors, or a spec's items its collate() batches), a loss, and how a
run is evaluated.

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
from ddplab.runtime import ranks
from ddplab.runtime import spec as spec_files
from ddplab.study.config import OptimizerConfig, StudyConfig, Target
from ddplab.study.optim import describe, from_torch, torch_optimizer

Source = tuple[str, tuple[tuple[str, Any], ...]]
"""(kind, keyword arguments): 'digits', 'regression' or 'spec', and what rebuilds it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """A model, its data, a loss and how to evaluate."""

    name: str
    model: Callable[[], torch.nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train: tuple[torch.Tensor, torch.Tensor] | None = None
    """The training inputs and targets as tensors; None where ``collate`` batches ``dataset``'s items."""
    dataset: Any = None
    """The spec's training dataset, read item by item, when its ``collate`` builds the batches."""
    collate: Callable[[list], Any] | None = None
    """The spec's collate(items) → batch (items of different lengths, padded); None: ``train`` holds tensors."""
    val: tuple[torch.Tensor, torch.Tensor] | None = None
    """Validation inputs and targets (with ``collate``: the validation items collated into one batch), evaluated
    vectorized (accuracy or loss)."""
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
    defaults: tuple[tuple[str, Any], ...] = ()
    """StudyConfig fields a built-in workload documents as its own (target, grid, optimizer, lr)."""
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    """The spec's optimizer(params) when it is outside SGD, Adam and AdamW: the DDP engine builds it and scales
    its lrs by the grid's lr over ``lr``."""
    own_optimizer: dict | None = None
    """How the JSON names ``make_optimizer``'s optimizer (optim.describe), where the runs train with it."""
    load: Callable[[str, torch.nn.Module, Any], Any] | None = None
    """The spec's load(path, model, optimizer) -> samples seen: how branches read the spec's own checkpoints."""

    @property
    def train_size(self) -> int:
        return len(self.dataset) if self.train is None else int(self.train[0].shape[0])

    def batches(self, device: torch.device | str, dtype: torch.dtype) -> Callable[[torch.Tensor], Any]:
        """How a run reads its training batches on ``device``: the samples' indices → the batch ``step_fn`` takes
        (floating tensors in ``dtype``)."""
        if self.collate is not None:
            # check's own batching of a spec's items: the same collate() on the same items.
            return lambda index: ranks.collate(self.dataset, index.tolist(), torch.device(device), dtype,
                                               self.collate)
        # Moved once: each step only indexes.
        inputs, targets = ranks.move(self.train, torch.device(device), dtype)
        return lambda index: (inputs[index], targets[index])

    @property
    def step_fn(self) -> Callable[[torch.nn.Module, Any, Callable], torch.Tensor]:
        """The spec's own step, else the loss of the model on an (input, target) batch."""
        from ddplab.runtime.spec import default_step

        return self.step or default_step


def load(source: Source) -> Workload:
    """The workload ``source`` describes."""
    kind, kwargs = source
    return {"digits": digits, "regression": regression, "spec": from_spec, "mnist1d": mnist1d,
            "charlm": charlm}[kind](**dict(kwargs))


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


def mnist1d() -> Workload:
    """MNIST-1D (Greydanus 2020): 4000 training and 1000 test signals of length 40, 10 classes, built offline by
    the ``mnist1d`` package's ``make_dataset`` from its templates (never its download); an MLP 40-100-100-10.

    Its documented study: validation accuracy 0.6, SGD with momentum 0.9, lr 0.05 at global batch 32.
    """
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise UsageError("the mnist1d workload needs the mnist1d package: pip install 'ddplab[study]'") from None
    import random

    import numpy

    # make_dataset seeds the global random and NumPy generators: this process's are given back as they were.
    states = random.getstate(), numpy.random.get_state()
    try:
        data = make_dataset(get_dataset_args())
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])
    train = (torch.as_tensor(data["x"]).float(), torch.as_tensor(data["y"]).long())
    val = (torch.as_tensor(data["x_test"]).float(), torch.as_tensor(data["y_test"]).long())
    defaults = (("target", Target(kind="accuracy", value=0.6)), ("reference_lr", 0.05),
                ("global_batch_sizes", (8, 16, 32, 64, 128, 256, 512, 1024)), ("max_steps", 3000))
    return Workload(name="mnist1d-mlp", model=_mnist1d_mlp, loss=torch.nn.functional.cross_entropy, train=train,
                    val=val, source=("mnist1d", ()), fingerprint="mnist1d-mlp-0.0.2", defaults=defaults)


def _mnist1d_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(40, 100), torch.nn.ReLU(), torch.nn.Linear(100, 100), torch.nn.ReLU(),
                               torch.nn.Linear(100, 10))


CHARLM_CONTEXT = 16


def charlm() -> Workload:
    """A character-level transformer on public-domain text shipped with ddplab (the opening of the Declaration
    of Independence, the Constitution's preamble, the Gettysburg Address): one pre-LayerNorm block with causal
    self-attention, width 32, dropout 0.1, AdamW. Windows of 16 characters predict the next character at every
    position; the last tenth of the text is the validation split.

    Its documented study: validation loss 2.1 nats per character, AdamW (weight decay 0.1) at lr 1e-2, global batch 32.
    """
    from importlib import resources

    text = resources.files("ddplab.study").joinpath("texts/american_founding.txt").read_text(encoding="utf-8")
    vocab = sorted(set(text))
    codes = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    split = len(codes) * 9 // 10
    # Validation windows overlap less (every 4th start): they only measure, and evaluation is a forward per run.
    train, val = _windows(codes[:split]), _windows(codes[split:], stride=4)
    defaults = (("target", Target(kind="loss", value=2.1)), ("reference_lr", 1e-2),
                ("optimizer", OptimizerConfig(family="adamw", weight_decay=0.1)),
                ("global_batch_sizes", (8, 16, 32, 64, 128, 256)), ("max_steps", 2000))
    return Workload(name="charlm", model=functools.partial(CharTransformer, len(vocab)), loss=_next_char_loss,
                    train=train, val=val, source=("charlm", ()), fingerprint=f"charlm-{len(text)}-{len(vocab)}",
                    defaults=defaults)


def _windows(codes: torch.Tensor, stride: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The text's windows: inputs are 16 characters, targets the same shifted by one."""
    starts = torch.arange(0, len(codes) - CHARLM_CONTEXT, stride)
    index = starts[:, None] + torch.arange(CHARLM_CONTEXT + 1)
    windows = codes[index]
    return windows[:, :-1], windows[:, 1:]


def _next_char_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


class CharTransformer(torch.nn.Module):
    """One pre-LayerNorm transformer block, single-head causal attention, written out so it vectorizes."""

    def __init__(self, vocab: int, width: int = 32, dropout: float = 0.1):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(CHARLM_CONTEXT, width) * 0.02)
        self.norm1, self.norm2, self.norm_out = (torch.nn.LayerNorm(width) for _ in range(3))
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))
        self.drop = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        hidden = self.embed(tokens) + self.position[:length]
        q, k, v = self.qkv(self.norm1(hidden)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        attention = self.drop(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        hidden = hidden + self.drop(self.proj(attention @ v))
        hidden = hidden + self.drop(self.mlp(self.norm2(hidden)))
        return self.head(self.norm_out(hidden))


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
    # Plain SGD, where the theory above holds; the lr is safe at small batches (the optimum is B / (2(B + dim + 1))).
    defaults = (("target", Target(kind="loss", value=1e-4)), ("optimizer", OptimizerConfig(momentum=0.0)),
                ("reference_lr", 0.05))
    return Workload(name=name, model=functools.partial(_zero_linear, dim), loss=torch.nn.functional.mse_loss,
                    train=(inputs[:n_train], targets[:n_train]), val=(inputs[n_train:], targets[n_train:]),
                    source=("regression", kwargs), fingerprint=f"{name}-{n_train}-{n_val}-{seed}", defaults=defaults)


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
    optimizer, lr, why, own = _spec_optimizer(spec, module)
    # What only the DDP engine can train: the spec's own step(), its collate(), an optimizer the stacked engine lacks.
    why = "; ".join(filter(None, ["it defines step()" if spec.custom_step else "", _COLLATED if spec.collate else "",
                                  why]))
    data = _training_data(spec)
    with spec.guard("val_dataset()"):
        eval_dataset = val_dataset() if callable(val_dataset) else spec.dataset()
    common = dict(name=os.path.basename(path), model=spec.model, loss=spec.loss, **data,
                  source=("spec", (("path", spec.path),)), fingerprint=_file_fingerprint(spec.path),
                  optimizer=optimizer, lr=lr, not_vectorized=why, step=spec.step if spec.custom_step else None,
                  make_optimizer=spec.optimizer if optimizer is None and lr is not None else None, own_optimizer=own,
                  load=_guarded_load(spec, module))
    if callable(evaluate):
        return Workload(evaluate=_guarded_evaluate(spec, evaluate), eval_dataset=eval_dataset, **common)
    return Workload(val=_validation(spec, eval_dataset), **common)


_COLLATED = ("its collate() batches items of different lengths, which cannot stack into one tensor that every run "
             "indexes")


def _training_data(spec) -> dict[str, Any]:
    """The Workload fields of the spec's training data: its tensors, or its items and the collate() that batches
    them (tried on two items here, so a failing collate() is one line before any rank starts)."""
    dataset = spec.dataset()
    if spec.collate is None:
        return {"train": _as_tensors(spec, dataset, "dataset()")}
    ranks.collate(dataset, list(range(min(2, len(dataset)))), torch.device("cpu"), collate_fn=spec.collate)
    return {"dataset": dataset, "collate": spec.collate}


def _validation(spec, dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation split as one batch: its tensors stacked, or its items collated by the spec's collate()."""
    if spec.collate is None:
        return _as_tensors(spec, dataset, "val_dataset()")
    batch = ranks.collate(dataset, list(range(len(dataset))), torch.device("cpu"), collate_fn=spec.collate)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise spec.error("collate() of val_dataset() must give an (input, target) pair for the study to score, or "
                         "define evaluate(model, dataset)")
    return tuple(batch)


def _spec_optimizer(spec, module) -> tuple[Any, float | None, str, dict | None]:
    """(OptimizerConfig or None, its lr, why it cannot be vectorized, how the JSON names it when only the DDP
    engine can train it) of the spec's own optimizer(), if any."""
    if not callable(getattr(module, "optimizer", None)):
        return None, None, "", None
    with spec.guard("optimizer(params)"):
        built = spec.optimizer(spec.model().parameters())
    if not isinstance(built, torch.optim.Optimizer):
        raise spec.error(f"optimizer(params) must return a torch.optim.Optimizer, got {literal(type(built).__name__)}")
    config, lr, why = from_torch(built)
    return config, lr, (f"its optimizer() ({why})" if why else ""), (None if config else describe(built))


def _guarded_evaluate(spec, evaluate):
    def call(model, dataset) -> float:
        with spec.guard("evaluate(model, dataset)"):
            value = float(evaluate(model, dataset))
        return value

    return call


def _guarded_load(spec, module):
    load = getattr(module, "load", None)
    if not callable(load):
        return None

    def call(path: str, model: torch.nn.Module, optimizer) -> Any:
        with spec.guard("load(path, model, optimizer)"):
            return load(path, model, optimizer)

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


def workload_for(spec: str | None, name: str | None = None) -> Workload:
    """The spec's workload, or the built-in one named (digits by default)."""
    if spec:
        return from_spec(spec)
    return load((name or "digits", ()))


def workload_defaults(workload: Workload) -> dict:
    """StudyConfig fields the workload sets (what a flag or a caller gives wins): a built-in workload's documented
    target and grid; a spec's optimizer() family and hyperparameters, and its lr as the reference lr."""
    out = dict(workload.defaults)
    if workload.optimizer is not None:
        out["optimizer"] = workload.optimizer
    if workload.lr is not None:
        out["reference_lr"] = workload.lr
    return out


def run_optimizer(workload: Workload, config: StudyConfig, params, lr: float) -> torch.optim.Optimizer:
    """One run's torch optimizer at ``lr``: the spec's own where it has one, else the study's."""
    if workload.make_optimizer is None:
        return torch_optimizer(config.optimizer, params, lr)
    # The spec's own optimizer, every group's lr scaled as the rule scales the reference lr.
    optimizer = workload.make_optimizer(params)
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * lr / workload.lr
    return optimizer
