"""Bug: the documents of token_mean.py with their token loss divided by a number fixed in advance.

The divisor is "the per-device batch × the longest document's label count" written as a number (4 · 31), so the
loss is a sum scaled by a constant: loss() computes the single-process reference on the global batch too, where
the same number divides W·K times as many samples, and the ranks' gradient is 1/(W·K) of the reference's.
"""

import torch.nn.functional as F
from token_mean import IGNORE, collate, dataset, model  # noqa: F401

PER_DEVICE_BATCH_SIZE, MAX_LABELS = 4, 31


def loss(logits, labels):
    summed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return summed / (PER_DEVICE_BATCH_SIZE * MAX_LABELS)
