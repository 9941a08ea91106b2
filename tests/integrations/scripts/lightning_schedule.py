"""Lightning, 2 processes: BatchSchedule follows a batch schedule of samples seen through accumulate_grad_batches.

Noisy linear regression (10 features, label noise 1), 8 samples per rank per micro-step (16 per
micro-step over both), 2048 samples an epoch. The schedule starts at global batch 16 and lr 0.02,
asks for 32 at lr 0.04 from 1000 samples and 64 at lr 0.06 from 5000: the thresholds fall
mid-epoch, so each takes effect at the next epoch's start. Each rank records the lr of every update
and each epoch's accumulation; rank 0 writes them, the schedule's changes, and whether the ranks hold
the same weights and drew every sample exactly once per epoch.
"""

import sys

from _accumulating import fit

from ddplab.integrations.lightning import BatchSchedule

EPOCHS, WARMUP = 4, 5
SCHEDULE = [{"samples_seen": 0, "global_batch_size": 16, "lr": 0.02},
            {"samples_seen": 1000, "global_batch_size": 32, "lr": 0.04},
            {"samples_seen": 5000, "global_batch_size": 64, "lr": 0.06}]


def main():
    schedule = BatchSchedule(SCHEDULE, warmup_steps=WARMUP)
    fit([schedule], EPOCHS, changes=lambda: [c.__dict__ for c in schedule.schedule.changes],
        samples_seen=lambda: schedule.schedule.samples_seen, state=schedule.state_dict, warmup_steps=lambda: WARMUP)
    sys.exit(0)


if __name__ == "__main__":
    main()
