"""The judgement of a loss's normalisation from its elements' weights, against exact arithmetic."""

import pytest

from ddplab.auditor import findings
from ddplab.auditor.normalisation import Part, divided_twice, judge, judge_windows, relative_weights


def _parts(counts: dict[int, list[int]], weight) -> list[Part]:
    return [Part(rank, micro, weight(rank, micro, count), count)
            for rank, own in counts.items() for micro, count in enumerate(own, start=1)]


COUNTS = {0: [95, 31], 1: [80, 92]}  # label tokens per micro-batch on two ranks
TOTAL = sum(map(sum, COUNTS.values()))


def test_a_global_count_times_the_world_size_is_silent_and_without_it_is_off_by_w():
    # Correct: every token weighs W/N in its rank's backward, and DDP's average makes it 1/N.
    assert judge(_parts(COUNTS, lambda r, m, c: 2 / TOTAL), 2, 0) is None
    wrong = judge(_parts(COUNTS, lambda r, m, c: 1 / TOTAL), 2, 0)
    assert wrong.code == "GLOBAL_COUNT_WITHOUT_WORLD_SIZE" and "1/2 of the global mean's" in wrong.detail
    # A constant scale that is neither (a mean over the global batch times 0.5) is no count to judge.
    assert judge(_parts(COUNTS, lambda r, m, c: 0.5 / TOTAL), 2, 0) is None


def test_per_micro_batch_means_give_the_exact_ratio_of_their_counts():
    judgement = judge(_parts(COUNTS, lambda r, m, c: 1 / (2 * c)), 2, 3)
    assert judgement.code == "LOSS_NORMALISED_PER_MICRO_BATCH"
    # 1/(2·31) against 1/(2·95): a token of the short micro-batch weighs 95/31 = 3.06× one of the long one.
    assert judgement.spread == pytest.approx(95 / 31)
    assert "on rank 0 the micro-batches held 95, 31 elements" in judgement.detail
    assert "weighed 3.06×" in judgement.detail
    # Relative to the fair weight 1/N (after DDP's average of 2): the smallest weight is N/(2·2·95).
    low, high = relative_weights(_parts(COUNTS, lambda r, m, c: 1 / (2 * c)))
    assert (low, high) == pytest.approx((TOTAL / (4 * 95), TOTAL / (4 * 31)))


def test_a_per_micro_batch_mean_divided_by_k_before_an_engine_divides_again_gives_both_of_its_effects():
    # DeepSpeed's engine.backward divides by K = 2 itself (in the weights): mean / K on top weighs 1/(K²·c).
    once = _parts(COUNTS, lambda r, m, c: 1 / (2 * c))
    twice = _parts(COUNTS, lambda r, m, c: 1 / (4 * c))
    assert divided_twice(once, 2, 0, engine_divides_by=2) is None
    found = divided_twice(twice, 2, 0, engine_divides_by=2)
    assert found.code == "ACCUMULATION_DIVIDED_TWICE" and "the gradient is 1/2 of that mean's" in found.detail
    # Σ w·c over 2 ranks × 2 micro-batches of 1/4 each is 1, half the average's divisor 2.
    assert "weighed 0.5 in all after the engine's own division by the 2 accumulation steps" in found.detail
    # No engine division, elements alike (judge's own case), or an unknown divisor: not this judgement.
    assert divided_twice(twice, 2, 0) is None and divided_twice(twice, 2, 0, None, 2) is None
    assert divided_twice(_parts(COUNTS, lambda r, m, c: 1 / (4 * TOTAL)), 2, 0, engine_divides_by=2) is None
    # Both findings come out of one step's windows, each with its own factor.
    windows = {("ds0", 1): {rank: {"group": [0, 1], "engine_divides_by": 2,
                                   "loss_weights": {"lm.py:9": [[m, 1 / (4 * c), c] for m, c in
                                                                 enumerate(COUNTS[rank], start=1)]}}
                            for rank in (0, 1)}}
    assert sorted(j.code for j in judge_windows(windows)) == ["ACCUMULATION_DIVIDED_TWICE",
                                                              "LOSS_NORMALISED_PER_MICRO_BATCH"]


