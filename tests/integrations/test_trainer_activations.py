"""`weights: auto` under the Trainer counts the activations: `device_activation_bytes` from the
activation estimate (plan/activations.py) at `per_device_train_batch_size` x the train
dataset's longest sequence among its first samples, on an accelerator, unless the user set it
(plan/activations.py `with_trainer_activations`, called by the Trainer's optimizer build)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from superoffload_hf.config import SuperOffloadConfig
from superoffload_hf.integrations import trainer_hooks
from superoffload_hf.integrations.callback import unwrap_optimizer
from superoffload_hf.integrations.trainer import Trainer, TrainingArguments
from superoffload_hf.plan.activations import estimate_activations
from superoffload_hf.plan.activations import dataset_seq_len, with_trainer_activations

from _models import tiny_llama

CONFIG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)


def samples(*lengths: int) -> list[dict]:
    return [{"input_ids": list(range(n)), "labels": list(range(n))} for n in lengths]


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from samples(8, 8)


def test_the_sequence_length_is_the_longest_input_ids_of_the_first_samples():
    assert dataset_seq_len(samples(12, 40, 7)) == 40
    assert dataset_seq_len(samples(*[10] * 64, 500)) == 10  # (the 65th is not read)
    assert dataset_seq_len(Stream()) is None
    assert dataset_seq_len([{"text": "no ids"}]) is None
    assert dataset_seq_len(None) is None


def meta_model() -> torch.nn.Module:
    with torch.device("meta"):  # (a device that is not the CPU: what an accelerator's model looks like here)
        return LlamaForCausalLM(CONFIG)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_auto_on_an_accelerator_counts_the_estimate_at_the_batch_and_the_datasets_length(checkpointing):
    config = SuperOffloadConfig(weights="auto", device_dtype="bf16")
    chosen, line = with_trainer_activations(config, {}, meta_model(), 3, checkpointing, samples(16, 48, 20),
                                            lambda: 10**12)
    want = estimate_activations(CONFIG, 3, 48, 2, gradient_checkpointing=checkpointing).total
    assert chosen.device_activation_bytes == int(want) > 0
    assert chosen.replace(device_activation_bytes=0) == config
    assert "at 3 x 48 tokens" in line and "`device_activation_bytes` sets it" in line


def test_a_given_value_stationary_weights_the_cpu_and_an_unknown_length_count_nothing_new():
    auto = SuperOffloadConfig(weights="auto", device_activation_bytes=123)
    data, free = samples(16), lambda: 10**12
    assert with_trainer_activations(auto, {"device_activation_bytes": 123}, meta_model(), 2, False, data, free) == (auto, None)
    stationary = SuperOffloadConfig(weights="stationary")
    assert with_trainer_activations(stationary, {}, meta_model(), 2, False, data, free) == (stationary, None)
    on_cpu = SuperOffloadConfig(weights="auto")
    assert with_trainer_activations(on_cpu, {}, LlamaForCausalLM(CONFIG), 2, False, data, free) == (on_cpu, None)
    unknown, line = with_trainer_activations(on_cpu, {}, meta_model(), 2, False, Stream(), free)
    assert unknown == on_cpu and "sequence length is unknown" in line and "device_activation_bytes" in line


def test_the_trainer_passes_its_batch_checkpointing_and_dataset_and_uses_the_chosen_config(tmp_path, monkeypatch):
    seen = {}

    def recording(config, explicit, model, micro_batch, checkpointing, dataset, free):
        seen.update(explicit=explicit, micro_batch=micro_batch, checkpointing=checkpointing, dataset=dataset)
        return config.replace(device_activation_bytes=4096), "counted"

    monkeypatch.setattr(trainer_hooks, "with_trainer_activations", recording)
    data = samples(16, 16, 16, 16)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                             gradient_checkpointing=True, use_cpu=True, report_to="none", save_strategy="no",
                             superoffload=True, superoffload_config={"weights": "auto", "host_kernel": "reference"})
    trainer = Trainer(model=tiny_llama(num_layers=2), args=args, train_dataset=data)
    trainer.create_optimizer()
    optimizer = unwrap_optimizer(trainer.optimizer)
    try:
        assert optimizer.config.device_activation_bytes == 4096
        assert seen["micro_batch"] == 2 and seen["checkpointing"] is True and seen["dataset"] is data
        assert seen["explicit"]["weights"] == "auto" and "device_activation_bytes" not in seen["explicit"]
    finally:
        optimizer.close()
