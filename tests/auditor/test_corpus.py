"""ddplab audit on a corpus of realistic DDP programs (tests/corpus), started by torchrun, mp.spawn and fork.

A correct program must run under the audit exactly as it runs alone (same exit code, same stdout lines) and get
no warning or error; each planted mistake must get exactly its own finding. The default matrix runs every correct
program and every mistake once, each under one launcher (torchrun for FSDP2, meshes and the programs that read its
environment, a few under spawn, the rest under fork); DDPLAB_FULL_CORPUS=1 runs every program and mistake under
every launcher, FSDP2 at 4 ranks and HSDP too.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import pytest

# Imported here so that reference runs forked from this process start with them loaded.
import torch._dynamo  # noqa: F401 - DDP's constructor imports it: ~1.6 s per forked rank otherwise
import torch.distributed
import torch.multiprocessing
import torch.nn.parallel
import torch.utils.data  # noqa: F401

import ddplab
from ddplab.runtime.timescale import scaled

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ddplab.__file__)))
LAUNCH_TIMEOUT_S = 120
"""A launch's bound on a quick machine: waits read it scaled, a test's timeout marker is scaled by its start."""
FULL = os.environ.get("DDPLAB_FULL_CORPUS") == "1"
LAUNCHERS = ("torchrun", "spawn", "fork")
TOTAL_STEPS = 24  # epochs_and_exit.py: 3 epochs of 8 steps
GLOO_EXIT_ABORT = "terminate called without an active exception"  # gloo's exit race (tests/conftest.py)


@dataclasses.dataclass(frozen=True)
class Case:
    """One program run: a corpus script, its flags, and the audit window."""

    script: str
    args: tuple[str, ...] = ()
    audit_steps: int | None = None
    world_size: int = 2
    launchers: tuple[str, ...] = LAUNCHERS
    """The launchers the script runs under (a script that reads torchrun's environment itself runs only there)."""

    def command(self, launcher: str) -> list[str]:
        if launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                    str(self.world_size), self.script, *self.args]
        return [sys.executable, self.script, "--launcher", launcher, "--world-size", str(self.world_size), *self.args]


CORRECT = {
    "trainer_class": Case("trainer_class.py"),
    "validate_rank0": Case("validate_rank0.py"),
    "validate_all_ranks": Case("validate_rank0.py", ("--validate-all-ranks",)),
    "validate_through_wrapper": Case("validate_rank0.py", ("--through-wrapper",)),
    "nanogpt_eval_all": Case("nanogpt_accum.py", ("--eval", "all")),
    "nanogpt_eval_rank0": Case("nanogpt_accum.py", ("--eval", "rank0")),
    "nanogpt_eval_rank0_raw": Case("nanogpt_accum.py", ("--eval", "rank0-raw")),
    "zero": Case("zero.py"),
    "gan_freeze": Case("gan.py", ("--g-step", "freeze")),
    "gan_plain": Case("gan.py", ("--g-step", "plain")),
    "probe_rank0": Case("probe_rank0.py"),
    "ema_teacher": Case("ema_teacher.py"),
    "sweep_groups": Case("sweep_groups.py", world_size=4),
    "skipped_step_unused": Case("skipped_step.py", ("--config", "unused")),
    "skipped_step_static": Case("skipped_step.py", ("--config", "static")),
    "epochs_window_2": Case("epochs_and_exit.py", audit_steps=2),
    "epochs_window_50": Case("epochs_and_exit.py", audit_steps=50),
    "epochs_os_exit_window_2": Case("epochs_and_exit.py", ("--exit", "os-exit"), audit_steps=2),
    "epochs_os_exit_window_50": Case("epochs_and_exit.py", ("--exit", "os-exit"), audit_steps=50),
    "imagenet_ddp_on_cpu": Case("imagenet_style.py"),
    "imagenet_hand_sync": Case("imagenet_style.py", ("--sync", "hand")),
    "uneven_join": Case("uneven_join.py"),
    "accumulate_mean": Case("accumulate_sum.py"),
    "accumulate_mean_accum_1": Case("accumulate_sum.py", ("--accum", "1")),
    "accumulate_sum_per_sample": Case("accumulate_sum.py", ("--loss", "sum-per-sample")),
    "accumulate_mean_grad_scaler": Case("accumulate_sum.py", ("--grad-scaler",)),
    "step_budget": Case("step_budget.py"),
    "step_budget_two_passes": Case("step_budget.py", ("--max-steps", "20")),
    "augmented_vision": Case("augmented_vision.py"),
    "augmented_vision_per_rank_files": Case("augmented_vision.py", ("--data", "per-rank-files")),
    "gpu_only_ddp_on_cpu": Case("gpu_only_ddp.py", launchers=("torchrun",)),
    # FSDP2 and device meshes read torchrun's environment, as their own tutorials do.
    "fsdp_trainer": Case("fsdp_trainer.py", launchers=("torchrun",)),
    "fsdp_trainer_4": Case("fsdp_trainer.py", world_size=4, launchers=("torchrun",)),
    "hsdp_reduce_every_micro_batch": Case("fsdp_trainer.py", ("--mesh", "hsdp", "--sync", "every-micro-batch"),
                                          world_size=4, launchers=("torchrun",)),
    "tp_dp": Case("tp_dp.py", world_size=4, launchers=("torchrun",)),
    "tp_dp_sequences": Case("tp_dp.py", ("--data", "sequences"), world_size=4, launchers=("torchrun",)),
    # Token-level losses over documents of different lengths: divided by the step's global token count.
    "token_lm_global": Case("token_lm.py"),
    "token_lm_hand_global": Case("token_lm.py", ("--loss", "hand-global")),
    "token_lm_scaled_terms": Case("token_lm.py", ("--loss", "scaled-terms")),
    "token_lm_zero_grad_before_backward": Case("token_lm.py", ("--zero-grad", "before-backward")),
    "token_lm_packed_token_mean": Case("token_lm.py", ("--loss", "token-mean", "--data", "packed")),
    "token_lm_eval_padded_not_combined": Case("token_lm.py", ("--eval-samples", "41", "--eval-results", "rank0")),
    "token_lm_fsdp_global": Case("token_lm.py", ("--strategy", "fsdp"), launchers=("torchrun",)),
    "token_lm_fsdp_tp_global": Case("token_lm.py", ("--strategy", "fsdp-tp"), world_size=4, launchers=("torchrun",)),
    "token_lm_tp_only": Case("token_lm.py", ("--strategy", "tp"), launchers=("torchrun",)),
    # The shapes of the code people copy, each judged against the reduction and loss function it really runs.
    "titan_summing_reduction": Case("titan_lm.py", launchers=("torchrun",)),
    "kl_label_smoothing_global": Case("label_smoothing.py"),
    "ce_label_smoothing_global": Case("label_smoothing.py", ("--loss", "ce-smoothing")),
    "class_weighted_global": Case("class_weighted.py"),
    "beta_vae_per_sample_kl": Case("beta_vae.py"),
    "near_count_times_world": Case("near_count.py"),
    # open_clip's ClipLoss with gather_with_grad: every rank's share summed back into each slice, local loss or not.
    "clip_gather_with_grad": Case("clip.py", ("--gather-with-grad",)),
    "clip_local_loss_gather_with_grad": Case("clip.py", ("--local-loss", "--gather-with-grad")),
    "clip_accum_gather_with_grad": Case("clip.py", ("--accum-freq", "2", "--gather-with-grad")),
    # open_clip's --local-loss without --gather-with-grad: every gathered copy detached, its own too. Wrong against
    # open_clip alone (which gathers nothing), the same as a program that detaches its copies alone too: an info.
    "clip_local_loss": Case("clip.py", ("--local-loss",)),
    # TRL's DPOTrainer shape: a pair's two sequences in one forward, DPO's mean over the pairs.
    "preference_pairs": Case("preference_pairs.py"),
    "simclr_autograd_gather": Case("simclr.py", ("--gather", "autograd")),
    "simclr_slice_times_world": Case("simclr.py", ("--gather", "slice-times-world")),
    "tp_dp_mean": Case("tp_dp_sum.py", world_size=4, launchers=("torchrun",)),
    # torchtune's shape: summed token losses, the gradients scaled after backward by dp / the all-reduced count, then
    # clipped (by about half: a clip read as the program's scaling would be 1/W).
    "tune_recipe_scaled": Case("tune_recipe.py"),
    "tune_recipe_sum_foreach": Case("tune_recipe.py", ("--loss", "sum", "--scale-by", "foreach")),
    "tune_recipe_fsdp_sum_divide": Case("tune_recipe.py", ("--strategy", "fsdp", "--loss", "sum", "--scale-by",
                                                           "divide"), launchers=("torchrun",)),
    # No wrapper: the program reduces the gradients itself, in its loop or in its optimizer's step (nanochat's).
    "by_hand_loop_sum_divide": Case("by_hand.py"),
    "by_hand_loop_avg": Case("by_hand.py", ("--reduce", "loop-avg")),
    "by_hand_loop_sum_global_count": Case("by_hand.py", ("--reduce", "loop-sum", "--loss", "global-no-world")),
    "by_hand_optimizer_avg": Case("by_hand.py", ("--reduce", "optimizer-avg")),
    "by_hand_optimizer_sum_divide": Case("by_hand.py", ("--reduce", "optimizer-sum-divide")),
}

