"""Start a function on N local ranks, or join the process group torchrun already set up.

Every ddplab feature that runs DDP goes through :func:`launch`. On CPU it forks ranks from
the already-imported parent (about 0.2 s for 8 ranks instead of ~15 s of spawning), with
gloo; with one GPU per rank it spawns them and uses NCCL; under torchrun (``RANK`` and
``WORLD_SIZE`` set) it runs the function once in this process, in torchrun's group.

While ranks run, SIGTERM, SIGINT and SIGHUP (those the parent does not ignore) cancel the
launch: the ranks are stopped, the launch directory removed, and the signal is then
delivered again under the caller's own handler (by default the process ends with it). Ranks
die with the parent even when it is SIGKILLed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddplab.errors import LaunchError, RankFailure, UsageError
from ddplab.runtime import compat, failures, timescale
from ddplab.runtime.launch_config import LaunchConfig, under_torchrun
from ddplab.runtime.signals import Cancelled, CancelOnSignals

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
STOP_GRACE_S = 1.0
"""How long a stopped rank gets between SIGTERM and SIGKILL (times :func:`timescale.factor`)."""
STACK_WAIT_S = 10.0
"""The most a live rank's stack dump is waited for (times :func:`timescale.factor`); it comes in milliseconds."""


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a rank knows about itself; passed as the first argument to the launched function."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device
    workdir: str | None = dataclasses.field(default=None, repr=False)
    """The launch directory (None under torchrun)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_ids(self) -> list[int] | None:
        """What DistributedDataParallel's ``device_ids`` wants for this rank."""
        return [self.device.index] if self.device.type == "cuda" else None

    def checkpoint(self, partial: Any) -> None:
        """Publish this rank's latest partial result (picklable), replacing the previous one.

        If the launch fails or outlives its deadline, :class:`LaunchError` carries it in
        ``partial``. Each call pickles ``partial``: keep it small, and put what grows in the
        :meth:`journal`. Under torchrun there is no launch directory and this does nothing.
        """
        if self.workdir is not None:
            _save(_path(self.workdir, "partial", self.rank), partial)

    def journal(self, records: list) -> None:
        """Append ``records`` to this rank's journal, which a failed launch returns with the partial result.

        Appending costs only the new records, so a run can journal every step without rewriting its
        history. The journal comes back as ``partial[rank]["journal"]`` beside the checkpoint's keys.
        """
        if self.workdir is not None and records:
            with open(_path(self.workdir, "journal", self.rank), "ab") as fh:
                pickle.dump(records, fh)


def gpus_for(world_size: int) -> bool:
    """True when each of ``world_size`` local ranks can have a GPU of its own."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def default_world_size() -> int:
    """The visible GPUs when there are at least 2 (one rank each), else 8 CPU ranks."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return n_gpus if n_gpus >= 2 else 8


def world_size_for(requested: int | None, *, default: int) -> int:
    """The ranks to train on: torchrun's WORLD_SIZE under torchrun, else ``requested`` or ``default``."""
    if not under_torchrun():
        return default if requested is None else requested
    actual = int(os.environ["WORLD_SIZE"])
    if requested is not None and requested != actual:
        raise UsageError(f"{{world_size}} {requested} disagrees with torchrun's WORLD_SIZE {actual}: under torchrun "
                         "the ranks are torchrun's, so drop {world_size} or change --nproc_per_node")
    return actual


