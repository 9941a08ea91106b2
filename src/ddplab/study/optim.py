"""The study's optimizers: torch.optim's SGD, Adam and AdamW as foreach updates over stacked parameters.

Every run of a group is a slice along dimension 0 of each stacked tensor, with its own lr (one
per run, broadcast over the slice); Adam's and AdamW's betas, eps and weight decay are per run too
(the tuned sweep trains another rule's settings beside the study's in one group), SGD's are the
group's. Each update is torch.optim's formula, operation for operation (``torch/optim/sgd.py``,
``adam.py``'s single-tensor path, which CPU tensors take), so a run's trajectory is the one
torch.optim would give it: tests/study compares them bit for bit on the CPU.

Beside them, the dtype every engine and the branches build a single run's model in (:func:`torch_dtype`); its
torch optimizer is the workload's to say (:func:`ddplab.study.workloads.run_optimizer`).
"""

from __future__ import annotations

import torch

from ddplab.errors import UsageError
from ddplab.study.config import OptimizerConfig, StudyConfig

Tensors = dict[str, torch.Tensor]


class StackedOptimizer:
    """The state and update of one optimizer family for stacked runs, ``configs[i]`` the settings of run i."""

    def __init__(self, configs: list[OptimizerConfig], params: Tensors):
        self.configs, self.names = configs, list(params)
        self.steps = 0
        self.state: dict[str, Tensors] = {}
        first = next(iter(params.values()))
        self.dtype, self.device = first.dtype, first.device
        # Per-run columns that change only with the runs or their lrs, made once (a host-to-device copy each).
        self._columns: dict[str, tuple[tuple, list[torch.Tensor]]] = {}

    def step(self, params: Tensors, grads: Tensors, lr: torch.Tensor) -> None:
        """Update ``params`` in place from ``grads``, run i at ``lr[i]`` (float64 on the host: torch.optim's lr is a
        Python float)."""
        raise NotImplementedError

    def keep(self, index: torch.Tensor, rows: list[int]) -> None:
        """Only the runs ``rows`` go on (``index``: the same on the runs' device): their state and settings."""
        self.state = {key: {n: t[index] for n, t in tensors.items()} for key, tensors in self.state.items()}
        self.configs = [self.configs[row] for row in rows]
        self._columns = {}

    def _per_run(self, params: Tensors, values: list[float]) -> list[torch.Tensor]:
        """One value per run, computed in Python floats (as torch.optim computes its scalars) and rounded once to
        the runs' dtype, shaped to broadcast over each parameter's slices."""
        column = torch.tensor(values, dtype=torch.float64).to(self.dtype).to(self.device)
        return [column.view(-1, *[1] * (params[n].dim() - 1)) for n in self.names]

    def _constant(self, params: Tensors, name: str, values, key: tuple = ()) -> list[torch.Tensor]:
        """:meth:`_per_run` of ``values()`` under ``name``, made again only when the runs or ``key`` (the lrs,
        which AdaScale changes every step) change."""
        if name not in self._columns or self._columns[name][0] != key:
            self._columns[name] = (key, self._per_run(params, values()))
        return self._columns[name][1]


class StackedSGD(StackedOptimizer):
    """torch.optim.SGD: g += wd·p; buf = g on the first step, then μ·buf + (1 − dampening)·g; nesterov g + μ·buf."""

    def __init__(self, configs: list[OptimizerConfig], params: Tensors):
        super().__init__(configs, params)
        if any(c != configs[0] for c in configs):
            raise ValueError("stacked SGD runs share their momentum, dampening and weight decay")

    def step(self, params: Tensors, grads: Tensors, lr: torch.Tensor) -> None:
        cfg, names = self.configs[0], self.names
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
        lrs = tuple(lr.tolist())
        torch._foreach_addcmul_(p, self._constant(params, "lr", lambda: list(lrs), lrs), g, value=-1)
        self.steps += 1


class StackedAdam(StackedOptimizer):
    """torch.optim.Adam and AdamW, each run with its own betas, eps and weight decay: m ← lerp(m, g, 1 − β₁),
    v ← β₂v + (1 − β₂)g², p −= lr/(1 − β₁ᵗ) · m / (√v/√(1 − β₂ᵗ) + ε); Adam adds wd·p to g, AdamW multiplies p
    by 1 − lr·wd first."""

    def __init__(self, configs: list[OptimizerConfig], params: Tensors):
        super().__init__(configs, params)
        if len({c.family for c in configs}) != 1:
            raise ValueError("stacked Adam runs are all Adam or all AdamW")
        self.state = {"m": {n: torch.zeros_like(t) for n, t in params.items()},
                      "v": {n: torch.zeros_like(t) for n, t in params.items()}}

    def step(self, params: Tensors, grads: Tensors, lr: torch.Tensor) -> None:
        self.steps += 1
        t, cfgs, lrs = self.steps, self.configs, tuple(lr.tolist())
        beta1, beta2 = [c.betas[0] for c in cfgs], [c.betas[1] for c in cfgs]
        decoupled = cfgs[0].family == "adamw"
        # Every scalar as torch.optim computes it, in Python floats, before one rounding to the runs' dtype.
        shrink = self._constant(params, "1 - lr·wd", lambda: [1 - r * c.weight_decay for r, c in zip(lrs, cfgs)], lrs)
        decay = self._constant(params, "wd", lambda: [c.weight_decay for c in cfgs])
        lerp = self._constant(params, "1 - β₁", lambda: [1 - b for b in beta1])
        keep2 = self._constant(params, "β₂", lambda: beta2)
        add2 = self._constant(params, "1 - β₂", lambda: [1 - b for b in beta2])
        eps = self._constant(params, "ε", lambda: [c.eps for c in cfgs])
        # The bias corrections change every step.
        root2 = self._per_run(params, [(1 - b ** t) ** 0.5 for b in beta2])
        step_size = self._per_run(params, [-(r / (1 - b ** t)) for r, b in zip(lrs, beta1)])
        for i, name in enumerate(self.names):
            p, g = params[name], grads[name]
            m, v = self.state["m"][name], self.state["v"][name]
            if decoupled:
                p.mul_(shrink[i])
            else:
                # grad.add(param, alpha=wd), whose kernel fuses the multiply-add as addcmul's does.
                g = torch.addcmul(g, p, decay[i])
            m.lerp_(g, lerp[i])
            # v.mul_(β₂).addcmul_(g, g, value=1 − β₂): the per-run value moves into the first factor.
            v.mul_(keep2[i]).addcmul_(g * add2[i], g)
            denom = v.sqrt().div_(root2[i]).add_(eps[i])
            # param.addcdiv_(m, denom, value=−step): param + (value·m)/denom.
            p.add_(step_size[i] * m / denom)


def stacked(configs: list[OptimizerConfig], params: Tensors) -> StackedOptimizer:
    """The stacked optimizer over ``params``, run i stepping with ``configs[i]`` (one family for all)."""
    return (StackedSGD if configs[0].family == "sgd" else StackedAdam)(configs, params)


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


def torch_dtype(config: StudyConfig) -> torch.dtype:
    return torch.float64 if config.dtype == "float64" else torch.float32
