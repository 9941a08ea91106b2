"""The vectorized engine trains what the user trains: torch.optim's SGD, Adam and AdamW, and models with
dropout, BatchNorm, LayerNorm and Embedding — each run as torch would train it alone."""

from __future__ import annotations

import pytest
import torch

from ddplab.study import optim
from ddplab.study.config import OptimizerConfig, StudyConfig, Target
from ddplab.study.engines import vmap as engine
from ddplab.study.runs import grid_group
from ddplab.study.workloads import Workload

STEPS = 50


class _Mlp(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


class _Tokens(torch.nn.Module):
    """Embedding → LayerNorm → mean over positions → + BatchNorm of it → ReLU → Dropout → Linear."""

    def __init__(self, dropout: float = 0.0, batchnorm: bool = True):
        super().__init__()
        self.emb, self.norm = torch.nn.Embedding(16, 12), torch.nn.LayerNorm(12)
        self.bn = torch.nn.BatchNorm1d(12) if batchnorm else torch.nn.Identity()
        self.drop, self.head = torch.nn.Dropout(dropout), torch.nn.Linear(12, 4)

    def forward(self, tokens):
        hidden = self.norm(self.emb(tokens)).mean(1)
        # The residual keeps LayerNorm's bias in play (BatchNorm alone would remove any shift it makes).
        return self.head(self.drop(torch.relu(hidden + self.bn(hidden))))


def _workload(model, inputs, targets) -> Workload:
    n = len(targets) * 3 // 4
    return Workload(name="test", model=model, loss=torch.nn.functional.cross_entropy, train=(inputs[:n], targets[:n]),
                    val=(inputs[n:], targets[n:]), source=("regression", ()), fingerprint="test")


def _mlp_workload() -> Workload:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 6, generator=generator)
    return _workload(_Mlp, inputs, (inputs[:, 0] + inputs[:, 1] > 0).long() + (inputs[:, 2] > 1).long())


def _token_workload(**kwargs) -> Workload:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (512, 5), generator=generator)
    return _workload(lambda: _Tokens(**kwargs), tokens, tokens.sum(1) % 4)


def _alone(workload: Workload, config: StudyConfig, global_batch: int, lr: float, seed: int, steps: int):
    """One run trained by torch.optim on the engine's data order: the reference the group must match."""
    dtype = engine.torch_dtype(config)
    params, buffers = engine.seeded_state(workload, seed, dtype)
    model = workload.model().to(dtype)
    model.load_state_dict({**params, **buffers})
    optimizer = optim.torch_optimizer(config.optimizer, model.parameters(), lr)
    order = engine.Batches(workload.train_size, global_batch, [seed])
    inputs, targets = engine.cast(workload.train[0], dtype), workload.train[1]
    for step in range(steps):
        index = order.indices(step)[0]
        optimizer.zero_grad()
        workload.loss(model(inputs[index]), targets[index]).backward()
        optimizer.step()
    return model


def _max_rel_diff(group: engine.Group, row: int, model: torch.nn.Module) -> float:
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    worst = 0.0
    for name, tensors in (*group.params.items(), *group.buffers.items()):
        mine, theirs = tensors[row].to(torch.float64), state[name].detach().to(torch.float64)
        worst = max(worst, float((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)))
    return worst


OPTIMIZERS = [
    OptimizerConfig(momentum=0.9),
    OptimizerConfig(momentum=0.9, dampening=0.3, weight_decay=1e-3),
    OptimizerConfig(momentum=0.8, nesterov=True, weight_decay=5e-3),
    OptimizerConfig(momentum=0.0, weight_decay=1e-2),
    OptimizerConfig(family="adam"),
    OptimizerConfig(family="adam", betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2),
    OptimizerConfig(family="adamw", weight_decay=0.1),
]


@pytest.mark.parametrize("dtype,tolerance", [("float64", 1e-10), ("float32", 1e-5)])
def test_each_stacked_run_follows_torch_optim(dtype, tolerance):
    """Every family's update, several lrs in one group, each run against torch.optim alone after 50 steps."""
    workload = _mlp_workload()
    for opt in OPTIMIZERS:
        lrs = (0.05, 0.2) if opt.family == "sgd" else (1e-3, 1e-2)
        config = StudyConfig(target=Target(kind="loss", value=1e-9), global_batch_sizes=(16, 32), optimizer=opt,
                             dtype=dtype)
        runs = [(lrs[0], 0), (lrs[1], 1), (lrs[1], 0)]
        group = engine.Group(workload, config, grid_group(config, 32, runs))
        for step in range(STEPS):
            group.step(step, measure=False)
        for row, (lr, seed) in enumerate(runs):
            alone = _alone(workload, config, 32, lr, seed, STEPS)
            assert _max_rel_diff(group, row, alone) <= tolerance, (opt, lr, seed)
        # The runs moved: a wrong lr would be seen (the comparison can fail).
        moved = _alone(workload, config, 32, lrs[0] * 1.01, 0, STEPS)
        assert _max_rel_diff(group, 0, moved) > 100 * tolerance, opt


