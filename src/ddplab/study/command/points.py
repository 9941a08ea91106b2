"""What each run of a command study fills in, and what the command must hold for the study asked (torch-free).

Every global batch is split over ``--world-size`` ranks with the fewest accumulation steps under
``--max-batch-size-per-device`` (as ``plan`` splits it); a run's lr, seed and the optimizer settings its rule gives
go where the command's placeholders say. A swept quantity with no placeholder, a rule a command's flags cannot
express, a split the command cannot state: each is one line before anything runs.
"""

from __future__ import annotations

from ddplab.errors import UsageError, literal
from ddplab.plan import scaling
from ddplab.study.command.template import ADAM_SETTINGS, CommandTemplate
from ddplab.study.config import OptimizerConfig, StudyConfig
from ddplab.study.rules import base, registry


def values(config: StudyConfig, world_size: int, max_per_device: int | None, global_batch: int, lr: float,
           seed: int, optimizer: OptimizerConfig, run_dir: str) -> dict:
    """The placeholders' values for one run (``{master_port}`` is the executor's, filled where the run starts)."""
    per_device, accumulation = scaling.split_global_batch(global_batch, world_size=world_size,
                                                          max_per_device=max_per_device)
    filled = {"world_size": world_size, "per_device_batch_size": per_device, "accumulation_steps": accumulation,
              "global_batch_size": global_batch, "lr": lr, "seed": seed, "run_dir": run_dir,
              "weight_decay": optimizer.weight_decay, "master_port": "{master_port}"}
    if optimizer.adam:
        filled |= {name: optimizer.betas[index] for name, index in ADAM_SETTINGS.items()} | {"eps": optimizer.eps}
    return filled


def check(template: CommandTemplate, config: StudyConfig, world_size: int, max_per_device: int | None) -> None:
    """Refuse the study the command cannot run, in one line, before anything starts."""
    names = template.names
    if "lr" not in names:
        raise UsageError("the command has no {{lr}}, and every rule trains its own lrs: put {{lr}} where your "
                         "script takes its learning rate")
    if not {"per_device_batch_size", "global_batch_size"} & names:
        raise UsageError("the command has no {{per_device_batch_size}} or {{global_batch_size}}, and the study "
                         "sweeps the global batch: put one where your script takes its batch size")
    if config.seeds > 1 and "seed" not in names:
        raise UsageError(f"{{seeds}} {config.seeds} needs {{{{seed}}}} in the command (its runs would be one run "
                         "repeated): add it, or pass {seeds} 1")
    for global_batch in config.global_batch_sizes:
        _check_split(names, global_batch, world_size, max_per_device)
    for rule in registry.of(config):
        _check_rule(rule, config, names)


def _check_split(names: set[str], global_batch: int, world_size: int, max_per_device: int | None) -> None:
    per_device, accumulation = scaling.split_global_batch(global_batch, world_size=world_size,
                                                          max_per_device=max_per_device)
    if accumulation > 1 and "per_device_batch_size" in names and "accumulation_steps" not in names:
        raise UsageError(f"global batch {global_batch} on {world_size} ranks takes {accumulation} accumulation steps "
                         f"of {per_device} under {{max_batch_size_per_device}}, and the command has no "
                         "{{accumulation_steps}}: add it, or raise {max_batch_size_per_device}")


def _check_rule(rule: base.Rule, config: StudyConfig, names: set[str]) -> None:
    if rule.lr_scaling != "fixed" or rule.batch_changes:
        changes = "lr" if rule.lr_scaling != "fixed" else "global batch"
        raise UsageError(f"the {rule.name} rule changes the {changes} as a run trains, which a command's flags "
                         "cannot: drop it from {rules}")
    needs = rule.measures_at_reference(config)
    if needs:
        # What a rule reads from the runs' gradients (B_simple), a command's guest does not measure.
        raise UsageError(f"the {rule.name} rule needs {literal(needs)}, which a command study does not measure: "
                         "measure B_simple with ddplab noise -- COMMAND and give it as {noise_scale}")
    for global_batch in config.global_batch_sizes:
        settings = [rule.optimizer(config, global_batch), rule.variant(config, global_batch)]
        for optimizer in filter(None, settings):
            missing = sorted(_changed(config.optimizer, optimizer) - names)
            if missing:
                shown = ", ".join(f"{{{{{m}}}}}" for m in missing)
                raise UsageError(f"the {rule.name} rule sets {shown} at global batch {global_batch}, which the "
                                 "command has no placeholder for: add them where your script takes them, or drop "
                                 f"{rule.name} from {{rules}}")


def _changed(base: OptimizerConfig, other: OptimizerConfig) -> set[str]:
    """The placeholders whose values differ between two optimizers' settings."""
    changed = {name for name, index in ADAM_SETTINGS.items() if base.betas[index] != other.betas[index]}
    if base.eps != other.eps:
        changed.add("eps")
    if base.weight_decay != other.weight_decay:
        changed.add("weight_decay")
    return changed
