"""The study's optimizers: torch.optim's SGD, Adam and AdamW as foreach updates over stacked parameters.

Every run of a group is a slice along dimension 0 of each stacked tensor, with its own lr (one
per run, broadcast over the slice); the other hyperparameters are the group's. Each update is
torch.optim's formula (``torch/optim/sgd.py``, ``adam.py``), so a run's trajectory is the one
torch.optim would give it: tests/study compares them in float64 and float32.
"""

from __future__ import annotations

import math

import torch

from ddplab.errors import UsageError
from ddplab.study.config import OptimizerConfig

Tensors = dict[str, torch.Tensor]


class StackedOptimizer:
    """The state and update of one optimizer family for stacked runs."""

    def __init__(self, config: OptimizerConfig, params: Tensors):
        self.config, self.names = config, list(params)
        self.steps = 0
        self.state: dict[str, Tensors] = {}

    def step(self, params: Tensors, grads: Tensors, lr: torch.Tensor) -> None:
        """Update ``params`` in place from ``grads``, run i at ``lr[i]``."""
        raise NotImplementedError

    def keep(self, index: torch.Tensor) -> None:
        """Only the runs at ``index`` go on: their state rows, in that order."""
        self.state = {key: {n: t[index] for n, t in tensors.items()} for key, tensors in self.state.items()}

    def _lrs(self, params: Tensors, lr: torch.Tensor) -> list[torch.Tensor]:
        return [lr.view(-1, *[1] * (params[n].dim() - 1)) for n in self.names]


class StackedSGD(StackedOptimizer):
    """torch.optim.SGD: g += wd·p; buf = g on the first step, then μ·buf + (1 − dampening)·g; nesterov g + μ·buf."""

    def step(self, params: Tensors, grads: Tensors, lr: torch.Tensor) -> None:
        cfg, names = self.config, self.names
        p, g = [params[n] for n in names], [grads[n] for n in names]
        if cfg.weight_decay:
            g = torch._foreach_add(g, p, alpha=cfg.weight_decay)
        if cfg.momentum:
            if self.steps == 0:
                self.state["buf"] = {n: t.detach().clone() for n, t in zip(names, g)}
            else:
                buf = [self.state["buf"][n] for n in names]
                torch._foreach_mul_(buf, cfg.momentum)
                torch._foreach_add_(buf, g, alpha=1 - cfg.dampening)
            buf = [self.state["buf"][n] for n in names]
            g = torch._foreach_add(g, buf, alpha=cfg.momentum) if cfg.nesterov else buf
        torch._foreach_addcmul_(p, self._lrs(params, lr), g, value=-1)
        self.steps += 1


class StackedAdam(StackedOptimizer):
    """torch.optim.Adam and AdamW: m ← lerp(m, g, 1 − β₁), v ← β₂v + (1 − β₂)g², p −= lr/(1 − β₁ᵗ) · m /
    (√v/√(1 − β₂ᵗ) + ε); Adam adds wd·p to g, AdamW multiplies p by 1 − lr·wd first."""

    def __init__(self, config: OptimizerConfig, params: Tensors):
        super().__init__(config, params)
        self.state = {"m": {n: torch.zeros_like(t) for n, t in params.items()},
                      "v": {n: torch.zeros_like(t) for n, t in params.items()}}

    def step(self, params: Tensors, grads: Tensors, lr: torch.Tensor) -> None:
        cfg, names = self.config, self.names
        beta1, beta2 = cfg.betas
        p, g = [params[n] for n in names], [grads[n] for n in names]
        m, v = [self.state["m"][n] for n in names], [self.state["v"][n] for n in names]
        lrs = self._lrs(params, lr)
        if cfg.weight_decay and cfg.family == "adamw":
            torch._foreach_mul_(p, [1 - r * cfg.weight_decay for r in lrs])
        elif cfg.weight_decay:
            g = torch._foreach_add(g, p, alpha=cfg.weight_decay)
        self.steps += 1
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        correction1, correction2 = 1 - beta1 ** self.steps, 1 - beta2 ** self.steps
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(correction2))
        torch._foreach_add_(denom, cfg.eps)
        ratio = torch._foreach_div(m, denom)
        torch._foreach_mul_(ratio, [r / correction1 for r in lrs])
        torch._foreach_sub_(p, ratio)


def stacked(config: OptimizerConfig, params: Tensors) -> StackedOptimizer:
    """The stacked optimizer of ``config``'s family over ``params``."""
    return (StackedSGD if config.family == "sgd" else StackedAdam)(config, params)


def torch_optimizer(config: OptimizerConfig, params, lr: float) -> torch.optim.Optimizer:
    """The torch.optim optimizer ``config`` describes, at ``lr`` (the ramp runs, --verify-ddp, the DDP engine)."""
    if config.family == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, dampening=config.dampening,
                               nesterov=config.nesterov, weight_decay=config.weight_decay)
    cls = torch.optim.AdamW if config.family == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)


def from_torch(optimizer: torch.optim.Optimizer) -> tuple[OptimizerConfig | None, float, str]:
    """(the family and hyperparameters, the lr, why not) of a spec's optimizer: a config when the stacked
    engine can train it (SGD, Adam, AdamW with one parameter group and torch's default switches), else None
    and the reason."""
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return None, float(groups[0]["lr"]), f"{name} is not among SGD, Adam and AdamW"
    if len(groups) != 1:
        return None, float(groups[0]["lr"]), f"{name} has {len(groups)} parameter groups"
    group = groups[0]
    lr = float(group["lr"]) if not torch.is_tensor(group["lr"]) else float(group["lr"].item())
    for switch in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(switch):
            return None, lr, f"{name} has {switch}=True"
    if name == "SGD":
        return OptimizerConfig(family="sgd", momentum=group["momentum"], dampening=group["dampening"],
                               nesterov=group["nesterov"], weight_decay=group["weight_decay"]), lr, ""
    family = "adamw" if name == "AdamW" else "adam"
    if family == "adam" and group.get("decoupled_weight_decay"):
        family = "adamw"
    try:
        return OptimizerConfig(family=family, betas=tuple(group["betas"]), eps=group["eps"],
                               weight_decay=group["weight_decay"]), lr, ""
    except UsageError as exc:
        return None, lr, str(exc)


def describe(optimizer: torch.optim.Optimizer) -> dict:
    """A spec's own optimizer for the study's JSON, as ``OptimizerConfig.to_json`` gives the stacked ones: its
    class and first parameter group's hyperparameters (the lr is the grid's), ``family`` "other"."""
    group = optimizer.param_groups[0]
    # torch's implementation switches say nothing of the update unless set.
    switches = ("foreach", "fused", "capturable", "differentiable", "maximize")
    settings = {key: list(value) if isinstance(value, tuple) else value for key, value in group.items()
                if key not in ("params", "lr") and isinstance(value, (bool, int, float, str, tuple))
                and not (key in switches and not value)}
    return {"family": "other", "name": type(optimizer).__name__, **settings,
            "parameter_groups": len(optimizer.param_groups)}
