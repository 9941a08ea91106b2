"""``branched.html``: a critical-batch measurement in one page: the critical batch over training with its intervals
(branched.png), each checkpoint's row, the schedule and what it cost.
"""

from __future__ import annotations

import os

from ddplab.study.report.html import b64, html_escape, number, write_page


def write_branched_html(values: dict, path: str) -> str:
    """The page for ``branched.json``'s ``values``, written to ``path`` (its figure embedded where it was drawn)."""
    images = "".join(f'<img alt="{html_escape(os.path.basename(p))}" src="data:image/png;base64,{b64(p)}">'
                     for p in values.get("plots") or [] if os.path.exists(p))
    rows = "".join(_row(point) for point in values["branches"])
    schedule = ", ".join(f"from {s['samples_seen']:,} samples: {s['global_batch_size']} (lr {number(s['lr'])})"
                         for s in values["schedule"])
    notes = "".join(f"<p>note: {html_escape(note)}</p>" for point in values["branches"] for note in point["notes"])
    cost = values["cost"]
    relative = f" ({number(cost['relative'])}× one reference run)" if cost.get("relative") else ""
    batches = ", ".join(map(str, values["global_batch_sizes"]))
    body = f"""<h1>ddplab study: {html_escape(values['workload'])}, the critical batch over training</h1>
<p>Branches of {values['branch_samples']:,} samples from each checkpoint at global batches {batches}, \
{values['seeds']} seeds, lrs of the {html_escape(values['lr_rule'])} rule; tolerance: \
{html_escape(values['tolerance'])}. The critical batch is the largest batch whose branches still match the \
reference batch's loss for the same samples (Merrill et al. 2025); its interval judges each batch by its worst \
and its best seed.</p>
{images}
<table><tr><th>samples seen</th><th>critical batch</th><th>interval (seeds)</th><th>resolved</th>\
<th>B_simple</th><th>reference loss</th><th>tolerance</th></tr>{rows}</table>
{notes}
<p>Batch schedule (double when the critical batch reaches twice the batch): {schedule}.</p>
<p>Cost: {cost['branch_samples']:,} samples of branches{relative}.</p>
"""
    return write_page(path, f"ddplab study: {values['workload']}, the critical batch over training", body)


def _row(point: dict) -> str:
    low, high = point["interval"]
    edge = " (edge)" if point.get("at_edge") else ""
    resolved = "yes" if point.get("resolved", True) else "no: the interval spans the grid"
    return (f"<tr><td>{point['samples_seen']:,}</td><td>{point['critical_batch_size'] or '—'}{edge}</td>"
            f"<td>[{low if low is not None else '—'}, {high if high is not None else '—'}]</td><td>{resolved}</td>"
            f"<td>{number(point.get('b_simple'))}</td><td>{number(point.get('reference_loss'))}</td>"
            f"<td>{number(point.get('tolerance'))}</td></tr>")