def test_per_micro_batch_means_never_divided_by_k_give_the_weighting_and_the_k_times_scale():
    from ddplab.auditor.normalisation import not_divided

    # Each micro-batch's own mean, not ÷ K = 2: Σ w·c = 2 ranks × 2 micro-batches × 1 = 4 = K · D.
    undivided = _parts(COUNTS, lambda r, m, c: 1 / c)
    found = not_divided(undivided, 2, 0)
    assert found.code == "ACCUMULATION_NOT_DIVIDED" and "the gradient is 2 times that mean's" in found.detail
    assert "weighed 2 in all over its 2 micro-batches per rank" in found.detail
    # Divided by K (the weighting alone), a global count (elements alike), or by an engine: not this judgement.
    assert not_divided(_parts(COUNTS, lambda r, m, c: 1 / (2 * c)), 2, 0) is None
    assert not_divided(_parts(COUNTS, lambda r, m, c: 2 / TOTAL), 2, 0) is None
    assert not_divided(undivided, 2, 0, engine_divides_by=2) is None and not_divided(undivided, 2, 0, None) is None
    # One micro-batch per rank: nothing accumulated, nothing to divide.
    assert not_divided([p for p in undivided if p.micro_step == 1], 2, 0) is None
    windows = {("ddp0", 1): {rank: {"group": [0, 1], "loss_weights": {"lm.py:9": [
        [m, 1 / c, c] for m, c in enumerate(COUNTS[rank], start=1)]}} for rank in (0, 1)}}
    assert sorted(j.code for j in judge_windows(windows)) == ["ACCUMULATION_NOT_DIVIDED",
                                                              "LOSS_NORMALISED_PER_MICRO_BATCH"]


def test_per_rank_means_are_per_device_with_the_ratio_of_the_ranks_counts():
    judgement = judge(_parts(COUNTS, lambda r, m, c: 1 / sum(COUNTS[r])), 2, 0)
    assert judgement.code == "LOSS_NORMALISED_PER_DEVICE"
    assert judgement.spread == pytest.approx(172 / 126)
    assert "(rank 0 126, rank 1 172): an element on rank 0 weighed 1.37× one on rank 1" in judgement.detail
    # Equal counts (packed sequences): the same per-rank mean is the global mean.
    assert judge(_parts({0: [64, 64], 1: [64, 64]}, lambda r, m, c: 1 / 128), 2, 0) is None


def test_weights_no_count_explains_are_not_guessed():
    # Per-rank weights that do not follow the ranks' counts (a per-sample importance weight, say): silent.
    assert judge(_parts(COUNTS, lambda r, m, c: 0.01 * (r + 1)), 2, 0) is None
    assert judge(_parts(COUNTS, lambda r, m, c: 0.01 * m), 2, 0) is None


def test_windows_are_judged_per_loss_line_and_only_where_every_rank_computed_it():
    def window(rank, rows):
        return {"group": [0, 1], "loss_weights": rows}

    per_rank = {0: window(0, {"train.py:40": [[1, 1 / 126, 126]]}), 1: window(1, {"train.py:40": [[1, 1 / 172, 172]]})}
    assert [j.code for j in judge_windows({("ddp0", 2): per_rank})] == ["LOSS_NORMALISED_PER_DEVICE"]
    assert judge_windows({("ddp0", 2): per_rank})[0].detail.startswith("at optimizer step 2, train.py:40: ")
    only_rank0 = {0: per_rank[0], 1: window(1, {"other.py:1": [[1, 1 / 172, 172]]})}
    assert judge_windows({("ddp0", 2): only_rank0}) == []
    # One line computing two losses in a micro-batch (a loop over tasks, each its own mean): not compared.
    two_tasks = {0: window(0, {"t.py:9": [[1, 1 / 10, 10], [1, 1 / 30, 30]]}),
                 1: window(1, {"t.py:9": [[1, 1 / 20, 20], [1, 1 / 40, 40]]})}
    assert judge_windows({("ddp0", 0): two_tasks}) == []


