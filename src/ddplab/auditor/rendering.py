"""The audit report as lines of text: one renderer for rank 0's report inside the run and the command's final one.

Each line comes with its kind (headline, clean, a severity, fix), so the command can colour it; rank 0 prints the
same lines plain. Findings and fixes wrap at the same width as the rest of ddplab's output.
"""

from __future__ import annotations

import textwrap
from typing import Literal

from ddplab.auditor.findings import Report

Kind = Literal["headline", "clean", "error", "warning", "info", "fix"]
WIDTH = 120
FINDING_INDENT, FIX_INDENT = "    ", "         "


def report_lines(report: Report, *, interim_steps: int | None = None, width: int = WIDTH) -> list[tuple[Kind, str]]:
    """The report's lines; ``interim_steps``: rank 0's report after that many steps, while training goes on."""
    prefix = f"[rank 0, after {interim_steps} steps] " if interim_steps is not None else ""
    lines: list[tuple[Kind, str]] = [("headline", f"{prefix}ddplab audit: {report.headline()}")]
    if not report.problems and report.audited:
        engine = report.reduction.engine if report.reduction is not None else "DDP"
        lines.append(("clean", _clean(interim_steps, engine)))
    for finding in report.problems:
        data = finding.to_json()
        ranks = ", ".join(map(str, data["ranks"]))
        text = f"{finding.severity.upper()} {finding.code} (ranks {ranks}): {data['message']}"
        lines += [(finding.severity, line) for line in _wrap(text, FINDING_INDENT, width)]
        lines += [("fix", line) for line in _wrap(f"fix: {finding.fix}", FIX_INDENT, width, first="    ")]
    return lines


def render_text(report: Report, *, interim_steps: int | None = None, width: int = WIDTH) -> str:
    """The report as plain text."""
    return "\n".join(text for _, text in report_lines(report, interim_steps=interim_steps, width=width))


def _clean(interim_steps: int | None, engine: str) -> str:
    """The clean line, naming the engine the run's gradients went through (DDP, FSDP2, HSDP, DeepSpeed ZeRO-2)."""
    if interim_steps is None:
        return f"no {engine} mistakes found"
    # What the run has not reached yet cannot be judged yet: a second pass over the data, evaluation.
    return (f"no {engine} mistakes found in the first {interim_steps} steps; a repeated epoch order and evaluation "
            "over padded samplers are judged when the run reaches them (the final report says)")


def _wrap(text: str, indent: str, width: int, first: str = "") -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False) or [first + text]
