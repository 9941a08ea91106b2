"""Acting on the measurement while training runs: AdaScale's lr gain and a batch ramp, on plain DDP.

gain (the pure arithmetic) · adascale (the lr adapter over any torch optimizer and scheduler) ·
accumulation (what a batch changed by accumulation steps shares) · ramp (a global batch that grows with the
measured noise scale) · thresholds (a batch schedule read and looked up, pure) · schedule (a global batch that
follows a schedule of samples seen, as ``ddplab study --branch-at`` writes one).
Importing this package imports no torch; :class:`AdaScale`, :class:`BatchRamp` and :class:`BatchSchedule` load it
on first use.
"""

__all__ = ["AdaScale", "BatchRamp", "BatchSchedule"]


def __getattr__(name):
    if name == "AdaScale":
        from ddplab.adapt.adascale import AdaScale

        return AdaScale
    if name == "BatchRamp":
        from ddplab.adapt.ramp import BatchRamp

        return BatchRamp
    if name == "BatchSchedule":
        from ddplab.adapt.schedule import BatchSchedule

        return BatchSchedule
    raise AttributeError(f"module 'ddplab.adapt' has no attribute {name!r}")
