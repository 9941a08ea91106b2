"""Every finding the audit can make: its severity, what it does to training, and how to fix it (pure data).

The fix for a loss normalised by a local count is also given in the words of the framework the program used.
Messages whose truth depends on the data-parallel reduction hold ``{reduction}`` (what the run's reduction does, in
its engine's words) and ``{divisor}`` (what it divides the ranks' summed gradients by): :func:`message` fills them
with the run's own :class:`~ddplab.runtime.reduction.Reduction`.
"""

from __future__ import annotations

from typing import Literal

from ddplab.runtime.reduction import Reduction

Severity = Literal["error", "warning", "info"]
ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITY_ORDER: dict[Severity, int] = {ERROR: 0, WARNING: 1, INFO: 2}

# The fix for a loss normalised by a local count, in a plain loop (frameworks' own words in TOKEN_FIXES).
GLOBAL_COUNT_RECIPE = (
    "divide the summed loss by the valid-element count of the whole optimizer step, all-reduced over the "
    "data-parallel ranks (and context-parallel ones) and summed over the step's micro-batches, times what the "
    "reduction divides the ranks' summed gradients by ({divisor}). The accumulation loop takes the step's "
    "micro-batches first, counts, then backwards each: micro_batches = [next(batches) for _ in "
    "range(accumulation_steps)]; count = sum((labels != -100).sum() for _, labels in micro_batches); "
    "dist.all_reduce(count, group=dp_group); for inputs, labels in micro_batches (no_sync on all but the last): "
    "loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), reduction='sum'){times} / count; "
    "loss.backward() (torchtitan's global valid-token count; no further division by the accumulation steps)")
# What the same fix is called in a framework the program used, per finding.
TOKEN_FIXES: dict[str, str] = {
    "transformers": "TrainingArguments(average_tokens_across_devices=True) (the default) with a model whose "
                    "forward accepts num_items_in_batch (or a compute_loss_func that divides by it): the Trainer "
                    "then counts the step's label tokens over all micro-batches and devices",
    "lightning": "in training_step, sum the token losses and divide by the step's token count all-reduced with "
                 "self.all_gather or torch.distributed.all_reduce over the data-parallel group, times "
                 "self.trainer.world_size; with accumulate_grad_batches, count over the step's micro-batches too "
                 "(Lightning divides the returned loss by accumulate_grad_batches)",
    "accelerate": "count the step's valid tokens over its micro-batches, accelerator.reduce(count, 'sum') across "
                  "processes, and backward loss_sum * accelerator.num_processes / count (with "
                  "gradient_accumulation_steps, Accelerator.backward divides by the steps: multiply them back in)",
    # Last: the Trainer and Accelerate drive DeepSpeed's engine themselves, and their own recipe is the user's.
    "deepspeed": "DeepSpeed's engine.backward(loss) divides the loss by gradient_accumulation_steps itself, unless "
                 "given scale_wrt_gas=False: take the step's micro-batches first, count their valid tokens, "
                 "all-reduce the count over the data-parallel group, then per micro-batch call "
                 "engine.backward(loss_sum * dp_size / count, scale_wrt_gas=False) and engine.step() (× dp_size "
                 "since the engine averages the ranks' gradients; no division by the accumulation steps anywhere, "
                 "which the default scale_wrt_gas=True would add a second time)",
}
TOKEN_FINDINGS = ("LOSS_NORMALISED_PER_DEVICE", "LOSS_NORMALISED_PER_MICRO_BATCH")
# code → framework → the finding's fix in the words of that framework, where the program used it (the catalogue's own
# fix is the plain loop's); the first framework of a code's table that the program imported wins.
FIXES_IN_FRAMEWORK: dict[str, dict[str, str]] = {
    **{code: TOKEN_FIXES for code in TOKEN_FINDINGS},
    "SCHEDULER_STEPS_PER_PROCESS": {
        "accelerate": "give the schedule's lengths in scheduler steps (multiply warmup and total steps by "
                      "num_processes), or prepare the scheduler with Accelerator(step_scheduler_with_optimizer=False) "
                      "and step it once per optimizer step yourself"},
    "DIVIDE_FACTOR": {
        "manual": "make the two agree: either keep the summed reduction and divide the summed loss by the global count "
                  "alone, or divide the reduced gradients by the world size (or reduce them with ReduceOp.AVG)"},
    "LR_SCALED_NOT_SCHEDULE": {
        "lightning": "scale the lr before configure_optimizers builds the scheduler, or use ddplab.integrations."
                     "lightning.ScaleLearningRate, which scales the lr, group['initial_lr'] and scheduler.base_lrs "
                     "together"},
}

