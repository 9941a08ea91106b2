"""One sandbox run and what it measured, beside the closed-form theory (torch-free)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

from ddplab.errors import UsageError
from ddplab.sandbox import theory
from ddplab.serialize import finite
from ddplab.validation import at_least, one_of, positive

DATASET_SIZE = 256
Mode = Literal["single", "multi"]
MODES: tuple[Mode, ...] = get_args(Mode)
DEFAULT_BATCH = {"single": 128, "multi": 16}
NOISY_EXPERIMENTS = 10_000
# float32/int64 tensors of (batch, experiments) the noisy data and the update statistics hold at once.
BYTES_PER_SAMPLE_EXPERIMENT = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """One sandbox run."""

    mode: Mode
    """'single' (one process) or 'multi' (world_size DDP ranks)."""
    lr: float = 1e-3
    """SGD learning rate (no momentum)."""
    per_device_batch_size: int | None = None
    """Per-device (per-rank) loader batch (default 128 single, 16 multi)."""
    world_size: int | None = None
    """DDP ranks to start (default: the visible GPUs when ≥ 2, else 8 CPU ranks; under torchrun its WORLD_SIZE);
    always 1 in single mode."""
    deterministic: bool = True
    """x = 1, y = 0; False: noisy data, x = 1 + N(0,1), y = N(0,1)."""
    n_experiments: int | None = None
    """Independent experiments, vectorized into one parameter tensor (default 1 deterministic, 10,000 noisy)."""
    n_epochs: int = 1
    """Epochs: passes over the 256 samples."""
    seed: int = 0
    """Data and sampler seed (DistributedSampler's shuffle too)."""
    bypass_ddp: bool = False
    """Reproduce the classic bug: forward through the inner module, so DDP never all-reduces (noisy data)."""

    def __post_init__(self):
        one_of("mode", self.mode, MODES)
        if self.mode == "single" and (self.world_size not in (None, 1) or self.bypass_ddp):
            raise UsageError("single mode runs one process: drop {world_size} / {bypass_ddp}")
        if self.per_device_batch_size is None:
            object.__setattr__(self, "per_device_batch_size", DEFAULT_BATCH[self.mode])
        if self.n_experiments is None:
            object.__setattr__(self, "n_experiments", 1 if self.deterministic else NOISY_EXPERIMENTS)
        if self.mode == "single":
            object.__setattr__(self, "world_size", 1)
        positive("lr", self.lr)
        for field in ("per_device_batch_size", "world_size", "n_experiments", "n_epochs"):
            at_least(field, getattr(self, field))
        if self.world_size is not None:
            self._check_batch()
        if self.bypass_ddp and self.deterministic:
            raise UsageError("{bypass_ddp} needs noisy data ({deterministic=False}): with x = 1, y = 0 every rank "
                             "computes the same gradient and the damage is invisible")

    def _check_batch(self) -> None:
        global_batch = self.global_batch_size
        if global_batch > DATASET_SIZE:
            raise UsageError(f"{{per_device_batch_size}} × world size = {global_batch} is more than the {DATASET_SIZE} "
                             f"samples of an epoch: lower {{per_device_batch_size}} or the world size")
        if DATASET_SIZE % global_batch:
            divisors = [d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256) if d % self.world_size == 0]
            if not divisors:
                raise UsageError(f"a world size of {self.world_size} cannot split the {DATASET_SIZE} samples of an "
                                 "epoch into equal steps: use a world size that divides 256 (a power of two)")
            nearest = min(divisors, key=lambda d: abs(d - global_batch))
            raise UsageError(f"{{per_device_batch_size}} × world size = {global_batch} must divide the {DATASET_SIZE} "
                             f"samples of an epoch: use {{per_device_batch_size}} {max(1, nearest // self.world_size)}"
                             f" (global batch {max(self.world_size, nearest)})")

    def for_ranks(self, world_size: int) -> SandboxConfig:
        """This configuration on ``world_size`` ranks (checked again)."""
        return dataclasses.replace(self, world_size=world_size)

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return DATASET_SIZE // self.global_batch_size

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.n_epochs

    @property
    def rank_bytes(self) -> int:
        """Memory one process needs for the experiments' data and statistics (the model is one weight each)."""
        return BYTES_PER_SAMPLE_EXPERIMENT * self.n_experiments * (self.per_device_batch_size + 1)

    def theory(self, *, batch_size: int | None = None) -> theory.Prediction:
        return theory.predict(lr=self.lr, batch_size=batch_size or self.global_batch_size, steps=self.steps,
                              deterministic=self.deterministic)

    def adascale_theory(self) -> float:
        """AdaScale's gain the closed form predicts for what the run measures (S = W over the per-rank batch)."""
        return theory.adascale_gain(lr=self.lr, batch_size=self.per_device_batch_size, scale=self.world_size,
                                    steps=self.steps, deterministic=self.deterministic, dataset_size=DATASET_SIZE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """What one run measured, beside what theory predicts."""

    config: SandboxConfig
    w: float
    """Mean over experiments of w after training."""
    w_stderr: float
    """Standard error of that mean (0 for a single experiment)."""
    update_step_variance: float
    """Unbiased variance of lr × the applied gradient, pooled over steps and experiments."""
    update_step_variance_stderr: float
    allreduces: int
    """Gradient all-reduces DDP performed on rank 0 (0 in single mode)."""
    w_rank_spread: float
    """Mean over experiments of the std of w across ranks (0 when DDP keeps them in sync)."""
    seconds: float
    weights: tuple[float, ...] | None = None
    """Every experiment's final w, when asked for (rank 0's in bypass mode)."""
    adascale_gain: float | None = None
    """AdaScale's gain at S = world size over the per-rank batch, from the noise scale measured on DDP's
    all-reduce at every step (multi runs through the wrapper); None otherwise."""

    def theory(self) -> theory.Prediction:
        return self.config.theory()

    @property
    def bypass_variance_ratio(self) -> float:
        """How much noisier each update was than DDP's (≈ the world size when every rank trained alone)."""
        return self.update_step_variance / max(self.config.theory().update_step_variance, 1e-300)

    def to_json(self) -> dict[str, Any]:
        cfg, predicted = self.config, self.theory()
        out = {
            "mode": cfg.mode, "world_size": cfg.world_size,
            "per_device_batch_size": cfg.per_device_batch_size,
            "global_batch_size": cfg.global_batch_size, "lr": cfg.lr,
            "deterministic": cfg.deterministic, "n_experiments": cfg.n_experiments,
            "n_epochs": cfg.n_epochs, "seed": cfg.seed, "steps": cfg.steps,
            "w": self.w, "w_stderr": self.w_stderr,
            "update_step_variance": self.update_step_variance,
            "update_step_variance_stderr": self.update_step_variance_stderr,
            "allreduces": self.allreduces,
            "theory": {"w": predicted.w, "update_step_variance": predicted.update_step_variance},
            "seconds": self.seconds,
        }
        if self.adascale_gain is not None:
            out["adascale_gain"] = self.adascale_gain
            out["theory"]["adascale_gain"] = cfg.adascale_theory()
        if cfg.bypass_ddp:
            out["bypass_ddp"] = True
            out["w_rank_spread"] = self.w_rank_spread
            out["theory_if_ranks_train_alone"] = dataclasses.asdict(cfg.theory(batch_size=cfg.per_device_batch_size))
        return finite(out)
