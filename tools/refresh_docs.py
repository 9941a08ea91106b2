"""Re-run every command quoted in the docs and paste its real output under it.

    python tools/refresh_docs.py [README.md docs/commands/plan.md ...]

With no argument it refreshes README.md and every page under docs/. A block looks like this in
Markdown (the command runs from the repository root, with this interpreter's environment first on PATH):

    <!-- output: ddplab plan --ref-batch-size 32 --ref-lr 0.1 --devices 8 -->
    ```text
    ...replaced...
    ```
    <!-- /output -->

A trimmed block (the README's short examples) leaves out the first `skip` lines of the output, then keeps
its first `head` and last `tail` lines, and says how many it left out at each cut:
`<!-- output skip=2 head=4 tail=1: ddplab plan ... -->`. A command quoted more than once is run once per
refresh, so every page shows the same run.
"""

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The opening marker alone: tests/test_readme.py reads the quoted commands with it.
MARKER = re.compile(r"<!-- output(?: skip=(?P<skip>\d+))?(?: head=(?P<head>\d+))?(?: tail=(?P<tail>\d+))?: "
                    r"(?P<cmd>.+?) -->")
BLOCK = re.compile(MARKER.pattern + r"\n```text\n.*?```\n<!-- /output -->", re.S)
# What would choose torch's CPU kernels for the command instead of the command itself (ddplab.study.kernels).
CPU_KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR")
# torchrun's own start-up chatter is not ddplab output.
NOISE = re.compile(r"^(W\d{4} .*|\*{10,}|Setting OMP_NUM_THREADS.*|.*OMP_NUM_THREADS.*)$")


def run(command: str, root: str | None = None) -> str:
    """``command``'s output as a terminal shows it, less torchrun's chatter.

    With ``root``, each folder under /tmp that the command names is the folder of that name under ``root`` instead
    (a run of its own, which no other run of the same command can touch), and the output names it as the command
    does.
    """
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               COLUMNS="120", TERM="dumb", NO_COLOR="1")
    # The CPU kernels a new user's command picks (a test session chooses its own for the processes it starts).
    for name in CPU_KERNEL_VARIABLES:
        env.pop(name, None)
    if root is not None:
        command = TMP_PATH.sub(lambda match: os.path.join(root, match[0][len("/tmp/"):]), command)
    # One stream, so output lands in the order a terminal would show it.
    done = subprocess.run(command, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    lines = done.stdout.splitlines()
    text = "\n".join(line.rstrip() for line in lines if not NOISE.match(line))
    if root is not None:
        text = text.replace(os.path.join(root, ""), "/tmp/")
    return text + (f"\n(exit code {done.returncode})" if done.returncode else "")


def trim(output: str, skip: int | None = None, head: int | None = None, tail: int | None = None) -> str:
    """``output`` less its first ``skip`` lines, then its first ``head`` and last ``tail`` lines; a line at each cut
    says how many lines it left out."""
    lines = output.split("\n")
    skip = min(skip or 0, len(lines))
    kept = [_cut(skip)] if skip else []
    rest = lines[skip:]
    if (head is None and tail is None) or (head or 0) + (tail or 0) >= len(rest):
        return "\n".join(kept + rest)
    head, tail = head or 0, tail or 0
    return "\n".join(kept + rest[:head] + [_cut(len(rest) - head - tail)] + rest[len(rest) - tail:])


def _cut(count: int) -> str:
    return f"… ({count} lines trimmed)"


def render(match: re.Match, output: str) -> str:
    skip, head, tail = (int(match[name]) if match[name] else None for name in ("skip", "head", "tail"))
    opening = match.group(0).split("\n", 1)[0]
    return f"{opening}\n```text\n$ {match['cmd']}\n{trim(output, skip, head, tail)}\n```\n<!-- /output -->"


def run_once(command: str, outputs: dict[str, str]) -> str:
    """``command``'s output, run (and named on stderr) only when ``outputs`` does not hold it yet."""
    if command not in outputs:
        print(f"$ {command}", file=sys.stderr, flush=True)
        outputs[command] = run(command)
    return outputs[command]


def refresh(path: str, outputs: dict[str, str]) -> None:
    with open(path) as fh:
        source = fh.read()

    def replace(match):
        return render(match, run_once(match["cmd"], outputs))

    # Every command runs before the file is touched, and the new text replaces it whole: a refresh that is
    # stopped half-way leaves the file as it was.
    refreshed = BLOCK.sub(replace, source)
    with open(path + ".tmp", "w") as fh:
        fh.write(refreshed)
    os.replace(path + ".tmp", path)


# A path a command reads under /tmp, and the folder a command writes there (--out).
TMP_PATH = re.compile(r"(?<![\w/])/tmp/[\w.-]+")
OUT_DIR = re.compile(r"--out[ =](/tmp/[\w.-]+)")


def in_order(commands: list[str]) -> list[str]:
    """``commands`` in page order, except that a command reading a folder under /tmp that another one writes
    (``--out``) runs after it: a page may quote a schedule before the study that makes it."""
    writer: dict[str, str] = {}
    for command in commands:
        for match in OUT_DIR.finditer(command):
            writer.setdefault(match[1], command)
    ordered: list[str] = []

    def visit(command: str, seen: frozenset[str]) -> None:
        if command in ordered or command in seen:
            return
        for path in TMP_PATH.findall(command):
            source = writer.get(path)
            if source is not None and source != command:
                visit(source, seen | {command})
        ordered.append(command)

    for command in commands:
        visit(command, frozenset())
    return ordered


def commands_in(paths: list[str]) -> list[str]:
    """Every command quoted in ``paths``, once each, in page order."""
    found: dict[str, None] = {}
    for path in paths:
        with open(path) as fh:
            found.update((match["cmd"], None) for match in BLOCK.finditer(fh.read()))
    return list(found)


def pages() -> list[str]:
    """README.md, then every Markdown page of the docs site."""
    docs = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [os.path.join(ROOT, "README.md"), *docs]


def refresh_all(targets: list[str]) -> None:
    """Every command of ``targets`` run in :func:`in_order`; each page written as soon as its last command has run,
    so a refresh stopped late keeps the pages it finished."""
    outputs: dict[str, str] = {}
    waiting = {target: commands_in([target]) for target in targets}
    for command in in_order(list(dict.fromkeys(c for needs in waiting.values() for c in needs))):
        run_once(command, outputs)
        for target in [t for t, needs in waiting.items() if outputs.keys() >= set(needs)]:
            refresh(target, outputs)
            del waiting[target]
    for target in waiting:
        refresh(target, outputs)


if __name__ == "__main__":
    refresh_all(sys.argv[1:] or pages())