# Every correct program once. torchrun and spawn (where each worker loads the auditor at its own start) get the
# programs that stress them most (FSDP2, meshes, a program that reads torchrun's environment, exits by os._exit, or
# keeps a training class); fork, which starts ranks from one process that imported torch once (a third of the
# start-up, so about half a torchrun launch's time), gets the rest: its ranks leave through os._exit, so nothing at
# exit may be relied on. Variants that only repeat a mechanism covered here (gan --g-step plain, nanogpt --eval
# rank0-raw) and every other launcher of each program run in the full matrix.
DEFAULT_CORRECT = [
    ("trainer_class", "torchrun"), ("validate_rank0", "fork"), ("zero", "fork"),
    ("epochs_os_exit_window_2", "torchrun"), ("imagenet_hand_sync", "fork"),
    ("validate_all_ranks", "spawn"), ("nanogpt_eval_all", "spawn"), ("imagenet_ddp_on_cpu", "spawn"),
    ("nanogpt_eval_rank0", "fork"), ("gan_freeze", "fork"), ("probe_rank0", "fork"), ("ema_teacher", "fork"),
    ("skipped_step_unused", "fork"), ("skipped_step_static", "fork"), ("epochs_os_exit_window_50", "fork"),
    ("sweep_groups", "fork"), ("validate_through_wrapper", "fork"), ("uneven_join", "fork"),
    ("accumulate_mean", "fork"), ("accumulate_mean_accum_1", "fork"), ("accumulate_sum_per_sample", "fork"),
    ("accumulate_mean_grad_scaler", "fork"),
    ("step_budget_two_passes", "fork"), ("augmented_vision", "fork"), ("augmented_vision_per_rank_files", "fork"),
    ("gpu_only_ddp_on_cpu", "torchrun"), ("fsdp_trainer", "torchrun"), ("tp_dp", "torchrun"),
    ("token_lm_global", "fork"), ("token_lm_hand_global", "fork"), ("token_lm_scaled_terms", "fork"),
    ("token_lm_packed_token_mean", "spawn"), ("token_lm_zero_grad_before_backward", "fork"),
    ("token_lm_eval_padded_not_combined", "fork"), ("token_lm_fsdp_global", "torchrun"),
    ("token_lm_fsdp_tp_global", "torchrun"), ("token_lm_tp_only", "torchrun"),
    ("titan_summing_reduction", "torchrun"), ("kl_label_smoothing_global", "fork"),
    ("ce_label_smoothing_global", "fork"),
    ("class_weighted_global", "fork"), ("beta_vae_per_sample_kl", "fork"), ("near_count_times_world", "fork"),
    ("simclr_autograd_gather", "fork"), ("simclr_slice_times_world", "spawn"), ("tp_dp_mean", "torchrun"),
    ("tune_recipe_scaled", "fork"), ("tune_recipe_sum_foreach", "fork"), ("tune_recipe_fsdp_sum_divide", "torchrun"),
    ("by_hand_loop_sum_divide", "fork"), ("by_hand_loop_sum_global_count", "fork"),
    ("by_hand_optimizer_avg", "torchrun"), ("clip_gather_with_grad", "torchrun"),
    ("clip_local_loss_gather_with_grad", "fork"), ("clip_accum_gather_with_grad", "fork"),
    ("preference_pairs", "fork"), ("clip_local_loss", "fork"),
]