def test_the_merged_report_names_the_frameworks_fix():
    records = [{"rank": rank, "world_size": 2, "frameworks": ["accelerate"],
                "windows": [{"wrapper": "ddp0-0.1", "group": [0, 1], "step": 0,
                             "loss_weights": {"loop.py:7": [[1, 1 / count, count]]}}]}
               for rank, count in ((0, 126), (1, 172))]
    report = findings.merge(records)
    finding = next(f for f in report.findings if f.code == "LOSS_NORMALISED_PER_DEVICE")
    assert finding.ranks == [0, 1] and "accelerator.reduce(count, 'sum')" in finding.fix
    for record in records:
        record["frameworks"] = []
    plain = next(f for f in findings.merge(records).findings if f.code == "LOSS_NORMALISED_PER_DEVICE")
    assert "dist.all_reduce(count, group=dp_group)" in plain.fix
    # Under DeepSpeed's engine, whose backward divides by the accumulation steps itself, DDP's recipe would halve the
    # gradient at K = 2: the fix says what engine.backward does and gives its own recipe.
    for record in records:
        record["strategy"] = "deepspeed-zero2"
    deepspeed = next(f for f in findings.merge(records).findings if f.code == "LOSS_NORMALISED_PER_DEVICE")
    assert deepspeed.fix.startswith("DeepSpeed's engine.backward(loss) divides the loss by gradient_accumulation_steps")
    assert "engine.backward(loss_sum * dp_size / count, scale_wrt_gas=False)" in deepspeed.fix
    # The Trainer drives the engine itself: its own recipe stays the user's.
    for record in records:
        record["frameworks"] = ["transformers"]
    trainer = next(f for f in findings.merge(records).findings if f.code == "LOSS_NORMALISED_PER_DEVICE")
    assert trainer.fix.startswith("TrainingArguments(average_tokens_across_devices=True)")


def test_a_tensor_parallel_fix_names_the_programs_own_data_parallel_dimension():
    def record(rank, batches):
        return {"rank": rank, "world_size": 4, "mesh": {"data_parallel": 2, "tensor_parallel": 2},
                "tp_groups": {"g": {"batches": "fsdp0", "dims": ["tensor_parallel"], "sharded_inputs": False}},
                "batches": {"fsdp0": batches}, "steps_audited": 3}

    report = findings.merge([record(0, ["a", "b", "c"]), record(1, ["x", "y", "z"])])
    finding = next(f for f in report.findings if f.code == "TP_RANKS_SEE_DIFFERENT_DATA")
    assert "mesh['data_parallel'].size()" in finding.fix and "mesh['dp']" not in finding.fix


def test_the_in_run_and_final_reports_count_the_same_audited_batches():
    # Rank 0 took 3 batches in its audited steps; 6 were kept (the data window). Rank 1 shares all of them.
    def record(rank, batches, audited):
        return {"rank": rank, "world_size": 2, "steps_audited": 3, "batches": {"ddp0-0.1": batches},
                "audited_batches": {"batches": {"ddp0-0.1": audited}}}

    stream = ["a", "b", "c", "d", "e", "f"]
    interim = findings.merge([record(0, stream[:3], 3), record(1, stream[:3], 3)])
    final = findings.merge([record(0, stream, 3), record(1, stream, 3)])
    details = [next(f.detail for f in r.findings if f.code == "SAME_DATA_ON_ALL_RANKS") for r in (interim, final)]
    assert details[0] == details[1] and details[0].startswith("up to 3 distinct training batches")


# --- judged against the reduction the program runs ---

