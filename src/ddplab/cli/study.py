"""``ddplab study``: measure steps-to-target versus global batch per lr rule, fit B_crit, plot and report."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ddplab.cli import render
from ddplab.cli.args import betas, default, given, integer, integers, number
from ddplab.errors import SpecError, UsageError, literal
from ddplab.study.config import (
    ADAM_RULES,
    DEFAULT_ACCURACY,
    DEFAULT_BATCHES,
    FAMILIES,
    FIXED_RULES,
    WORKLOADS,
    OptimizerConfig,
    StudyConfig,
    StudyOptions,
)
from ddplab.study.rules import REGISTRY as RULES

DESCRIPTION = f"""\
Train a grid of runs — global batch sizes × lr rules × seeds — each until it first reaches a
target, and fit steps-to-target S(B) = S_min(1 + B_crit/B) (McCandlish et al. 2018) per rule:
perfect scaling (S ∝ 1/B) below B_crit, diminishing returns around it, no further gain past it
(Shallue et al. 2019). Rules scale the reference lr: constant, linear (× B/B_ref), sqrt
(× √(B/B_ref)); tuned sweeps lrs at every batch size and keeps the best: the ground truth the
rules are judged against. B_simple (the gradient noise scale, as in ddplab noise) is measured
along the best tuned runs and printed beside B_crit.

