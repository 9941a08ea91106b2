"""Time ``ddplab sandbox table`` against the classic way, on the same machine in one sitting.

    python benchmarks/sandbox_table.py [--repeats 3] [--skip-classic] [--out benchmarks/results/sandbox_table.json]

The table is timed as a fresh ``ddplab sandbox table`` process (start-up included). The classic
way runs each of the nine runs as its own fresh process, spawning 8 ranks for the multi runs and
training the experiments one after another. Both include Python and torch start-up.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _time(cmd: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return time.perf_counter() - started, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-classic", action="store_true", help="time only the table")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "sandbox_table.json"))
    args = parser.parse_args()

    table = [_time([sys.executable, "-m", "ddplab", "sandbox", "table", "--json"])[0] for _ in range(args.repeats)]
    print(f"ddplab sandbox table: {', '.join(f'{t:.2f}' for t in table)} s", flush=True)
    record = {
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}",
        "table_seconds": table, "table_median_seconds": statistics.median(table),
    }
    if not args.skip_classic:
        classic = []
        for run in range(1, 10):
            seconds, out = _time([sys.executable, os.path.join(HERE, "classic_run.py"), str(run)])
            classic.append(seconds)
            print(f"classic run {run}: {seconds:.1f} s (mean w {float(out.split()[-1]):.6f})", flush=True)
        record.update(classic_seconds=classic, classic_total_seconds=sum(classic),
                      speedup=sum(classic) / statistics.median(table))
        print(f"classic total {sum(classic):.1f} s → {record['speedup']:.0f}× slower than the table", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=2)


if __name__ == "__main__":
    main()