def test_under_a_summing_reduction_the_global_count_alone_is_right_and_times_w_is_w_times_too_large():
    # torchtitan: FSDP2 with set_gradient_divide_factor(1.0) sums the ranks' gradients, so 1/N per element is exact.
    assert judge(_parts(COUNTS, lambda r, m, c: 1 / TOTAL), 2, 0, divisor=1.0) is None
    doubled = judge(_parts(COUNTS, lambda r, m, c: 2 / TOTAL), 2, 0, divisor=1.0)
    assert doubled.code == "DIVIDE_FACTOR" and "the gradient is 2 times the global mean's" in doubled.detail
    # An averaging reduction written as a number is the default.
    assert judge(_parts(COUNTS, lambda r, m, c: 2 / TOTAL), 2, 0, divisor=2.0) is None
    # A divisor nobody could read: no judgement of the scale at all; unequal counts are still judged.
    assert judge(_parts(COUNTS, lambda r, m, c: 1 / TOTAL), 2, 0, divisor=None) is None
    assert judge(_parts(COUNTS, lambda r, m, c: 1 / sum(COUNTS[r])), 2, 0, divisor=None).code == \
        "LOSS_NORMALISED_PER_DEVICE"


def test_a_count_a_few_percent_off_is_judged_by_its_factor_and_says_how_far_it_is():
    # The script's count holds a token per sequence the loss does not use: 3% more than the loss's own.
    near = TOTAL * 1.03
    wrong = judge(_parts(COUNTS, lambda r, m, c: 1 / near), 2, 0)
    assert wrong.code == "GLOBAL_COUNT_WITHOUT_WORLD_SIZE"
    assert f"the count divides by {near:,.0f} elements, where the loss uses {TOTAL} over the step's" in wrong.detail
    assert "(+3.0%)" in wrong.detail and "0.485 (about 1/2)" in wrong.detail
    # With × W the same near count is right, and silent; halfway between the factors is no evidence of either.
    assert judge(_parts(COUNTS, lambda r, m, c: 2 / near), 2, 0) is None
    assert judge(_parts(COUNTS, lambda r, m, c: 0.7 / TOTAL), 2, 0) is None


def test_per_micro_batch_counts_a_token_per_sequence_off_are_still_attributed():
    # Each micro-batch divided by its own count plus its 4 sequences: w·c within 5%, the weights 3× apart.
    judgement = judge(_parts(COUNTS, lambda r, m, c: 1 / (2 * (c + 4))), 2, 0)
    assert judgement.code == "LOSS_NORMALISED_PER_MICRO_BATCH"
    # Weights that differ about as much as their products do are no count's.
    assert judge(_parts({0: [100, 90], 1: [95, 85]}, lambda r, m, c: 1 / (2 * c) * (1 + 0.04 * m)), 2, 0) is None


def test_the_merged_report_names_the_runs_own_reduction_and_drops_a_sum_the_reduction_sums_too():
    def records(divisor, source, weight, codes=()):
        return [{"rank": rank, "world_size": 2, "steps_audited": 1, "strategy": "fsdp", "data_parallel_size": 2,
                 "reduction": {"strategy": "fsdp", "data_parallel_size": 2, "divisor": divisor, "source": source},
                 "findings": [vars(findings.Finding.make(code, rank)) for code in codes],
                 "windows": [{"wrapper": "fsdp0-0.1", "group": [0, 1], "step": 0,
                              "loss_weights": {"titan.py:9": [[1, weight(count), count]]}}]}
                for rank, count in ((0, 126), (1, 172))]

    averaged = findings.merge(records(2.0, "", lambda c: 1 / 298))
    finding = next(f for f in averaged.findings if f.code == "GLOBAL_COUNT_WITHOUT_WORLD_SIZE")
    assert "FSDP2 averages the gradients over the 2 data-parallel ranks: the gradient is 1/2" in finding.message
    assert "loss_sum * 2 / global_count" in finding.fix
    summed = findings.merge(records(1.0, "set_gradient_divide_factor(1)", lambda c: 1 / 298, ["SUM_REDUCTION"]))
    assert summed.problems == []
    assert summed.headline().endswith("; FSDP2 sums the 2 data-parallel ranks' gradients here "
                                      "(set_gradient_divide_factor(1))")
    doubled = findings.merge(records(1.0, "set_gradient_divide_factor(1)", lambda c: 2 / 298))
    assert [f.code for f in doubled.problems] == ["DIVIDE_FACTOR"]
    assert "but FSDP2 sums the 2 data-parallel ranks' gradients here" in doubled.problems[0].message
    assert doubled.to_json()["reduction"]["divisor"] == 1.0


