"""The rules that train at a fixed lr in the shared grid: constant, linear and square root of k = B/B_ref."""

from __future__ import annotations

import math

from ddplab.study.rules.base import GridRule
from ddplab.study.rules.registry import register


class Constant(GridRule):
    name = "constant"
    summary = "the reference lr at every batch"
    colour = "tab:gray"
    default_for = ("sgd", "adam", "adamw")

    def factor(self, k: float) -> float:
        return 1.0


class Linear(GridRule):
    name = "linear"
    summary = "lr × k (Goyal et al. 2017)"
    colour = "tab:blue"
    predicts = ("sgd",)
    default_for = ("sgd", "adam", "adamw")

    def factor(self, k: float) -> float:
        return k


class Sqrt(GridRule):
    name = "sqrt"
    summary = "lr × √k"
    colour = "tab:orange"
    predicts = ("adam", "adamw")
    default_for = ("sgd", "adam", "adamw")

    def factor(self, k: float) -> float:
        return math.sqrt(k)


register(Constant())
register(Linear())
register(Sqrt())
