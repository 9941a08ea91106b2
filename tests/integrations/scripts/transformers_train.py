"""The Transformers Trainer on CPU under torchrun, 2 processes: a tiny token model, sequences of varied length.

Correct: the model divides its summed token loss by ``num_items_in_batch`` (the Trainer's token count,
across devices with ``average_tokens_across_devices``), gradient accumulation 2, a linear schedule with warmup.
--mistake per_device turns average_tokens_across_devices off: each device divides by its own token count.
--mistake micro_mean_override: a ``compute_loss`` override returning the micro-batch's own token mean, as many
fine-tuning scripts write it; the model takes loss kwargs, so the Trainer (which then trusts the loss to be divided
by ``num_items_in_batch``) does not divide it by the accumulation steps either: the weighting and the K× both.
"""

import argparse
import sys
import tempfile

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

VOCAB, LENGTH, SEQUENCES = 16, 12, 256


class TokenData(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=g)
        self.lengths = torch.randint(3, LENGTH + 1, (SEQUENCES,), generator=g)

    def __len__(self):
        return SEQUENCES

    def __getitem__(self, index):
        labels = self.ids[index].roll(-1).clone()
        labels[self.lengths[index] - 1:] = -100  # padding: no loss
        return {"input_ids": self.ids[index], "labels": labels}


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels=None, num_items_in_batch=None, **kwargs):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = None
        if labels is not None:
            summed = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
            count = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
            loss = summed / count
        return {"loss": loss, "logits": logits}


class MicroBatchMean(Trainer):
    """compute_loss over this micro-batch's own label tokens, num_items_in_batch ignored."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs["logits"].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return (loss, outputs) if return_outputs else loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", choices=("none", "per_device", "micro_mean_override"), default="none")
    mistake = parser.parse_args().mistake
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                                 max_steps=8, learning_rate=0.05, lr_scheduler_type="linear", warmup_steps=2,
                                 use_cpu=True, ddp_backend="gloo", report_to="none", save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
                                 average_tokens_across_devices=mistake != "per_device")
        trainer_class = MicroBatchMean if mistake == "micro_mean_override" else Trainer
        trainer = trainer_class(model=TinyLM(), args=args, train_dataset=TokenData())
        result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"trainer-done steps={result.global_step}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
