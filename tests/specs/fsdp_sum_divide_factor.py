"""A summed loss with FSDP2's divide factor 1: the ranks sum the per-rank sums, which is one process's sum."""

from fsdp_divide_factor import step  # noqa: F401
from sum_reduction import dataset, loss, model  # noqa: F401
