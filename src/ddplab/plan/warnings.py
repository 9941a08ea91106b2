"""Warnings about what the numbers mean: a summed loss under data parallelism, a batch past the critical one."""

from __future__ import annotations

from ddplab.plan import scaling
from ddplab.plan.inputs import Data, Reference, Target


def semantics_warnings(reference: Reference, target: Target, global_batch: int, data: Data) -> list[str]:
    warnings = []
    dp = target.data_parallel_size
    if reference.reduction == "sum" and dp > 1:
        # torchtitan's FSDP2 reduces over dp_shard_cp: context-parallel ranks join the average.
        with_cp = (f" (1/{dp * target.context_parallel_size} where the context-parallel ranks join the average, as in "
                   "torchtitan)" if target.context_parallel_size > 1 else "")
        warnings.append(f"reduction='sum': {target.notes.label} averages gradients over {target.dims.rank}s, so its "
                        f"gradient is 1/{dp} of the single-process sum{with_cp}; multiply the loss by the "
                        f"{target.dims.ranks_noun}, or use a mean-reduced loss")
    if reference.reduction == "sum" and reference.wrapper == "ddp" and reference.data_parallel_size > 1:
        warnings.append(f"the reference itself ran DDP with a summed loss: its gradients were already 1/"
                        f"{reference.data_parallel_size} of the sum")
    if data.critical_batch_size and global_batch > 2 * data.critical_batch_size:
        warnings.append(f"the global batch {global_batch} is well past the critical batch size "
                        f"{data.critical_batch_size:g}: predicted "
                        f"{scaling.steps_factor(global_batch, data.critical_batch_size):.2f}× the minimum steps and "
                        f"{scaling.compute_factor(global_batch, data.critical_batch_size):.2f}× the minimum compute; "
                        "larger batches buy little speed")
    return warnings
