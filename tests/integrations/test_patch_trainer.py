"""`superoffload_hf.patch_trainer()`: superoffload for TRL's SFTTrainer and DPOTrainer (any
Trainer subclass) in-process, against the same trainers with stock torch AdamW (CPU, fp32).

Each pair of runs starts from bitwise-equal tiny Llamas and sees the same batches; losses, grad
norms, learning rates and every parameter agree element by element to a few ulp per step (the
engine's Adam rounds with fma and sums the norm in float64), as in test_trainer.py. Speculation
is on and clipping finds it late, so buckets are stepped during backward and rolled back.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import superoffload_hf
from superoffload_hf.config import ConfigError
from superoffload_hf.integrations.accelerate import SuperOffloadAcceleratedOptimizer, SuperOffloadPlugin
from superoffload_hf.integrations.callback import LOG_PREFIX, unwrap_optimizer
from superoffload_hf.integrations.patch import unpatch_trainer

from _models import tiny_llama

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.timeout(300)

RTOL, ATOL = 1e-5, 1e-6
STEPS = 4
SPECULATE = {"host_kernel": "reference", "speculation": "on", "rollback": "snapshot"}
WORDS = "the a river runs to sea and light house keeps ships off rocks at night".split()


@pytest.fixture(autouse=True)
def stock_trainer_classes_after_each_test():
    yield
    for cls in (transformers.Trainer, trl.SFTTrainer, trl.DPOTrainer):
        unpatch_trainer(cls)


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="<eos>")


def model():
    llama = tiny_llama(num_layers=2, vocab_size=32)
    llama.config.pad_token_id, llama.config.eos_token_id, llama.config.bos_token_id = 1, 2, 2
    return llama


def common_args(tmp_path, name: str, max_grad_norm: float) -> dict:
    return dict(output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=4,
                learning_rate=1e-3, weight_decay=0.1, max_grad_norm=max_grad_norm, logging_steps=1,
                save_strategy="no", report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                optim="adamw_torch", seed=0, data_seed=0)


def sft_trainer(tmp_path, name: str, max_grad_norm: float = 1.0):
    texts = ["the river runs to the sea", "a light house keeps ships off the rocks at night",
             "the sea and the light", "ships at night keep off rocks"] * 4
    args = trl.SFTConfig(max_length=16, **common_args(tmp_path, name, max_grad_norm))
    return trl.SFTTrainer(model=model(), args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                          processing_class=word_tokenizer())


def dpo_trainer(tmp_path, name: str, max_grad_norm: float = 1.0):
    rows = {"prompt": ["the river runs to ", "a light house keeps ", "ships at night keep ", "the sea and "] * 4,
            "chosen": ["the sea", "ships off the rocks", "off rocks", "the light"] * 4,
            "rejected": ["rocks house", "the river at night", "a sea light", "runs to ships"] * 4}
    args = trl.DPOConfig(max_length=16, beta=0.1, **common_args(tmp_path, name, max_grad_norm))
    policy = model()
    return trl.DPOTrainer(model=policy, ref_model=copy.deepcopy(policy), args=args,
                          train_dataset=datasets.Dataset.from_dict(rows), processing_class=word_tokenizer())


def train_logs(trainer) -> list[dict]:
    return [record for record in trainer.state.log_history if "loss" in record]


def assert_same_training(stock, offload) -> None:
    stock_logs, offload_logs = train_logs(stock), train_logs(offload)
    assert len(stock_logs) == len(offload_logs) == STEPS
    for key in ("loss", "grad_norm", "learning_rate"):
        expected = torch.tensor([record[key] for record in stock_logs], dtype=torch.float64)
        actual = torch.tensor([record[key] for record in offload_logs], dtype=torch.float64)
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=f"logged {key}")
    stock_params = dict(stock.model.named_parameters())
    for name, actual in offload.model.named_parameters():
        torch.testing.assert_close(actual.detach(), stock_params[name].detach(), rtol=RTOL, atol=ATOL, msg=name)


# Each threshold lies just under the trainer's first grad norms (SFT ~1.2, DPO ~0.73): clipped steps.
@pytest.mark.parametrize("build, max_grad_norm", [(sft_trainer, 1.0), (dpo_trainer, 0.7)],
                         ids=["SFTTrainer", "DPOTrainer"])
def test_patch_trainer_trains_trl_trainers_with_superoffload_to_the_stock_adamw_numbers(tmp_path, build,
                                                                                       max_grad_norm):
    stock = build(tmp_path, "stock", max_grad_norm)
    stock.train()
    assert isinstance(stock.optimizer.optimizer, torch.optim.AdamW)

    superoffload_hf.patch_trainer(**SPECULATE)  # transformers.Trainer: every subclass built from now on
    offload = build(tmp_path, "offload", max_grad_norm)
    offload.train()
    assert isinstance(offload.optimizer, SuperOffloadAcceleratedOptimizer)
    assert_same_training(stock, offload)
    # A norm above the threshold only in the sum over buckets: speculated, rolled back, replayed.
    assert sum(record["grad_norm"] > max_grad_norm for record in train_logs(offload)) >= 2
    counters = unwrap_optimizer(offload.optimizer).counters
    assert counters.speculative_steps >= 1 and counters.rollbacks >= 1
    assert all(LOG_PREFIX + "rollbacks" in record for record in train_logs(offload))


def test_patch_trainer_is_idempotent_replaces_its_settings_and_is_undone_by_unpatch(tmp_path):
    original_init = transformers.Trainer.__init__
    superoffload_hf.patch_trainer(speculation="off")
    wrapped = transformers.Trainer.__init__
    settings = superoffload_hf.patch_trainer(config={"speculation": "off"}, host_kernel="reference", speculation="on")
    assert transformers.Trainer.__init__ is wrapped  # wrapped once
    assert settings == SuperOffloadPlugin(speculation="on", host_kernel="reference")
    trainer = sft_trainer(tmp_path, "patched")
    assert trainer.superoffload.plugin.speculation == "on"  # the latest call's settings
    assert [type(cb).__name__ for cb in trainer.callback_handler.callbacks].count("SuperOffloadCallback") == 1

    assert superoffload_hf.unpatch_trainer() is True
    assert transformers.Trainer.__init__ is original_init
    assert superoffload_hf.unpatch_trainer() is False
    assert not hasattr(sft_trainer(tmp_path, "stock"), "superoffload")
    assert trainer.superoffload.plugin.speculation == "on"  # one built before keeps what it has


def test_a_patched_subclass_gets_its_own_settings_over_a_patched_base_and_unpatches_alone(tmp_path):
    superoffload_hf.patch_trainer(speculation="off")
    superoffload_hf.patch_trainer(trl.DPOTrainer, speculation="on")
    assert "__init__" in vars(trl.DPOTrainer)  # patched although its base's __init__ already was
    dpo = dpo_trainer(tmp_path, "dpo")
    assert dpo.superoffload.plugin.speculation == "on"
    assert [type(cb).__name__ for cb in dpo.callback_handler.callbacks].count("SuperOffloadCallback") == 1
    assert sft_trainer(tmp_path, "sft").superoffload.plugin.speculation == "off"

    assert superoffload_hf.unpatch_trainer(trl.DPOTrainer) is True
    assert "__init__" in vars(trl.DPOTrainer)  # its own __init__, back
    assert not hasattr(vars(trl.DPOTrainer)["__init__"], "_superoffload_patch")
    assert dpo_trainer(tmp_path, "dpo_base").superoffload.plugin.speculation == "off"  # the base's patch remains


def test_a_subclass_that_inherits_its_init_is_patched_on_its_own_and_unpatched_back_to_inheriting(tmp_path):
    class MySFTTrainer(trl.SFTTrainer):  # no __init__ of its own
        pass

    superoffload_hf.patch_trainer(speculation="off")
    superoffload_hf.patch_trainer(MySFTTrainer, speculation="on")
    assert "__init__" in vars(MySFTTrainer)
    def mine():
        return MySFTTrainer(model=model(), args=trl.SFTConfig(max_length=16, **common_args(tmp_path, "mine", 1.0)),
                            train_dataset=datasets.Dataset.from_dict({"text": ["the sea"] * 4}),
                            processing_class=word_tokenizer())

    assert mine().superoffload.plugin.speculation == "on"
    assert superoffload_hf.unpatch_trainer() is True  # the base: MySFTTrainer keeps its own patch
    trainer = mine()
    assert trainer.superoffload.plugin.speculation == "on"
    assert [type(cb).__name__ for cb in trainer.callback_handler.callbacks].count("SuperOffloadCallback") == 1
    assert superoffload_hf.unpatch_trainer(MySFTTrainer) is True
    assert "__init__" not in vars(MySFTTrainer)  # inherits again


def test_our_own_trainer_follows_its_arguments_under_a_patch(tmp_path):
    from superoffload_hf import Trainer, TrainingArguments

    superoffload_hf.patch_trainer(speculation="on")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    assert Trainer(model=model(), args=args, train_dataset=[]).superoffload is None


def test_patch_trainer_refuses_a_misspelled_field_and_what_is_not_a_trainer_class():
    with pytest.raises(ConfigError, match=r"Did you mean `speculation` for `speculaton`\?"):
        superoffload_hf.patch_trainer(speculaton="on")
    with pytest.raises(TypeError, match=r"takes a subclass of transformers.Trainer, got <class 'torch.nn.modules"):
        superoffload_hf.patch_trainer(torch.nn.Linear)
    assert not hasattr(transformers.Trainer.__init__, "_superoffload_patch")  # nothing patched by a failed call
