"""Acting on the measurement while training runs: AdaScale's lr gain and a batch ramp, on plain DDP.

gain (the pure arithmetic) · adascale (the lr adapter over any torch optimizer and scheduler) ·
ramp (a global batch that grows with the measured noise scale, by accumulation steps).
Importing this package imports no torch; :class:`AdaScale` and :class:`BatchRamp` load it on first use.
"""

__all__ = ["AdaScale", "BatchRamp"]


def __getattr__(name):
    if name == "AdaScale":
        from ddplab.adapt.adascale import AdaScale

        return AdaScale
    if name == "BatchRamp":
        from ddplab.adapt.ramp import BatchRamp

        return BatchRamp
    raise AttributeError(f"module 'ddplab.adapt' has no attribute {name!r}")
