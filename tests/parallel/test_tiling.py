"""parallel/tiling.py: config `tiled_loss` / `tiled_mlp` (choice, validation, application), and a
Trainer run with the tiled loss and MLP on equals the same run with them off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.parallel.tiled_loss import is_tiled_loss
from superoffload_hf.parallel.tiled_mlp import is_tiled_mlp
from superoffload_hf.parallel.tiling import prepare_tiling
from superoffload_hf.plan.activations import choose_tiling, untiled_terms
from tests._models import tiny_batch, tiny_llama

REPO = Path(__file__).resolve().parents[2]


def test_config_switches_are_validated_naming_the_value():
    assert SuperOffloadConfig().tiled_loss == "auto" and SuperOffloadConfig().tiled_mlp == "auto"
    with pytest.raises(ConfigError, match=r"`tiled_loss` is True; valid choices are \['auto', 'on', 'off'\]"):
        SuperOffloadConfig(tiled_loss=True)
    with pytest.raises(ConfigError, match="`tiled_mlp` is 'yes'"):
        SuperOffloadConfig(tiled_mlp="yes")
    with pytest.raises(ConfigError, match="`tiled_loss_chunk_tokens` is 0"):
        SuperOffloadConfig(tiled_loss_chunk_tokens=0)


def test_auto_is_off_on_the_cpu_device_and_on_as_configured():
    assert choose_tiling("auto", "auto", True) == choose_tiling("off", "off", False).__class__(
        False, False, "auto: off on the CPU device")
    assert (choose_tiling("on", "off", True).loss, choose_tiling("on", "off", True).mlp) == (True, False)


def test_auto_on_an_accelerator_tiles_a_term_above_an_eighth_of_the_free_memory():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(REPO / "recipes" / "models" / "llama-3.1-8b")
    logits, mlp = untiled_terms(config, 1, 16384, 2)
    # 12 bytes a logit, less what the tiled loss keeps: one token's logits, the head's gradients
    assert logits == 16384 * 128256 * 12 - (128256 * 12 + 128256 * 4096 * (4 + 2))
    free = 141 * 10**9
    long = choose_tiling("auto", "auto", False, model_config=config, micro_batch=1, seq_len=16384,
                         free_device_bytes=free)
    assert long.loss == (logits > free / 8) == True  # noqa: E712 (22 GB against 17.6 GB)
    assert long.mlp == (mlp > free / 8) == False  # noqa: E712
    short = choose_tiling("auto", "auto", False, model_config=config, micro_batch=1, seq_len=2048,
                          free_device_bytes=free)
    assert not short.loss and not short.mlp
    unknown = choose_tiling("auto", "on", False)
    assert (unknown.loss, unknown.mlp) == (False, True) and "unknown" in unknown.reason


def test_prepare_applies_on_leaves_auto_off_on_the_cpu_and_defers_auto_on_an_accelerator():
    model = tiny_llama(num_layers=1)
    prepare_tiling(model, SuperOffloadConfig(tiled_loss="on", tiled_mlp="auto"), True, lambda: 0)
    assert is_tiled_loss(model) and not is_tiled_mlp(model)
    model = tiny_llama(num_layers=1)
    assert prepare_tiling(model, SuperOffloadConfig(), True, lambda: 0).reason == "auto: off on the CPU device"
    assert not is_tiled_loss(model)
    # "auto" on an accelerator with 10 kB free, chosen at the first forward with labels: the loss
    # tiled (23 kB of logits saved); not the MLP (at 32 tokens its fp32 weight-gradient sums
    # would cost more than the 48 kB intermediate they remove)
    model, reference = tiny_llama(num_layers=1), tiny_llama(num_layers=1)
    assert prepare_tiling(model, SuperOffloadConfig(), False, lambda: 10**4) is None
    assert is_tiled_loss(model)  # the wrapper is in place, undecided
    batch = tiny_batch(batch=2, seq=16)
    got = model(**batch)
    assert got.logits is None and not is_tiled_mlp(model)
    assert_close(got.loss, reference(**batch).loss)


def test_on_for_a_model_the_tiling_cannot_wrap_is_an_error_and_auto_leaves_it():
    linear = torch.nn.Linear(2, 2)
    assert prepare_tiling(linear, SuperOffloadConfig(), False, lambda: 0) is None
    with pytest.raises(ValueError, match="tiled_loss: off"):
        prepare_tiling(linear, SuperOffloadConfig(tiled_loss="on", tiled_mlp="off"), True, lambda: 0)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    assert prepare_tiling(gpt2, SuperOffloadConfig(), False, lambda: 1) is None  # no Llama-style estimate
    assert not is_tiled_loss(gpt2)


def test_a_trainer_run_with_the_tiled_loss_and_mlp_on_equals_it_off(tmp_path):
    from superoffload_hf.integrations.trainer import Trainer, TrainingArguments
    from _trainer_data import TinyDataset

    runs = {}
    for switch in ("off", "on"):
        args = TrainingArguments(
            output_dir=str(tmp_path / switch), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
            data_seed=0, superoffload=True,
            superoffload_config={"host_kernel": "reference", "tiled_loss": switch, "tiled_mlp": switch,
                                 "tiled_loss_chunk_tokens": 7, "tiled_mlp_chunk_tokens": 5})
        trainer = Trainer(model=tiny_llama(num_layers=2), args=args, train_dataset=TinyDataset(size=12))
        trainer.train()
        assert is_tiled_loss(trainer.model) == is_tiled_mlp(trainer.model) == (switch == "on")
        runs[switch] = ([r["loss"] for r in trainer.state.log_history if "loss" in r],
                        {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    assert len(runs["on"][0]) == 3
    assert_close(runs["on"][0], runs["off"][0], rtol=1e-5, atol=1e-6)
    for name, value in runs["off"][1].items():
        assert_close(runs["on"][1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_dry_run_prints_the_activation_terms_and_the_switches_decisions(capsys):
    from superoffload_hf.cli import main

    assert main(["train", "llama3.1-8b", "--dry-run", "--data.seq_len", "65536"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  activations of 1 x 65536 tokens (bf16, gradient "
                                                            "checkpointing on) "))
    assert all(f"{name} " in line for name in ("checkpointed_inputs", "attention", "mlp", "backward", "loss"))
    # 65536 x 128256 logits at 12 bytes (101 GB) against 1/8 of (141 - 16.06) GB: the loss is tiled
    assert "tiled_loss auto, tiled_mlp auto - against an H200's 141 GB less the stationary weights, tiled loss on, " \
           "tiled MLP off (auto at 1 x 65536 tokens" in out, out
    assert main(["train", "tiny_llama_cpu", "--dry-run"]) == 0
    assert "tiled loss off, tiled MLP off (auto - off on the CPU device)" in capsys.readouterr().out


def _train_with(tiled: bool, weights: str, checkpointing: bool) -> dict:
    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.parallel.tiled_loss import apply_tiled_loss
    from superoffload_hf.parallel.tiled_mlp import apply_tiled_mlp
    from tests._models import engine_config, micro_batches, read_params

    model = tiny_llama(num_layers=2)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tiled:
        apply_tiled_mlp(apply_tiled_loss(model, chunk_tokens=7), chunk_tokens=5)
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-2, model=model, max_grad_norm=1.0,
                            config=engine_config(device_buckets=0, weights=weights, speculation="on"))
    with opt:
        for step in range(3):
            (batch,) = micro_batches(step)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        return {name: p.detach().clone() for name, p in read_params(model).items()}


@pytest.mark.usefixtures("device_mode")
@pytest.mark.parametrize("weights,checkpointing", [("stationary", False), ("flow", True)])
def test_the_engine_trains_the_tiled_model_like_the_untiled_one(weights, checkpointing):
    """The engine's per-parameter gradient hooks, weight-flow's fetch and release around the
    blocks (the tiled MLP saves its weights for backward, no copy) and checkpointing's recompute
    see the tiled loss and MLP; on the CPU device and the simulated one."""
    expected, got = _train_with(False, "stationary", False), _train_with(True, weights, checkpointing)
    for name, value in expected.items():
        assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_tiled_by_an_earlier_optimizer_is_kept_as_it_is():
    """A second optimizer (a second Trainer) on the same model: its tiling stays, no error."""
    model = tiny_llama(num_layers=1)
    config = SuperOffloadConfig(tiled_loss="on", tiled_mlp="on")
    prepare_tiling(model, config, True, lambda: 0)
    forwards = (model.forward, [layer.mlp.forward for layer in model.model.layers])
    assert prepare_tiling(model, config, True, lambda: 0) is None
    assert is_tiled_loss(model) and is_tiled_mlp(model)
    assert (model.forward, [layer.mlp.forward for layer in model.model.layers]) == forwards
