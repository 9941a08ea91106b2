"""What training was fed: DistributedSampler's passes, and the dataset indices behind each training batch.

- ``SET_EPOCH_MISSING``: a second training pass of a shuffling DistributedSampler draws the same order as
  an earlier one. A pass counts once it fed an optimizer step (a peek at one batch, or an evaluation
  pass, does not), so a correct script that inspects its loader before calling ``set_epoch`` stays clean;
  the orders are compared on the pass's first indices, so a repeat is seen within its first batches. The
  detail says what the program did: set_epoch never called, or called with an epoch that never advances.
- ``SAMPLER_SEEDED_PER_RANK``: the ranks' DistributedSamplers of one dataset shuffle with different seeds, so each
  rank takes its slice of a permutation of its own and the slices overlap (a seed + rank): the seed, epoch and
  dataset of each sampler's first training pass are compared across ranks by :func:`ddplab.auditor.findings.merge`.
- ``SAME_DATA_ON_ALL_RANKS`` on indices: each index batch a DataLoader's iterator draws from its sampler
  (the indices its map-style dataset is then asked for) is fingerprinted together with a signature of the
  dataset, and tied to the training forward whose input is the batch the loader returned for it.
  :func:`ddplab.auditor.findings.merge` compares the ranks' index batches as it compares their tensors:
  random augmentation changes the pixels, not which samples were drawn.
"""

from __future__ import annotations

import functools
import hashlib
from collections import deque

import torch
from torch.utils.data import DistributedSampler
from torch.utils.weak import WeakIdKeyDictionary

from ddplab.auditor import evaluation, state
from ddplab.guest import tensors
from ddplab.guest.patches import Patches

# Indices of a pass kept to compare orders; a pass is judged once it drew this many (or all it had).
ORDER_PREFIX = 64
ORDER_EVIDENCE = 8
# Batches a DataLoader returned whose index batch is remembered until a training forward takes them.
LOADED_WINDOW = 16
# Index batches a loader drew ahead of the batches it returned (prefetch_factor × num_workers), per iterator.
DRAWN_AHEAD = 64
# A dataset's signature reads at most this many elements of a list or tensor, and this deep into its attributes.
SIGNATURE_ELEMENTS = 4096
SIGNATURE_DEPTH = 3
SIGNATURE_PARTS = 20000
# DistributedSamplers of a rank whose first training pass is kept for the ranks' comparison.
MAX_SAMPLERS = 8


def install(patches: Patches) -> None:
    global _TABLES
    _TABLES = _Tables()
    patches.replace(DistributedSampler, "__iter__", _watched_iter)
    patches.replace(DistributedSampler, "set_epoch", _watched_set_epoch)
    loader_iter = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", None)
    if loader_iter is not None and callable(getattr(loader_iter, "_next_index", None)):
        patches.replace(loader_iter, "_next_index", _watched_next_index)
        # Also where an evaluation pass's results stop being awaited (evaluation).
        patches.replace(loader_iter, "__next__", _watched_next)


class _Pass:
    """One pass over a DistributedSampler's order."""

    def __init__(self, epoch: int, steps_at_start: int, calls_at_start: int):
        self.epoch, self.steps_at_start, self.calls_at_start = epoch, steps_at_start, calls_at_start
        self.prefix: list[int] = []
        self.training = False  # it fed an optimizer step
        self.judged = False


class _Sampler:
    """A DistributedSampler's training passes and the epochs set_epoch was called with."""

    def __init__(self):
        self.passes: list[_Pass] = []
        self.calls: list[int] = []


class _Tables:
    """This process's side tables (weak: they die with the user's samplers, loader iterators and datasets)."""

    def __init__(self):
        self.samplers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.streams: WeakIdKeyDictionary = WeakIdKeyDictionary()  # DataLoader iterator → its drawn index batches
        self.signatures: WeakIdKeyDictionary = WeakIdKeyDictionary()  # dataset → signature (or None)


_TABLES = _Tables()


# --- DistributedSampler: passes and set_epoch ---

def _watched_set_epoch(original_set_epoch):
    @functools.wraps(original_set_epoch)
    def set_epoch(self, epoch, *args, **kwargs):
        _set_epoch_called(self, epoch)
        return original_set_epoch(self, epoch, *args, **kwargs)

    return set_epoch


