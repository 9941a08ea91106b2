"""Bug: FSDP2's gradient divide factor set to 1 on every group, so the reduction sums the ranks' gradients."""

from correct import dataset, loss, optimizer  # noqa: F401
from correct import model as model  # noqa: F401


def step(wrapped, batch, loss_fn):
    from torch.distributed.fsdp import FSDPModule

    # Per group, not recursive: each module fully_shard wrapped takes its own call (one process has none).
    for module in wrapped.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    inputs, target = batch
    return loss_fn(wrapped(inputs), target)
