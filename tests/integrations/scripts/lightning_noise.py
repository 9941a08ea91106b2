"""Lightning, 2 processes: the GradientNoiseScale and Audit callbacks on linear regression at fixed weights.

lr 0 holds the weights at 0, where each batch's gradient is known exactly, and Lightning's automatic
DistributedSampler (shuffled, seed 0) fixes each rank's batches, so the test can recompute every
measured step's squared norms from the data alone.
"""

import importlib.util
import os
import sys

import _data
import lightning as L
import torch
import torch.nn.functional as F

from ddplab.integrations.lightning import Audit, GradientNoiseScale

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC_PATH = os.path.join(HERE, "..", "..", "..", "examples", "linear_regression_spec.py")
BATCH, STEPS = 16, int(os.environ.get("DDPLAB_TEST_STEPS", "400"))


def load_spec():
    spec = importlib.util.spec_from_file_location("linear_regression_spec", SPEC_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FixedLinear(L.LightningModule):
    def __init__(self, spec):
        super().__init__()
        self.layer = spec.model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main():
    torch.set_num_threads(1)
    spec = load_spec()
    loader = torch.utils.data.DataLoader(spec.dataset(), batch_size=BATCH, shuffle=False)
    noise, audit = GradientNoiseScale(every=1), Audit(steps=3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[noise, audit])
    trainer.fit(FixedLinear(spec), loader)
    summary = noise.noise_scale.summary()
    _data.write_result(trainer.global_rank, history=noise.history, b_simple=summary.b_simple,
                       b_small=noise.noise_scale.b_small, b_big=noise.noise_scale.b_big,
                       audit={f.code: f.severity for f in audit.report.problems}, audited=audit.report.steps_audited,
                       logged={k: float(trainer.callback_metrics[k])
                               for k in ("b_simple", "grad_sq_norm", "trace_sigma")})
    _data.leave()
    sys.exit(0)


if __name__ == "__main__":
    main()