@state.guarded("watching DistributedSampler.set_epoch")
def _set_epoch_called(audit, sampler, epoch) -> None:
    calls = _sampler(sampler).calls
    if len(calls) < 1000:
        calls.append(epoch)


def _sampler(sampler) -> _Sampler:
    watch = _TABLES.samplers.get(sampler)
    if watch is None:
        watch = _TABLES.samplers[sampler] = _Sampler()
    return watch


def _watched_iter(original_iter):
    @functools.wraps(original_iter)
    def sampler_iter(self, *args, **kwargs):
        iterator = evaluation.watch_pass(self, original_iter(self, *args, **kwargs))
        audit = state.current()
        if audit is None or audit.disabled is not None or not (self.shuffle and self.num_replicas > 1):
            return iterator
        this_pass = _start_pass(self)
        return iterator if this_pass is None else _counted(iterator, self, this_pass)

    return sampler_iter


@state.guarded("watching DistributedSampler")
def _start_pass(audit, sampler) -> _Pass:
    return _Pass(sampler.epoch, audit.total_steps, len(_sampler(sampler).calls))


def _counted(iterator, sampler, this_pass: _Pass):
    """Pass the indices through; once the pass fed a step and drew enough of its order, compare it."""
    evidence = max(1, min(ORDER_EVIDENCE, len(sampler)))
    for index in iterator:
        if len(this_pass.prefix) < ORDER_PREFIX:
            this_pass.prefix.append(int(index))
        if not this_pass.judged and len(this_pass.prefix) >= evidence:
            _judge_pass(sampler, this_pass)
        yield index
    # Loader workers draw indices ahead of training: the end of the pass is the last chance to see its steps.
    if not this_pass.judged:
        _judge_pass(sampler, this_pass)


@state.guarded("watching DistributedSampler")
def _judge_pass(audit, sampler, this_pass: _Pass) -> None:
    # A peek at one batch or an evaluation pass is no training pass: only a pass that fed optimizer steps counts.
    if audit.total_steps == this_pass.steps_at_start:
        return
    this_pass.judged = this_pass.training = True
    watch = _sampler(sampler)
    for number, earlier in enumerate(watch.passes, start=1):
        common = min(len(earlier.prefix), len(this_pass.prefix))
        if common and earlier.prefix[:common] == this_pass.prefix[:common]:
            audit.add("SET_EPOCH_MISSING", f"training pass {len(watch.passes) + 1} drew the same order as training "
                                           f"pass {number} (sampler epoch {this_pass.epoch} both times): "
                                           f"{_what_set_epoch_did(watch, earlier, this_pass)}")
            break
    if not watch.passes and len(audit.samplers) < MAX_SAMPLERS:
        # Its first training pass: what the ranks' samplers are compared by (findings.merge, SAMPLER_SEEDED_PER_RANK).
        audit.samplers.append({"seed": int(sampler.seed), "epoch": int(this_pass.epoch),
                               "num_replicas": int(sampler.num_replicas), "size": len(sampler.dataset),
                               "signature": _signature(sampler.dataset), "prefix": list(this_pass.prefix)})
    if len(watch.passes) < 16:
        watch.passes.append(this_pass)


def _what_set_epoch_did(watch: _Sampler, earlier: _Pass, later: _Pass) -> str:
    between = watch.calls[earlier.calls_at_start:later.calls_at_start]
    before = watch.calls[:earlier.calls_at_start]
    if not watch.calls:
        return "set_epoch was not called"
    if between and before:
        return (f"set_epoch was called with epoch {later.epoch} in both passes: the epoch given to it never "
                "advances")
    if between:
        return f"set_epoch was called with epoch {later.epoch} before the second pass, and not before the first"
    return f"set_epoch({before[-1]}) was called before the first pass, and not again before the second"


# --- DataLoader: the indices behind each training batch ---

class _Stream:
    """One DataLoader iterator: its dataset's signature and the fingerprints of the index batches it drew."""

    def __init__(self, signature: str | None):
        self.signature = signature
        # (fingerprint, samples) of each index batch drawn; samples None where the loader batches nothing itself.
        self.drawn: deque[tuple[str, int | None]] = deque(maxlen=DRAWN_AHEAD)


