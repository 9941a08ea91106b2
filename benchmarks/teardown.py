"""How often a rank that ddplab starts aborts at exit right after its last collective.

The abort is torch's "terminate called without an active exception": a gloo worker thread lets go of
the last collective's work, and with it a tensor Python created, while the rank's interpreter is
already finalizing. Each run launches ``--world-size`` gloo ranks whose function's very last act is
an ``all_reduce`` of a tensor it then drops (after a few DDP steps), while rank 0 goes on for a second,
through each of the launch layer's paths:

- ``fork``: :func:`ddplab.runtime.launch.launch` forking the ranks from this process;
- ``spawn``: the same with ``start_method="spawn"`` (fresh interpreters that finalize at exit);
- ``torchrun``: ``python -m torch.distributed.run --standalone`` on this file, whose workers join
  torchrun's group through ``launch``;
- ``plain``: the control, torchrun on a worker without ddplab's launch that inits the group itself, runs
  the same function and destroys the group at once (what a user's script does without a barrier);
- ``plain-gc`` and ``plain-barrier``: the same worker ending through ddplab's ``teardown``, without
  and with its barrier (``gc.collect()``, [barrier,] ``destroy_process_group()``).

A run aborted when the launch failed (a rank died: SIGABRT) or any rank wrote "terminate called".
If the base rate is p per run, n clean runs after a fix happen by chance with probability (1 - p)^n.

    PYTHONPATH=src python benchmarks/teardown.py [--paths fork,spawn,torchrun] [--runs 100]
        [--out benchmarks/results/teardown.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from ddplab.errors import LaunchError
from ddplab.runtime.launch import LaunchConfig, launch, teardown

ABORT_TEXT = "terminate called"
PATHS = ("fork", "spawn", "torchrun", "plain", "plain-gc", "plain-barrier")


LINGER_S = 1.0
"""How long rank 0 goes on after the last collective while the other ranks leave (printing a report, say)."""


def last_act_all_reduce(ctx) -> None:
    """A few DDP steps, then an all-reduce; every rank but 0 returns the instant it does.

    The shape of the abort first seen (a training script whose rank 1 left while rank 0 still reported).
    """
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
    del model, optimizer
    value = torch.ones(1)
    dist.all_reduce(value)
    if dist.get_rank() == 0:
        time.sleep(LINGER_S)


def _launched(start_method: str, world_size: int) -> tuple[bool, str]:
    """One launch through the launch layer: (aborted, what the ranks wrote to stderr)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        # The ranks inherit file descriptor 2: point it at a file for the length of the launch.
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            launch(last_act_all_reduce, LaunchConfig(world_size=world_size, start_method=start_method,
                                                      pg_timeout_s=30, deadline_s=120))
            failed = False
        except LaunchError:
            failed = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        text = err.read()
    return failed or ABORT_TEXT in text, text


def plain_worker(ending: str) -> None:
    """A torchrun worker without ddplab's launch: its own group, the same function, then ``ending``."""
    dist.init_process_group("gloo")
    last_act_all_reduce(None)
    if ending == "plain":
        dist.destroy_process_group()
    else:
        teardown(barrier_timeout_s=30 if ending == "plain-barrier" else None)


def _torchrun(world_size: int, worker: str) -> tuple[bool, str]:
    """One ``python -m torch.distributed.run`` of this file's worker: (aborted, its stderr)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(world_size), os.path.abspath(__file__), "--worker", worker],
                          capture_output=True, text=True, timeout=300)
    return done.returncode != 0 or ABORT_TEXT in done.stderr, done.stderr


def measure(path: str, runs: int, world_size: int) -> dict:
    """Abort count over ``runs`` launches through ``path``, with the first aborted run's stderr."""
    aborts, first_error, started = 0, None, time.monotonic()
    for _ in range(runs):
        if path.startswith(("torchrun", "plain")):
            aborted, err = _torchrun(world_size, "launch" if path == "torchrun" else path)
        else:
            aborted, err = _launched(path, world_size)
        if aborted:
            aborts += 1
            first_error = first_error or err[-2000:]
    return {"path": path, "runs": runs, "aborts": aborts, "rate": aborts / runs,
            "seconds_per_run": (time.monotonic() - started) / runs, "first_abort_stderr": first_error}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--label", default="", help="what the code under test is (e.g. 'no barrier')")
    parser.add_argument("--out", default=None, help="append the results to this JSON file")
    parser.add_argument("--worker", choices=("launch", "plain", "plain-gc", "plain-barrier"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "launch":
        launch(last_act_all_reduce, LaunchConfig())
        return
    if args.worker is not None:
        plain_worker(args.worker)
        return
    results = []
    for path in args.paths.split(","):
        result = {**measure(path, args.runs, args.world_size), "world_size": args.world_size,
                  "label": args.label, "commit": _commit(), "torch": torch.__version__,
                  "python": platform.python_version(), "cpus": os.cpu_count()}
        results.append(result)
        print(f"{path:9s} {result['aborts']:4d} aborts in {args.runs} runs ({result['rate']:.1%}), "
              f"{result['seconds_per_run']:.2f} s per run", flush=True)
    if args.out:
        previous = json.load(open(args.out)) if os.path.exists(args.out) else []
        with open(args.out, "w") as fh:
            json.dump(previous + results, fh, indent=1)


if __name__ == "__main__":
    main()