def launch(fn: Callable[..., Any], config: LaunchConfig, *args: Any) -> list[Any]:
    """Run ``fn(ctx, *args)`` on every rank and return the ranks' results in rank order.

    Under torchrun only this process's result is returned (a one-element list); the
    function must use collectives for anything rank 0 needs from the others.

    Raises:
        LaunchError: a rank raised, died or stopped answering, the deadline passed, or a signal cancelled it.
        UsageError: CPU ranks would be forked from a process that has initialised CUDA.
    """
    if under_torchrun():
        return [_run_in_torchrun_group(fn, config, args)]
    if config.world_size is None:
        raise UsageError("{world_size} must be given to start ranks outside torchrun")
    backend = config.backend or ("nccl" if gpus_for(config.world_size) else "gloo")
    # CUDA cannot survive a fork, and a spawned child re-imports everything anyway.
    start_method = "spawn" if backend == "nccl" or config.start_method == "spawn" else "fork"
    if start_method == "fork":
        _refuse_fork_after_cuda()
    partial = {}
    with CancelOnSignals() as cancel:
        workdir = tempfile.mkdtemp(prefix="ddplab-launch-")
        try:
            _start_and_join(fn, config, backend, start_method, workdir, args, cancel)
            return [_load(_path(workdir, "result", r)) for r in range(config.world_size)]
        except LaunchError as exc:
            # The ranks are stopped by now: their last checkpoints are final.
            exc.partial = _partials(workdir, config.world_size)
            raise
        except Cancelled:
            partial = _partials(workdir, config.world_size)
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    # Only reached when a signal cancelled the launch and the caller's own handler returned.
    name = signal.Signals(cancel.received).name
    raise LaunchError(f"launch cancelled by {name}; stopped every rank", kind="cancelled", partial=partial)


def _refuse_fork_after_cuda() -> None:
    if torch.cuda.is_initialized():
        raise UsageError(
            "CUDA is already initialised in this process, and CPU ranks forked from it would crash: "
            "launch the ranks before anything touches CUDA (e.g. a spec that allocates on the GPU at import), "
            "or give every rank a GPU of its own (NCCL ranks are spawned, not forked)")


def _start_and_join(fn, config: LaunchConfig, backend: str, start_method: str, workdir: str, args,
                    cancel: CancelOnSignals) -> None:
    if start_method == "fork":
        _prepare_parent_for_fork()
    context = multiprocessing.get_context(start_method)
    # A forked rank puts back the handlers the parent had before the launch; a spawned one starts with defaults.
    restore = cancel if start_method == "fork" else None
    processes = []
    try:
        for rank in range(config.world_size):
            cancel.check()
            process = context.Process(target=_rank_entry, name=f"ddplab-rank-{rank}",
                                      args=(rank, fn, args, config, backend, workdir, os.getpid(), restore))
            process.start()
            processes.append(process)
        _supervise(processes, config, workdir, cancel)
    finally:
        _stop(processes)
        if start_method == "fork":
            gc.unfreeze()


def _prepare_parent_for_fork() -> None:
    # DDP's constructor lazily imports torch._dynamo (~1 s); pay it once here, not per rank.
    import torch._dynamo  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    # Objects alive at fork time stay shared copy-on-write instead of being touched by gc.
    gc.collect()
    gc.freeze()


def _supervise(processes: list, config: LaunchConfig, workdir: str, cancel: CancelOnSignals) -> None:
    """Wait until every rank returned; raise on the first failure, the deadline or a signal."""
    deadline = None if config.deadline_s is None else time.monotonic() + config.deadline_s
    grace_until = None
    while True:
        running = [p.sentinel for p in processes if p.exitcode is None]
        if running:
            multiprocessing.connection.wait(running, timeout=0.1)
        cancel.check()
        errors = _errors(workdir, len(processes))
        _raise_if_died_or_raised(processes, errors, workdir)
        if all(p.exitcode == 0 for p in processes):
            return
        now = time.monotonic()
        if errors and grace_until is None:
            # A collective failed: give the peers waiting in it the time to time out too. One that entered it a
            # collective timeout or more after this rank had not answered for that long: it stopped answering, by
            # the timeout's own measure. A shorter grace would blame a peer that was only slow (a loaded machine).
            grace_until = now + config.pg_timeout_s
        if grace_until is not None and (now >= grace_until or _only_returned_ranks_left(processes, errors, workdir)):
            raise _stopped_answering(processes, errors, config, workdir)
        if deadline is not None and now >= deadline:
            alive = [r for r, p in enumerate(processes) if p.exitcode is None]
            raise LaunchError(f"{_ranks(alive)} still running after the {config.deadline_s:g} s deadline; stopped them",
                              kind="deadline", rank=alive[0] if alive else None)


