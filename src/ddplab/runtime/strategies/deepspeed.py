"""``deepspeed``: DeepSpeed's engine at ZeRO stage 0-3, which owns the optimizer and the accumulation.

``deepspeed.initialize`` takes the model and the caller's optimizer and returns an engine: the forward goes through
it, ``engine.backward(loss)`` divides each micro-batch's loss by the accumulation steps itself and reduces at the
boundary (ZeRO 0-1) or every micro-batch into partitions (ZeRO 2-3), and ``engine.step()``, called after every
micro-batch, steps the optimizer at the boundary only. The engine averages over its data-parallel group; it reduces
no float64 (``split_half_float_double_sparse`` on every accelerator), so the ranks train in float32. Whole gradients
and parameters are read with DeepSpeed's own ``safe_get_full_grad`` and ``safe_get_full_fp32_param``, collectives on
a sharded stage. DeepSpeed is imported only here, when a rank builds an engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import os
import sys
import warnings
from typing import ClassVar

import torch
import torch.distributed as dist

from ddplab.errors import UsageError
from ddplab.runtime import compat, op_builds
from ddplab.runtime.config import DEFAULT_ZERO_STAGE
from ddplab.runtime.strategies.base import Strategy
from ddplab.runtime.strategies.training import Training, whole

ENGINE_MODULE = "deepspeed.runtime.engine"
STAGES = (0, 1, 2, 3)
INSTALL = "pip install torch==2.13.0 'ddplab[deepspeed]'"


def is_engine(model) -> bool:
    """Whether ``model`` is a DeepSpeed engine (DeepSpeed is not imported here: only a process that did has one)."""
    engine = getattr(sys.modules.get(ENGINE_MODULE), "DeepSpeedEngine", None)
    return isinstance(engine, type) and isinstance(model, engine)


def require_deepspeed():
    """The ``deepspeed`` module; UsageError with the extra's pip command where it is not installed."""
    if not torch.cuda.is_available():
        # Else DeepSpeed warns, on import, that it found no GPU and picked its CPU accelerator.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise UsageError(f"the deepspeed strategy needs DeepSpeed ({INSTALL}): {exc}") from None
    return deepspeed


@dataclasses.dataclass(frozen=True)
class DeepSpeedStrategy(Strategy):
    """DeepSpeed's engine: ZeRO stage 0 (DDP-like), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters)."""

    name: ClassVar[str] = "deepspeed"
    reduces_float64: ClassVar[bool] = False
    taps_local_gradients: ClassVar[bool] = False
    owns_optimizer: ClassVar[bool] = True
    zero_stage: int = DEFAULT_ZERO_STAGE
    """The ZeRO stage (the config's zero_optimization.stage)."""

    def __post_init__(self):
        if self.zero_stage not in STAGES:
            raise UsageError(f"{{zero_stage}} must be one of 0, 1, 2, 3, got {self.zero_stage!r}")

    @property
    def collective_forward(self) -> bool:  # type: ignore[override]
        # ZeRO-3 all-gathers each module's parameters in its forward, on every rank.
        return self.zero_stage == 3

    def check_runnable(self, world_size: int) -> None:
        require_deepspeed()

    def config(self, per_device_batch_size: int, accumulation_steps: int) -> dict:
        """The engine's config: the caller's optimizer, no clipping, no half precision, no periodic logging."""
        # gradient_clipping defaults to 1.0 in DeepSpeed's config: a spec is trained as written, unclipped. ZeRO-3
        # keeps parameters under 1e5 elements whole by default: here every one is partitioned, as a large model's are.
        zero = {"stage": self.zero_stage, **({"stage3_param_persistence_threshold": 0} if self.zero_stage == 3 else {})}
        return {"train_micro_batch_size_per_gpu": per_device_batch_size,
                "gradient_accumulation_steps": accumulation_steps, "gradient_clipping": 0.0,
                "zero_optimization": zero,
                "zero_allow_untested_optimizer": True, "steps_per_print": 2 ** 31 - 1, "wall_clock_breakdown": False}

    def training(self, model, make_optimizer, ctx, facts=None, *, accumulation_steps: int = 1,
                 per_device_batch_size: int | None = None) -> EngineTraining:
        # The engine asks for the launcher's LOCAL_RANK; ranks ddplab starts itself have their context instead.
        os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))
        deepspeed = require_deepspeed()
        # Its lines (the config, "untested optimizer" for the caller's own, its op loaded) are not this command's
        # output, which may be JSON: they are dropped, once per rank.
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        # ZeRO calls torch's collectives by their deprecated names, each call a warning on stderr.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        if ctx.is_main:
            _say_op_build()
        bounded = _BoundedNewGroups(compat.world_timeout(ctx.device.type))
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model.parameters()),
                                                  config=self.config(per_device_batch_size or 1, accumulation_steps),
                                                  dist_init_required=False)
        except BaseException:
            bounded.close()
            raise
        return EngineTraining(engine, accumulation_steps, bounded)

    def wrap(self, model, ctx, facts=None):
        raise UsageError("DeepSpeed's engine owns the optimizer: train it through strategy.training(...)")

    def owns(self, model) -> bool:
        return is_engine(model)

    def module(self, model) -> torch.nn.Module:
        return model.module

    def data_parallel_group(self, model) -> dist.ProcessGroup:
        return model.data_parallel_group

    def no_sync(self, model):
        # The engine accumulates by itself: engine.step() between micro-batches only counts them.
        return contextlib.nullcontext()

    def syncs(self, model) -> bool:
        return model.is_gradient_accumulation_boundary()

    def tap_local_gradients(self, model, params, observe, *, via="auto", comm_hook=None, state=None):
        raise UsageError("the local gradients of DeepSpeed's engine are not tapped here: measure its noise scale on "
                         "your own command (ddplab noise -- COMMAND), which reads them where the engine reduces")

    def reduced_gradient_share(self, model, params):
        raise UsageError("the reduced gradient of DeepSpeed's engine is read whole (EngineTraining.gradients)")


