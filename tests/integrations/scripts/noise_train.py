"""The noise-scale integrations of Accelerate and the Transformers Trainer, 2 processes under torchrun.

Linear regression at fixed weights (lr 0), unshuffled data, gradient accumulation 2: each process's
micro-batch m holds samples [(m·W + rank)·b, (m·W + rank + 1)·b) (both frameworks deal out the loader's
batches round-robin), so the test can recompute every measured step's squared norms from the data.
"""

import argparse
import importlib.util
import os
import sys
import tempfile

import _data
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC_PATH = os.path.join(HERE, "..", "..", "..", "examples", "linear_regression_spec.py")
BATCH, ACCUMULATION, STEPS = 16, 2, int(os.environ.get("DDPLAB_TEST_STEPS", "200"))


def load_spec():
    spec = importlib.util.spec_from_file_location("linear_regression_spec", SPEC_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_accelerate(spec):
    from accelerate import Accelerator

    from ddplab.integrations.accelerate import noise_scale

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model = spec.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = torch.utils.data.DataLoader(spec.dataset(), batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    gns = noise_scale(accelerator, model, per_device_batch_size=BATCH, every=1)
    history, steps = [], 0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                record = gns.step()
                history.append({"g_small_sq": record.g_small_sq, "g_big_sq": record.g_big_sq})
                steps += 1
            optimizer.step()
            optimizer.zero_grad()
        if steps == STEPS:
            break
    return accelerator.process_index, gns, history


class Regression(torch.nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.layer = spec.model()

    def forward(self, x, y):
        return {"loss": F.mse_loss(self.layer(x), y)}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, dataset):
        self.x, self.y = dataset.tensors

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index], "y": self.y[index]}


def with_trainer(spec):
    from transformers import Trainer, TrainingArguments

    from ddplab.integrations.transformers import NoiseScaleCallback

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH,
                                 gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=0.0,
                                 lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
                                 optim="sgd", train_sampling_strategy="sequential", use_cpu=True,
                                 ddp_backend="gloo", report_to="none", save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
        trainer = Trainer(model=Regression(spec), args=args, train_dataset=Pairs(spec.dataset()))
        callback = NoiseScaleCallback(trainer, every=1)
        trainer.add_callback(callback)
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "b_simple" in entry]
    assert len(logged) == len(callback.history) == STEPS
    assert all(entry["b_simple"] == record["b_simple"] for entry, record in zip(logged, callback.history))
    return trainer.args.process_index, callback.noise_scale, callback.history


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=("accelerate", "transformers"), required=True)
    framework = parser.parse_args().framework
    torch.set_num_threads(1)
    spec = load_spec()
    rank, gns, history = with_accelerate(spec) if framework == "accelerate" else with_trainer(spec)
    _data.write_result(rank, history=[{"g_small_sq": r["g_small_sq"], "g_big_sq": r["g_big_sq"]} for r in history],
                       b_small=gns.b_small, b_big=gns.b_big, b_simple=gns.summary().b_simple)
    _data.leave()
    sys.exit(0)


if __name__ == "__main__":
    main()
