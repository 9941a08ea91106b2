"""A spec to start from: copy this file, replace each body with your own code, and run

    ddplab check spec_template.py --world-size 2 --batch-size 16
    ddplab noise spec_template.py --world-size 2 --batch-size 32
    ddplab study spec_template.py --target-accuracy 0.9 --global-batch-sizes 16,32,64,128

From a Trainer class of your own (``class Trainer: def __init__(...): self.model = Net(); self.opt =
AdamW(...); def train_step(self, batch): ...``), each piece moves to one function below: what
``__init__`` builds goes into model() and optimizer(), the datasets your loaders wrap into dataset() and
val_dataset(), the criterion into loss(), and train_step's forward into step() only when it is more than
``loss(model(inputs), targets)``. Leave out the DDP wrapper, the sampler, the loaders, the backward and
``optimizer.step()``: ddplab builds those itself, per rank, for every global batch it tries. Every
function must build the same thing every time it is called (a seed for the data; the model is seeded
by ddplab), since every rank and every run calls it afresh.
"""

import torch


class Net(torch.nn.Module):
    """Your model, unchanged (here a small MLP on 2-class data)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, 2))

    def forward(self, inputs):
        return self.body(inputs)


def _split(seed: int, size: int):
    # Synthetic data seeded once: replace with your Dataset (any map-style dataset of (input, target) pairs).
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 8, generator=generator)
    targets = ((inputs[:, 0] + 0.5 * inputs[:, 1] - inputs[:, 2]) > 0).long()
    return torch.utils.data.TensorDataset(inputs, targets)


def model():
    """Required: a fresh model (ddplab seeds it; every rank builds the same one)."""
    return Net()


def dataset():
    """Required: the training set, (input, target) pairs."""
    return _split(seed=0, size=2048)


def loss(output, target):
    """Required: a mean-reduced loss (a summed one is what ddplab check flags)."""
    return torch.nn.functional.cross_entropy(output, target)


def optimizer(params):
    """Optional (default: SGD at lr 0.1): your optimizer; its lr is the study's reference lr."""
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def val_dataset():
    """Optional, for ddplab study: the held-out split the target is measured on (accuracy or loss)."""
    return _split(seed=1, size=512)


# Optional: step(model, batch, loss_fn) -> loss, when the forward is more than loss_fn(model(x), y)
# (several inputs, an auxiliary loss); the study then trains on real DDP ranks only.
# Optional: evaluate(model, dataset) -> float, when the target is neither accuracy nor the mean loss.