def test_a_comm_hooks_divisor_is_measured_from_every_ranks_sums():
    def record(rank, local, reduced, codes=()):
        return {"rank": rank, "world_size": 2, "steps_audited": 1,
                "reduction": {"strategy": "ddp", "data_parallel_size": 2, "divisor": None,
                              "source": "the comm hook summing, measured"},
                "findings": [vars(findings.Finding.make(code, rank)) for code in codes],
                "windows": [{"wrapper": "ddp0-0.1", "group": [0, 1], "step": 0, "comm_sums": [local, reduced]}]}

    # Σ local = 3 + 5 = 8 = D · reduced: a reduced functional of 8 is a sum (D = 1), of 4 an average.
    summing = findings.merge([record(0, 3.0, 8.0, ["SUM_REDUCTION"]), record(1, 5.0, 8.0, ["SUM_REDUCTION"])])
    assert summing.reduction.divisor == 1.0 and summing.problems == []
    averaging = findings.merge([record(0, 3.0, 4.0, ["SUM_REDUCTION"]), record(1, 5.0, 4.0, ["SUM_REDUCTION"])])
    assert [f.code for f in averaging.problems] == ["SUM_REDUCTION"]
    assert "DDP averages the gradients over the 2 data-parallel ranks (the comm hook summing, measured)" in \
        averaging.problems[0].message
    # A hook that is no plain divisor (a lossy compression): a summed loss is not judged, and the report says why.
    lossy = findings.merge([record(0, 3.0, 3.1, ["SUM_REDUCTION"]), record(1, 5.0, 3.1, ["SUM_REDUCTION"])])
    assert lossy.reduction.divisor is None and [f.code for f in lossy.problems] == ["AUDIT_INCOMPLETE"]


def test_the_reductions_words_and_measurement_hold_their_examples():
    import doctest

    from ddplab.runtime import reduction

    assert doctest.testmod(reduction).failed == 0


def test_a_sum_reductions_fix_names_the_world_size_apart_from_the_accumulation_steps():
    # W = 2 ranks and K = 2 micro-batches: each 2 says which it is.
    from ddplab.auditor import catalogue
    from ddplab.auditor.losses import _grown_detail
    from ddplab.runtime.reduction import Reduction

    _, fix = catalogue.message("SUM_REDUCTION", Reduction("ddp", 2, 2.0, ""))
    assert "times W = 2 (the global-count recipe" in fix and fix.endswith("multiply the summed loss by W = 2")
    assert _grown_detail(8, 2, 2).startswith("a summed loss reached backward divided by K = 2, the micro-batches")
    # A divisor that is not the data-parallel size (set_gradient_divide_factor) is not called W.
    _, fix = catalogue.message("SUM_REDUCTION", Reduction("fsdp", 2, 4.0, "set_gradient_divide_factor(4)"))
    assert fix.endswith("multiply the summed loss by 4") and "W =" not in fix


def _by_hand(local: list[list[list[float]]], reduced: list[list[float]], op: str, in_step: bool = False,
             kind: str = "all_reduce") -> dict[int, list[dict]]:
    """Every rank's probe of one gradient: its shards before the collective, and what the step took."""
    return {rank: [{"kind": kind, "shard": 0 if kind == "all_reduce" else rank, "local": local[rank],
                    "reduced": reduced[rank], "in_step": in_step, "op": op}] for rank in range(len(local))}


