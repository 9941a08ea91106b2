"""The Trainer's per-device token counts are the tokens that reach the loss: a causal LM shifts its labels, so each
sequence's first label is no token of it (the Trainer's own count, in one process)."""

import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ddplab.auditor.frameworks import label_tokens, shifts_labels  # noqa: E402


def _padded_batches() -> list[dict]:
    """Two micro-batches of right-padded sequences (lengths 5, 3 and 7, 2), labels the ids with -100 at the pads."""
    out = []
    for lengths in ((5, 3), (7, 2)):
        labels = torch.full((2, 8), -100)
        for row, length in enumerate(lengths):
            labels[row, :length] = torch.arange(1, length + 1)
        out.append({"input_ids": labels.clamp(min=0), "labels": labels})
    return out


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8)
    return transformers.LlamaForCausalLM(config)


def _tiny_gpt2():
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def test_a_causal_lms_tokens_are_counted_after_the_shift_as_the_trainer_counts_them(tmp_path):
    trainer = transformers.Trainer(model=_tiny_llama(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    batches = _padded_batches()
    assert shifts_labels(trainer)
    # 17 labels, one per sequence dropped by the shift: 4 + 2 + 6 + 1 = 13.
    assert label_tokens(batches, shifts_labels(trainer)) == 13
    assert label_tokens(batches, shifts_labels(trainer)) == int(trainer._get_num_items_in_batch(batches, "cpu"))


def test_gpt2s_head_shifts_its_labels_though_the_trainer_counts_them_unshifted(tmp_path):
    model = _tiny_gpt2()
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    batches = _padded_batches()
    # What reaches GPT-2's loss: its own mean over the shifted labels, times their count, is its summed loss.
    model.eval()  # no dropout: both forwards see the same logits
    with torch.no_grad():
        logits = model(input_ids=batches[0]["input_ids"]).logits
        mean = model(input_ids=batches[0]["input_ids"], labels=batches[0]["labels"]).loss
    summed = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 16), batches[0]["labels"][:, 1:].reshape(-1),
                                               ignore_index=-100, reduction="sum")
    assert float(mean) * label_tokens(batches[:1], True) == pytest.approx(float(summed), rel=1e-5)
    assert shifts_labels(trainer) and label_tokens(batches, shifts_labels(trainer)) == 13
    assert int(trainer._get_num_items_in_batch(batches, "cpu")) == 17


def test_a_collators_shift_labels_are_taken_as_given_and_an_unshifted_model_counts_every_label():
    batches = _padded_batches()
    packed = [{**b, "shift_labels": b["labels"][..., 1:]} for b in batches]
    assert label_tokens(packed, True) == 13
    assert label_tokens(batches, False) == 17


def test_an_older_trainer_that_does_not_say_is_read_from_the_model():
    assert shifts_labels(types.SimpleNamespace(model=_tiny_gpt2()))
    assert not shifts_labels(types.SimpleNamespace(model=torch.nn.Linear(2, 2)))
