"""Lightning, 2 processes: BatchRamp grows accumulate_grad_batches with the measured noise scale.

Noisy linear regression (10 features, label noise 1): B_simple rises as the weights approach w*, so
the global batch must grow between epochs. Each rank records the lr of every update and each
epoch's accumulation; rank 0 writes them, the ramp's changes, and whether the ranks hold the same
weights and drew every sample exactly once per epoch.
"""

import sys

from _accumulating import fit

from ddplab.integrations.lightning import BatchRamp, GradientNoiseScale

EPOCHS = 6


def main():
    noise = GradientNoiseScale(every=1, log=False)
    ramp = BatchRamp(noise, max_accumulation_steps=16, warmup_steps=5)
    fit([noise, ramp], EPOCHS, changes=lambda: [c.__dict__ for c in ramp.ramp.changes], warmup_steps=lambda: 5,
        b_simple_history=lambda: [h["b_simple"] for h in noise.history])
    sys.exit(0)


if __name__ == "__main__":
    main()
