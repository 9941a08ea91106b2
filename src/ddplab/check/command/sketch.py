"""A count sketch of one tensor by its global element indices: the same on every side of a check, shard by shard.

Each element ``i`` of a parameter's flat global index goes to bucket ``h(i) mod m`` with sign ``±1`` from a second
hash; the sketch is the signed sum per bucket, in float64. It is linear (the sketch of a difference is the difference
of the sketches) and additive over shards (each rank sketches the elements it holds, and the ranks' sketches add up to
the whole tensor's), so two runs that split a parameter differently — one process, DDP replicas, FSDP2 shards — are
compared without gathering it, in ``m`` numbers a parameter. ``|sketch(x)|²`` estimates ``|x|²`` without bias, with a
relative standard deviation of at most √(2/m). A tensor of at most ``m`` elements is stored whole (bucket ``i``, sign
+1): its comparison is exact.

The hashes are 2-universal (``(a·i + b) mod p``, ``p = 2³¹ − 1``), computed in int64 without overflow, with ``a`` and
``b`` drawn from the parameter's key alone, so the same key gives the same sketch on any machine and device.
"""

from __future__ import annotations

import math
import random

import torch

from ddplab.check.command.config import BUCKETS

PRIME = 2**31 - 1
CHUNK = 1 << 20
"""Elements hashed at once: the index tensors stay this small however large the parameter."""


def coefficients(key: str) -> tuple[int, int, int, int]:
    """(a, b) of the bucket hash and (c, d) of the sign hash for the parameter called ``key``."""
    draw = random.Random(f"ddplab-check-sketch:{key}")
    return tuple(draw.randrange(1, PRIME) for _ in range(4))  # type: ignore[return-value]


def sketch(local: torch.Tensor, key: str, global_shape: tuple[int, ...], offset: tuple[int, ...],
           buckets: int = BUCKETS) -> torch.Tensor:
    """The sketch (float64, ``buckets`` long, or the tensor's own size when smaller) of ``local``, the block of a
    tensor of ``global_shape`` whose first element sits at ``offset``."""
    total = math.prod(global_shape)
    size = min(total, buckets)
    out = torch.zeros(size, dtype=torch.float64, device=local.device)
    values = local.detach()
    if values.numel() == 0:
        return out
    if values.dim() == 0:
        values, global_shape, offset = values.reshape(1), (1,), (0,)
    coeffs = coefficients(key)
    # Blocks of whole rows, so no index tensor grows past CHUNK elements.
    rows = max(1, CHUNK // max(1, values[0].numel()))
    for first in range(0, values.shape[0], rows):
        block = values[first:first + rows]
        start = (offset[0] + first, *offset[1:])
        index = _global_indices(tuple(block.shape), global_shape, start, local.device)
        _add(out, index, block.reshape(-1).to(torch.float64), coeffs, exact=total <= buckets)
    return out


def _add(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor, coeffs: tuple[int, int, int, int],
         exact: bool) -> None:
    if exact:
        out.index_add_(0, index, values)
        return
    a, b, c, d = coeffs
    reduced = index.remainder(PRIME)
    bucket = (reduced * a + b).remainder(PRIME).remainder(out.numel())
    sign = (reduced * c + d).remainder(PRIME).remainder(2) * 2 - 1
    out.index_add_(0, bucket, values * sign.to(torch.float64))


def _global_indices(local_shape: tuple[int, ...], global_shape: tuple[int, ...], offset: tuple[int, ...],
                    device) -> torch.Tensor:
    """The flat global index of every element of the block, in the block's own (row-major) order."""
    strides, stride = [], 1
    for size in reversed(global_shape):
        strides.append(stride)
        stride *= size
    strides.reverse()
    flat = torch.zeros((), dtype=torch.int64, device=device)
    for dim, (size, start, step) in enumerate(zip(local_shape, offset, strides)):
        shape = [1] * len(local_shape)
        shape[dim] = size
        flat = flat + ((torch.arange(size, dtype=torch.int64, device=device) + start) * step).reshape(shape)
    return flat.expand(local_shape).reshape(-1)
