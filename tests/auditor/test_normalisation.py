"""The judgement of a loss's normalisation from its elements' weights, against exact arithmetic."""

import pytest

from ddplab.auditor import findings
from ddplab.auditor.normalisation import Part, judge, judge_windows, relative_weights


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