# id → (case, the finding it must give, findings it may give as a consequence, default launcher)
MISTAKES = {
    # Epoch 1 repeats epoch 0's order from step 9, after the 5-step window; fork's os._exit must not lose it.
    "set_epoch_missing_after_window": (Case("trainer_class.py", ("--mistake", "no-set-epoch")),
                                       {"SET_EPOCH_MISSING": "warning"}, {}, "fork"),
    "none_then_sum": (Case("trainer_class.py", ("--mistake", "none-sum")), {"SUM_REDUCTION": "warning"}, {}, "fork"),
    "same_seed": (Case("nanogpt_accum.py", ("--mistake", "same-seed", "--eval", "all")),
                  {"SAME_DATA_ON_ALL_RANKS": "error"}, {}, "fork"),
    "same_seed_shifted_by_rank0_eval": (Case("nanogpt_accum.py", ("--mistake", "same-seed", "--eval", "rank0-raw")),
                                        {"SAME_DATA_ON_ALL_RANKS": "error"}, {}, "fork"),
    "accumulation_without_toggle": (Case("nanogpt_accum.py", ("--mistake", "no-sync-toggle")),
                                    {"ACCUMULATION_SYNCS_EVERY_STEP": "warning"}, {}, "fork"),
    # Training through .module trains each rank alone: its parameters do drift apart as a consequence.
    "module_forward_in_training": (Case("validate_rank0.py", ("--mistake", "module-forward")),
                                   {"NO_ALLREDUCE": "error"}, {"PARAMS_DIVERGED": "error"}, "fork"),
    "bias_nudged_on_rank1": (Case("perturbed_bias.py"), {"PARAMS_DIVERGED": "error"}, {}, "fork"),
    # pytorch/examples' ImageNet script on CPU: a process group and a sharded sampler, but no DDP model.
    "imagenet_unwrapped_on_cpu": (Case("imagenet_style.py", ("--sync", "none")), {"NOT_DISTRIBUTED": "error"}, {},
                                  "torchrun"),
    # Ranks that join early under torch's Join still get the findings of their own steps.
    "uneven_join_sum": (Case("uneven_join.py", ("--mistake", "sum")), {"SUM_REDUCTION": "warning"}, {}, "fork"),
    # CrossEntropyLoss(reduction='sum') then / accum: still a sum, whatever it is divided by last.
    "sum_divided_by_accumulation": (Case("accumulate_sum.py", ("--loss", "sum")), {"SUM_REDUCTION": "warning"}, {},
                                    "fork"),
    # The same under a GradScaler: backward from the sum × 1024, the gradients unscaled before the step.
    "sum_under_grad_scaler": (Case("accumulate_sum.py", ("--loss", "sum", "--grad-scaler")),
                              {"SUM_REDUCTION": "warning"}, {}, "fork"),
    "sum_divided_by_accumulation_1": (Case("accumulate_sum.py", ("--loss", "sum", "--accum", "1")),
                                      {"SUM_REDUCTION": "warning"}, {}, "fork"),
    # set_epoch(0) before every pass: the second pass repeats the first from its first batch (2 batches into it).
    "set_epoch_frozen": (Case("step_budget.py", ("--mistake", "frozen-epoch")), {"SET_EPOCH_MISSING": "warning"}, {},
                         "fork"),
    # The same indices on every rank, augmented differently: no two tensors alike.
    "same_indices_augmented": (Case("augmented_vision.py", ("--mistake", "random-sampler")),
                               {"SAME_DATA_ON_ALL_RANKS": "error"}, {}, "fork"),
    # DistributedSampler(seed=SEED + rank): each rank's slice of a permutation of its own.
    "sampler_seeded_per_rank": (Case("augmented_vision.py", ("--mistake", "seed-per-rank")),
                                {"SAMPLER_SEEDED_PER_RANK": "warning"}, {}, "fork"),
    "gpu_only_no_group": (Case("gpu_only_ddp.py", ("--distributed-when", "cuda"), launchers=("torchrun",)),
                          {"NOT_DISTRIBUTED": "error"}, {}, "torchrun"),
    # A group joined but never used, in a run shorter than the audit window.
    "gpu_only_unused_group": (Case("gpu_only_ddp.py", ("--distributed-when", "cuda-model"), launchers=("torchrun",)),
                              {"NOT_DISTRIBUTED": "error"}, {}, "torchrun"),
    # cross_entropy(reduction='sum') / accumulation steps in an FSDP2 trainer under AdamW.
    "fsdp_sum": (Case("fsdp_trainer.py", ("--loss", "sum"), launchers=("torchrun",)), {"SUM_REDUCTION": "warning"}, {},
                 "torchrun"),
    # tp × dp with DistributedSampler(dataset): split by the world size, so a tp group's two ranks differ.
    "tp_dp_world_sampler": (Case("tp_dp.py", ("--mistake", "world-sampler"), world_size=4, launchers=("torchrun",)),
                            {"TP_RANKS_SEE_DIFFERENT_DATA": "error"}, {}, "torchrun"),
    # Fabric's shape: the model is fed a view of the loaded batch (batch[:, :-1]), whose indices are still compared.
    "tp_dp_world_sampler_sequences": (Case("tp_dp.py", ("--mistake", "world-sampler", "--data", "sequences"),
                                           world_size=4, launchers=("torchrun",)),
                                      {"TP_RANKS_SEE_DIFFERENT_DATA": "error"}, {}, "torchrun"),
    # Token means over documents of different lengths, each divided by a count of its own.
    "token_mean_per_micro_batch": (Case("token_lm.py", ("--loss", "token-mean")),
                                   {"LOSS_NORMALISED_PER_MICRO_BATCH": "warning"}, {}, "fork"),
    # The same means never divided by the accumulation steps: the weighting and the K× scale, both.
    "token_mean_not_divided": (Case("token_lm.py", ("--loss", "token-mean-undivided")),
                               {"LOSS_NORMALISED_PER_MICRO_BATCH": "warning", "ACCUMULATION_NOT_DIVIDED": "warning"},
                               {}, "fork"),
    "token_mean_per_device": (Case("token_lm.py", ("--loss", "token-mean", "--accumulation", "1")),
                              {"LOSS_NORMALISED_PER_DEVICE": "warning"}, {}, "fork"),
    "rank_token_count": (Case("token_lm.py", ("--loss", "rank-mean")), {"LOSS_NORMALISED_PER_DEVICE": "warning"}, {},
                         "spawn"),
    "hand_written_token_mean": (Case("token_lm.py", ("--loss", "hand-mean")),
                                {"LOSS_NORMALISED_PER_MICRO_BATCH": "warning"}, {}, "fork"),
    "hand_written_token_sum": (Case("token_lm.py", ("--loss", "hand-sum")), {"SUM_REDUCTION": "warning"}, {}, "fork"),
    # No loss function: a .mean() over the masked selection of the label tokens' log-probs, per rank.
    "selected_log_prob_mean": (Case("token_lm.py", ("--loss", "selected-mean", "--accumulation", "1")),
                               {"LOSS_NORMALISED_PER_DEVICE": "warning"}, {}, "fork"),
    "global_count_without_world_size": (Case("token_lm.py", ("--loss", "global-no-world")),
                                        {"GLOBAL_COUNT_WITHOUT_WORLD_SIZE": "warning"}, {}, "fork"),
    "eval_padded_all_reduced": (Case("token_lm.py", ("--eval-samples", "41")), {"EVAL_SAMPLES_DUPLICATED": "warning"},
                                {}, "fork"),
    "token_mean_fsdp": (Case("token_lm.py", ("--strategy", "fsdp", "--loss", "token-mean", "--accumulation", "1"),
                             launchers=("torchrun",)), {"LOSS_NORMALISED_PER_DEVICE": "warning"}, {}, "torchrun"),
    "gradients_never_cleared": (Case("token_lm.py", ("--zero-grad", "never")), {"GRADIENTS_NOT_CLEARED": "warning"},
                                {}, "fork"),
    "gradients_never_cleared_fsdp_tp": (Case("token_lm.py", ("--strategy", "fsdp-tp", "--zero-grad", "never"),
                                             world_size=4, launchers=("torchrun",)),
                                        {"GRADIENTS_NOT_CLEARED": "warning"}, {}, "torchrun"),
    "token_mean_fsdp_tp": (Case("token_lm.py", ("--strategy", "fsdp-tp", "--loss", "token-mean"), world_size=4,
                                launchers=("torchrun",)), {"LOSS_NORMALISED_PER_MICRO_BATCH": "warning"}, {},
                           "torchrun"),
    # torchtitan's global count without its set_gradient_divide_factor(1.0): FSDP2 averages a loss already global.
    "titan_averaging_reduction": (Case("titan_lm.py", ("--divide-factor", "default"), launchers=("torchrun",)),
                                  {"GLOBAL_COUNT_WITHOUT_WORLD_SIZE": "warning"}, {}, "torchrun"),
    # The divide factor 1 and the × W a DDP script writes: the summed gradient is W times the global mean's.
    "titan_times_world_under_sum": (Case("titan_lm.py", ("--loss", "times-world"), launchers=("torchrun",)),
                                    {"DIVIDE_FACTOR": "warning"}, {}, "torchrun"),
    # The Annotated Transformer's KLDivLoss(reduction='sum') / batch.ntokens, the micro-batch's own token count.
    # Not divided by the accumulation steps either (its run_epoch backwards each micro-batch's loss as it is).
    "kl_label_smoothing_per_micro_batch": (Case("label_smoothing.py", ("--loss", "per-batch-tokens")),
                                           {"LOSS_NORMALISED_PER_MICRO_BATCH": "warning",
                                            "ACCUMULATION_NOT_DIVIDED": "warning"}, {}, "fork"),
    "kl_label_smoothing_per_device": (Case("label_smoothing.py", ("--loss", "per-batch-tokens", "--accumulation", "1")),
                                      {"LOSS_NORMALISED_PER_DEVICE": "warning"}, {}, "fork"),
    # nn.CrossEntropyLoss(weight=w): each rank's mean divides by its own targets' summed class weights.
    "class_weighted_mean": (Case("class_weighted.py", ("--loss", "mean")), {"LOSS_NORMALISED_PER_DEVICE": "warning"},
                            {}, "fork"),
    # mse_loss(x, x̂) + 0.1 * (-0.5 * torch.sum(KL terms)): the KL term is a sum scaled by constants.
    "beta_vae_kl_sum": (Case("beta_vae.py", ("--kl", "sum")), {"SUM_REDUCTION": "warning"}, {}, "fork"),
    # A global count a token per sequence larger than the loss's own, without × W.
    "near_count_without_world": (Case("near_count.py", ("--mistake", "no-world-size")),
                                 {"GLOBAL_COUNT_WITHOUT_WORLD_SIZE": "warning"}, {}, "fork"),
    # A GatherLayer whose backward returns only this rank's slice, the loss not × W.
    "simclr_slice_gather": (Case("simclr.py", ("--gather", "slice")), {"GATHERED_LOSS_WITHOUT_WORLD_SIZE": "warning"},
                            {}, "torchrun"),
    # open_clip's default: dist.all_gather without autograd, this rank's features put back with their graph.
    "clip_no_grad_gather": (Case("clip.py"), {"GATHERED_LOSS_WITHOUT_WORLD_SIZE": "warning"}, {}, "torchrun"),
    "clip_no_grad_gather_accum": (Case("clip.py", ("--accum-freq", "2")),
                                  {"GATHERED_LOSS_WITHOUT_WORLD_SIZE": "warning"}, {}, "fork"),
    # A local loss whose gather puts the own slice back: the ranks' losses differ, the others' terms are dropped.
    "clip_local_loss_put_back": (Case("clip.py", ("--local-loss", "--put-back")), {"GATHERED_TERMS_MISSING": "warning"},
                                 {}, "fork"),
    # The official FSDP + TP example's model(inp).sum() on a dp × tp mesh.
    "tp_dp_hand_sum": (Case("tp_dp_sum.py", ("--loss", "sum"), world_size=4, launchers=("torchrun",)),
                       {"SUM_REDUCTION": "warning"}, {}, "torchrun"),
    # torchtune's recipe with its gradients scaled by 1 / the global count (no dp), or by 1 / the rank's own count:
    # under DDP the ranks then step different gradients, and their parameters part.
    "tune_recipe_no_world": (Case("tune_recipe.py", ("--mistake", "no-world", "--loss", "sum")),
                             {"GLOBAL_COUNT_WITHOUT_WORLD_SIZE": "warning"}, {}, "fork"),
    "tune_recipe_rank_count": (Case("tune_recipe.py", ("--mistake", "rank-count", "--scale-by", "foreach")),
                               {"LOSS_NORMALISED_PER_DEVICE": "warning"}, {"PARAMS_DIVERGED": "error"}, "fork"),
    "tune_recipe_fsdp_rank_count": (Case("tune_recipe.py", ("--strategy", "fsdp", "--mistake", "rank-count"),
                                         launchers=("torchrun",)),
                                    {"LOSS_NORMALISED_PER_DEVICE": "warning"}, {}, "torchrun"),
    # Gradients reduced by hand with ReduceOp.SUM and never divided, under a loss already × W / the global count.
    "by_hand_loop_sum_times_world": (Case("by_hand.py", ("--reduce", "loop-sum")), {"DIVIDE_FACTOR": "warning"}, {},
                                     "fork"),
    "by_hand_optimizer_sum_times_world": (Case("by_hand.py", ("--reduce", "optimizer-sum")),
                                          {"DIVIDE_FACTOR": "warning"}, {}, "torchrun"),
    "by_hand_loop_summed_loss": (Case("by_hand.py", ("--reduce", "loop-avg", "--loss", "hand-sum")),
                                 {"SUM_REDUCTION": "warning"}, {}, "fork"),
    "by_hand_same_data": (Case("by_hand.py", ("--mistake", "same-data")), {"SAME_DATA_ON_ALL_RANKS": "error"}, {},
                          "fork"),
    "by_hand_optimizer_token_mean": (Case("by_hand.py", ("--reduce", "optimizer-avg", "--loss", "token-mean",
                                                         "--accumulation", "1")),
                                     {"LOSS_NORMALISED_PER_DEVICE": "warning"}, {}, "fork"),
}

