"""ddplab: see, plan, audit and measure data-parallel training with PyTorch DDP.

Importing the package imports no torch; the torch-backed helpers load on first use.
"""

__version__ = "0.1.0"


def audit(ddp_model, optimizer=None, sampler=None, steps: int = 5):
    """Audit a DDP model from code; see :func:`ddplab.auditor.audit`."""
    from ddplab.auditor import audit as _audit

    return _audit(ddp_model, optimizer=optimizer, sampler=sampler, steps=steps)


def __getattr__(name):
    # Torch-backed names load on first use, so `import ddplab` stays instant.
    if name == "GradientNoiseScale":
        from ddplab.noise_scale import GradientNoiseScale

        return GradientNoiseScale
    if name in ("plan", "Reference", "Target", "Data"):
        from ddplab import planner

        return getattr(planner, name)
    raise AttributeError(f"module 'ddplab' has no attribute {name!r}")
