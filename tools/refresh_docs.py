"""Re-run every command quoted in the docs and paste its real output under it.

    python tools/refresh_docs.py [README.md docs/*.md]

A block looks like this in Markdown (the command runs from the repository root, with this
interpreter's environment first on PATH):

    <!-- output: ddplab plan --ref-batch-size 32 --ref-lr 0.1 --devices 8 -->
    ```text
    ...replaced...
    ```
    <!-- /output -->
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(<!-- output: (?P<cmd>.+?) -->\n)```text\n.*?```\n(<!-- /output -->)", re.S)
# torchrun's own start-up chatter is not ddplab output.
NOISE = re.compile(r"^(W\d{4} .*|\*{10,}|Setting OMP_NUM_THREADS.*|.*OMP_NUM_THREADS.*)$")


def run(command: str) -> str:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               COLUMNS="120", TERM="dumb", NO_COLOR="1")
    # One stream, so output lands in the order a terminal would show it.
    done = subprocess.run(command, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    lines = done.stdout.splitlines()
    text = "\n".join(line.rstrip() for line in lines if not NOISE.match(line))
    return text + (f"\n(exit code {done.returncode})" if done.returncode else "")


def refresh(path: str) -> None:
    with open(path) as fh:
        source = fh.read()

    def replace(match):
        print(f"$ {match['cmd']}", file=sys.stderr, flush=True)
        return f"{match.group(1)}```text\n$ {match['cmd']}\n{run(match['cmd'])}\n```\n{match.group(3)}"

    # Every command runs before the file is touched, and the new text replaces it whole: a refresh that is
    # stopped half-way leaves the file as it was.
    refreshed = BLOCK.sub(replace, source)
    with open(path + ".tmp", "w") as fh:
        fh.write(refreshed)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    for target in sys.argv[1:] or [os.path.join(ROOT, "README.md")]:
        refresh(target)
