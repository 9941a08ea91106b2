"""Step time of a small GPT under `ddplab audit -- torchrun ...` against plain `torchrun ...`.

    python benchmarks/audit_overhead.py [--rounds 2] [--steps 60] [--out benchmarks/results/audit_overhead.json]

Two ranks (gloo on CPU, one thread each), a 4-layer GPT (d=256, sequence 64, vocabulary 512, 3.3M parameters),
8 sequences per rank. Each launch times every optimizer step on rank 0; plain and audited launches alternate
`--rounds` times, so drift in the machine's speed falls on both alike. Reported: the median step time during the
audit window (steps 0-4), after it (steps 20 to the end), each launch's wall time, and the overhead of the audit
in each. The audit's own report (its finding lines) is kept too: the program is correct, so it should be clean.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, SEQUENCE, WIDTH, HEADS, LAYERS, PER_RANK_BATCH = 512, 64, 256, 4, 4, 8
WINDOW, AFTER_FROM = range(5), 20


def _gpt():
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
            self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                           torch.nn.Linear(4 * WIDTH, WIDTH))

        def forward(self, x):
            batch, time_, _ = x.shape
            q, k, v = (t.view(batch, time_, HEADS, -1).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(WIDTH, 2))
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attended.transpose(1, 2).reshape(batch, time_, WIDTH))
            return x + self.mlp(self.ln_2(x))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Embedding(SEQUENCE, WIDTH)
            self.blocks = torch.nn.Sequential(*(Block() for _ in range(LAYERS)))
            self.ln_f, self.head = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, VOCAB, bias=False)

        def forward(self, idx):
            x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
            return self.head(self.ln_f(self.blocks(x)))

    torch.manual_seed(0)
    return GPT()


def worker(steps: int, times_path: str) -> None:
    """One rank under torchrun: train and time every optimizer step; rank 0 writes the times."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ddp = DistributedDataParallel(_gpt())
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    tokens = torch.randint(VOCAB, (100_000,), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        starts = torch.randint(len(tokens) - SEQUENCE - 1, (PER_RANK_BATCH,), generator=generator)
        x = torch.stack([tokens[s:s + SEQUENCE] for s in starts])
        y = torch.stack([tokens[s + 1:s + 1 + SEQUENCE] for s in starts])
        begin = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x).view(-1, VOCAB), y.view(-1))
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - begin)
    if rank == 0:
        with open(times_path, "w") as fh:
            json.dump({"times": times, "parameters": sum(p.numel() for p in ddp.parameters()),
                       "final_loss": loss.item()}, fh)
    del ddp, optimizer
    dist.destroy_process_group()


def _launch(audited: bool, steps: int, workdir: str, index: int) -> dict:
    times_path = os.path.join(workdir, f"times-{index}.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.abspath(__file__), "--worker", "--steps", str(steps), "--times", times_path]
    if audited:
        command = [sys.executable, "-m", "ddplab", "audit", "--", *command]
    begin = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    wall = time.perf_counter() - begin
    if done.returncode != 0 or not os.path.exists(times_path):
        raise RuntimeError(f"launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(times_path) as fh:
        result = json.load(fh)
    report = [line for line in (done.stdout + done.stderr).splitlines()
              if line.lstrip().startswith(("ERROR", "WARNING", "INFO", "ddplab audit", "no DDP mistakes"))]
    return {**result, "wall_s": wall, "report": report}


def _summary(launches: list[dict]) -> dict:
    window = [t for launch in launches for i, t in enumerate(launch["times"]) if i in WINDOW]
    after = [t for launch in launches for t in launch["times"][AFTER_FROM:]]
    return {"window_median_s": statistics.median(window), "after_median_s": statistics.median(after),
            "launch_wall_s": [round(launch["wall_s"], 2) for launch in launches],
            "after_medians_per_launch_s": [statistics.median(launch["times"][AFTER_FROM:]) for launch in launches]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="plain/audited launch pairs (default 2)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per launch (default 60)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "audit_overhead.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--times", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.times)
        return
    if args.steps <= AFTER_FROM:
        raise SystemExit(f"--steps must be more than {AFTER_FROM}, to time steps after the audit window")
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"plain": [], "audited": []}
    with tempfile.TemporaryDirectory(prefix="audit-overhead-") as workdir:
        for round_ in range(args.rounds):
            # Alternate which goes first, so a trend in the machine's speed does not favour one.
            for audited in ((False, True) if round_ % 2 == 0 else (True, False)):
                name = "audited" if audited else "plain"
                runs[name].append(_launch(audited, args.steps, workdir, len(runs["plain"]) + len(runs["audited"])))
                print(f"round {round_}: {name} done", file=sys.stderr, flush=True)
    plain, audited = _summary(runs["plain"]), _summary(runs["audited"])
    result = {
        "setup": {"model": f"GPT {LAYERS} layers, d={WIDTH}, sequence {SEQUENCE}, vocabulary {VOCAB}",
                  "parameters": runs["plain"][0]["parameters"], "world_size": 2, "backend": "gloo",
                  "per_device_batch_size": PER_RANK_BATCH, "steps": args.steps, "rounds": args.rounds,
                  "window_steps": f"{WINDOW.start}-{WINDOW.stop - 1}", "after_steps": f"{AFTER_FROM}-{args.steps - 1}"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "plain": plain, "audited": audited,
        "overhead": {"window": audited["window_median_s"] / plain["window_median_s"] - 1,
                     "after": audited["after_median_s"] / plain["after_median_s"] - 1},
        # How far two plain launches' medians after the window lie apart: what the machine's noise alone does.
        "plain_run_to_run_after": (max(plain["after_medians_per_launch_s"])
                                   / min(plain["after_medians_per_launch_s"]) - 1),
        "final_loss_equal": len({run["final_loss"] for run in runs["plain"] + runs["audited"]}) == 1,
        "audit_report": runs["audited"][-1]["report"],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps({k: result[k] for k in ("plain", "audited", "overhead", "plain_run_to_run_after",
                                             "final_loss_equal")}, indent=2))


if __name__ == "__main__":
    main()