def _watched_next_index(original_next_index):
    @functools.wraps(original_next_index)
    def _next_index(self):
        index = original_next_index(self)
        _index_drawn(self, index)
        return index

    return _next_index


def _watched_next(original_next):
    @functools.wraps(original_next)
    def __next__(self):
        ended = evaluation.ended_passes()
        batch = original_next(self)
        evaluation.batch_returned(ended)
        _batch_loaded(self, batch)
        return batch

    return __next__


def _collecting(audit) -> bool:
    """Index batches are collected once a DDP model (or a device mesh) exists, for as long as its training batches
    are (the data window: a bounded number of optimizer steps), never for a whole run."""
    # An FSDP2 model is found at its first forward, after the loader drew that batch: a mesh announces it.
    collecting = (audit.disabled is None and (audit.wrapper_count > 0 or audit.watching_meshes)
                  and audit.total_steps < audit.data_window)
    if not collecting:
        audit.loaded.clear()
    return collecting


@state.guarded("watching a DataLoader's indices")
def _index_drawn(audit, loader_iter, index) -> None:
    kinds = getattr(torch.utils.data.dataloader, "_DatasetKind", None)
    # An iterable dataset's "indices" are placeholders: only a map-style dataset is asked for samples by index.
    if not _collecting(audit) or kinds is None or getattr(loader_iter, "_dataset_kind", None) != kinds.Map:
        return
    stream = _TABLES.streams.get(loader_iter)
    if stream is None:
        stream = _TABLES.streams[loader_iter] = _Stream(_signature(getattr(loader_iter, "_dataset", None)))
    if stream.signature is not None:
        stream.drawn.append((_index_fingerprint(stream.signature, index), _samples(index)))


@state.guarded("watching a DataLoader's batches")
def _batch_loaded(audit, loader_iter, batch) -> None:
    stream = _TABLES.streams.get(loader_iter)
    if stream is None or not stream.drawn or not _collecting(audit):
        return
    # Loaders return batches in the order their indices were drawn (prefetching draws ahead).
    fingerprint, samples = stream.drawn.popleft()
    _count_loaded(audit, samples)
    first = _first_tensor(batch)
    if first is not None:
        audit.loaded[tensors.digest(first)] = fingerprint
        while len(audit.loaded) > LOADED_WINDOW:
            audit.loaded.pop(next(iter(audit.loaded)))


def _samples(index) -> int | None:
    """Samples in an index batch the loader's sampler drew; None for one index (the dataset returns a batch)."""
    if isinstance(index, (list, tuple)):
        return len(index)
    if isinstance(index, torch.Tensor) and index.dim() == 1:
        return int(index.shape[0])
    return None


def _count_loaded(audit, samples: int | None) -> None:
    """The samples training loaders returned since the last optimizer step, in the program's own unit (pairs,
    documents before packing): a batch loaded under no_grad, or while the newest trained model is in eval mode, is no
    training batch."""
    info = audit.training_info
    model = info.root() if info is not None else None
    if not audit.armed or not torch.is_grad_enabled() or (model is not None and not model.training):
        return
    audit.loaded_samples = None if samples is None or audit.loaded_samples is None else audit.loaded_samples + samples


def training_forward(audit, key: str, inputs, window: int) -> bool:
    """A training forward of wrapper ``key``: whether its input is a batch a DataLoader returned (as far as the
    data window sees); if so, that batch's indices are noted (compared across ranks by
    :func:`ddplab.auditor.findings.merge`)."""
    if not audit.loaded or not _collecting(audit):
        return False
    first = _first_tensor(inputs)
    fingerprint = None
    for candidate in (first, _batch_base(first)):
        if candidate is not None and fingerprint is None:
            fingerprint = audit.loaded.pop(tensors.digest(candidate), None)
    if fingerprint is None:
        return False
    indices = audit.index_batches.setdefault(key, [])
    if len(indices) < window:
        indices.append(fingerprint)
    return True


