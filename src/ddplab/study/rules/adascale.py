"""``adascale``: AdaScale (Johnson et al. 2020) from the reference lr, untuned: each update's lr is the reference lr
times the gain measured from the noise scale, at every batch from the reference up."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ddplab.study import fit
from ddplab.study.rules.base import BatchRuns, OwnGroupRule, html_num, row
from ddplab.study.rules.registry import ground_truth, register
from ddplab.study.runs import steps
from ddplab.text import num_or_dash

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig


class AdaScale(OwnGroupRule):
    name = "adascale"
    summary = "the reference lr × AdaScale's measured gain (Johnson et al. 2020), untuned"
    help = "adascale adds AdaScale runs from the rules' reference lr, untuned, at every batch from the reference up"
    colour = "tab:red"
    lr_scaling = "gain"
    multi_rank = True

    def runs(self, config: StudyConfig, global_batch: int) -> list[tuple[float, int]]:
        # AdaScale only scales up, and measures from two halves of the batch.
        if self.name not in config.rules or global_batch < max(config.reference_global_batch_size, 2):
            return []
        return [(config.scale_lr, seed) for seed in range(config.seeds)]

    def lr_at(self, view: BatchRuns) -> float | None:
        """The lr its updates took on average: the reference lr × the mean gain recorded at its evaluations."""
        runs = self.seeds_at(view)
        gains = [g[1] for r in runs or [] for g in r.gains]
        return runs[0].lr * sum(gains) / len(gains) if gains else None

    def rows(self, view: BatchRuns) -> list[dict]:
        return [row(self.name, view.global_batch_size, run, gains=run.gains) for run in self.seeds_at(view) or []]

    def report(self, config: StudyConfig, batches: dict[int, BatchRuns], tuned: list[dict]) -> dict:
        """Per batch AdaScale ran at: its median steps beside the best-tuned fixed lr's, and its mean gain."""
        best = {p["global_batch_size"]: p["median_steps"] for p in tuned}
        out = []
        for b, view in sorted(batches.items()):
            runs = self.seeds_at(view)
            if runs is None:
                continue
            median = fit.median([steps(r) for r in runs])
            gains = [g[1] for r in runs for g in r.gains]
            out.append({"global_batch_size": b, "scale": b / config.reference_global_batch_size,
                        "median_steps": median, "tuned_median_steps": best.get(b),
                        "steps_over_tuned": fit.ratio(median, best.get(b)),
                        "mean_gain": sum(gains) / len(gains) if gains else None})
        return {"adascale": out}

    def text(self, values: dict) -> list[str]:
        points = values.get("adascale")
        if not points:
            return []
        return ["AdaScale from the reference lr, untuned: median steps vs the best tuned lr's at each global batch: "
                + ", ".join(f"{p['global_batch_size']} (S={p['scale']:g}): {num_or_dash(p['median_steps'])} vs "
                            f"{num_or_dash(p['tuned_median_steps'])}"
                            + (f" = {p['steps_over_tuned']:.2f}×" if p["steps_over_tuned"] is not None else "")
                            for p in points)]

    def figures(self, values: dict, directory: str, drawing) -> list[str]:
        """adascale.png: AdaScale's gain along its runs (seed 0), and its steps to target beside the best-tuned fixed
        lr's."""
        if not values.get("adascale"):
            return []
        path = os.path.join(directory, "adascale.png")
        report, sweep = values, ground_truth().name
        plt = drawing.pyplot()
        fig, (ax_gain, ax_steps) = plt.subplots(1, 2, figsize=(12, 4.5))
        cmap = plt.get_cmap("plasma")
        # Only AdaScale's runs carry gains.
        rows = [r for r in report["runs"] if r["seed"] == 0 and r.get("gains")]
        for i, run in enumerate(rows):
            steps, gains, _ = zip(*run["gains"])
            scale = run["global_batch_size"] / report["reference"]["global_batch_size"]
            label = f"B={run['global_batch_size']} (S={scale:g})"
            ax_gain.plot(steps, gains, color=cmap(i / max(1, len(rows))), label=label)
        ax_gain.set_xlabel("optimizer step")
        ax_gain.set_ylabel("gain r_t (lr = reference lr × r_t)")
        ax_gain.set_title("AdaScale's gain along its runs (seed 0)")
        points = [p for p in report["adascale"] if p["median_steps"] is not None]
        ax_steps.plot([p["global_batch_size"] for p in points], [p["median_steps"] for p in points], "o-",
                      color=drawing.color(self.name), label="AdaScale from the reference lr")
        tuned = [p for p in report["tuned_lr"] if p["median_steps"] is not None]
        ax_steps.plot([p["global_batch_size"] for p in tuned], [p["median_steps"] for p in tuned], "o-",
                      color=drawing.color(sweep), label="best tuned fixed lr")
        drawing.batch_axes(ax_steps, "optimizer steps to target (median over seeds)",
                           "AdaScale, untuned, vs the best tuned lr")
        drawing.save_figure(plt, fig, path, (ax_gain, ax_steps))
        return [path]

    def html(self, values: dict) -> str:
        rows = "".join(
            f"<tr><td>{p['global_batch_size']}</td><td>{p['scale']:g}</td><td>{html_num(p['median_steps'])}</td>"
            f"<td>{html_num(p['tuned_median_steps'])}</td><td>{html_num(p['steps_over_tuned'])}</td>"
            f"<td>{html_num(p['mean_gain'])}</td></tr>" for p in values.get("adascale") or [])
        if not rows:
            return ""
        return ("<h2>AdaScale from the reference lr, untuned</h2><table><tr><th>global batch</th><th>S</th>"
                "<th>median steps</th><th>best tuned median steps</th><th>ratio</th><th>mean gain</th></tr>"
                f"{rows}</table>")


register(AdaScale())
