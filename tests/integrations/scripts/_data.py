"""What the framework scripts share: a small regression data set and model, and a result file."""

import json
import os

import torch

SAMPLES, FEATURES = 256, 8


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def leave() -> None:
    """End this rank's process group as the launch layer does, a barrier first: a rank that exits the instant its
    last collective returns can abort in gloo ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()


def write_result(rank: int, **values) -> None:
    """Rank 0's numbers for the test, in the file named by DDPLAB_TEST_RESULT (if set)."""
    path = os.environ.get("DDPLAB_TEST_RESULT")
    if path and rank == 0:
        with open(path, "w") as fh:
            json.dump(values, fh)
