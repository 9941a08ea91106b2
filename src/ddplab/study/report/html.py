"""``report.html``: the study's figures and tables in one page.
"""

from __future__ import annotations

import base64
import html
import os

from ddplab.study.report.records import TRAINING_LOSS, optimizer_text
from ddplab.study.rules import registry


def _front_html(report: dict) -> str:
    """The rules whose batch changes against the fixed-batch front: the tuned batches that reach the target in both
    fewer steps and fewer samples, and the tuned fit's front at their median steps."""
    fixed = {p["global_batch_size"]: p["median_steps"] for p in report["tuned_lr"]}
    rows = ""
    for name, entry in (report.get("adaptive") or {}).items():
        beaten = ", ".join(f"{b} ({number(fixed[b])} steps, {number(fixed[b] * b)} samples)"
                           for b in entry.get("dominated_by") or [])
        rows += (f"<tr><td>{html_escape(name)}</td><td>{entry['start_global_batch_size']}</td>"
                 f"<td>{number(entry['median_steps'])}</td><td>{number(entry['median_samples'])}</td>"
                 f"<td>{beaten or 'none: on or below the front'}</td>"
                 f"<td>{number(entry.get('front_samples_at_steps'))}</td></tr>")
    if not rows:
        return ""
    return ("<h2>Batches that change, against the fixed-batch front</h2><p>Median steps and samples to the target "
            "of each rule whose batch changes as it trains; the best tuned fixed batches that reach the target in both "
            "fewer steps and fewer samples (none: the rule lies on or below the front measured here); the samples "
            "the tuned fit's front (S/S_min − 1)(E/E_min − 1) = 1 needs at the rule's median steps.</p>"
            "<table><tr><th>rule</th><th>from global batch</th><th>median steps</th><th>median samples</th>"
            f"<th>fixed batches with fewer of both</th><th>fitted front's samples at its steps</th></tr>{rows}</table>")


def _fit_row(rule: str, f: dict) -> str:
    """A rule's fit as a table row: an undefined (flat) fit shows why, not its zeros."""
    if f.get("undefined"):
        return (f"<tr><td>{rule}</td><td>{number(f['s_min'])}</td><td>undefined</td><td>({html.escape(f['undefined'])})"
                "</td><td>undefined</td></tr>")
    low, high = f["b_crit_ci95"]
    return (f"<tr><td>{rule}</td><td>{number(f['s_min'])}</td><td>{number(f['b_crit'])}</td>"
            f"<td>[{number(low)}, {number(high)}]</td><td>{number(f['e_min'])}</td></tr>")


def _settings(optimizer: dict | None) -> str:
    """A run's Adam settings in the runs table: betas, eps, weight decay ("" for SGD)."""
    if not optimizer:
        return ""
    parts = []
    if "betas" in optimizer:
        parts.append(f"β ({', '.join(f'{b:.6g}' for b in optimizer['betas'])})")
    if "eps" in optimizer:
        parts.append(f"ε {optimizer['eps']:.3g}")
    if "weight_decay" in optimizer:
        parts.append(f"λ {optimizer['weight_decay']:.4g}")
    # A command's run keeps the settings no placeholder gave it: what they are, the study cannot know.
    if optimizer.get("own"):
        parts.append("the rest the command's own" if parts else "the command's own")
    return ", ".join(parts)


def _scorecard_html(report: dict) -> str:
    """The scorecard: per rule its lr's distance from the best tuned lr and its steps over the best's."""
    card = report.get("scorecard") or {}
    rows = "".join(
        f"<tr><td>{html_escape(rule)}</td><td>{number(row['median_abs_log2_lr_gap'])}</td>"
        f"<td>{number(row['median_steps_ratio'])}</td>"
        f"<td>{number((row['steps_ratio_seed_range'] or [None, None])[0])} to "
        f"{number((row['steps_ratio_seed_range'] or [None, None])[1])}</td><td>{row['batches']}</td></tr>"
        for rule, row in card.items())
    if not rows:
        return ""
    if report.get("scorecard_note"):
        table = f"<p>Not shown: {html_escape(report['scorecard_note'])}.</p>"
    else:
        table = ("<p>Medians over the global batches: |log₂(rule's lr / best tuned lr)|, and the rule's median steps "
                 "to the target over the best tuned setting's (the range: its fewest and most seeds').</p><table><tr>"
                 "<th>rule</th><th>|log₂ lr gap|</th><th>steps ÷ tuned</th><th>seeds' range</th><th>batches</th>"
                 f"</tr>{rows}</table>")
    peak, peak_text = report.get("lr_peak"), ""
    if peak is not None:
        where = (f"peaks inside the measured range at global batch {peak['global_batch_size']}"
                 if peak["global_batch_size"] else "does not peak inside the measured range")
        peak_text = (f"<p>The best tuned lr {where}; B_simple at the reference batch: {number(peak['b_simple'])} "
                     "(Li et al. 2024 put Adam's peak at B_noise).</p>")
    return f"<h2>Scorecard</h2>{table}{peak_text}"


