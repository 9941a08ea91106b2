"""The ranks' DistributedSamplers compared from their records: seeds that differ over one dataset are evidence of
overlapping slices; ranks that each read their own shard, or agree on the seed, are not (no torch launch)."""

from ddplab.auditor.findings import _seeded_per_rank


def _record(rank: int, seed: int, signature: str = "images", prefix=(1, 2, 3, 4)) -> dict:
    return {"rank": rank, "samplers": [{"seed": seed, "epoch": 0, "num_replicas": 4, "size": 1000,
                                        "signature": signature, "prefix": list(prefix)}]}


def test_seeds_that_differ_over_one_dataset_are_found_with_the_share_of_samples_trained_twice_and_never():
    finding = _seeded_per_rank([_record(r, 7 + r, prefix=(r, 10, 11, 12)) for r in range(4)])
    assert finding.code == "SAMPLER_SEEDED_PER_RANK" and finding.ranks == [0, 1, 2, 3]
    # Four independent slices of a quarter each: P(none) = (3/4)^4 = 32%, P(one) = (3/4)^3 = 42%, so 26% twice+.
    assert "rank 0 seed 7, rank 1 seed 8, rank 2 seed 9, rank 3 seed 10" in finding.detail
    assert "about 26% of the samples train on two ranks or more in an epoch and 32% on none" in finding.detail
    assert "the first 4 indices of two ranks already share 3" in finding.detail


def test_one_seed_everywhere_or_a_shard_of_its_own_per_rank_is_no_evidence():
    assert _seeded_per_rank([_record(r, 7) for r in range(4)]) is None
    assert _seeded_per_rank([_record(r, 7 + r, signature=f"shard-{r}") for r in range(4)]) is None
    # A dataset the signature cannot tell apart from another rank's: nothing to compare.
    assert _seeded_per_rank([_record(r, 7 + r, signature=None) for r in range(4)]) is None