class _BoundedNewGroups:
    """Until :meth:`close`, a process group created without a timeout gets ``timeout`` (None: nothing changes).

    DeepSpeed clones the world into groups of its own (``dist.new_group(ranks)``: torch's 30 minutes) and ZeRO 1-2
    reduce over them; with the launch's timeout, a rank that stops answering is named in time, as on DDP.
    """

    def __init__(self, timeout):
        self.original = self.ours = dist.new_group
        if timeout is not None:
            dist.new_group = self.ours = functools.partial(_new_group, self.original, timeout)

    def close(self) -> None:
        # Put back only what is still ours: a later patch of new_group is its owner's to undo.
        if dist.new_group is self.ours:
            dist.new_group = self.original


def _new_group(original, timeout, *args, **kwargs):
    if len(args) < 2 and kwargs.get("timeout") is None:
        kwargs["timeout"] = timeout
    return original(*args, **kwargs)


def _say_op_build() -> None:
    """That DeepSpeed's CPU communication op builds once (minutes) before it does, or that a killed build's lock
    blocks it; nothing where the op is built, or where this DeepSpeed names its builder otherwise."""
    try:
        from deepspeed.accelerator import get_accelerator
        from torch.utils.cpp_extension import _get_build_directory

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            op_builds.say(builder.name, _get_build_directory(builder.name, verbose=False))
    except Exception:  # noqa: BLE001, S110 - a note never stands in the way of training
        pass


def _whole_parameter(param: torch.Tensor) -> torch.Tensor:
    """``param`` whole: its fp32 master copy at ZeRO 1-3, gathered from the partitions (a collective); the module's
    own tensor at ZeRO 0; a frozen parameter, which has no master copy, gathered at ZeRO-3 and itself below."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    if full is not None:
        return full.detach()
    if hasattr(param, "ds_id"):
        import deepspeed

        # ZeRO-3 partitions frozen parameters too.
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().clone()
    return whole(param.detach())


class EngineTraining(Training):
    """A DeepSpeed engine trained as its tutorials do: ``engine.backward(loss); engine.step()`` per micro-batch."""

    def __init__(self, engine, accumulation_steps: int, bounded: _BoundedNewGroups | None = None):
        self.model, self.accumulation_steps, self.bounded = engine, accumulation_steps, bounded

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    @contextlib.contextmanager
    def micro_batch(self, *, last: bool):
        yield
        if not last:
            # Before the boundary the engine's step only counts the micro-batch; the caller's step() takes the last.
            self.model.step()

    def backward(self, loss: torch.Tensor, *, parts: int) -> None:
        if parts != self.accumulation_steps:
            # Its boundary is every gradient_accumulation_steps-th micro-batch: a short step shifts every later one.
            raise UsageError(f"DeepSpeed's engine steps every {self.accumulation_steps} micro-batches, and this step "
                             f"has {parts}")
        # The engine divides by gradient_accumulation_steps itself (scale_wrt_gas).
        self.model.backward(loss)

    def step(self) -> None:
        self.model.step()

    def gradients(self) -> list[torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        found = [safe_get_full_grad(p) for p in self.module.parameters()]
        return [g.detach() if g is not None else torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else p.shape,
                                                               dtype=p.dtype)
                for g, p in zip(found, self.module.parameters())]

    def parameters(self) -> list[torch.Tensor]:
        return [_whole_parameter(p) for p in self.module.parameters()]

    def divide_factors(self) -> set[float]:
        size = float(dist.get_world_size(self.model.data_parallel_group))
        return {size if getattr(self.model, "gradient_average", True) else 1.0}

    def close(self) -> None:
        try:
            destroy = getattr(self.model, "destroy", None)
            if callable(destroy):
                destroy()
        finally:
            if self.bounded is not None:
                self.bounded.close()