# code → (severity, what it does to training, the fix)
CATALOGUE: dict[str, tuple[str, str, str]] = {
    "NO_ALLREDUCE": (
        ERROR,
        "gradients were not all-reduced: every rank trains alone on its own data, as W separate runs",
        "call the DDP wrapper for every training forward (ddp_model(x), not the model it wraps), and keep the "
        "wrapper alive until backward: build it once, outside the training loop"),
    "PARAMS_DIVERGED": (
        ERROR,
        "parameters differ across ranks: the ranks no longer train the same model",
        "make every rank run the same optimizer steps on all-reduced gradients; look for rank-dependent code, "
        "per-rank seeds in the model, or a forward that bypasses the wrapper"),
    "SAME_DATA_ON_ALL_RANKS": (
        ERROR,
        "ranks trained on the same batches: the W ranks repeat each other's work, and an epoch covers only "
        "1/W of the data it should",
        "give the DataLoader sampler=DistributedSampler(dataset) (and shuffle=False on the loader), or seed each "
        "rank's random batches differently (e.g. seed + rank; where the seed also advances by one per step, "
        "step * world_size + rank, since step + rank repeats another rank's batch one step later)"),
    "TP_RANKS_SEE_DIFFERENT_DATA": (
        ERROR,
        "ranks of one tensor-parallel group were fed different batches: each holds a shard of every parallelised "
        "layer and computes it on its own inputs, so the activations and gradients its group combines mix different "
        "samples; nothing fails, training just learns less",
        "split the data by the data-parallel mesh dimension only: DistributedSampler(dataset, "
        "num_replicas=mesh['dp'].size(), rank=mesh['dp'].get_local_rank()), the same on every rank of a "
        "tensor-parallel group (and seed their random batches alike)"),
    "SET_EPOCH_MISSING": (
        WARNING,
        "a shuffling DistributedSampler fed training the same sample order in two passes over the data: unless "
        "set_epoch is given each epoch's own number, every epoch repeats the first one's order",
        "call sampler.set_epoch(epoch) at the start of every epoch, with that epoch's number (one that advances), "
        "before iterating the loader"),
    "SAMPLER_SEEDED_PER_RANK": (
        WARNING,
        "the ranks' DistributedSamplers shuffle one dataset with different seeds: each rank takes its own slice of "
        "a permutation of its own, so the slices overlap: some samples train on several ranks in an epoch and "
        "others on none",
        "give every rank's DistributedSampler the same seed (DistributedSampler(dataset, seed=args.seed), not "
        "seed + rank): it shuffles one permutation and hands each rank its own slice of it; vary the seed by "
        "epoch with set_epoch"),
    "SUM_REDUCTION": (
        WARNING,
        "backward starts from a loss summed over the batch: {reduction}, so the gradient is 1/{divisor} of what one "
        "process summing the global batch gets (with SGD the step is {divisor} times smaller; Adam-style optimizers "
        "mostly normalise the scale away, but not their epsilon or an L2 penalty in the loss)",
        "for a token loss, divide the summed loss by the step's valid-token count all-reduced over the data-parallel "
        "ranks, times {named} (the global-count recipe; reduction='mean' divides each micro-batch by its own "
        "count, which weighs tokens unequally); for a loss over samples of one size, reduction='mean' or a division "
        "by the sample count; or multiply the summed loss by {named}"),
    "BATCHNORM_NOT_SYNCED": (
        INFO,
        "BatchNorm normalises with statistics over each rank's batch, not the global batch",
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping in DDP computes global statistics "
        "(it needs GPUs with NCCL); with large per-rank batches per-rank statistics are common practice"),
    "ACCUMULATION_SYNCS_EVERY_STEP": (
        WARNING,
        "performance: gradient accumulation all-reduces on every micro-step; the result is unchanged but "
        "communication is accumulation-steps times larger",
        "wrap every micro-step but the last in `with ddp_model.no_sync():`"),
    "ACCUMULATION_REDUCES_EVERY_STEP": (
        INFO,
        "FSDP2 reduced the gradients of every micro-batch accumulated into one optimizer step: the result is "
        "unchanged, the communication accumulation-steps times larger, and the gradients stay sharded between "
        "micro-batches (the memory this saves is why it is FSDP2's default)",
        "where memory allows, model.set_requires_gradient_sync(False) before every micro-batch but the last "
        "(True before the last); under HSDP, set_requires_all_reduce(False) defers only the all-reduce across "
        "replicas"),
    "NOT_DISTRIBUTED": (
        ERROR,
        "several processes were started but each trains a model of its own: W separate runs, each learning only "
        "from what its own process loads (its shard with DistributedSampler, the whole dataset without one)",
        "make the processes join one distributed run: init_process_group and DistributedDataParallel in a plain "
        "loop; with Accelerate on CPU, Accelerator(cpu=True) or ACCELERATE_USE_CPU=1 (check "
        "accelerator.num_processes == WORLD_SIZE)"),
    "SCHEDULER_STEPS_PER_PROCESS": (
        WARNING,
        "the lr scheduler steps several times per optimizer step, so a warmup or decay given in optimizer steps "
        "runs that many times faster: warmup ends early, and a decay reaches its end while training goes on",
        "call scheduler.step() once per optimizer step (after optimizer.step(), outside the micro-batch loop), or "
        "give the schedule's lengths in the scheduler steps it really takes"),
    "LR_SCALED_NOT_SCHEDULE": (
        WARNING,
        "the optimizer's lr was scaled for the world size after its scheduler was built: the scheduler's base_lrs "
        "(and the groups' initial_lr) keep the old lr",
        "scale the lr before building the scheduler (for group in optimizer.param_groups: group['lr'] *= factor, "
        "then scheduler = ...), or scale group['initial_lr'] and scheduler.base_lrs by the same factor too"),
    "LR_SCALED_BY_WORLD_SIZE": (
        WARNING,
        "the lr was scaled by the world size, but under a device mesh only the data-parallel ranks add samples to "
        "the global batch (the ranks of a tensor-parallel group share theirs): the lr is world/dp times (or its "
        "square root) what the scaling rule gives",
        "scale the lr by the data-parallel size (mesh['dp'].size(), or the product of the data-parallel "
        "dimensions), not dist.get_world_size(); `ddplab plan --tp` computes it"),
    "LOSS_NORMALISED_PER_DEVICE": (
        WARNING,
        "each rank divided its loss by its own element (token) count, and {reduction}: with different counts per "
        "rank, an element on a rank with few weighs more than one on a rank with many, so the "
        "gradient is not the mean over the global batch's elements",
        GLOBAL_COUNT_RECIPE),
    "LOSS_NORMALISED_PER_MICRO_BATCH": (
        WARNING,
        "each micro-batch's loss was divided by its own element (token) count before the micro-batches were "
        "accumulated: with different counts per micro-batch, an element of a short micro-batch weighs more than one "
        "of a long one, so the step's gradient is not the mean over its elements",
        GLOBAL_COUNT_RECIPE),
    "GLOBAL_COUNT_WITHOUT_WORLD_SIZE": (
        WARNING,
        "the loss was divided by the element count of the whole step on all data-parallel ranks, and {reduction}: "
        "the gradient is 1/{divisor} of the global mean's (with SGD the step is {divisor} times smaller)",
        "multiply the loss by what the reduction divides by: loss = loss_sum * {divisor} / global_count (the "
        "reduction then divides the ranks' summed gradients by {divisor}, so this gives exactly the global mean)"),
    "DIVIDE_FACTOR": (
        WARNING,
        "the loss was normalised as a reduction that averages needs it (a mean over each rank's own elements, or the "
        "step's global count times the data-parallel size), but {reduction}: the gradient is {factor} times the "
        "global mean's",
        "make the two agree: either keep the reduction and divide the summed loss by the global count alone "
        "(times {divisor}), or remove set_gradient_divide_factor (or the summing comm hook) so that the reduction "
        "averages"),
    "GATHERED_LOSS_WITHOUT_WORLD_SIZE": (
        WARNING,
        "the loss is computed over features all-gathered from every rank by a gather whose backward passes back "
        "only this rank's slice: each rank's parameters get its own rows' share of the loss's gradient, and "
        "{reduction}: the gradient is 1/{size} of what one process computing the same loss gets",
        "multiply the loss by the world size, or gather with torch.distributed.nn.functional.all_gather, whose "
        "backward all-reduces the gradient of every gathered slice"),
    "GATHERED_TERMS_MISSING": (
        WARNING,
        "the loss is computed over features all-gathered from every rank by a gather without autograd: what each "
        "rank's loss sends the other ranks' rows is dropped, and the ranks' losses differ (a local loss), so the "
        "gradient lacks those terms: not a scale of what one process computing the same loss gets, but another "
        "direction",
        "gather with torch.distributed.nn.functional.all_gather, whose backward sums what every rank's loss sends "
        "each slice (with a local loss too: open_clip's --gather-with-grad)"),
    "ACCUMULATION_DIVIDED_TWICE": (
        WARNING,
        "the loss was divided by the gradient accumulation steps, and the engine's backward divided it by them again "
        "(DeepSpeed's engine.backward does, unless given scale_wrt_gas=False): the gradient is 1/K of the global "
        "mean's, K the accumulation steps (with SGD the step is K times smaller; Adam-style optimizers mostly "
        "normalise the scale away, but not their epsilon)",
        "remove your own division by the accumulation steps (engine.backward already divides), or normalise the step "
        "yourself and call engine.backward(loss, scale_wrt_gas=False)"),
    "ACCUMULATION_NOT_DIVIDED": (
        WARNING,
        "each micro-batch's loss reached backward as a whole step's would, undivided by the gradient accumulation "
        "steps: the K micro-batches' gradients add up, so the gradient is K times the step's mean (with SGD the "
        "step is K times larger; Adam-style optimizers mostly normalise the scale away, but not their epsilon), and "
        "it changes with K at the same global batch",
        "divide each micro-batch's loss by the accumulation steps before backward, or (exact with tokens of "
        "different counts) divide its summed loss by the step's count over its micro-batches and data-parallel "
        "ranks, times W; a Transformers Trainer compute_loss override that takes num_items_in_batch must divide "
        "its summed loss by it (the Trainer then skips its own division by the accumulation steps)"),
    "EVAL_SAMPLES_DUPLICATED": (
        WARNING,
        "an evaluation pass over a DistributedSampler that padded the dataset to a multiple of the ranks "
        "(drop_last=False) reached a collective: the padded samples are evaluated and counted twice in the "
        "combined result",
        "count only real samples: shard without padding (indices range(rank, len(dataset), world_size), as "
        "Lightning's UnrepeatedDistributedSampler does), drop the padded duplicates before reducing "
        "(Accelerate's gather_for_metrics does), or DistributedSampler(drop_last=True) where skipping a few "
        "samples is acceptable"),
    "GRADIENTS_NOT_CLEARED": (
        WARNING,
        "gradients are never cleared between optimizer steps: each backward adds to every earlier step's gradients, "
        "so step k follows the sum of k steps' gradients (a momentum nobody asked for, and a step that keeps growing)",
        "call optimizer.zero_grad(set_to_none=True) (or model.zero_grad()) after every optimizer step; to "
        "accumulate over micro-batches, clear once per optimizer step, not never"),
    "AUDIT_INCOMPLETE": (
        INFO,
        "the audit did not cover the whole run; training itself was not affected",
        "nothing to fix in training; the detail says what the audit could not see"),
    "RUN_INFO": (INFO, "", ""),
}

