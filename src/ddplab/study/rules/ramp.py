"""``ramp``: ``ddplab.BatchRamp`` itself, one run per seed, from the grid's smallest batch.

A ramp run's global batch changes as it trains, so it cannot share a vectorized group: it trains
one model in this process, with the run's optimizer and step (the spec's own where it has them, as
on the DDP engine), the one-process noise scale (micro-batches of half the starting batch, measured
at every step) and the library's BatchRamp, growing up to the grid's largest batch with the linear
rule and a warmup of ``WARMUP_STEPS`` after each jump. Its micro-batches follow DistributedSampler's
order for the run's seed (full micro-batches only), it starts from the same initial weights as the
grid's runs of that seed, and it is evaluated as they are, every ``eval_every`` optimizer steps. It is
judged against the best tuned fixed lr at its starting batch, not fitted.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ddplab.errors import UsageError
from ddplab.study import fit
from ddplab.study.rules import changing
from ddplab.study.rules.base import BatchRuns, html_num
from ddplab.study.rules.registry import ground_truth, register
from ddplab.text import num_or_dash

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig

WARMUP_STEPS = 10


class Ramp(changing.ChangingRule):
    name = "ramp"
    summary = "ddplab.BatchRamp from the smallest batch, growing it with the noise scale"
    help = "ramp adds one BatchRamp run per seed from the smallest batch, growing with the measured noise scale"
    colour = "tab:purple"

    def check(self, config: StudyConfig) -> None:
        start = min(config.global_batch_sizes)
        if start % 2:
            raise UsageError(f"the ramp starts from the smallest of {{global_batch_sizes}}, {start}: it must be even "
                             "(two micro-batches of half of it)")

    def start(self, config: StudyConfig) -> int | None:
        """The global batch ramp runs start from (the grid's smallest), or None without the rule."""
        return min(config.global_batch_sizes) if self.name in config.rules else None

    def micro_batch_size(self, config: StudyConfig) -> int:
        # The one-process noise scale measures from two micro-batches of half the starting batch.
        return min(config.global_batch_sizes) // 2

    def adapter(self, workload, config: StudyConfig, model, optimizer):
        """The library's BatchRamp, growing with the noise scale measured at every step, up to the grid's largest
        batch."""
        from ddplab.adapt.ramp import BatchRamp
        from ddplab.noise.scale import GradientNoiseScale

        micro = self.micro_batch_size(config)
        noise = GradientNoiseScale(model, per_device_batch_size=micro, accumulation_steps=2, every=1,
                                   dataset_size=workload.train_size)
        largest = min(max(config.global_batch_sizes), workload.train_size)
        ramp = BatchRamp(model, optimizer, noise, max_accumulation_steps=max(2, largest // micro), rule="linear",
                         warmup_steps=WARMUP_STEPS)
        return ramp, noise.step

    def report(self, config: StudyConfig, batches: dict[int, BatchRuns], tuned: list[dict]) -> dict:
        """Median steps and samples of the ramp runs over those of the best-tuned fixed lr at their starting batch
        (``ramp``), and the same as every rule whose batch changes reports them (``adaptive``)."""
        start = self.start(config)
        runs = self.seeds_at(batches[start]) if start in batches else None
        if not runs:
            return {"ramp": None}
        adaptive = changing.adaptive(start, runs, tuned)
        median_steps, samples = adaptive["median_steps"], adaptive["median_samples"]
        fixed, fixed_samples = adaptive["fixed_median_steps"], adaptive["fixed_median_samples"]
        return {"ramp": {"start_global_batch_size": start, "lr": runs[0].lr, "median_steps": median_steps,
                         "median_samples": samples, "tuned_median_steps": fixed, "tuned_median_samples": fixed_samples,
                         "steps_over_tuned": fit.ratio(median_steps, fixed),
                         "samples_over_tuned": fit.ratio(samples, fixed_samples),
                         "final_global_batch_sizes": [r.trajectory[-1][1] if r.trajectory else start for r in runs]},
                "adaptive": {self.name: adaptive}}

    def text(self, values: dict) -> list[str]:
        ramp = values.get("ramp")
        if not ramp:
            return super().text(values)
        versus = "" if ramp["tuned_median_steps"] is None else (
            f" vs the best tuned lr's {num_or_dash(ramp['tuned_median_steps'])} steps and "
            f"{num_or_dash(ramp['tuned_median_samples'])} samples")
        ratios = "" if ramp["steps_over_tuned"] is None else (
            f" ({ramp['steps_over_tuned']:.2f}× the steps, {ramp['samples_over_tuned']:.2f}× the samples)")
        return [f"ramp from global batch {ramp['start_global_batch_size']} at lr {ramp['lr']:.4g}: median "
                f"{num_or_dash(ramp['median_steps'])} steps and {num_or_dash(ramp['median_samples'])} samples{versus}"
                f"{ratios}; final global batches {', '.join(map(str, ramp['final_global_batch_sizes']))}"]

    def figures(self, values: dict, directory: str, drawing) -> list[str]:
        """ramp.png: each ramp run's global batch and lr along its steps, the tuned fixed run's batch beside them."""
        if not values.get("ramp"):
            return []
        path = os.path.join(directory, "ramp.png")
        report, sweep = values, ground_truth().name
        plt = drawing.pyplot()
        fig, (ax_batch, ax_lr) = plt.subplots(1, 2, figsize=(12, 4.5))
        # Only runs whose batch changed carry a trajectory.
        for row in (r for r in report["runs"] if r.get("trajectory")):
            steps, batches, lrs = zip(*row["trajectory"])
            ax_batch.step(steps, batches, where="post", label=f"seed {row['seed']}")
            ax_lr.step(steps, lrs, where="post", label=f"seed {row['seed']}")
        ramp = report["ramp"]
        ax_batch.axhline(ramp["start_global_batch_size"], color=drawing.color(sweep), linestyle=":",
                         label="fixed runs at the start")
        if report.get("b_simple") and report["b_simple"]["value"]:
            ax_batch.axhline(report["b_simple"]["value"], color="tab:purple", linestyle=":",
                             label="B_simple (tuned runs)")
        ax_batch.set_yscale("log", base=2)
        ax_batch.set_ylabel("global batch")
        ax_lr.set_ylabel("learning rate")
        ax_batch.set_title("ramp: the global batch as the noise scale grows")
        ax_lr.set_title("ramp: the lr, linear in the batch, warmed up after each jump")
        for axis in (ax_batch, ax_lr):
            axis.set_xlabel("optimizer step")
        drawing.save_figure(plt, fig, path, (ax_batch, ax_lr))
        return [path]

    def html(self, values: dict) -> str:
        ramp = values.get("ramp")
        if not ramp:
            return ""
        return (f"<h2>Batch ramp from global batch {ramp['start_global_batch_size']} at lr {ramp['lr']:.4g}</h2>"
                f"<p>median {html_num(ramp['median_steps'])} steps and {html_num(ramp['median_samples'])} samples to "
                f"the target; the best tuned fixed lr at that batch: {html_num(ramp['tuned_median_steps'])} steps, "
                f"{html_num(ramp['tuned_median_samples'])} samples (ratios {html_num(ramp['steps_over_tuned'])} and "
                f"{html_num(ramp['samples_over_tuned'])}); final global batches "
                f"{', '.join(map(str, ramp['final_global_batch_sizes']))}</p>")


register(Ramp())
