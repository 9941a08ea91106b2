"""A tiny causal LM trained by the Transformers Trainer under DeepSpeed: `TrainingArguments(deepspeed=<config>)`.

The shape of a Transformers fine-tuning script (run_clm.py): a Llama model built from a tiny config (no download),
an in-memory dataset of documents of 5 to 32 tokens, a data collator that pads each micro-batch to its longest
document (input_ids with the pad id, attention_mask 0, labels -100), and a DeepSpeed config whose batch values are
"auto" (the Trainer fills them from per_device_train_batch_size 4 and gradient_accumulation_steps 2) and which names
no optimizer (the Trainer's torch AdamW is DeepSpeed's client optimizer: DeepSpeed's own FusedAdam needs CUDA).
max_steps 6; the Trainer's linear schedule, stepped by the engine.

On CPU the Trainer needs the gloo group made first (it ignores `ddp_backend` under DeepSpeed and would otherwise see
one process): `ACCELERATE_USE_DEEPSPEED=true`, `PartialState(backend="gloo")`, then
`accelerator_config={"use_configured_state": True}`.

  --stage 1|2|3        the config's zero_optimization.stage (2 by default)
  --accumulation K     gradient_accumulation_steps (2 by default)

Correct by default: the model's own loss, its summed token loss divided by the Trainer's `num_items_in_batch` (the
label tokens of the whole step, counted over the ranks with `average_tokens_across_devices`) and multiplied by the
number of processes; the Trainer passes `scale_wrt_gas=False` so the engine does not divide again.

Mistake:

  --mistake rank-mean  a `compute_loss` override that divides each micro-batch's summed token loss by that
                       micro-batch's own label tokens, and (as the Trainer's docstring asks of a per-batch mean) sets
                       `loss_is_scaled_for_ga = False` so the Trainer divides it by the accumulation steps: every
                       micro-batch weighs the same whatever its token count (LOSS_NORMALISED_PER_MICRO_BATCH; with
                       --accumulation 1, LOSS_NORMALISED_PER_DEVICE)

Rank 0 prints each optimizer step's logged loss and gradient norm, and a checksum of the (gathered) parameters.
"""

import argparse
import os
import tempfile

import _ds_harness
import torch
import torch.nn.functional as F

VOCAB, PAD, IGNORE, DOCUMENTS, LR = 64, 0, -100, 96, 3e-2


def documents(count: int = DOCUMENTS, seed: int = 3) -> list[dict]:
    """Documents of 5 to 32 tokens (ids 1..VOCAB-1; 0 is the pad), the same on every rank: each counts up from a
    random token by a random stride of 1 to 3 (wrapping), something a small LM learns in context."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 33, (count,), generator=generator).tolist()
    starts = torch.randint(VOCAB - 1, (count,), generator=generator).tolist()
    strides = torch.randint(1, 4, (count,), generator=generator).tolist()
    return [{"input_ids": [1 + (start + i * stride) % (VOCAB - 1) for i in range(length)]}
            for length, start, stride in zip(lengths, starts, strides)]


def collate(features: list[dict]) -> dict:
    """Pad to the micro-batch's longest document; the labels are the inputs with padding as -100 (the model shifts)."""
    longest = max(len(f["input_ids"]) for f in features)
    input_ids = torch.full((len(features), longest), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(features), longest), dtype=torch.long)
    labels = torch.full((len(features), longest), IGNORE, dtype=torch.long)
    for row, feature in enumerate(features):
        ids = torch.tensor(feature["input_ids"], dtype=torch.long)
        input_ids[row, :len(ids)] = ids
        attention_mask[row, :len(ids)] = 1
        labels[row, :len(ids)] = ids
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def ds_config(stage: int) -> dict:
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "contiguous_gradients": True, "overlap_comm": False,
                              "reduce_scatter": True},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--mistake", choices=("none", "rank-mean"), default="none")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by DeepSpeed's launcher; unused")
    args = parser.parse_args()

    torch.set_num_threads(1)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    PartialState(backend="gloo")

    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class PerMicroBatchMean(Trainer):
        """compute_loss written as many fine-tuning scripts do: the mean over this micro-batch's own tokens."""

        loss_is_scaled_for_ga = False  # a per-batch mean: the Trainer divides it by the accumulation steps

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits, targets = outputs.logits[:, :-1], labels[:, 1:]
            summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                                     reduction="sum")
            loss = summed / targets.ne(IGNORE).sum()
            return (loss, outputs) if return_outputs else loss

    class StepLines(TrainerCallback):
        def on_log(self, training_args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                _ds_harness.emit(f"step {state.global_step} loss {logs['loss']:.6f} "
                                 f"grad_norm {float(logs.get('grad_norm', float('nan'))):.6f}")

    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, deepspeed=ds_config(args.stage), accelerator_config={"use_configured_state": True},
            per_device_train_batch_size=4, gradient_accumulation_steps=args.accumulation, max_steps=6,
            learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
            average_tokens_across_devices=True, logging_strategy="steps", logging_steps=1, save_strategy="no",
            report_to="none", disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0,
            dataloader_pin_memory=False, remove_unused_columns=False)
        trainer_class = PerMicroBatchMean if args.mistake == "rank-mean" else Trainer
        trainer = trainer_class(model=tiny_llama(), args=training_args, train_dataset=documents(),
                                data_collator=collate, callbacks=[StepLines()])
        trainer.remove_callback(PrinterCallback)  # its log dicts carry wall times
        trainer.train()
        engine = trainer.model_wrapped
        line = _ds_harness.checksum(engine)
        if trainer.is_world_process_zero():
            _ds_harness.emit(f"engine zero{engine.zero_optimization_stage()} train_batch_size "
                             f"{engine.train_batch_size()} micro {engine.train_micro_batch_size_per_gpu()} "
                             f"accumulation {engine.gradient_accumulation_steps()} steps {engine.global_steps}")
            _ds_harness.emit(line)
    PartialState().wait_for_everyone()
    PartialState().destroy_process_group()


if __name__ == "__main__":
    main()
