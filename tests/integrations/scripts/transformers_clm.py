"""The Trainer in the shape of transformers' examples/pytorch/language-modeling/run_clm.py, 2 processes under torchrun.

Its arguments come from the command line through HfArgumentParser (TrainingArguments' own flags: --output_dir,
--use_cpu, --ddp_backend...); a tiny GPT-2 is built from a config (nothing downloaded); the data are token lists
made in code, blocks of equal length as run_clm's group_texts makes them. Like run_clm.py, whose imports of datasets,
evaluate and transformers come before its own ``import torch``, this script never imports torch first: transformers
asks where torch is (importlib.util.find_spec) before anything imports it.

Without --use_cpu on a CPU machine each process trains alone; with --use_cpu --ddp_backend gloo the Trainer builds DDP.
"""

import dataclasses
import random

from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments, set_seed
from transformers.data.data_collator import default_data_collator


@dataclasses.dataclass
class ModelArguments:
    """The tiny model's size (run_clm.py's --config_overrides, in a flag of its own)."""

    n_layer: int = dataclasses.field(default=1, metadata={"help": "Transformer blocks."})
    block_size: int = dataclasses.field(default=16, metadata={"help": "Tokens per training block."})


VOCAB, BLOCKS = 64, 64


def blocks(block_size: int) -> list[dict]:
    """Causal-LM blocks as group_texts leaves them: labels are the input ids (the model shifts them)."""
    rng = random.Random(0)
    data = []
    for _ in range(BLOCKS):
        ids = [rng.randrange(VOCAB) for _ in range(block_size)]
        data.append({"input_ids": ids, "attention_mask": [1] * block_size, "labels": list(ids)})
    return data


def main():
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=model_args.block_size, n_embd=16, n_layer=model_args.n_layer,
                        n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    with training_args.main_process_first(desc="grouping texts"):
        train_dataset = blocks(model_args.block_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                      data_collator=default_data_collator)
    result = trainer.train()
    trainer.save_model()
    trainer.save_state()
    print(f"clm-done steps={result.global_step} world_size={training_args.world_size}", flush=True)


if __name__ == "__main__":
    main()
