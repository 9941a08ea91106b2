"""Parallelism strategies: the registry, and ``ddp`` on two real ranks (float64, so every comparison is exact)."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddplab.errors import UsageError
from ddplab.runtime import strategies
from ddplab.runtime.launch import LaunchConfig, launch

PATHS = ("grad_hooks", "comm_hook")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()


def _loss(model, ctx) -> torch.Tensor:
    # Each rank its own batch: local gradients that differ, so an average is told apart from either.
    generator = torch.Generator().manual_seed(10 + ctx.rank)
    x, y = torch.randn(6, 5, generator=generator).double(), torch.randn(6, 2, generator=generator).double()
    return torch.nn.functional.mse_loss(model(x), y)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _sorted(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]).sort().values


def _through_the_strategy(ctx, via: str, local: list[torch.Tensor], plain_ddp: list[torch.Tensor]) -> dict:
    strategy = strategies.get("ddp")
    model = _model()
    wrapped = strategy.wrap(model, ctx)
    params = list(model.parameters())
    seen = []
    tap = strategy.tap_local_gradients(wrapped, params, lambda tensor: seen.append(tensor.detach().clone()), via=via)
    _loss(wrapped, ctx).backward()
    out = {"via": tap.via, "local_seen": torch.equal(_sorted(seen), _sorted(local)),
           "reduced_is_plain_ddp": all(torch.equal(a, b) for a, b in zip(_grads(model), plain_ddp)),
           "share": [s.clone() for s in strategy.reduced_gradient_share(wrapped, params)]}
    seen.clear()
    wrapped.zero_grad(set_to_none=True)
    with strategy.no_sync(wrapped):
        out["syncs_inside"] = strategy.syncs(wrapped)
        _loss(wrapped, ctx).backward()
    out["syncs_after"], out["seen_under_no_sync"] = strategy.syncs(wrapped), len(seen)
    out["no_sync_kept_local"] = all(torch.equal(a, b) for a, b in zip(_grads(model), local))
    tap.remove()
    del wrapped
    return out


def _on_rank(ctx):
    strategy = strategies.get("ddp")
    model = _model()
    wrapped = strategy.wrap(model, ctx)
    facts = {"owns": strategy.owns(wrapped), "found": strategies.of(wrapped) is strategy,
             "plain_found": strategies.of(model), "module": strategy.module(wrapped) is model,
             "group_is_ddps": strategy.data_parallel_group(wrapped) is wrapped.process_group,
             "size": strategy.data_parallel_size(wrapped), "rank": strategy.data_parallel_rank(wrapped)}
    # This rank's gradient alone (a plain module on its batch), and what a DistributedDataParallel built by hand gives.
    reference = _model()
    _loss(reference, ctx).backward()
    local = _grads(reference)
    by_hand = DistributedDataParallel(_model())
    _loss(by_hand, ctx).backward()
    plain_ddp = _grads(by_hand.module)
    del wrapped, by_hand
    return facts, local, plain_ddp, {via: _through_the_strategy(ctx, via, local, plain_ddp) for via in PATHS}


@pytest.mark.timeout(60)
def test_ddp_wraps_on_two_ranks_and_shows_the_local_and_the_reduced_gradient():
    results = launch(_on_rank, LaunchConfig(world_size=2))
    for rank, (facts, _, _, paths) in enumerate(results):
        assert facts == {"owns": True, "found": True, "plain_found": None, "module": True, "group_is_ddps": True,
                         "size": 2, "rank": rank}
        for via in PATHS:
            out = paths[via]
            assert out["via"] == via
            # Before the reduction the tap sees exactly this rank's gradient; after it, exactly plain DDP's.
            assert out["local_seen"] and out["reduced_is_plain_ddp"]
            # no_sync: no reduction, nothing shown, each rank keeps its own gradient.
            assert (out["syncs_inside"], out["syncs_after"], out["seen_under_no_sync"]) == (False, True, 0)
            assert out["no_sync_kept_local"]
    (_, local0, ddp0, paths0), (_, local1, ddp1, paths1) = results
    for i, (a, b) in enumerate(zip(local0, local1)):
        assert not torch.equal(a, b)  # the ranks' batches differ: an average is not either one
        # DDP averages: ×1/2 on each rank, then a sum (exact in float64, ×1/2 being a power of two).
        assert torch.equal(ddp0[i], a * 0.5 + b * 0.5) and torch.equal(ddp0[i], ddp1[i])
        for via in PATHS:
            # The two ranks' shares are disjoint and together the whole reduced gradient.
            whole = torch.cat([paths0[via]["share"][i], paths1[via]["share"][i]])
            assert torch.equal(whole, ddp0[i].reshape(-1))


def test_the_registry_holds_ddp_and_finds_a_model_by_its_wrapper():
    assert strategies.get() is strategies.get("ddp") is strategies.STRATEGIES["ddp"]
    assert strategies.DEFAULT in strategies.STRATEGIES
    with pytest.raises(UsageError, match="must be one of ddp, deepspeed, fsdp, hsdp, got 'nccl'"):
        strategies.get("nccl")
    # Options are the strategy's dataclass fields, checked by name and value.
    with pytest.raises(UsageError, match="^replicate is not an option of the ddp strategy$"):
        strategies.get("ddp", replicate=2)
    with pytest.raises(UsageError, match="^replicate must be at least 1, got 0$"):
        strategies.get("hsdp", replicate=0)
    with pytest.raises(UsageError, match="^reduce_dtype must be one of float32, bfloat16, got 'float16'$"):
        strategies.get("fsdp", reduce_dtype="float16")
    with pytest.raises(UsageError, match="hsdp needs replicate, the replicas of its 2-D mesh, to divide the world "
                                         "size 4 \\(got 3\\)"):
        strategies.get("hsdp", replicate=3).check_runnable(4)
    strategies.get("hsdp", replicate=2).check_runnable(4)
    with pytest.raises(UsageError, match="^zero_stage is not an option of the fsdp strategy$"):
        strategies.get("fsdp", zero_stage=3)
    with pytest.raises(UsageError, match="^zero_stage must be one of 0, 1, 2, 3, got 4$"):
        strategies.get("deepspeed", zero_stage=4)
    assert strategies.get("deepspeed").zero_stage == 2 and strategies.get("deepspeed", zero_stage=3).collective_forward
    assert not strategies.get("deepspeed", zero_stage=2).collective_forward
    assert strategies.get("hsdp", replicate=2).replicate == 2 and strategies.get("hsdp").replicate is None
    assert dataclasses.is_dataclass(strategies.get("ddp"))
    plain = torch.nn.Linear(2, 1)
    assert strategies.of(plain) is None and strategies.of(None) is None
    # A plain module has nothing to skip: accumulation on one process needs no context.
    with strategies.no_sync(plain):
        plain(torch.ones(1, 2)).sum().backward()
    assert plain.weight.grad is not None
    assert copy.copy(strategies.get("ddp")) == strategies.get("ddp")


def _fsdp_on_rank(ctx, name: str, options: dict) -> dict:
    strategy = strategies.get(name, **options)
    reference = _model()
    _loss(reference, ctx).backward()
    local = _grads(reference)
    # The exact average, in float64, of every rank's local gradient.
    average = [g.clone() for g in local]
    for g in average:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    model = _model()
    wrapped = strategy.wrap(model, ctx)
    params = list(wrapped.parameters())
    seen = []
    tap = strategy.tap_local_gradients(wrapped, params, lambda tensor: seen.append(tensor.detach().clone()))
    _loss(wrapped, ctx).backward()
    reduced = [p.grad.full_tensor() for p in params]
    shares = torch.cat([s.reshape(-1) for s in strategy.reduced_gradient_share(wrapped, params)])
    share_norm = shares.pow(2).sum()
    dist.all_reduce(share_norm)
    out = {"wrapped_in_place": wrapped is model, "owns": strategy.owns(wrapped),
           "found": strategies.of(wrapped).name, "module": strategy.module(wrapped) is model,
           "size": strategy.data_parallel_size(wrapped), "rank": strategy.data_parallel_rank(wrapped),
           "group_size": dist.get_world_size(strategy.data_parallel_group(wrapped)),
           "factors": strategy.divide_factors(wrapped), "local_seen": torch.equal(_sorted(seen), _sorted(local)),
           "reduced_error": max((a - b).abs().max().item() for a, b in zip(reduced, average)),
           "share_norm_error": abs(share_norm.item() - sum(g.pow(2).sum().item() for g in reduced))}
    # Accumulation: a micro-step under no_sync is neither reduced nor shown; the next one reduces both.
    seen.clear()
    wrapped.zero_grad(set_to_none=True)
    with strategy.no_sync(wrapped):
        out["syncs_inside"] = strategy.syncs(wrapped)
        _loss(wrapped, ctx).backward()
        out["grad_inside"] = [p.grad for p in params] == [None] * len(params)
    out["syncs_after"], out["seen_under_no_sync"] = strategy.syncs(wrapped), len(seen)
    _loss(wrapped, ctx).backward()
    out["accumulated_seen"] = torch.equal(_sorted(seen), _sorted(2 * g for g in local))
    out["accumulated_error"] = max((p.grad.full_tensor() - 2 * g).abs().max().item() for p, g in zip(params, average))
    tap.remove()
    with pytest.raises(UsageError, match="fsdp has no DDP communication hook"):
        strategies.get("fsdp").tap_local_gradients(wrapped, params, print, via="comm_hook")
    # A divide factor set on one group shows; FSDP2's default (None) is the data-parallel size. Not recursive: the
    # root's own call changes nothing here, its children hold every parameter.
    wrapped.set_gradient_divide_factor(1.0)
    out["root_factors"] = strategy.divide_factors(wrapped)
    wrapped[0].set_gradient_divide_factor(1.0)
    out["changed_factors"] = strategy.divide_factors(wrapped)
    # Reduce-scatter without the all-reduce: a whole reduction on one mesh dimension, half of one on two, where
    # no rank ever holds its local gradient whole: the tap refuses to show a part of it.
    wrapped.set_requires_all_reduce(False)
    out["syncs_without_all_reduce"] = strategy.syncs(wrapped)
    tap = strategy.tap_local_gradients(wrapped, params, lambda tensor: None)
    try:
        _loss(wrapped, ctx).backward()
        out["refused"] = None
    except UsageError as exc:
        out["refused"] = str(exc)
        wrapped.reset_iter_state()
    tap.remove()
    del wrapped, model
    return out


REFUSED = ("the local gradient cannot be seen whole under HSDP's set_requires_all_reduce(False): accumulate with "
           "set_requires_gradient_sync(False) instead")


@pytest.mark.timeout(120)
def test_fsdp_and_hsdp_shard_average_and_show_the_local_gradient():
    # FSDP2 on 2 ranks, and HSDP on 4 as 2 replicas × 2 shards: the data-parallel degree is the product.
    for name, world_size, options in (("fsdp", 2, {}), ("hsdp", 4, {"replicate": 2})):
        results = launch(_fsdp_on_rank, LaunchConfig(world_size=world_size), name, options)
        for rank, out in enumerate(results):
            assert out.pop("reduced_error") <= 1e-16 and out.pop("accumulated_error") <= 1e-16
            assert out.pop("share_norm_error") <= 1e-15
            # Only the root's own group changed: the children keep the default.
            assert out == {"wrapped_in_place": True, "owns": True, "found": name, "module": True,
                           "size": world_size, "rank": rank, "group_size": world_size, "factors": {world_size},
                           "local_seen": True, "syncs_inside": False, "grad_inside": True, "syncs_after": True,
                           "seen_under_no_sync": 0, "accumulated_seen": True,
                           "root_factors": {world_size}, "changed_factors": {float(world_size), 1.0},
                           "syncs_without_all_reduce": name == "fsdp",
                           "refused": None if name == "fsdp" else REFUSED}, (name, rank)
