"""Acting on the measurement while training runs: AdaScale's lr gain on plain DDP.

gain (the pure arithmetic) · adascale (the adapter over any torch optimizer and scheduler).
Importing this package imports no torch; :class:`AdaScale` loads it on first use.
"""

__all__ = ["AdaScale"]


def __getattr__(name):
    if name == "AdaScale":
        from ddplab.adapt.adascale import AdaScale

        return AdaScale
    raise AttributeError(f"module 'ddplab.adapt' has no attribute {name!r}")