def _read_from(report: dict) -> str:
    """What the target is read from: the spec's validation set, or the command's training loss or printed metric."""
    read = report.get("target_read")
    if read == TRAINING_LOSS:
        return "the training loss (the ranks' mean between evaluations)"
    return f"{read}, as the command printed it," if read else f"validation {report['target']['kind']}"


def write_html(report: dict, path: str) -> str:
    """One HTML file: the plots embedded, the fits, B_simple and a table of every run."""
    images = "".join(f'<img alt="{html_escape(os.path.basename(p))}" src="data:image/png;base64,{b64(p)}">'
                     for p in report["plots"])
    fits = "".join(_fit_row(rule, f) for rule, f in report["fit"].items())
    runs = "".join(
        f"<tr><td>{r['rule']}{' ★' if r.get('best') else ''}</td><td>{r['global_batch_size']}</td>"
        f"<td>{r['lr']:.4g}</td><td>{html_escape(_settings(r.get('optimizer')))}"
        f"{html_escape(' (' + r['variant'] + ')') if r.get('variant') else ''}</td>"
        f"<td>{r['seed']}</td><td>{_steps(r)}</td></tr>" for r in report["runs"])
    b_simple = report.get("b_simple") or {}
    b_low, b_high = b_simple.get("ci95") or [None, None]
    sections = "".join(rule.html(report) for rule in registry.known().values())
    target = report["target"]
    body = f"""<h1>ddplab study: {html_escape(report['workload'])}</h1>
<p>{report.get('trained_runs', '')} runs trained ({html_escape(str(report['engine']))} engine). \
Steps until {html_escape(_read_from(report))} first reaches {target['value']:g} \
(evaluated every {report['eval_every']} steps,
budget {report['max_steps']}), median over {report['seeds']} seeds; \
reference lr {report['reference']['lr']:g} at global batch
{report['reference']['global_batch_size']}{_rules_lr(report['reference'])}; \
{html_escape(optimizer_text(report['optimizer']))}. \
Fit: S(B) = S_min(1 + B_crit/B).</p>
<table><tr><th>rule</th><th>S_min</th><th>B_crit</th><th>B_crit 95% (seed bootstrap)</th>\
<th>E_min (samples)</th></tr>{fits}</table>
<p>B_simple along the best tuned runs: {number(b_simple.get('value'))} \
(95% interval [{number(b_low)}, {number(b_high)}]); \
B_crit / B_simple = {number(b_simple.get('b_crit_over_b_simple'))}</p>
<p>B_crit is where the fitted curve bends: below it, doubling the global batch halves the steps; above it, \
steps barely fall while the samples (compute) grow. B_simple = tr Σ / |G|² is the gradient noise scale measured \
along the best runs (McCandlish et al. 2018): the batch at which one step's noise equals its signal. The two are \
predicted to agree within a small factor; B_simple grows as the loss falls, so its per-batch values \
(b_simple.png) rise along each run.</p>
{_scorecard_html(report)}
{''.join(f'<p>warning: {html_escape(w)}</p>' for w in report['warnings'])}
{sections}
{_front_html(report)}
{images}
<h2>Every run</h2><p>★ the best lr of the tuned sweep at that batch size.</p>
<table><tr><th>rule</th><th>global batch</th><th>lr</th><th>Adam settings (variant)</th><th>seed</th>\
<th>steps to target</th></tr>{runs}</table>
"""
    return write_page(path, f"ddplab study: {report['workload']}", body)


STYLE = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto}img{max-width:100%;display:block;margin:1em 0}"
         "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}")


def write_page(path: str, title: str, body: str) -> str:
    """One HTML page of the study's: ``body`` under ``title`` in the pages' style, written whole or not at all."""
    page = (f'<!doctype html><html><head><meta charset="utf-8"><title>{html_escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n{body}</body></html>")
    with open(path + ".tmp", "w") as fh:
        fh.write(page)
    os.replace(path + ".tmp", path)
    return path


def html_escape(text: str) -> str:
    return html.escape(str(text))


def b64(path: str) -> str:
    with open(path, "rb") as fh:
        return base64.b64encode(fh.read()).decode()


def number(value) -> str:
    """A figure as the pages print it: four significant digits, a dash for none."""
    if value is None:
        return "—"
    return f"{value:.4g}"


def _steps(run: dict) -> str:
    if run["steps_to_target"] is not None:
        return str(run["steps_to_target"])
    if run.get("pruned"):
        return "stopped: slower than the best lr"
    return "diverged" if run.get("diverged") else "not reached"


def _rules_lr(reference: dict) -> str:
    """Where the rules scaled from another lr than the reference's: which, and why."""
    scaled = reference.get("rules_lr")
    if not scaled or scaled["lr"] == reference["lr"]:
        return ""
    why = "the best tuned lr there" if scaled["source"] == "best_at_reference" else "as given"
    return f" (the rules scale from lr {scaled['lr']:g}, {why})"
