"""The auditor under FSDP2 and device meshes, without processes: a rank's layout in a mesh, and what comparing the
batches of a tensor-parallel group shows. (The corpus runs real FSDP2 and tp × dp programs under torchrun.)"""

import doctest

import pytest

from ddplab.auditor import findings, meshes


def test_the_docstring_examples_hold():
    for module in (meshes, findings):
        assert doctest.testmod(module).failed == 0


# mesh (nested lists of ranks), names, rank, ranks FSDP2 averages over, HSDP → mesh, strategy, dp ranks, peers
LAYOUTS = {
    # The FSDP2 tutorial: one dimension, every rank.
    "fsdp": ([0, 1], ["dp"], 1, {0, 1}, False, {"dp": 2}, "fsdp", [0, 1], [1]),
    # fully_shard(model) with no mesh: torch's default 1-D mesh has no names.
    "fsdp_unnamed": ([0, 1, 2, 3], None, 2, {0, 1, 2, 3}, False, {"dp": 4}, "fsdp", [0, 1, 2, 3], [2]),
    # tp × dp, dp outer (torchtitan): the tp groups are the rows, the dp groups the columns.
    "tp_dp": ([[0, 1], [2, 3]], ["dp", "tp"], 2, {0, 2}, False, {"dp": 2, "tp": 2}, "fsdp+tp", [0, 2], [2, 3]),
    # tp outer: the other way round.
    "dp_inner": ([[0, 1], [2, 3]], ["tp", "dp"], 2, {2, 3}, False, {"tp": 2, "dp": 2}, "fsdp+tp", [2, 3], [0, 2]),
    # HSDP: replicas of 2-way shards; every rank averages with every other.
    "hsdp": ([[0, 1], [2, 3]], ["dp_replicate", "dp_shard"], 3, {0, 1, 2, 3}, True,
             {"dp_replicate": 2, "dp_shard": 2}, "hsdp", [0, 1, 2, 3], [3]),
    # 2 × 2 × 2 with tp: the data-parallel size is 4 of the 8 ranks.
    "hsdp_tp": ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["dp_replicate", "dp_shard", "tp"], 5, {1, 3, 5, 7}, True,
                {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, "hsdp+tp", [1, 3, 5, 7], [4, 5]),
    # torchtitan shards over dp_shard × cp, but context-parallel ranks share a batch: dp is 2, not 4.
    "cp": ([[0, 1], [2, 3]], ["dp_shard", "cp"], 1, {0, 1, 2, 3}, False, {"dp_shard": 2, "cp": 2}, "fsdp+cp",
           [1, 3], [0, 1]),
    # Pipeline stages see different inputs by design: neither data-parallel nor peers.
    "pp": ([[0, 1], [2, 3]], ["pp", "dp"], 3, {2, 3}, False, {"pp": 2, "dp": 2}, "fsdp", [2, 3], [3]),
    # A dimension of size 1 is no parallelism at all.
    "tp_1": ([[0], [1]], ["dp", "tp"], 1, {0, 1}, False, {"dp": 2, "tp": 1}, "fsdp", [0, 1], [1]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_ranks_layout_in_a_mesh(name):
    mesh, names, rank, averaged, replicated, shape, strategy, dp_ranks, peers = LAYOUTS[name]
    where = meshes.layout(mesh, names, rank, averaged, replicated)
    assert (where.mesh, where.strategy, where.data_parallel_ranks, where.peer_ranks) == \
        (shape, strategy, dp_ranks, peers)
    assert where.sharded_inputs == (name == "cp")
    assert list(where.mesh) == [n for n in (names or ["dp"])]


def _tp_record(rank, dp_key, group, indices, tensors, sharded=False):
    return {"rank": rank, "world_size": 4, "findings": [], "batches": {dp_key: tensors},
            "index_batches": {dp_key: indices} if indices is not None else {},
            "tp_groups": {group: {"batches": dp_key, "dims": ["tp"], "sharded_inputs": sharded}}}


def _tp_dp(indices, tensors, sharded=False):
    """A 2 × 2 (dp, tp) run: ranks 0, 1 and 2, 3 are tp groups; 0, 2 and 1, 3 dp groups."""
    return [_tp_record(rank, f"fsdp0-{rank % 2}.{rank % 2 + 2}", f"fsdp0/tp-{rank // 2 * 2}.{rank // 2 * 2 + 1}",
                       indices[rank], tensors[rank], sharded) for rank in range(4)]


def _codes(records):
    return {f.code: f.ranks for f in findings.cross_rank_findings(records)}


def test_ranks_of_a_tp_group_fed_their_own_batches_are_found():
    # A sampler split by the world size: four shards, one per rank.
    indices = [[f"{rank}{step}" for step in range(5)] for rank in range(4)]
    (finding,) = findings.cross_rank_findings(_tp_dp(indices, indices))
    assert finding.code == "TP_RANKS_SEE_DIFFERENT_DATA" and finding.ranks == [0, 1, 2, 3]
    assert "in the tp group of ranks 0, 1, 5 of the first 5 training batches of rank 1 and rank 0 were loaded from " \
           "different dataset indices (2 groups alike)" in finding.detail


def test_a_tp_group_sharing_its_batches_is_clean_and_not_duplicate_data():
    # Split by the dp dimension: each tp group's two ranks load the same batches, which is right.
    shards = [[f"{rank // 2}{step}" for step in range(5)] for rank in range(4)]
    assert _codes(_tp_dp(shards, shards)) == {}
    # The same indices, augmented differently on each rank: the samples agree, and indices are what count.
    pixels = [[f"{rank}{step}" for step in range(5)] for rank in range(4)]
    assert _codes(_tp_dp(shards, pixels)) == {}


def test_without_indices_the_tensors_tell_unless_inputs_are_split():
    different = [[f"{rank}{step}" for step in range(5)] for rank in range(4)]
    assert _codes(_tp_dp([None] * 4, different)) == {"TP_RANKS_SEE_DIFFERENT_DATA": [0, 1, 2, 3]}
    # Context parallelism: each rank holds its slice of every sequence, so its tensors differ by design.
    assert _codes(_tp_dp([None] * 4, different, sharded=True)) == {}
    # One differing batch (or one compared) is no evidence.
    one_off = [[f"{rank // 2}{step}" if step else f"x{rank}" for step in range(5)] for rank in range(4)]
    assert _codes(_tp_dp([None] * 4, one_off)) == {}
    assert _codes(_tp_dp([None] * 4, [[f"{rank}"] for rank in range(4)])) == {}


def test_same_data_is_judged_among_the_data_parallel_ranks():
    # No sampler at all: every rank loads the same batches; the dp peers 0, 2 and 1, 3 repeat each other.
    same = [[f"b{step}" for step in range(5)] for _ in range(4)]
    assert _codes(_tp_dp(same, same)) == {"SAME_DATA_ON_ALL_RANKS": [0, 1, 2, 3]}


def test_the_report_says_the_mesh_and_the_data_parallel_size():
    record = {"rank": 0, "world_size": 4, "global_batch_size": 8, "lr": 3e-3, "steps_audited": 5,
              "steps_requested": 5, "data_parallel_size": 2, "strategy": "fsdp+tp", "mesh": {"dp": 2, "tp": 2},
              "findings": []}
    report = findings.merge([record])
    assert report.headline() == ("world size 4, fsdp+tp on mesh dp 2 × tp 2 (data-parallel size 2), global batch 8, "
                                 "lr 0.003, 5 optimizer steps audited")
    data = report.to_json()
    assert (data["world_size"], data["data_parallel_size"], data["global_batch_size"], data["strategy"],
            data["mesh"]) == (4, 2, 8, "fsdp+tp", {"dp": 2, "tp": 2})
    # DDP reads as it always did.
    ddp = findings.merge([{**record, "strategy": "ddp", "mesh": None, "data_parallel_size": 4}])
    assert ddp.headline().startswith("world size 4, global batch 8,")


@pytest.mark.parametrize("scale, expected", [
    (4.0, {"LR_SCALED_NOT_SCHEDULE": "W = 4 times", "LR_SCALED_BY_WORLD_SIZE": "so the lr is 2 times too high"}),
    # The linear rule over the 2 data-parallel ranks (which is also √W on a 2 × 2 mesh): scaled late, but right.
    (2.0, {"LR_SCALED_NOT_SCHEDULE": "D = 2 times"}),
    (2 ** 0.5, {"LR_SCALED_NOT_SCHEDULE": "sqrt(D) = 1.414 times"}),
])
def test_an_lr_scaled_by_the_world_size_under_tensor_parallelism_is_named(scale, expected):
    import torch

    from ddplab.auditor import install

    audit = install.install(steps=5)
    try:
        # What the auditor knows once it found a tp × dp FSDP2 root on 4 ranks.
        audit.world_size, audit.data_parallel_size, audit.strategy, audit.mesh = 4, 2, "fsdp+tp", {"dp": 2, "tp": 2}
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # noqa: F841 - kept alive
        for group in optimizer.param_groups:
            group["lr"] *= scale  # after the scheduler was built: its base_lrs keep 1e-3
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        found = {code: finding.detail for code, finding in audit.findings.items()}
    finally:
        install.uninstall()
    assert set(found) == set(expected)
    for code, words in expected.items():
        assert words in found[code], found[code]