# id → (finding, words its message must hold): what the finding says happened.
MESSAGES = {
    "sum_divided_by_accumulation": ("SUM_REDUCTION", "divided by K = 4, the micro-batches accumulated"),
    "sum_under_grad_scaler": ("SUM_REDUCTION", "divided by K = 4, the micro-batches accumulated"),
    "sum_divided_by_accumulation_1": ("SUM_REDUCTION", "each of a micro-batch's 16 samples weighs 1"),
    "set_epoch_frozen": ("SET_EPOCH_MISSING", "set_epoch was called with epoch 0 in both passes"),
    "set_epoch_missing_after_window": ("SET_EPOCH_MISSING", "set_epoch was not called"),
    "same_indices_augmented": ("SAME_DATA_ON_ALL_RANKS", "loaded from the same indices of the same dataset"),
    "sampler_seeded_per_rank": ("SAMPLER_SEEDED_PER_RANK", "one dataset of 256 samples over 2 replicas, rank 0 seed "
                                                           "42, rank 1 seed 43: about 25% of the samples train on two "
                                                           "ranks or more in an epoch and 25% on none"),
    "gpu_only_no_group": ("NOT_DISTRIBUTED", "torchrun started 2 processes (WORLD_SIZE=2), but this process stepped"),
    "gpu_only_unused_group": ("NOT_DISTRIBUTED", "torchrun started 2 processes (WORLD_SIZE=2); they joined a process "
                                                 "group"),
    "fsdp_sum": ("SUM_REDUCTION", "FSDP2 averages the gradients over the 2 data-parallel ranks, so the gradient is 1/2 "
                                  "of what one process summing the global batch gets (with SGD the step is 2 times "
                                  "smaller; Adam-style optimizers mostly normalise the scale away, but not their "
                                  "epsilon or an L2 penalty in the loss) (a summed loss reached backward divided by "
                                  "K = 2, the micro-batches accumulated per optimizer step: each of a micro-batch's 8 "
                                  "samples weighs 1/2 in the gradient where a mean would weigh it 1/16, so the loss "
                                  "still grows with the per-device batch (dividing by the accumulation steps does not "
                                  "make a sum a mean)"),
    "tp_dp_world_sampler": ("TP_RANKS_SEE_DIFFERENT_DATA", "in the tp group of ranks 0, 1, "),
    "tp_dp_world_sampler_sequences": ("TP_RANKS_SEE_DIFFERENT_DATA", "training batches of rank 1 and rank 0 were "
                                                                     "loaded from different dataset indices"),
    # The weights the documents' lengths give (first step, seed 0): rank 0's micro-batches hold 95 and 31 tokens.
    "token_mean_per_micro_batch": ("LOSS_NORMALISED_PER_MICRO_BATCH",
                                   "on rank 0 the micro-batches held 95, 31 elements, so an element of micro-batch 2 "
                                   "weighed 3.06× one of micro-batch 1"),
    "token_mean_not_divided": ("ACCUMULATION_NOT_DIVIDED", "the step's elements weighed 2 in all over its 2 "
                                                           "micro-batches per rank"),
    "token_mean_per_device": ("LOSS_NORMALISED_PER_DEVICE", "(rank 0 67, rank 1 29): an element on rank 1 weighed "
                                                            "2.31× one on rank 0"),
    "selected_log_prob_mean": ("LOSS_NORMALISED_PER_DEVICE", "(rank 0 67, rank 1 29): an element on rank 1 weighed "
                                                             "2.31× one on rank 0"),
    "rank_token_count": ("LOSS_NORMALISED_PER_DEVICE", "(rank 0 126, rank 1 172): an element on rank 0 weighed 1.37× "
                                                       "one on rank 1"),
    "hand_written_token_sum": ("SUM_REDUCTION", "weighs 1 in the gradient"),
    "gradients_never_cleared": ("GRADIENTS_NOT_CLEARED", "the first backward after optimizer step 0 started with the "
                                                         "gradients of 5 of 5 parameters still nonzero"),
    "global_count_without_world_size": ("GLOBAL_COUNT_WITHOUT_WORLD_SIZE", "the gradient is 1/2 of the global mean's"),
    "titan_averaging_reduction": ("GLOBAL_COUNT_WITHOUT_WORLD_SIZE", "FSDP2 averages the gradients over the 2 "
                                                                     "data-parallel ranks: the gradient is 1/2"),
    "titan_times_world_under_sum": ("DIVIDE_FACTOR", "but FSDP2 sums the 2 data-parallel ranks' gradients here "
                                                     "(set_gradient_divide_factor(1)): the gradient is 2 times"),
    "beta_vae_kl_sum": ("SUM_REDUCTION", "a sum written by hand at beta_vae.py:"),
    "near_count_without_world": ("GLOBAL_COUNT_WITHOUT_WORLD_SIZE", "elements, where the loss uses"),
    "simclr_slice_gather": ("GATHERED_LOSS_WITHOUT_WORLD_SIZE", "gathered from the 2 ranks, and its backward "
                                                                "returned only rank"),
    "clip_no_grad_gather": ("GATHERED_LOSS_WITHOUT_WORLD_SIZE", "every rank's slice kept exactly 1/2 of what the 2 "
                                                                "ranks' losses sent it (the same loss on every rank)"),
    "clip_no_grad_gather_accum": ("GATHERED_LOSS_WITHOUT_WORLD_SIZE",
                                  "at 1/2: 8 parameter tensors (visual.2.bias, text.2.bias, visual.2.weight, …); "
                                  "reached outside the gather, whole: 1 parameter tensor (logit_scale)"),
    "clip_local_loss_put_back": ("GATHERED_TERMS_MISSING", "(a scale would be 1/2 at cosine 1)"),
    "tp_dp_hand_sum": ("SUM_REDUCTION", "FSDP2 averages the gradients over the 2 data-parallel ranks"),
    "tune_recipe_no_world": ("GLOBAL_COUNT_WITHOUT_WORLD_SIZE", "the gradient is 1/2 of the global mean's (these "
                                                                "weights include the program's scaling of the "
                                                                "gradients after backward: ×0.003906 on every rank)"),
    "tune_recipe_rank_count": ("PARAMS_DIVERGED", "the program scaled its gradients after they were reduced by a "
                                                  "different number on each rank (rank 0 ×0.007874, rank 1 ×0.007752)"),
    "tune_recipe_fsdp_rank_count": ("LOSS_NORMALISED_PER_DEVICE", "(rank 0 115, rank 1 148): an element on rank 0 "
                                                                  "weighed 1.29× one on rank 1"),
    "by_hand_loop_sum_times_world": ("DIVIDE_FACTOR", "but the program's own reduction sums the 2 data-parallel "
                                                      "ranks' gradients here (dist.all_reduce with ReduceOp.SUM in the "
                                                      "training loop; measured): the gradient is 2 times the global "
                                                      "mean's"),
    "by_hand_optimizer_sum_times_world": ("DIVIDE_FACTOR", "(dist.reduce_scatter_tensor with ReduceOp.SUM in "
                                                           "DistAdamW.step; measured): the gradient is 2 times"),
    "by_hand_loop_summed_loss": ("SUM_REDUCTION", "the program's own reduction averages the gradients over the 2 "
                                                  "data-parallel ranks (dist.all_reduce with ReduceOp.AVG in the "
                                                  "training loop; measured), so the gradient is 1/2 of what one "
                                                  "process summing the global batch gets"),
    "eval_padded_all_reduced": ("EVAL_SAMPLES_DUPLICATED", "41 samples on 2 ranks padded it to 42: 1 sample was "
                                                           "evaluated twice (the padding is on rank 1)"),
}