def test_an_optimizer_read_from_torch_round_trips_and_others_are_named():
    params = [torch.nn.Parameter(torch.zeros(3))]
    for opt in OPTIMIZERS:
        built = optim.torch_optimizer(opt, params, 0.01)
        assert optim.from_torch(built) == (opt, 0.01, "")
    config, lr, why = optim.from_torch(torch.optim.RMSprop(params, lr=0.02))
    assert config is None and lr == 0.02 and why == "RMSprop is not among SGD, Adam and AdamW"
    # How a study's JSON names it (plan --from-study then refuses it for SGD and Adam alike: family "other").
    assert optim.describe(torch.optim.RMSprop(params, lr=0.02, alpha=0.9, centered=True)) == {
        "family": "other", "name": "RMSprop", "momentum": 0, "alpha": 0.9, "eps": 1e-08, "centered": True,
        "weight_decay": 0, "parameter_groups": 1}
    assert optim.from_torch(torch.optim.Adam(params, amsgrad=True))[2] == "Adam has amsgrad=True"
    two_groups = torch.optim.SGD([{"params": params}, {"params": [torch.nn.Parameter(torch.ones(1))]}], lr=0.1)
    assert "2 parameter groups" in optim.from_torch(two_groups)[2]


def test_batchnorm_layernorm_embedding_runs_keep_their_own_running_statistics():
    """Each run's BatchNorm statistics are its own (float64, against torch alone), and evaluation uses them in
    eval mode: the vectorized validation metric is torch's eval-mode metric of that run."""
    workload = _token_workload()
    config = StudyConfig(target=Target(kind="accuracy", value=0.99), global_batch_sizes=(16, 32),
                         optimizer=OptimizerConfig(family="adamw", weight_decay=0.01), dtype="float64")
    runs = [(3e-3, 0), (1e-2, 1)]
    group = engine.Group(workload, config, grid_group(config, 16, runs))
    for step in range(30):
        group.step(step, measure=step % 10 == 9)
    inputs, targets = workload.val
    for row, (lr, seed) in enumerate(runs):
        alone = _alone(workload, config, 16, lr, seed, 30)
        assert _max_rel_diff(group, row, alone) <= 1e-10
        alone.eval()
        with torch.no_grad():
            expected = float((alone(inputs).argmax(-1) == targets).double().mean())
        assert group.metrics()[row] == expected
    assert int(group.buffers["bn.num_batches_tracked"][0]) == 30
    assert not torch.equal(group.buffers["bn.running_mean"][0], group.buffers["bn.running_mean"][1])


def test_dropout_draws_independent_masks_per_run_reproducibly():
    workload = _token_workload(dropout=0.5, batchnorm=False)
    config = StudyConfig(target=Target(kind="loss", value=1e-9), global_batch_sizes=(16, 32),
                         optimizer=OptimizerConfig(family="adam"), dtype="float64")
    runs = [(1e-2, 0), (1e-2, 0)]

    def trained():
        group = engine.Group(workload, config, grid_group(config, 32, runs))
        losses = [group.step(step, measure=False) for step in range(20)]
        return group, torch.stack(losses)

    group, losses = trained()
    # Two runs alike in lr, seed and data differ only by their dropout masks.
    assert not torch.equal(losses[:, 0], losses[:, 1])
    again, losses_again = trained()
    assert torch.equal(losses, losses_again) and torch.equal(group.params["head.weight"], again.params["head.weight"])
    # The masks are dropout's: in eval mode the run sees no dropout, and its loss fell while training.
    assert float(losses[-5:].mean()) < float(losses[:5].mean())


@pytest.mark.parametrize("family", ["sgd", "adamw"])
def test_a_group_keeps_every_tensor_on_its_device(family):
    """The device path without a GPU: on the meta device (shapes, no data) every tensor a group makes or updates
    stays there through training steps, dropout, BatchNorm, LayerNorm, Embedding and the optimizer's state
    included, since any tensor left on the CPU would raise at the first op that mixes them. Reading a value is
    the one thing meta cannot do, and the one place a GPU run copies to the host."""
    workload = _token_workload(dropout=0.1)
    config = StudyConfig(target=Target(kind="accuracy", value=0.9), global_batch_sizes=(16, 32),
                         optimizer=OptimizerConfig(family=family, momentum=0.9 if family == "sgd" else 0.0))
    group = engine.Group(workload, config, grid_group(config, 16, [(1e-2, 0), (3e-2, 1), (1e-2, 2)]), device="meta")
    for step in range(2):
        losses = group.step(step, measure=False)
    group.keep([0, 2])
    losses = group.step(2, measure=False)
    state = [t for tensors in group.optimizer.state.values() for t in tensors.values()]
    tensors = [losses, group.inputs, group.targets, *group.params.values(), *group.buffers.values(), *state]
    assert state and {t.device.type for t in tensors} == {"meta"} and losses.shape == (2,)
    # The lrs stay on the host in float64, as torch.optim's Python-float lr: the optimizer derives its scalars there.
    assert group.lr.device.type == "cpu" and group.lr.dtype == torch.float64 and group.lr.tolist() == [1e-2, 1e-2]
    for read in (lambda: group.step(3, measure=True), group.metrics):
        with pytest.raises(NotImplementedError, match="meta tensor"):
            read()