def test_a_reduction_written_by_hand_is_measured_element_by_element():
    from ddplab.runtime.reduction import divisor_by_elements

    local = [[[1.0, -2.0, 0.5]], [[3.0, 4.0, 0.25]]]
    summed = [4.0, 2.0, 0.75]
    # A sum, then the program's ÷ W: the average; a sum left alone: D = 1.
    assert divisor_by_elements(_by_hand(local, [[v / 2 for v in summed]] * 2, "sum"), 2) == 2.0
    assert divisor_by_elements(_by_hand(local, [summed] * 2, "sum"), 2) == 1.0
    # torchtune's scaling after a sum (× W / N, N = 263 tokens): not a whole number, kept as measured.
    scaled = divisor_by_elements(_by_hand(local, [[v * 2 / 263 for v in summed]] * 2, "sum"), 2)
    assert scaled == pytest.approx(131.5)
    # Elements that disagree (a term added to the gradient): no one divisor.
    assert divisor_by_elements(_by_hand(local, [[2.0, 1.0, 0.5]] * 2, "sum"), 2) is None
    # A reduce-scatter: rank r's output is shard r of the ranks' summed inputs, averaged.
    shards = [[[1.0, 2.0], [5.0, 6.0]], [[3.0, 4.0], [7.0, 8.0]]]
    assert divisor_by_elements(_by_hand(shards, [[2.0, 3.0], [6.0, 7.0]], "avg", True, "reduce_scatter"), 2) == 2.0


def test_an_optimizers_own_buffer_blended_after_its_reduction_is_not_read_as_a_divisor():
    from ddplab.runtime.reduction import divisor_by_elements

    # Muon's first step: the reduced buffer × (1 - m²), m = 0.95: one number, but no divisor a reduction has.
    local = [[[1.0, -2.0]], [[3.0, 4.0]]]
    blended = [[v / 2 * (1 - 0.95 ** 2) for v in (4.0, 2.0)]] * 2
    assert divisor_by_elements(_by_hand(local, blended, "avg", in_step=True), 2) is None
    # Read before the step (a loop's collective), the same factor is the program's own scaling, and counts.
    assert divisor_by_elements(_by_hand(local, blended, "avg"), 2) == pytest.approx(2 / (1 - 0.95 ** 2))


def test_the_merged_report_of_a_reduction_by_hand_names_it_and_its_measured_divisor():
    def record(rank, reduced, codes=()):
        return {"rank": rank, "world_size": 2, "steps_audited": 1, "strategy": "manual",
                "reduction": {"strategy": "manual", "data_parallel_size": 2, "divisor": None,
                              "source": "dist.all_reduce with ReduceOp.SUM in the training loop"},
                "findings": [vars(findings.Finding.make(code, rank)) for code in codes],
                "windows": [{"wrapper": "manual0-0.1", "group": [0, 1], "step": 0,
                             "reduced_by_hand": _by_hand([[[1.0, 2.0]], [[3.0, 4.0]]], [reduced] * 2, "sum")[rank]}]}

    divided = findings.merge([record(r, [2.0, 3.0], ["SUM_REDUCTION"]) for r in (0, 1)])
    assert divided.reduction.divisor == 2.0 and [f.code for f in divided.problems] == ["SUM_REDUCTION"]
    assert ("the program's own reduction averages the gradients over the 2 data-parallel ranks (dist.all_reduce "
            "with ReduceOp.SUM in the training loop, then scaled by the program; measured)") in \
        divided.problems[0].message
    # Summed and left so: a summed loss is what one process summing the global batch computes.
    summed = findings.merge([record(r, [4.0, 6.0], ["SUM_REDUCTION"]) for r in (0, 1)])
    assert summed.reduction.divisor == 1.0 and summed.problems == []
    # Unread (a rank's probe missing): a sum the program may still scale is not judged, and the report says so.
    unread = findings.merge([record(0, [4.0, 6.0], ["SUM_REDUCTION"]), {**record(1, [4.0, 6.0]), "windows": []}])
    assert unread.reduction.divisor is None and [f.code for f in unread.problems] == ["AUDIT_INCOMPLETE"]