# id → the lr the report's header must show: the configured (peak) lr, not the last audited step's.
CONFIGURED_LR = {"step_budget_two_passes": 0.02, "nanogpt_eval_all": 3e-3}
# The samples the loader feeds one optimizer step on all ranks (a GAN's generated batch is no part of it).
GLOBAL_BATCH = {"token_lm_fsdp_tp_global": 4 * 2 * 2, "gan_freeze": 64, "gan_plain": 64, "trainer_class": 32,
                # Micro-batch × accumulation steps × the data-parallel size: never the world size when tp > 1.
                "fsdp_trainer": 8 * 2 * 2, "fsdp_trainer_4": 8 * 2 * 4, "hsdp_reduce_every_micro_batch": 8 * 2 * 4,
                "tp_dp": 4 * 2, **{name: 4 * 2 * 2 for name in CORRECT if name.startswith("by_hand")},
                # Counted in the samples the loaders returned, where the forwards took rows made from them.
                "preference_pairs": 4 * 2, "simclr_autograd_gather": 8 * 2, "clip_gather_with_grad": 8 * 2,
                # An FSDP2 root called with keywords only (torchtune's self._model(**batch)).
                "tune_recipe_fsdp_sum_divide": 4 * 2 * 2}
# What the global batch counts where it is not the forwards' rows (None: it is).
GLOBAL_BATCH_UNIT = {"preference_pairs": "samples the DataLoaders returned; the model's forwards took 16 rows",
                     "simclr_autograd_gather": "samples the DataLoaders returned; the model's forwards took 32 rows",
                     "clip_gather_with_grad": None, "trainer_class": None}
