"""What only the training frameworks' idioms make possible, and ranks that each train alone.

Lightning, Accelerate and the Transformers Trainer all build an ordinary ``DistributedDataParallel``
wrapper and step an ordinary ``torch.optim.Optimizer``, so :mod:`hooks` audits them as it audits a
plain loop. This module adds, each judged by its effect:

- ``NOT_DISTRIBUTED``: a launcher started W processes but each trains alone: no process group,
  Accelerate reporting one process, or a process group in which optimizer steps go by with no
  collective at all (pytorch/examples' ImageNet script wraps in DDP only on GPUs). A program that
  synchronises by hand issues collectives and stays clean.
- ``LOSS_NORMALISED_PER_DEVICE``: the Trainer normalises a token-level loss by each device's own token
  count (``average_tokens_across_devices`` off, or a model that takes no ``num_items_in_batch``);
  each rank records its label-token count per step, and the finding needs counts that differ.
- ``SUM_REDUCTION`` through the framework's own division of the loss by the accumulation steps
  (Lightning's closure, ``Accelerator.backward``), which hides the summed loss from :mod:`losses`.

Framework modules are never imported here: each is patched only once the user's program has
imported it (seen when a DDP wrapper is built or an optimizer steps), under a guard of its own.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist

from ddplab.auditor import environment, losses, schedulers, state
from ddplab.auditor.schedulers import accelerate_state
from ddplab.guest.patches import Patches
from ddplab.runtime import compat

_PATCHES: Patches | None = None
_PATCHED: set[str] = set()


def install(patches: Patches) -> None:
    """Remember where framework patches are recorded; they are applied when a framework shows up."""
    global _PATCHES
    _PATCHES = patches
    _PATCHED.clear()


def on_attach(audit) -> None:
    """A DDP wrapper was built: patch the frameworks the program has imported by now."""
    _patch_imported_frameworks(audit)


def on_optimizer_step(audit) -> None:
    _patch_imported_frameworks(audit)


# --- several processes, each training alone ---

def check_not_distributed(audit, optimizer) -> None:
    """With no DDP model in this process: evidence, step by step, that the launched ranks each train alone."""
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size < 2 or "NOT_DISTRIBUTED" in audit.findings or audit.disabled is not None or audit.synchronised:
        return
    if audit.attached_pid is None:
        # A distributed run with no DDP model still reports its setting (and, with evidence, NOT_DISTRIBUTED).
        audit.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)
        audit.world_size = world_size
        audit.lr = schedulers.configured_lr(optimizer, None)
        audit.optimizer = type(optimizer).__name__
        audit.attached_pid = os.getpid()
        audit.write()
    evidence = _alone_evidence(audit, world_size)
    if evidence is not None:
        audit.add("NOT_DISTRIBUTED", evidence)


def _alone_evidence(audit, world_size: int) -> str | None:
    started = f"{environment.launcher()} started {world_size} processes (WORLD_SIZE={world_size})"
    shared = accelerate_state()
    if shared is not None and shared.get("num_processes") == 1:
        # The Trainer builds its Accelerator itself: its user turns CPU distribution on through TrainingArguments.
        trainer = "transformers" in audit.frameworks
        remedy = ("TrainingArguments(use_cpu=True) (--use_cpu on the command line)" if trainer
                  else "Accelerator(cpu=True) or ACCELERATE_USE_CPU=1")
        return (f"{started}, but Accelerate runs with num_processes 1 "
                f"({shared.get('distributed_type')}): prepare() returned the model without DDP and the data "
                f"unsharded (on a CPU machine, {remedy} makes it distributed)")
    if not dist.is_initialized():
        return (f"{started}, but this process stepped its optimizer without joining a process group or building "
                "a DistributedDataParallel model")
    return _silent_group(audit, started)


def _silent_group(audit, started: str) -> str | None:
    """In a process group: optimizer steps with no collective between them synchronise nothing."""
    issued = compat.collectives_issued()
    if issued is None:
        return None  # this torch cannot count collectives: no evidence either way
    audit.alone_steps += 1
    if audit.alone_steps == 1:
        audit.alone_collectives = issued
        return None
    if issued != audit.alone_collectives:
        # Synchronised by hand (or by FSDP, ZeRO, a framework): this process is not training alone.
        audit.synchronised = True
        return None
    if audit.alone_steps < max(2, audit.steps_to_audit):
        return None
    return _silent_detail(audit, started)


def _silent_detail(audit, started: str) -> str:
    return (f"{started}; they joined a process group of {dist.get_world_size()}, but across "
            f"{audit.alone_steps - 1} optimizer steps not one collective ran on any process group: no "
            "DistributedDataParallel model and no hand-written all-reduce synchronised the gradients "
            "(pytorch/examples' ImageNet script, for one, wraps the model in DDP only on GPUs)")


@state.guarded("judging ranks that train alone")
def at_exit(audit) -> None:
    """At the end of a run shorter than the audit window: a group in which every optimizer step so far passed with
    no collective (each step compared the count with the first's) trained alone all the same."""
    if ("NOT_DISTRIBUTED" in audit.findings or audit.synchronised or audit.alone_steps < 2 or audit.wrapper_count
            or audit.world_size < 2):
        return
    started = f"{environment.launcher()} started {audit.world_size} processes (WORLD_SIZE={audit.world_size})"
    audit.add("NOT_DISTRIBUTED", (f"{started}; they joined a process group, but across all {audit.alone_steps - 1} "
                                  "optimizer step intervals of the run not one collective ran on any process group: "
                                  "no DistributedDataParallel model and no hand-written all-reduce synchronised the "
                                  "gradients"))


# --- summed losses through the frameworks' own division by the accumulation steps ---

def _patch_imported_frameworks(audit) -> None:
    for name, patch in (("lightning.pytorch.loops.optimization.automatic", _patch_lightning),
                        ("pytorch_lightning.loops.optimization.automatic", _patch_lightning),
                        ("accelerate.accelerator", _patch_accelerate),
                        ("transformers.trainer", _patch_trainer)):
        module = sys.modules.get(name)
        if module is not None and name not in _PATCHED and _PATCHES is not None:
            _PATCHED.add(name)
            audit.frameworks.add(name.split(".")[0].replace("pytorch_lightning", "lightning"))
            try:
                patch(_PATCHES, module)
            except Exception as exc:  # noqa: BLE001 - another release of the framework: that idiom goes unwatched
                audit.add("AUDIT_INCOMPLETE", f"could not watch {name} ({type(exc).__name__}: {exc})")


@state.guarded("inspecting a framework's loss")
def _check_framework_loss(audit, output, framework: str, divisor) -> None:
    # Lightning's training_step may return the loss itself or a mapping holding it under "loss".
    loss = output.get("loss") if hasattr(output, "get") else output
    if audit.armed and isinstance(loss, torch.Tensor) and losses.summed(loss):
        audit.add("SUM_REDUCTION", f"a summed loss went to {framework}, which divided it only by the "
                                   f"accumulation steps ({divisor}) before backward")


def _patch_lightning(patches: Patches, module) -> None:
    closure_result = module.ClosureResult

    def make(original):
        function = original.__func__

        @functools.wraps(function)
        def from_training_step_output(cls, *args, **kwargs):
            output = args[0] if args else kwargs.get("training_step_output")
            normalize = args[1] if len(args) > 1 else kwargs.get("normalize", 1)
            _check_framework_loss(output, "Lightning", f"accumulate_grad_batches={normalize}")
            return function(cls, *args, **kwargs)

        return classmethod(from_training_step_output)

    patches.replace(closure_result, "from_training_step_output", make)


def _patch_accelerate(patches: Patches, module) -> None:
    def make(original):
        @functools.wraps(original)
        def backward(self, *args, **kwargs):
            loss = args[0] if args else kwargs.get("loss")
            _check_framework_loss(loss, "Accelerator.backward", "gradient_accumulation_steps")
            return original(self, *args, **kwargs)

        return backward

    patches.replace(module.Accelerator, "backward", make)


# --- the Trainer's token counts ---

def _patch_trainer(patches: Patches, module) -> None:
    if getattr(module.Trainer, "_get_num_items_in_batch", None) is None:
        return  # another Trainer version: nothing to watch

    def make(original):
        @functools.wraps(original)
        def _get_num_items_in_batch(self, *args, **kwargs):
            num_items = original(self, *args, **kwargs)
            batch_samples = args[0] if args else kwargs.get("batch_samples")
            _record_tokens(self, batch_samples, num_items)
            return num_items

        return _get_num_items_in_batch

    patches.replace(module.Trainer, "_get_num_items_in_batch", make)


@state.guarded("counting the Trainer's label tokens")
def _record_tokens(audit, trainer, batch_samples, num_items) -> None:
    info = audit.wrappers.get(getattr(trainer, "model_wrapped", None))
    if info is None or not audit.armed:
        return
    across = bool(getattr(trainer.args, "average_tokens_across_devices", False)) and num_items is not None
    if across:
        return  # one count over all devices divides every rank's loss: no per-device normalisation
    tokens = label_tokens(batch_samples, shifts_labels(trainer))
    if tokens is not None:
        window = audit.window(info)
        window["tokens"] = tokens
        window["tokens_why"] = ("average_tokens_across_devices=False" if num_items is not None
                                else "the model takes no num_items_in_batch, so it averages over its own tokens")


def shifts_labels(trainer) -> bool:
    """The model's loss drops each sequence's first label (a causal LM shifts them): where the Trainer says so, or
    where the model is a causal LM by its loss type or class (GPT-2's head shifts though the Trainer, going by its
    loss type alone, counts it unshifted)."""
    if getattr(trainer, "_loss_shifts_labels", False):
        return True
    model = getattr(trainer, "model", None)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    return getattr(model, "loss_type", None) == "ForCausalLM" or type(model).__name__.endswith(("ForCausalLM",
                                                                                                "LMHeadModel"))


def label_tokens(batch_samples, shifted: bool) -> int | None:
    """Label tokens (not -100) that reach the loss in one optimizer step's micro-batches: a collator's
    ``shift_labels`` as given, else ``labels[..., 1:]`` where the loss shifts them; None unless labels are token
    sequences."""
    total = 0
    for batch in batch_samples:
        if not (isinstance(batch, dict) or hasattr(batch, "get")):
            return None
        given = batch.get("shift_labels")
        labels = given if given is not None else batch.get("labels")
        if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.is_floating_point():
            return None
        if shifted and given is None:
            labels = labels[..., 1:]
        total += int(labels.ne(-100).sum())
    return total