def _only_returned_ranks_left(processes: list, errors: dict[int, RankFailure], workdir: str) -> bool:
    """Whether every rank that has not failed has returned: none of them can still join the collective."""
    return all(os.path.exists(_path(workdir, "result", rank)) for rank in range(len(processes)) if rank not in errors)


def _raise_if_died_or_raised(processes: list, errors: dict[int, RankFailure], workdir: str) -> None:
    for rank, process in enumerate(processes):
        if rank in errors or process.exitcode is None:
            continue
        if process.exitcode < 0:
            raise LaunchError(f"rank {rank} died: terminated with signal {signal.Signals(-process.exitcode).name}",
                              kind="died", rank=rank)
        if process.exitcode > 0 or not os.path.exists(_path(workdir, "result", rank)):
            raise LaunchError(f"rank {rank} died: exited with code {process.exitcode} without a result",
                              kind="died", rank=rank)
    # A collective failure is a consequence; an exception of any other kind is a cause.
    causes = {r: e for r, e in errors.items() if not e.collective}
    if causes:
        first = min(causes.values(), key=lambda failure: failure.time)
        raise _raised(first)


def _raised(failure: RankFailure) -> LaunchError:
    return LaunchError(f"rank {failure.rank} raised:\n{failure.traceback}", kind="raised", rank=failure.rank,
                       failure=failure)


def _stopped_answering(processes: list, errors: dict[int, RankFailure], config: LaunchConfig,
                       workdir: str) -> LaunchError:
    """Blame the ranks that did not fail in the collective the others timed out in."""
    first = min(errors.values(), key=lambda failure: failure.time)
    culprits = [r for r in range(len(processes)) if r not in errors]
    if not culprits:
        # Every rank waited (mismatched collectives): report the first failure as it is.
        return _raised(first)
    waiting = _ranks(sorted(errors))
    reason = first.message.strip().splitlines()[-1] if first.message.strip() else first.exc_type
    parts = [f"{_ranks(culprits)} stopped answering: {waiting} waited in a collective and failed "
             f"(collective timeout {config.pg_timeout_s:g} s): {reason}"]
    for rank in culprits:
        # A rank with a result has returned, even while it waits for its peers at the leaving barrier.
        if processes[rank].exitcode == 0 or os.path.exists(_path(workdir, "result", rank)):
            parts.append(f"rank {rank} had returned without joining that collective")
        else:
            stack = _stack(processes[rank], _path(workdir, "stack", rank, ext="txt"))
            parts.append(f"rank {rank} was still busy" + (f" in:\n{stack}" if stack else ""))
    return LaunchError("\n".join(parts), kind="stopped_answering", rank=culprits[0])


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _stack(process, path: str) -> str:
    """A live rank's Python stack, dumped by faulthandler on SIGUSR1 (empty if it cannot say)."""
    with open(path) as fh:
        before = len(fh.read())
    try:
        os.kill(process.pid, signal.SIGUSR1)
    except ProcessLookupError:
        return ""
    # The dump is written from the rank's signal handler: wait for its main thread's frames to reach the file.
    end = time.monotonic() + timescale.scaled(STACK_WAIT_S)
    while time.monotonic() < end and process.exitcode is None:
        time.sleep(0.05)
        with open(path) as fh:
            frames = _user_frames(fh.read()[before:])
        if frames:
            return frames
    return ""


