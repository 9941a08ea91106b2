"""``ddplab check -- COMMAND``: the two runs' comparison rendered (the library computes; this only prints)."""

from __future__ import annotations

import argparse

from ddplab.check.command.config import CommandCheckConfig
from ddplab.cli import render

STYLE = {"EQUIVALENT": "bold green", "ROUNDING": "bold green", "DIVERGES": "bold red", "INCOMPARABLE": "bold yellow"}
MODULES_SHOWN = 8


def check(args: argparse.Namespace, config: CommandCheckConfig):
    """The two runs and their comparison; a line on stderr as each run starts."""
    from ddplab.check.command.run import check_command

    err = render.console(stderr=True)
    return check_command(config, say=lambda text: err.print(f"ddplab check: {text}", markup=False),
                         program_stdout_to_stderr=bool(args.json))


def print_result(result) -> None:
    out = render.console()
    ranks, one = result.runs
    title = (f"ddplab check: {ranks.side.describe()} vs {one.side.describe()} (global batch "
             f"{result.config.global_batch_size}), tolerance {result.tolerance:g}")
    rows = [[str(s.step), _num(s.gradient.gradient_ratio, 6), _num(s.gradient.cosine, 6),
             _sci(s.gradient.difference), _num(s.update.gradient_ratio, 4), _num(s.update.cosine, 4),
             "✓" if s.agrees else "✗"] for s in result.steps]
    out.print(render.table(title, ["step", "gradient ratio", "cosine", "relative Δ", "update ratio", "update cos", ""],
                           rows))
    _print_modules(out, result)
    cause = f" ({result.cause})" if result.cause else ""
    out.print(f"[{STYLE[result.verdict]}]{result.verdict}[/]{cause}: {result.explanation}")
    for finding in result.audit_findings:
        out.print(f"audit on the split run: {finding['code']}: {finding['message']}", markup=False)
    if result.samples.compared and result.samples.same:
        how = "DistributedSampler's indices" if result.samples.how == "indices" else "the inputs' fingerprints"
        out.print(f"samples: the first global batch is the same {result.samples.size} samples on both sides ({how})",
                  markup=False)
    for note in result.notes:
        out.print(f"note: {note}", markup=False)
    out.print(f"cost: the split run {ranks.seconds:.1f} s, the reference {one.seconds:.1f} s, the check in all "
              f"{result.check_s:.1f} s", markup=False)


def _print_modules(out, result) -> None:
    """Each module's ratio and cosine at the first step that differs (or the first step): where a cause shows."""
    step = next((s for s in result.steps if s.step == result.first_divergent_step), result.steps[0])
    if result.verdict != "DIVERGES":
        return
    rows = [[name, _num(c.gradient_ratio, 6), _num(c.cosine, 6), _sci(c.difference), "exact" if c.exact else "sketch"]
            for name, c in list(step.modules.items())[:MODULES_SHOWN]]
    more = len(step.modules) - MODULES_SHOWN
    title = f"by module at step {step.step}" + (f" (the first {MODULES_SHOWN} of {len(step.modules)})" if more > 0
                                                  else "")
    out.print(render.table(title, ["module", "gradient ratio", "cosine", "relative Δ", "cosine from"], rows))


def _num(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _sci(value: float | None) -> str:
    return "—" if value is None else f"{value:.2e}"
