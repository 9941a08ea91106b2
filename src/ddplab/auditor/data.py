"""DistributedSampler's passes: SET_EPOCH_MISSING when two training passes draw the same epoch's order.

A pass counts once it fed optimizer steps (a peek at one batch, or an evaluation pass, does not),
so a correct script that inspects its loader before calling ``set_epoch`` stays clean.
"""

from __future__ import annotations

import functools

from torch.utils.data import DistributedSampler

from ddplab.auditor import state
from ddplab.auditor.patches import Patches


def install(patches: Patches) -> None:
    patches.replace(DistributedSampler, "__iter__", _watched_iter)


def _watched_iter(original_iter):
    @functools.wraps(original_iter)
    def sampler_iter(self, *args, **kwargs):
        iterator = original_iter(self, *args, **kwargs)
        audit = state.current()
        if audit is None or audit.disabled is not None or not (self.shuffle and self.num_replicas > 1):
            return iterator
        return _counted(iterator, self, self.epoch, audit.total_steps)

    return sampler_iter


def _counted(iterator, sampler, epoch: int, steps_at_start: int):
    """Pass the indices through; past half of the shard, note a training pass over ``epoch``'s order."""
    half, drawn, counted = max(1, len(sampler) // 2), 0, False
    for index in iterator:
        drawn += 1
        if drawn >= half and not counted:
            counted = _training_pass(sampler, epoch, steps_at_start) is not False
        yield index
    # Loader workers draw indices ahead of training: the end of the pass is the last chance to see its steps.
    if drawn >= half and not counted:
        _training_pass(sampler, epoch, steps_at_start)


@state.guarded("watching DistributedSampler")
def _training_pass(audit, sampler, epoch: int, steps_at_start: int) -> bool:
    """Note a pass over ``epoch``'s order if it fed optimizer steps; True once noted."""
    # A peek at one batch or an evaluation pass is no training pass: only a pass that fed optimizer steps counts.
    if audit.total_steps == steps_at_start:
        return False
    passes = audit.sampler_passes.setdefault(sampler, [])
    if epoch in passes:
        audit.add("SET_EPOCH_MISSING", f"training pass {len(passes) + 1} drew the same order as an earlier one "
                                       f"(sampler epoch {epoch} both times): set_epoch was not called")
    passes.append(epoch)
    return True
