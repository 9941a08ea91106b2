"""Bit-exact digests of tensors, computed where the tensor lives, for comparing ranks without collectives.

Correct DDP keeps parameters bitwise identical on every rank, so a digest that changes with any bit
of any element is the right test: no tolerance to tune, and a 3e-5 change in a bias beside a
1024×1024 weight is as visible as a large one.
"""

from __future__ import annotations

import hashlib
import sys

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def digest(tensor: torch.Tensor) -> str:
    """A hex digest of the tensor's bits, shape and dtype (two position-weighted integer sums)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool or flat.is_complex():
        flat = flat.view(torch.uint8) if flat.dtype == torch.bool else torch.view_as_real(flat).reshape(-1)
    ints = flat.contiguous().view(_INT_VIEW[flat.element_size()])
    weighted = plain = 0
    for index, chunk in enumerate(ints.split(_CHUNK)):
        values = chunk.to(torch.int64)
        # Integer arithmetic wraps instead of rounding: any changed bit changes the sum.
        weighted += int((values * _weights(chunk.device, values.numel())).sum()) * (index + 1)
        plain += int(values.sum())
    return f"{weighted & (2**64 - 1):016x}{plain & (2**64 - 1):016x}:{tuple(tensor.shape)}:{tensor.dtype}"


def _weights(device: torch.device, count: int) -> torch.Tensor:
    weights = _WEIGHTS.get(device)
    if weights is None:
        weights = _WEIGHTS[device] = torch.arange(_CHUNK, dtype=torch.int64, device=device).remainder_(8191).add_(1)
    return weights[:count]


def functional(tensor: torch.Tensor) -> float:
    """A fixed linear functional of a tensor's elements, Σ_i (1 + i mod 7) x_i in float64: equal layouts on two ranks
    give values that add as the tensors do (a plain sum of a softmax head's gradient would cancel to 0)."""
    flat = tensor.detach().reshape(-1).double()
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(7).add_(1)
    return float(flat.dot(weights))


def named_digests(named: list[tuple[str, torch.Tensor]]) -> list[list]:
    """``[name, digest, norm]`` per tensor; the norm says how large a difference is once digests differ."""
    out = []
    for name, tensor in named:
        norm = torch.linalg.vector_norm(tensor.detach().double()).item() if tensor.is_floating_point() else 0.0
        out.append([name, digest(tensor), norm])
    return out


def is_plain(tensor: torch.Tensor) -> bool:
    """A dense tensor whose bits live here: an operation on a DTensor (or another subclass) may run a collective."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided and not tensor.is_meta


def is_local(tensor: torch.Tensor) -> bool:
    """A tensor whose values are this rank's: a plain one, or the result of a collective already issued (an
    AsyncCollectiveTensor, which a tensor-parallel layer returns: reading it waits for that collective, runs none)."""
    if is_plain(tensor):
        return True
    module = sys.modules.get("torch.distributed._functional_collectives")
    waiting = getattr(module, "AsyncCollectiveTensor", None)
    return isinstance(waiting, type) and type(tensor) is waiting


def fingerprint(value) -> str | None:
    """A short digest of every plain tensor in a batch (args, kwargs, nested lists and dicts); None without any."""
    parts = [digest(t) for t in iter_tensors(value) if is_plain(t)]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest() if parts else None


def iter_tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)


def first_dim(value) -> int | None:
    """The leading dimension of the first tensor in a batch: its per-rank batch size."""
    for tensor in iter_tensors(value):
        return tensor.shape[0] if tensor.dim() else 1
    return None
