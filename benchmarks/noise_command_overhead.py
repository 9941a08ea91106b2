"""Step time of a small GPT under `ddplab noise -- torchrun ...` against plain `torchrun ...`.

    python benchmarks/noise_command_overhead.py [--rounds 2] [--steps 80] [--out PATH.json]

The training program is `benchmarks/audit_overhead.py`'s worker: two ranks (gloo on CPU, one thread each), a 4-layer
GPT (d=256, sequence 64, vocabulary 512, 3.3M parameters), 8 sequences per rank, every optimizer step timed on rank 0.
Plain and measured launches alternate `--rounds` times. Reported: the median step time during the measured steps
(10-49), after them (55 to the end), the guest's own time per measured step as `ddplab noise` reports it, and
whether the final loss is the same.
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
WORKER = os.path.join(HERE, "audit_overhead.py")
START, MEASURED, AFTER_FROM = 10, 40, 55


def _launch(measured: bool, steps: int, workdir: str, index: int) -> dict:
    times_path = os.path.join(workdir, f"times-{index}.json")
    report_path = os.path.join(workdir, f"noise-{index}.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", WORKER,
               "--worker", "--steps", str(steps), "--times", times_path]
    if measured:
        command = [sys.executable, "-m", "ddplab", "noise", "--start-step", str(START), "--steps", str(MEASURED),
                   "--json-file", report_path, "--", *command]
    begin = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    wall = time.perf_counter() - begin
    if done.returncode != 0 or not os.path.exists(times_path):
        raise RuntimeError(f"launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(times_path) as fh:
        result = json.load(fh)
    if measured:
        with open(report_path) as fh:
            report = json.load(fh)
        result["noise"] = {key: report[key] for key in ("b_simple", "b_simple_ci95", "measured_step_range",
                                                        "guest_seconds_per_measured_step", "measured_step_seconds",
                                                        "overhead")}
    return {**result, "wall_s": wall}


def _summary(launches: list[dict]) -> dict:
    window = [t for launch in launches for t in launch["times"][START:START + MEASURED]]
    after = [t for launch in launches for t in launch["times"][AFTER_FROM:]]
    return {"measured_median_s": statistics.median(window), "after_median_s": statistics.median(after),
            "launch_wall_s": [round(launch["wall_s"], 2) for launch in launches],
            "measured_medians_per_launch_s": [statistics.median(launch["times"][START:START + MEASURED])
                                              for launch in launches]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="plain/measured launch pairs (default 2)")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per launch (default 80)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "noise_command_overhead.json"))
    args = parser.parse_args()
    if args.steps <= AFTER_FROM:
        raise SystemExit(f"--steps must be more than {AFTER_FROM}, to time steps after the measured ones")
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"plain": [], "measured": []}
    with tempfile.TemporaryDirectory(prefix="noise-overhead-") as workdir:
        for round_ in range(args.rounds):
            # Alternate which goes first, so a trend in the machine's speed does not favour one.
            for measured in ((False, True) if round_ % 2 == 0 else (True, False)):
                name = "measured" if measured else "plain"
                runs[name].append(_launch(measured, args.steps, workdir, len(runs["plain"]) + len(runs["measured"])))
                print(f"round {round_}: {name} done", file=sys.stderr, flush=True)
    plain, measured = _summary(runs["plain"]), _summary(runs["measured"])
    result = {
        "setup": {"model": "benchmarks/audit_overhead.py's GPT", "parameters": runs["plain"][0]["parameters"],
                  "world_size": 2, "backend": "gloo", "steps": args.steps, "rounds": args.rounds,
                  "measured_steps": f"{START}-{START + MEASURED - 1}", "after_steps": f"{AFTER_FROM}-{args.steps - 1}"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "plain": plain, "measured": measured,
        "overhead": {"measured_steps": measured["measured_median_s"] / plain["measured_median_s"] - 1,
                     "after": measured["after_median_s"] / plain["after_median_s"] - 1},
        "plain_run_to_run_measured_steps": (max(plain["measured_medians_per_launch_s"])
                                            / min(plain["measured_medians_per_launch_s"]) - 1),
        "final_loss_equal": len({run["final_loss"] for run in runs["plain"] + runs["measured"]}) == 1,
        "guest_reports": [run["noise"] for run in runs["measured"]],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps({k: result[k] for k in ("plain", "measured", "overhead", "plain_run_to_run_measured_steps",
                                             "final_loss_equal", "guest_reports")}, indent=2))


if __name__ == "__main__":
    main()