# The run under a mesh: (data-parallel size, strategy, mesh); DDP runs report their group's size and no mesh.
SETTING = {"token_lm_fsdp_tp_global": (2, "fsdp+tp", {"dp": 2, "tp": 2}),
           "tp_dp_mean": (2, "fsdp+tp", {"dp": 2, "tp": 2}),
           "fsdp_trainer": (2, "fsdp", {"dp": 2}), "fsdp_trainer_4": (4, "fsdp", {"dp": 4}),
           "hsdp_reduce_every_micro_batch": (4, "hsdp", {"dp_replicate": 2, "dp_shard": 2}),
           "tp_dp": (2, "fsdp+tp", {"dp": 2, "tp": 2}), "trainer_class": (2, "ddp", None),
           **{name: (2, "manual", None) for name in CORRECT if name.startswith("by_hand")}}
# What the data-parallel reduction divides the ranks' summed gradients by, as the report measured it.
DIVISOR = {"by_hand_loop_sum_divide": 2.0, "by_hand_loop_avg": 2.0, "by_hand_loop_sum_global_count": 1.0,
           "by_hand_optimizer_avg": 2.0, "by_hand_optimizer_sum_divide": 2.0}
# Runs with model parallelism and no data-parallel dimension: the mesh the report names instead of a DDP model.
MODEL_PARALLEL_ONLY = {"token_lm_tp_only": {"tp": 2}}
# Information a correct program must get (and no other, in these programs).
INFO = {"hsdp_reduce_every_micro_batch": {"ACCUMULATION_REDUCES_EVERY_STEP"}, "fsdp_trainer": set(), "tp_dp": set(),
        "clip_local_loss": {"GATHERED_TERMS_MISSING"}, "clip_gather_with_grad": set()}

# What `ddplab audit` itself prints: interim reports, the final report, finding and fix lines.
REPORT_LINE = re.compile(r"^(ddplab audit\b|\[rank \d+, after |\s*(ERROR|WARNING|INFO)\b|\s*fix:|"
                         r"\s*no [\w -]+ mistakes found)")


@dataclasses.dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


# --- running programs ---

def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for p in frontier for child in children.get(p, [])]
        found += frontier
    return found


def _kill_tree(pid: int) -> None:
    for process in [pid, *_descendants(pid)]:
        try:
            os.kill(process, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _hang(command: list[str], stdout: str, stderr: str):
    pytest.fail(f"HANG: {' '.join(command)} did not finish in {scaled(LAUNCH_TIMEOUT_S):.0f} s\n"
                f"stdout tail:\n{stdout[-2000:]}\nstderr tail:\n{stderr[-3000:]}")


def _run(command: list[str]) -> Run:
    """Run a command in the corpus directory; a hang fails the test (and its whole process tree is killed). A run
    that gloo aborted at exit, and only so (tests/conftest.py), runs once more."""
    done = _run_once(command)
    return _run_once(command) if done.returncode != 0 and GLOO_EXIT_ABORT in done.stderr else done


def _run_once(command: list[str]) -> Run:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=CORPUS, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=scaled(LAUNCH_TIMEOUT_S))
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        _hang(command, *proc.communicate())
    return Run(proc.returncode, stdout, stderr, time.monotonic() - start)


def _run_forked(case: Case) -> Run:
    """`python SCRIPT --launcher fork` from a fork of this process, which has torch imported: no start-up cost."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _forked_main(case, out.fileno(), err.fileno())
        deadline = start + scaled(LAUNCH_TIMEOUT_S)
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            _kill_tree(pid)
            os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        if done[0] == 0:
            _hang(case.command("fork"), stdout, stderr)
    return Run(os.waitstatus_to_exitcode(done[1]), stdout, stderr, time.monotonic() - start)


def _forked_main(case: Case, out_fd: int, err_fd: int):
    code = 1
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # noqa: SIM115
        os.chdir(CORPUS)
        sys.path.insert(0, CORPUS)
        sys.argv = case.command("fork")[1:]
        runpy.run_path(case.script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - the forked child reports any failure as its exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@functools.cache
def _plain(case: Case, launcher: str) -> Run:
    """The program run alone. Its output does not depend on the launcher (the full matrix checks that), so the
    default matrix reuses one forked run for every launcher."""
    if FULL or "fork" not in case.launchers:
        return _run(case.command(launcher))
    return _run_forked(case)


# --- the audit CLI and its report: the one place that knows them ---

def _audit(command: list[str], steps: int | None = None) -> tuple[Run, dict | None]:
    """`ddplab audit` on a command: the run and the JSON report (None when none was written)."""
    with tempfile.TemporaryDirectory(prefix="corpus-audit-") as tmp:
        report_path = os.path.join(tmp, "audit.json")
        flags = ["--json-file", report_path] + ([] if steps is None else ["--steps", str(steps)])
        run = _run([sys.executable, "-m", "ddplab", "audit", *flags, "--", *command])
        report = None
        if os.path.exists(report_path):
            with open(report_path) as fh:
                report = json.load(fh)
    return run, report


@functools.cache
def _audited(case: Case, launcher: str) -> tuple[Run, dict | None]:
    """A mistake's audited run, once for every test that reads it."""
    return _audit(case.command(launcher), steps=case.audit_steps)