Every batch size here is a global batch: per-device batch × devices × nodes × accumulation.
A global batch B trains the same on W DDP ranks as in one process with B, so by default the grid
runs in one process, all runs of a batch size vectorized (torch.func.vmap over the stacked runs,
each with its own dropout masks and BatchNorm statistics; the optimizer is torch.optim's SGD, Adam
or AdamW as stacked updates); --verify-ddp K replays K grid points on real DDP ranks and reports
the largest difference. What cannot be vectorized (a spec's own step(), another optimizer) trains
on the DDP engine: each run on --world-size real DDP ranks, one launch per batch size. Under
torchrun (one node or several) every process runs the command and the grid trains across the
job; rank 0 owns the cache and the report. With BatchNorm, the vectorized engine normalizes over
the whole global batch, as one device would; DDP ranks normalize over their own share.

Without SPEC.py: sklearn's digits, an MLP, SGD with momentum, target validation accuracy
{DEFAULT_ACCURACY} (pip install 'ddplab[study]'). SPEC.py defines model(), dataset(), loss(output,
target), as for ddplab check, plus val_dataset() (evaluated as accuracy or loss, per the target
flag) or evaluate(model, dataset) -> float (compared with the target; called on val_dataset() if
defined).

Results are cached under --out (default {default(StudyOptions, 'out')}) per batch size: running
again continues, --fresh starts over. A changed setting or spec file is refused there rather than
mixed. study.json is written before the plots, so a failing plot never loses a study. The exit
code is 1 when no run reached the target (the JSON then says how close each batch size came).

examples:
  ddplab study
  ddplab study --global-batch-sizes 16,64,256 --seeds 3 --json
  ddplab study --rules tuned,adascale,ramp
  ddplab study spec.py --target-loss 0.1 --ref-global-batch-size 64 --ref-lr 0.1
  ddplab study spec.py --target-loss 1.5 --optimizer adamw --weight-decay 0.1 --rules tuned,adam-sqrt
  ddplab study spec.py --target-accuracy 0.9 --engine ddp --world-size 4 --max-batch-size-per-device 32
  torchrun --nnodes 2 --nproc-per-node 4 ... -m ddplab study spec.py --target-accuracy 0.9
  ddplab plan --from-study study-out/study.json --ref-batch-size 32 --ref-lr 0.1 --devices 8 --batch-size 32
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("study", help="measure steps-to-target vs global batch per lr rule; fit B_crit",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", metavar="SPEC.py", nargs="?", default=None,
                        help="training spec file (default: the built-in digits workload)")
    parser.add_argument("--workload", choices=WORKLOADS,
                        help="a built-in workload instead of a spec, each with its documented target and grid: "
                             "digits (scikit-learn's digits, an MLP, accuracy 0.95), mnist1d (MNIST-1D built "
                             "offline, an MLP, accuracy 0.6), charlm (a character-level transformer with LayerNorm, "
                             "dropout and AdamW on public-domain text, validation loss 2.1)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target-accuracy", type=number,
                        help=f"validation accuracy to reach (default {DEFAULT_ACCURACY} for the built-in workload)")
    target.add_argument("--target-loss", type=number, help="validation loss to reach")
    parser.add_argument("--global-batch-sizes", type=integers,
                        help="global batch sizes, comma-separated (default {})".format(
                            ",".join(map(str, DEFAULT_BATCHES))))
    parser.add_argument("--rules", type=_rule_list,
                        help=f"lr rules, comma-separated among {','.join(RULES)} (default "
                             f"{','.join(FIXED_RULES)} for SGD, {','.join(ADAM_RULES)} for Adam/AdamW); adam-sqrt is "
                             "Malladi et al.'s rule (lr × √k, 1 − β' = k(1 − β), ε' = ε/√k); adascale adds AdaScale "
                             "runs from --ref-lr, "
                             "untuned, at every batch from the reference up; ramp adds one BatchRamp run per seed "
                             "from the smallest batch, growing with the measured noise scale")
    parser.add_argument("--ref-global-batch-size", type=integer,
                        help="the reference's global batch, which the rules scale from "
                             f"(default {default(StudyConfig, 'reference_global_batch_size')})")
    parser.add_argument("--ref-lr", type=number,
                        help=f"lr at the reference global batch (default {default(StudyConfig, 'reference_lr'):g})")
    parser.add_argument("--seeds", type=integer, help=f"seeds per grid point (default {default(StudyConfig, 'seeds')})")
    opt = parser.add_argument_group("optimizer (default: the spec's optimizer(), else SGD with momentum 0.9; "
                                    "flags override single settings)")
    opt.add_argument("--optimizer", choices=FAMILIES, help="the optimizer family every run trains with")
    opt.add_argument("--momentum", type=number,
                     help=f"SGD momentum (default {default(OptimizerConfig, 'momentum')})")
    opt.add_argument("--dampening", type=number, help="SGD dampening (default 0)")
    opt.add_argument("--nesterov", action="store_const", const=True, help="SGD with Nesterov momentum")
    opt.add_argument("--weight-decay", type=number,
                     help="weight decay as torch.optim applies it: added to the gradient (SGD, Adam) or decoupled "
                          "(AdamW) (default 0)")
    opt.add_argument("--betas", type=betas,
                     help="Adam/AdamW betas as B1,B2 (default {},{})".format(*default(OptimizerConfig, "betas")))
    opt.add_argument("--eps", type=number, help=f"Adam/AdamW epsilon (default {default(OptimizerConfig, 'eps'):g})")
    parser.add_argument("--patience", type=integer,
                        help="stop a run whose metric has not improved for this many evaluations, counted as not "
                             f"reached and flagged stalled (default {default(StudyConfig, 'patience')}; 0: never)")
    parser.add_argument("--max-steps", type=integer,
                        help=f"step budget per run (default {default(StudyConfig, 'max_steps')})")
    parser.add_argument("--eval-every", type=integer,
                        help=f"evaluate every K steps (default {default(StudyConfig, 'eval_every')})")
    parser.add_argument("--sweep-factor", type=number,
                        help="spacing of the tuned lr sweep "
                             f"(default {default(StudyConfig, 'sweep_factor'):g}: factors of 2)")
    parser.add_argument("--sweep-margin", type=number,
                        help="the sweep spans the constant and linear lrs widened by this factor "
                             f"(default {default(StudyConfig, 'sweep_margin'):g})")
    parser.add_argument("--max-runs", type=integer,
                        help="at most this many fixed-lr runs: the grid must fit in it, and a tuned sweep whose best "
                             "lr sits on its edge extends past it (a --sweep-factor at a time, until the best is "
                             f"interior) while runs remain (default {default(StudyConfig, 'max_runs')})")
    parser.add_argument("--dtype", choices=("float32", "float64"), help="(default float32)")
    parser.add_argument("--out", help="directory for the cache, plots, study.json and report "
                                      f"(default {default(StudyOptions, 'out')})")
    parser.add_argument("--fresh", action="store_true", help="discard cached runs in --out and start over")
    parser.add_argument("--verify-ddp", type=integer, metavar="K",
                        help="re-run K grid points through real DDP ranks and report the largest difference")
    parser.add_argument("--verify-world-size", type=integer,
                        help=f"ranks for --verify-ddp (default {default(StudyOptions, 'verify_world_size')})")
    parser.add_argument("--verify-steps", type=integer,
                        help=f"steps per --verify-ddp point (default {default(StudyOptions, 'verify_steps')})")
    parser.add_argument("--threads", type=integer,
                        help=f"torch intra-op threads while training (default {default(StudyOptions, 'threads')}: "
                             "the runs are already batched, and small models lose more to thread hand-offs than "
                             "they gain)")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--engine", choices=("auto", "vmap", "ddp"),
                     help="vmap: a batch size's runs train at once in one process; ddp: each run on --world-size "
                          "real DDP ranks, one launch per batch size (a spec's own step(), any optimizer, torchrun "
                          "across nodes); auto (default): where the spec allows both, a step timed both ways at each "
                          "batch size picks the faster (BatchNorm models stay vectorized), else ddp; the report "
                          "says which and why")
    eng.add_argument("--world-size", type=integer,
                     help=f"ranks of the DDP engine (default {default(StudyOptions, 'world_size')}; under torchrun: "
                          "torchrun's)")
    eng.add_argument("--max-batch-size-per-device", type=integer,
                     help="the DDP engine's largest loader batch per rank: a larger share of a global batch "
                          "accumulates over micro-batches (default: no cap)")
    eng.add_argument("--device", choices=("auto", "cpu", "cuda"),
                     help="where runs train (default auto: CUDA when torch sees it; the DDP engine then uses NCCL)")
    parser.add_argument("--compare", metavar="STUDY.json",
                        help="another study's study.json (another optimizer, say): compare_lr.png draws both best lrs "
                             "per batch, each beside its rule's prediction (linear for SGD, square root for Adam)")
    parser.add_argument("--no-plots", action="store_true", help="skip PNG plots and the HTML report")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def _rule_list(text: str) -> tuple[str, ...]:
    rules = tuple(part.strip() for part in text.split(","))
    bad = [r for r in rules if r not in RULES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown rule {bad[0]!r}; choose among {', '.join(RULES)}")
    return rules


def config_from_args(args: argparse.Namespace, defaults: dict | None = None) -> tuple[StudyConfig, StudyOptions]:
    """The study's settings: the flags given, else the workload's own (a spec's optimizer and lr, a built-in
    workload's documented target and grid: ``defaults``), else StudyConfig's."""
    from ddplab.study.config import target_for

    # A missing file is the first thing to say: asking it for a target would send the user the wrong way.
    if args.spec and not os.path.exists(args.spec):
        raise SpecError(f"spec file {literal(args.spec)} does not exist")
    if args.spec and args.workload:
        raise UsageError("give a spec file or {workload}, not both")
    target = target_for(spec=args.spec, accuracy=args.target_accuracy, loss=args.target_loss)
    if defaults and "target" in defaults and args.target_accuracy is None and args.target_loss is None:
        target = defaults["target"]
    grid = given(args, global_batch_sizes="global_batch_sizes", rules="rules",
                 reference_global_batch_size="ref_global_batch_size", reference_lr="ref_lr", seeds="seeds",
                 max_steps="max_steps", eval_every="eval_every", sweep_factor="sweep_factor",
                 sweep_margin="sweep_margin", dtype="dtype", patience="patience", max_runs="max_runs")
    if defaults is None and (args.spec or args.workload not in (None, "digits")) and not args.optimizer:
        # The workload's optimizer is not known yet: the family its flags name stands in for it.
        family = "adam" if args.betas is not None or args.eps is not None else "sgd"
        defaults = {"optimizer": OptimizerConfig(family=family)}
    defaults = defaults or {}
    for field in ("reference_lr", "global_batch_sizes", "max_steps"):
        if field not in grid and field in defaults:
            grid[field] = defaults[field]
    grid["optimizer"] = _optimizer(args, defaults.get("optimizer"))
    if "global_batch_sizes" in grid:
        grid["global_batch_sizes"] = tuple(sorted(set(grid["global_batch_sizes"])))
    options = StudyOptions(fresh=args.fresh, plots=not args.no_plots, **given(
        args, out="out", verify_ddp="verify_ddp", verify_world_size="verify_world_size",
        verify_steps="verify_steps", threads="threads", engine="engine", world_size="world_size",
        max_batch_size_per_device="max_batch_size_per_device", device="device", compare="compare"))
    return StudyConfig(target=target, **grid), options


def _optimizer(args: argparse.Namespace, spec_optimizer: OptimizerConfig | None) -> OptimizerConfig:
    """The spec's optimizer (or the default) with the flags given on top; another --optimizer starts afresh."""
    fields = given(args, momentum="momentum", dampening="dampening", nesterov="nesterov",
                   weight_decay="weight_decay", betas="betas", eps="eps")
    family = args.optimizer or (spec_optimizer.family if spec_optimizer else "sgd")
    wrong = [f"--{name.replace('_', '-')}" for name in fields
             if name in (("momentum", "dampening", "nesterov") if family != "sgd" else ("betas", "eps"))]
    if wrong:
        raise UsageError(f"{', '.join(wrong)} changes nothing for {family}: drop it or pass {{optimizer.family}} "
                         f"{'sgd' if family != 'sgd' else 'adam or adamw'}")
    base = spec_optimizer if spec_optimizer and spec_optimizer.family == family else OptimizerConfig(family=family)
    return dataclasses.replace(base, **fields)


def run(args: argparse.Namespace) -> int:
    config_from_args(args)  # bad flags are said before the spec is loaded (its optimizer guessed from the flags)
    from ddplab.study.run import run_study, workload_defaults, workload_for

    workload = workload_for(args.spec, args.workload)
    config, options = config_from_args(args, workload_defaults(workload))
    report = run_study(workload, config, options, progress=render.ProgressBar("ddplab study"))
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun, rank 0 speaks for the study
    if args.json:
        render.print_json(report)
    else:
        _print(report)
    if not report.analysis.reached:
        print(f"ddplab: no run reached the target ({config.target.kind} {config.target.value:g}) within --max-steps "
              f"{config.max_steps}: lower the target or raise --max-steps (runs are cached)", file=sys.stderr)
        return 1
    return 0


def _print(report) -> None:
    values = report.to_json()
    out = render.console()
    target = values["target"]
    title = (f"ddplab study: {values['workload']}, steps to {target['kind']} {target['value']:g}, "
             f"{values['trained_runs']} runs, {values['seeds']} seeds, {values['seconds']:.0f} s")
    rows = []
    from ddplab.study.report import optimizer_text

    out.print(f"optimizer: {optimizer_text(values['optimizer'])}; engine: {values['engine']} "
              f"({values['engine_reason']})")
    for rule, fit in values["fit"].items():
        low, high = fit["b_crit_ci95"]
        rows.append([rule, _num(fit["s_min"]), _num(fit["b_crit"]), f"[{_num(low)}, {_num(high)}]", _num(fit["e_min"])])
    if rows:
        out.print(render.table(title, ["rule", "S_min", "B_crit", "B_crit 95% (seeds)", "E_min (samples)"], rows))
    else:
        out.print(f"[bold]{title}[/]: no rule reached the target at two batch sizes, so nothing was fitted")
    if values["tuned_lr"]:
        tuned = ", ".join(f"{p['global_batch_size']}: {p['lr']:.4g}" for p in values["tuned_lr"])
        out.print(f"best tuned lr by global batch: {tuned}")
    _print_b_simple(out, values["b_simple"])
    if values.get("adascale"):
        out.print("AdaScale from the reference lr, untuned: median steps vs the best tuned lr's at each global batch: "
                  + ", ".join(f"{p['global_batch_size']} (S={p['scale']:g}): {_num(p['median_steps'])} vs "
                              f"{_num(p['tuned_median_steps'])}" + (f" = {p['steps_over_tuned']:.2f}×"
                                                                     if p["steps_over_tuned"] is not None else "")
                              for p in values["adascale"]))
    ramp = values.get("ramp")
    if ramp:
        versus = "" if ramp["tuned_median_steps"] is None else (
            f" vs the best tuned lr's {_num(ramp['tuned_median_steps'])} steps and "
            f"{_num(ramp['tuned_median_samples'])} samples")
        ratios = "" if ramp["steps_over_tuned"] is None else (
            f" ({ramp['steps_over_tuned']:.2f}× the steps, {ramp['samples_over_tuned']:.2f}× the samples)")
        out.print(f"ramp from global batch {ramp['start_global_batch_size']} at lr {ramp['lr']:.4g}: median "
                  f"{_num(ramp['median_steps'])} steps and {_num(ramp['median_samples'])} samples{versus}{ratios}; "
                  f"final global batches {', '.join(map(str, ramp['final_global_batch_sizes']))}")
    for miss in values["unreached"]:
        best = "no finite metric" if miss["best_metric"] is None else \
            f"its runs' best {target['kind']}: {miss['best_metric']:.4g}"
        out.print(f"median run never reached the target: rule {miss['rule']} at global batch "
                  f"{miss['global_batch_size']} ({best})")
    _print_verify(out, values.get("verify_ddp"))
    for warning in values["warnings"]:
        out.print(f"[bold yellow]warning:[/] {warning}")
    if values.get("report"):
        out.print(f"report: {values['report']}")


def _print_b_simple(out, b_simple: dict | None) -> None:
    if not b_simple:
        return
    low, high = b_simple["ci95"]
    out.print(f"B_simple along the best tuned runs: {_num(b_simple['value'])} "
              f"(95% [{_num(low)}, {_num(high)}]); B_crit / B_simple = {_num(b_simple['b_crit_over_b_simple'])}")


def _print_verify(out, verify: dict | None) -> None:
    if not verify:
        return
    if verify["nothing_to_verify"]:
        out.print(f"--verify-ddp: nothing to verify: {verify['nothing_to_verify']}")
        return
    out.print(f"--verify-ddp: {len(verify['points'])} points × {verify['steps']} steps on {verify['world_size']} "
              f"DDP ranks ({verify['dtype']}): largest parameter difference {verify['max_abs_diff']:.3g}")


def _num(value) -> str:
    return "—" if value is None else render.num(value)