def _user_frames(dump: str) -> str:
    """The main thread's frames above the launch layer's own (faulthandler lists the innermost first)."""
    for block in dump.split("\n\n"):
        lines = [line for line in block.splitlines() if line.startswith("  File")]
        ends = [i for i, line in enumerate(lines) if line.endswith("in _rank_entry")]
        if ends:
            return "\n".join(lines[:ends[0]])
    return ""


def _stop(processes: list) -> None:
    """SIGTERM every live rank, SIGKILL what is left after a short grace, reap them all."""
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    end = time.monotonic() + timescale.scaled(STOP_GRACE_S)
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
    for process in processes:
        if process.exitcode is None:
            # A rank whose own code handles SIGTERM may be stuck in C++ and never run the handler.
            process.kill()
        # SIGKILL cannot be refused: wait for the exit, so no rank outlives the launch.
        process.join()


def _errors(workdir: str, world_size: int) -> dict[int, RankFailure]:
    """Each failed rank's record."""
    return _saved(workdir, "error", world_size)


def _partials(workdir: str, world_size: int) -> dict[int, Any]:
    """Each rank's last checkpoint, with its journal (the records it appended) under "journal"."""
    partials = _saved(workdir, "partial", world_size)
    for rank in range(world_size):
        path = _path(workdir, "journal", rank)
        if rank in partials and isinstance(partials[rank], dict) and os.path.exists(path):
            partials[rank] = {**partials[rank], "journal": _read_journal(path)}
    return partials


def _read_journal(path: str) -> list:
    records = []
    with open(path, "rb") as fh:
        while True:
            try:
                records.extend(pickle.load(fh))
            except EOFError:
                return records
            except pickle.UnpicklingError:
                return records  # a write cut short by the stop: the records before it stand


def _saved(workdir: str, kind: str, world_size: int) -> dict[int, Any]:
    paths = {r: _path(workdir, kind, r) for r in range(world_size)}
    return {r: _load(path) for r, path in paths.items() if os.path.exists(path)}


def _path(workdir: str, kind: str, rank: int, ext: str = "pkl") -> str:
    return os.path.join(workdir, f"{kind}-{rank}.{ext}")