def _program_lines(stdout: str) -> list[str]:
    """The program's own stdout lines, sorted (ranks interleave): the audit's report lines removed."""
    lines = stdout.splitlines()
    final_report = [i for i, line in enumerate(lines) if line.startswith("ddplab audit")]
    if final_report:
        lines = lines[:final_report[-1]]  # the final report is the tail of stdout
    return sorted(line for line in lines if not REPORT_LINE.match(line))


def _serious(report: dict) -> dict[str, str]:
    return {f["code"]: f["severity"] for f in report["findings"] if f["severity"] in ("error", "warning")}


def _why(verdict: str, run: Run, report: dict | None) -> str:
    """A failure message whose first line says what went wrong (it is what pytest's summary shows)."""
    errors = [line.strip() for line in run.stderr.splitlines()
              if re.search(r"(Error|Exception|what\(\)|exitcode)\b.*:", line) and "ChildFailedError" not in line]
    findings = [(f["code"], f["severity"], f.get("message", "")[-160:]) for f in (report or {}).get("findings", [])]
    return (f"{verdict}\nfirst errors: {list(dict.fromkeys(errors))[:6]}\nfindings: {findings}\n"
            f"stderr tail:\n{run.stderr[-2500:]}")


def _matrix(default):
    return [(name, launcher) for name, case in CORRECT.items() for launcher in case.launchers] if FULL else default


# --- the tests ---

@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("name, launcher", _matrix(DEFAULT_CORRECT))
def test_a_correct_program_runs_unchanged_and_clean_under_audit(name, launcher):
    case = CORRECT[name]
    plain = _plain(case, launcher)
    assert plain.returncode == 0, _why("the program fails on its own", plain, None)
    audited, report = _audit(case.command(launcher), steps=case.audit_steps)
    assert audited.returncode == plain.returncode, \
        _why(f"CRASH: exit code {audited.returncode} under audit, {plain.returncode} alone", audited, report)
    assert _program_lines(audited.stdout) == _program_lines(plain.stdout), \
        _why("OUTPUT CHANGED: the program printed other lines under audit", audited, report)
    assert report is not None, _why("NO REPORT: the audit wrote no report", audited, report)
    assert report["world_size"] == case.world_size
    assert _serious(report) == {}, _why(f"FALSE ALARM: {_serious(report)}", audited, report)
    if name in GLOBAL_BATCH:
        assert report["global_batch_size"] == GLOBAL_BATCH[name], \
            _why(f"GLOBAL BATCH: {report['global_batch_size']}", audited, report)
    if name in GLOBAL_BATCH_UNIT:
        assert report["global_batch_unit"] == GLOBAL_BATCH_UNIT[name], \
            _why(f"GLOBAL BATCH UNIT: {report['global_batch_unit']}", audited, report)
    if name in SETTING:
        setting = (report["data_parallel_size"], report["strategy"], report["mesh"])
        assert setting == SETTING[name], _why(f"SETTING: {setting}", audited, report)
    if name in DIVISOR:
        # Found at its first step, audited from its second: every step of the window counted.
        assert (report["reduction"]["divisor"], report["steps_audited"]) == (DIVISOR[name], 5), \
            _why(f"REDUCTION: {report['reduction']}, {report['steps_audited']} steps", audited, report)
    if name in INFO:
        infos = {f["code"] for f in report["findings"] if f["severity"] == "info"} - {"RUN_INFO"}
        assert infos == INFO[name], _why(f"INFO: {infos}", audited, report)
    if name in MODEL_PARALLEL_ONLY:
        assert report["model_parallel_only"] == MODEL_PARALLEL_ONLY[name], _why("MESH", audited, report)
    if name in CONFIGURED_LR:
        assert report["lr"] == pytest.approx(CONFIGURED_LR[name]), _why(f"LR: {report['lr']}", audited, report)
    if case.script == "epochs_and_exit.py":
        assert report["steps_audited"] == min(case.audit_steps, TOTAL_STEPS), \
            _why(f"STEPS: {report['steps_audited']} audited, {min(case.audit_steps, TOTAL_STEPS)} expected",
                 audited, report)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("name, launcher", [(name, launcher) for name, (case, *_, default) in MISTAKES.items()
                                            for launcher in (case.launchers if FULL else (default,))])
def test_a_planted_mistake_gets_exactly_its_finding(name, launcher):
    case, expected, consequences, _ = MISTAKES[name]
    audited, report = _audited(case, launcher)
    assert audited.returncode == 0, _why(f"CRASH: exit code {audited.returncode} under audit", audited, report)
    assert report is not None, _why("NO REPORT: the audit wrote no report", audited, report)
    serious = _serious(report)
    assert expected.items() <= serious.items(), _why(f"MISS: expected {expected}, got {serious}", audited, report)
    extra = {code: severity for code, severity in serious.items() if code not in expected}
    assert extra.items() <= consequences.items(), _why(f"FALSE ALARM besides the mistake: {extra}", audited, report)
    if name in MESSAGES:
        code, words = MESSAGES[name]
        message = next(f["message"] for f in report["findings"] if f["code"] == code)
        assert words in message, _why(f"MESSAGE: {words!r} not in {message!r}", audited, report)


def _first_grad_norm(run: Run) -> float:
    return float(re.search(r"^step 0 grad norm (\S+)$", run.stdout, re.MULTILINE).group(1))


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
def test_a_summed_loss_under_fsdp2_makes_the_gradient_the_data_parallel_size_times_smaller():
    """What SUM_REDUCTION says, measured: one process summing the same global batch (the first step's 32 samples:
    2 micro-batches of 16, which 2 ranks' DistributedSampler split into 8 each) gets exactly dp = 2 times the
    gradient FSDP2 averages; with a mean the two agree."""
    alone = {loss: _run(Case("fsdp_trainer.py", ("--loss", loss, "--batch-size", "16"), world_size=1,
                             launchers=("torchrun",)).command("torchrun")) for loss in ("sum", "mean")}
    for run in alone.values():
        assert run.returncode == 0, _why("the program fails on one rank", run, None)
    summed, _ = _audited(MISTAKES["fsdp_sum"][0], "torchrun")
    mean = _plain(CORRECT["fsdp_trainer"], "torchrun")
    assert _first_grad_norm(alone["sum"]) / _first_grad_norm(summed) == pytest.approx(2, rel=1e-5)
    assert _first_grad_norm(alone["mean"]) / _first_grad_norm(mean) == pytest.approx(1, rel=1e-5)


