"""ddplab: see, plan, audit and measure data-parallel training with PyTorch DDP.

Importing the package imports no torch; the torch-backed helpers load on first use.
"""

__version__ = "0.1.0"
