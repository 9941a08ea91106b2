"""The gradient noise scale: pure estimators, the DDP-hook measurement, a measured run of a spec and its report;
``command/`` measures a user's own training command through the guest in ``guest/``.

Importing this package imports no torch; :class:`GradientNoiseScale` loads it on first use.
"""

__all__ = ["GradientNoiseScale"]


def __getattr__(name):
    if name == "GradientNoiseScale":
        from ddplab.noise.scale import GradientNoiseScale

        return GradientNoiseScale
    raise AttributeError(f"module 'ddplab.noise' has no attribute {name!r}")