# The findings whose message and fix depend on the run's reduction (:func:`message`).
REDUCTION_FINDINGS = ("SUM_REDUCTION", "GLOBAL_COUNT_WITHOUT_WORLD_SIZE", "DIVIDE_FACTOR",
                      "GATHERED_LOSS_WITHOUT_WORLD_SIZE", *TOKEN_FINDINGS)
# What a message says of a reduction nobody has described yet (a rank's own findings, before the merge).
_ANY_REDUCTION = {"reduction": "DDP and FSDP2 average the gradients over the W data-parallel ranks", "divisor": "W",
                  "named": "W", "times": " * dp_size", "size": "W", "factor": "W/D"}


def fill(text: str, reduction: Reduction | None) -> str:
    """A catalogue text with the run's reduction in it (or the default average's words, where it is unknown)."""
    if reduction is None or not reduction.known:
        return text.format(**_ANY_REDUCTION)
    divisor = f"{reduction.divisor:g}"
    times = "" if reduction.sums else f" * {divisor}"
    size = reduction.data_parallel_size
    # W named where the divisor is the data-parallel size, apart from any other count (the accumulation steps K).
    named = f"W = {divisor}" if reduction.divisor == size else divisor
    return text.format(reduction=reduction.describe(), divisor=divisor, named=named, times=times, size=size,
                       factor=f"{size / reduction.divisor:g}")


def message(code: str, reduction: Reduction | None = None) -> tuple[str, str]:
    """``code``'s message and fix, saying what ``reduction`` does where they depend on it."""
    _, text, fix = CATALOGUE[code]
    if code not in REDUCTION_FINDINGS:
        return text, fix
    return fill(text, reduction), fill(fix, reduction)
