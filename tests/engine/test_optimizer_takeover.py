"""Two optimizers on the same parameters: the newest takes them over.

A second SuperOffload optimizer built on parameters a live one manages (a resume with a new
optimizer + load_state_dict while the old one is still referenced; a second Trainer on the
model of a first one) closes the older one, with a warning saying so; the older one's step()
then raises an error naming what happened. The newer one trains exactly as it would on a model
no optimizer had ever managed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.integrations.callback import unwrap_optimizer
from superoffload_hf.integrations.trainer import Trainer, TrainingArguments

from _models import engine_config, one_torch_thread, tiny_batch, tiny_llama  # noqa: F401

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "device_mode"), pytest.mark.timeout(120)]

TAKEOVER = "took over"


def train_steps(model, opt, steps, first_seed=0):
    for seed in range(first_seed, first_seed + steps):
        model(**tiny_batch(seed=seed)).loss.backward()
        opt.step()
        opt.zero_grad()


def assert_same_params(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    actual.state_dict(), expected.state_dict()  # the documented reads (waits for copy-backs)
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters()):
        assert torch.equal(a.detach(), e.detach()), name


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_a_new_optimizer_loading_the_state_takes_over_from_a_live_one(speculation):
    config = engine_config(speculation=speculation)
    model, reference = tiny_llama(2), tiny_llama(2)
    first = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=config)
    straight = SuperOffloadAdamW(reference.parameters(), lr=1e-3, config=config)
    train_steps(model, first, 2)
    train_steps(reference, straight, 2)
    saved = copy.deepcopy(first.state_dict())
    with pytest.warns(UserWarning, match=TAKEOVER):
        second = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=config)
    second.load_state_dict(saved)
    train_steps(model, second, 3, first_seed=2)
    train_steps(reference, straight, 3, first_seed=2)
    assert_same_params(model, reference)
    with pytest.raises(RuntimeError, match="taken over by a newer SuperOffload optimizer"):
        first.step()
    second.close(), straight.close()


def test_a_takeover_between_backward_and_step_drops_the_old_gradients():
    model = tiny_llama(2)
    first = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=engine_config())
    model(**tiny_batch()).loss.backward()  # gradients held by `first`, never stepped
    with pytest.warns(UserWarning, match=TAKEOVER):
        second = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=engine_config())
    assert all(p.grad is None for p in model.parameters())
    reference = tiny_llama(2)
    straight = SuperOffloadAdamW(reference.parameters(), lr=1e-3, config=engine_config())
    train_steps(model, second, 2)
    train_steps(reference, straight, 2)
    assert_same_params(model, reference)
    second.close(), straight.close()


def test_an_optimizer_on_a_deep_copy_of_the_model_takes_nothing_over():
    model = tiny_llama(2)
    first = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=engine_config())
    twin = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = SuperOffloadAdamW(twin.parameters(), lr=1e-3, config=engine_config())
    assert not [w for w in caught if TAKEOVER in str(w.message)], [str(w.message) for w in caught]
    train_steps(model, first, 1)  # the first one still trains its model
    train_steps(twin, other, 1)
    other.close(), first.close()


class TinyDataset(torch.utils.data.Dataset):
    def __init__(self, size: int = 16):
        self.examples = [{k: v[0] for k, v in tiny_batch(batch=1, seed=i).items()} for i in range(size)]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]


def trainer_args(tmp_path, name: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
        weight_decay=0.1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        disable_tqdm=True, seed=0, data_seed=0, superoffload=True,
        superoffload_config={"host_kernel": "reference", "speculation": "on", "rollback": "snapshot"})


def test_a_second_trainer_on_the_model_of_a_live_first_one_trains(tmp_path):
    model = tiny_llama(num_layers=2)
    first = Trainer(model=model, args=trainer_args(tmp_path, "first"), train_dataset=TinyDataset())
    first.train()
    trained = tiny_llama(num_layers=2)  # what the second Trainer starts from, on a model no optimizer managed
    trained.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match=TAKEOVER):
        second = Trainer(model=model, args=trainer_args(tmp_path, "second"), train_dataset=TinyDataset())
        second.train()
    alone = Trainer(model=trained, args=trainer_args(tmp_path, "alone"), train_dataset=TinyDataset())
    alone.train()
    logs = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (second, alone)]
    assert logs[0] == logs[1]
    assert_same_params(model, trained)
    with pytest.raises(RuntimeError, match="taken over by a newer SuperOffload optimizer"):
        unwrap_optimizer(first.optimizer).step()  # the first Trainer's, still referenced