def _rank_entry(rank: int, fn, args, config: LaunchConfig, backend: str, workdir: str, parent_pid: int,
                restore: CancelOnSignals | None):
    _die_with_parent(parent_pid)
    if restore is not None:
        restore.restore_in_child()
    # The launching process owns cancellation: Ctrl-C reaches it, and it stops its ranks with SIGTERM,
    # which ends a rank quietly whatever handler its parent had (torch elastic installs one that raises).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if backend == "gloo":
        # Forked children deadlock in an inherited intra-op thread pool; one thread each.
        torch.set_num_threads(1)
    # On SIGUSR1 the parent gets this rank's stack, to say where a rank that stopped answering is.
    stack_file = open(_path(workdir, "stack", rank, ext="txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        ctx = _init_group(rank, rank, config.world_size, backend, config, workdir=workdir,
                          store=dist.FileStore(os.path.join(workdir, "store"), config.world_size))
        result = fn(ctx, *args)
        _save(_path(workdir, "result", rank), result)
    except BaseException as exc:
        _save(_path(workdir, "error", rank), failures.record(rank, exc))
        sys.stderr.flush()
        # Wait to be stopped: exiting would break the peers' connections and hide who failed first.
        while True:
            time.sleep(60)
    # fn's frame, and with it every DDP model and optimizer, is gone by now.
    del result, ctx
    # A peer that failed waits to be stopped and never reaches the barrier: leave without it.
    teardown(barrier_timeout_s=None if _any_failed(workdir, config.world_size) else config.pg_timeout_s)


def _die_with_parent(parent_pid: int) -> None:
    # SIGKILL, not torch's SIGINT: a parent started with SIGINT ignored would orphan its ranks.
    compat.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _run_in_torchrun_group(fn, config: LaunchConfig, args):
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if dist.is_initialized():
        # The caller's group: use it, and leave its teardown to its owner.
        backend = dist.get_backend()
        return fn(RankContext(rank=rank, local_rank=local_rank, world_size=world_size, backend=backend,
                              device=_device(backend, local_rank)), *args)
    backend = config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ctx = _init_group(rank, local_rank, world_size, backend, config, store=None)
    returned = False
    try:
        result = fn(ctx, *args)
        returned = True
        return result
    except BaseException as exc:
        if failures.in_collective(exc):
            _wait_to_be_stopped(config.pg_timeout_s)
        raise
    finally:
        del ctx
        # A failing rank leaves at once: its peers may never reach a barrier, and torchrun stops them.
        teardown(barrier_timeout_s=config.pg_timeout_s if returned else None)


def _wait_to_be_stopped(timeout_s: float) -> None:
    """A torchrun rank whose collective failed: the peer that broke it says why, then torchrun stops this rank.

    torchrun stops every rank once one exits with an error, so this rank leaving first (with a traceback that only
    says a peer went away) could stop the peer that failed before it says what failed, on a slow machine most of all.
    The same rule as a forked rank's: the consequence waits, the cause speaks. A peer that is still busy rather than
    gone (it never joined the collective) is waited for one more process-group timeout; then this rank's own error
    stands.
    """
    with contextlib.suppress(KeyboardInterrupt):
        time.sleep(timeout_s)


def _device(backend: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def _init_group(rank, local_rank, world_size, backend, config: LaunchConfig, store, workdir=None) -> RankContext:
    device = _device(backend, local_rank)
    if backend == "nccl":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=config.pg_timeout_s)
    # device_id binds NCCL to this rank's GPU at once; store=None means torchrun's env:// rendezvous.
    dist.init_process_group(backend, store=store, rank=rank if store else -1, world_size=world_size if store else -1,
                            timeout=timeout, **compat.init_process_group_kwargs(device if backend == "nccl" else None))
    return RankContext(rank=rank, local_rank=local_rank, world_size=world_size,
                       backend=backend, device=device, workdir=workdir)


def teardown(*, barrier_timeout_s: float | None = None) -> None:
    """End this rank's part in its process group: collect what DDP left, meet the peers, destroy the group.

    Callers drop their models and optimizers first: a DDP Reducer holding the last reference to a
    gloo group can hang the process at exit, so this collects the cycles. A rank that exits the
    instant its last collective returns can abort ("terminate called without an active exception"):
    a gloo worker thread still holds that collective's work, and releasing its tensors needs the
    interpreter that is finalizing. One barrier first, waited with the GIL released, lets it go.

    Args:
        barrier_timeout_s: how long the barrier waits for the peers; None leaves without one (this
            rank or a peer failed). A barrier that fails or times out only ends the wait.
    """
    gc.collect()
    if not dist.is_initialized():
        return
    if barrier_timeout_s is not None and dist.get_world_size() > 1:
        _leaving_barrier(barrier_timeout_s)
    dist.destroy_process_group()


def _any_failed(workdir: str, world_size: int) -> bool:
    return any(os.path.exists(_path(workdir, "error", rank)) for rank in range(world_size))


def _leaving_barrier(timeout_s: float) -> None:
    """Wait for every rank of the default group, at most ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if dist.get_backend() == dist.Backend.GLOO:
            dist.monitored_barrier(timeout=timeout)
        else:
            # NCCL has no monitored barrier: its barrier's work handle takes the timeout instead.
            dist.barrier(async_op=True).wait(timeout=timeout)
    except RuntimeError:
        # The result is already out; a peer that never came is reported by whoever supervises it.
        pass


def _save(path: str, obj: Any) -> None:
    with open(path + ".tmp", "wb") as fh:
        pickle.dump(obj, fh)
    os.replace(path + ".tmp", path)


def _load(path: str) -> Any:
    with open(path, "rb") as fh:
        return pickle.load(fh)