def test_report_lines_are_told_apart_from_the_programs_own():
    stdout = ("[GPU1] Epoch 0 | Batchsize: 16 | Steps: 8\nfinal loss 0.5 params 1.0 2.0\n"
              "ddplab audit: world size 2, global batch 32, lr 0.1, 5 optimizer steps audited\n"
              "WARNING SUM_REDUCTION (ranks 0, 1): backward starts from a loss summed over the batch, wrapped\n"
              "over two lines\n    fix: use reduction='mean'\n")
    assert _program_lines(stdout) == ["[GPU1] Epoch 0 | Batchsize: 16 | Steps: 8", "final loss 0.5 params 1.0 2.0"]
    assert _program_lines("[rank 0, after 5 steps] ddplab audit: ...\n  no DDP mistakes found\nstep 1\n") == ["step 1"]


@pytest.mark.slow
@pytest.mark.timeout(8 * LAUNCH_TIMEOUT_S + 60)
def test_what_the_reduction_findings_say_is_the_gradient_measured_against_one_process():
    """The factor each finding names, measured: one process fed the same global batch (2 ranks' micro-batches of B
    documents, or samples, are one process's 2B) against the 2 ranks' first gradient."""
    def alone(script, *flags):
        batch = {"titan_lm.py": "8", "tune_recipe.py": "8"}.get(script, "16")
        run = _run(Case(script, (*flags, "--batch-size", batch), world_size=1,
                        launchers=("torchrun",)).command("torchrun"))
        assert run.returncode == 0, _why("the program fails on one rank", run, None)
        return _first_grad_norm(run)

    def ratio(run, reference):
        return _first_grad_norm(run) / reference

    titan = alone("titan_lm.py")
    assert ratio(_plain(CORRECT["titan_summing_reduction"], "torchrun"), titan) == pytest.approx(1, rel=1e-4)
    for name, factor in (("titan_averaging_reduction", 0.5), ("titan_times_world_under_sum", 2)):
        assert ratio(_audited(MISTAKES[name][0], "torchrun")[0], titan) == pytest.approx(factor, rel=1e-4)
    simclr = alone("simclr.py", "--gather", "autograd")
    for name in ("simclr_autograd_gather", "simclr_slice_times_world"):
        assert ratio(_plain(CORRECT[name], "torchrun"), simclr) == pytest.approx(1, rel=1e-4)
    assert ratio(_audited(MISTAKES["simclr_slice_gather"][0], "torchrun")[0], simclr) == pytest.approx(0.5, rel=1e-4)
    # The gradient as clip_grad_norm_ reads it: after the program's own scaling, before the clip.
    tune = alone("tune_recipe.py")
    assert ratio(_plain(CORRECT["tune_recipe_scaled"], "fork"), tune) == pytest.approx(1, rel=1e-4)
    assert ratio(_audited(MISTAKES["tune_recipe_no_world"][0], "fork")[0], tune) == pytest.approx(0.5, rel=1e-4)


def _first_step(run: Run) -> tuple[float, float, list[float]]:
    """clip.py's first step: the towers' gradient norm, the logit scale's gradient, 8 of the towers' elements."""
    def line(what):
        return re.search(rf"^step 0 {what} (.+)$", run.stdout, re.MULTILINE).group(1)
    return float(line("grad norm")), float(line("logit_scale grad")), [float(v) for v in line("grad sample").split()]


@pytest.mark.slow
@pytest.mark.timeout(6 * LAUNCH_TIMEOUT_S + 60)
def test_what_the_gather_findings_say_is_the_gradient_measured_against_one_process():
    """open_clip's ClipLoss on 2 ranks against one process fed the same global batch (one process gathers nothing):
    with autograd the gradient is one process's; the default's put-back slices give the towers exactly 1/2 and the
    logit scale all of its gradient, with accumulation too; a local loss over put-back or detached slices is no
    scale at all."""
    def alone(*flags):
        run = _run(Case("clip.py", (*flags, "--batch-size", "16"), world_size=1).command("fork"))
        assert run.returncode == 0, _why("the program fails on one rank", run, None)
        return _first_step(run)

    for reference, runs in ((alone(), {"clip_gather_with_grad": 1, "clip_no_grad_gather": 0.5,
                                       "clip_local_loss_gather_with_grad": 1, "clip_local_loss_put_back": None,
                                       "clip_local_loss": None}),
                            (alone("--accum-freq", "2"), {"clip_accum_gather_with_grad": 1,
                                                          "clip_no_grad_gather_accum": 0.5})):
        for name, factor in runs.items():
            run = _plain(CORRECT[name], "fork") if name in CORRECT else _plain(MISTAKES[name][0], "fork")
            norm, logit_scale, sample = _first_step(run)
            assert logit_scale == pytest.approx(reference[1], rel=1e-5), name
            ratios = [value / expected for value, expected in zip(sample, reference[2])]
            if factor is None:  # terms missing: the elements' ratios differ, so no one factor describes it
                assert max(ratios) - min(ratios) > 0.1, name
            else:
                assert norm / reference[0] == pytest.approx(factor, rel=1e-5), name
                assert ratios == pytest.approx([factor] * len(ratios), rel=1e-4), name


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
def test_a_reduction_written_by_hand_scales_the_gradient_as_its_findings_say():
    """The first step's gradient after the loop's own all-reduce, against one process fed the 2 ranks' documents
    (2 × 4 per micro-batch): a sum ÷ W is one process's mean, a sum left alone W times it (DIVIDE_FACTOR: 2), an
    average of summed losses 1/W of one process's sum (SUM_REDUCTION: 1/2)."""
    def alone(*flags):
        run = _run(Case("by_hand.py", (*flags, "--batch-size", "8"), world_size=1,
                        launchers=("torchrun",)).command("torchrun"))
        assert run.returncode == 0, _why("the program fails on one rank", run, None)
        return _first_grad_norm(run)

    mean, summed = alone(), alone("--loss", "hand-sum")
    assert _first_grad_norm(_plain(CORRECT["by_hand_loop_sum_divide"], "fork")) / mean == pytest.approx(1, rel=1e-5)
    assert _first_grad_norm(_audited(MISTAKES["by_hand_loop_sum_times_world"][0], "fork")[0]) / mean == \
        pytest.approx(2, rel=1e-5)
    assert _first_grad_norm(_audited(MISTAKES["by_hand_loop_summed_loss"][0], "fork")[0]) / summed == \
        pytest.approx(0.5, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_gradients_reduced_in_a_flat_buffer_are_not_read_and_the_report_says_why():
    case = Case("by_hand.py", ("--reduce", "flat"))
    plain, (audited, report) = _plain(case, "fork"), _audited(case, "fork")
    assert audited.returncode == 0 and _program_lines(audited.stdout) == _program_lines(plain.stdout)
    assert report is not None and report["steps_audited"] == 0 and _serious(report) == {}
    said = " ".join(audited.stderr.split())  # the report, wrapped to the terminal's width
    assert "nothing was audited: the program reduced 4,176 values in collectives" in said and \
        "into tensors that are not the parameters' gradients (a flat buffer)" in said, \
        _why("WHY: the reason is missing", audited, report)
