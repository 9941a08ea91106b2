"""Translate a training setup to new hardware, with a reason for every number (pure Python, no torch)."""

from ddplab.plan.planner import Data, Plan, Reference, Target, plan

__all__ = ["Data", "Plan", "Reference", "Target", "plan"]