def _batch_base(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The loaded batch an input is a view of, keeping its samples (a language model's ``batch[:, :-1]``); None for
    a slice of the samples (a micro-batch), which is not the whole loaded batch. A copy made after the slice
    (``.contiguous()``, ``.to(device)``) keeps no base, and a loaded batch that is itself a view has its own base
    instead: neither is matched, and their finding then compares the inputs themselves."""
    base = getattr(tensor, "_base", None)
    if base is None or not tensors.is_plain(base) or base.dim() == 0 or tensor.dim() == 0:
        return None
    return base if base.shape[0] == tensor.shape[0] else None


def _first_tensor(value) -> torch.Tensor | None:
    """A batch's first tensor (a model's input comes first), if it is a dense one that digests can read."""
    first = next(tensors.iter_tensors(value), None)
    return first if first is not None and tensors.is_plain(first) else None


def _index_fingerprint(signature: str, index) -> str:
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    return hashlib.blake2b(f"{signature}|{index!r}".encode(), digest_size=8).hexdigest()


# --- which dataset: the same indices of different datasets are different samples ---

def _signature(dataset) -> str | None:
    """A digest of what a dataset holds (its tensors, arrays, strings and numbers, through its attributes), so
    ranks that each read their own shard or file never look alike; None when it holds nothing to tell it by."""
    if dataset is None:
        return None
    try:
        cached = _TABLES.signatures.get(dataset, False)
    except TypeError:
        cached = False
    if cached is not False:
        return cached
    try:
        parts: list[str] = []
        content = [0]
        _describe(dataset, parts, content, 0, set())
        signature = None
        # Only numbers and names (a synthetic dataset drawing random samples) tell nothing about what it holds.
        if content[0]:
            text = f"{type(dataset).__qualname__}|" + "|".join(parts)
            signature = hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
    except Exception:  # noqa: BLE001 - a dataset the signature cannot read: no index evidence from it
        signature = None
    try:
        _TABLES.signatures[dataset] = signature
    except TypeError:
        pass  # a dataset that takes no weak reference: computed again for its next iterator
    return signature


def _describe(value, parts: list[str], content: list[int], depth: int, seen: set[int]) -> None:
    """Append what ``value`` holds to ``parts``; count in ``content`` the parts that are data (tensors, arrays,
    sequences of several items, paths)."""
    if len(parts) >= SIGNATURE_PARTS:
        return  # enough read to tell datasets apart
    if isinstance(value, (str, int, float, bool, bytes)) or value is None:
        content[0] += isinstance(value, str) and "/" in value
        parts.append(repr(value)[:SIGNATURE_ELEMENTS])
    elif isinstance(value, torch.Tensor) and value.layout == torch.strided:
        content[0] += 1
        flat = value.detach().reshape(-1)
        stride = max(1, flat.numel() // SIGNATURE_ELEMENTS)
        parts.append(f"{tuple(value.shape)}:{tensors.digest(flat[::stride].contiguous())}")
    elif type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "reshape"):
        content[0] += 1
        flat = value.reshape(-1)
        stride = max(1, flat.size // SIGNATURE_ELEMENTS)
        parts.append(f"{value.shape}:{hashlib.blake2b(flat[::stride].tobytes(), digest_size=8).hexdigest()}")
    elif id(value) in seen or depth > SIGNATURE_DEPTH:
        parts.append(f"type:{type(value).__qualname__}")
    elif isinstance(value, (list, tuple)):
        seen.add(id(value))
        content[0] += len(value) >= 2
        stride = max(1, len(value) // SIGNATURE_ELEMENTS)
        parts.append(f"len:{len(value)}")
        for item in value[::stride]:
            _describe(item, parts, content, depth + 1, seen)
    elif isinstance(value, dict):
        seen.add(id(value))
        for key in list(value)[:SIGNATURE_ELEMENTS]:
            parts.append(repr(key)[:200])
            _describe(value[key], parts, content, depth + 1, seen)
    elif hasattr(value, "__dict__") and not callable(value):
        seen.add(id(value))
        parts.append(f"type:{type(value).__qualname__}")
        for name, attribute in sorted(vars(value).items()):
            if not name.startswith("__"):
                parts.append(name)
                _describe(attribute, parts, content, depth + 1, seen)
    else:
        parts.append(f"type:{type(value).__qualname__}")

