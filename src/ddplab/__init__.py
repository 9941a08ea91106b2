"""ddplab: see, plan, audit and measure data-parallel training with PyTorch DDP.

The tree is the table of contents: ``plan/`` (batch and lr arithmetic, torch-free), ``check/``,
``noise/``, ``study/``, ``sandbox/``, ``auditor/``, ``integrations/`` (Lightning, Accelerate,
Transformers), ``runtime/`` (launching ranks, signals, spec files, data order), ``cli/`` and
``errors`` (one policy: UsageError for bad input, LaunchError for failed ranks).

Importing the package imports no torch; the torch-backed names load on first use.
"""

__version__ = "0.1.0"


def audit(ddp_model, optimizer=None, sampler=None, steps: int = 5):
    """Audit a DDP model from code; see :func:`ddplab.auditor.install.audit`."""
    from ddplab.auditor.install import audit as _audit

    return _audit(ddp_model, optimizer=optimizer, sampler=sampler, steps=steps)


def __getattr__(name):
    # Torch-backed names load on first use, so `import ddplab` stays instant.
    if name == "GradientNoiseScale":
        from ddplab.noise.scale import GradientNoiseScale

        return GradientNoiseScale
    if name in ("AdaScale", "BatchRamp", "BatchSchedule"):
        from ddplab import adapt

        return getattr(adapt, name)
    if name in ("plan", "Reference", "Target", "Data"):
        from ddplab.plan import planner

        return getattr(planner, name)
    if name in ("UsageError", "LaunchError"):
        from ddplab import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'ddplab' has no attribute {name!r}")
