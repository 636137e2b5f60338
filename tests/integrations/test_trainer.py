"""The HF Trainer with superoffload=True against the stock Trainer with adamw_torch (CPU, fp32).

Each run trains a tiny Llama for a few steps on a tiny in-memory dataset; the two runs start
from bitwise-equal weights and see the same batches. The engine's Adam rounds with fma and sums
the norm in float64 where torch does neither, so losses, grad norms and parameters agree to a
few ulp per step (rtol 1e-5, atol 1e-6), element by element. Speculation is on, so buckets
are stepped on the host during backward, and rolled back and replayed when the step clips.
"""

from __future__ import annotations

import copy

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import HfArgumentParser, TrainerCallback

from superoffload_hf.config import ConfigError
from superoffload_hf.integrations.accelerate import SuperOffloadAcceleratedOptimizer, SuperOffloadLossScaler
from superoffload_hf.integrations.resume import ResumeError
from superoffload_hf.integrations.callback import LOG_PREFIX, SuperOffloadCallback, unwrap_optimizer
from superoffload_hf.integrations.trainer import Trainer, TrainingArguments
from superoffload_hf.integrations.trainer_hooks import check_hook_points
from superoffload_hf.optimizer import SuperOffloadAdamW

from _checkpoints import write_checkpoint
from _models import tiny_llama
from _trainer_data import TinyDataset
from superoffload_hf.testing.engine_parts import parts, is_superoffload

pytestmark = [pytest.mark.usefixtures("device_mode"), pytest.mark.timeout(300)]

RTOL, ATOL = 1e-5, 1e-6
STEPS = 6
# The tiny Llama's grad norm is ~1.1: HUGE never clips; LATE clips, but only the sum over most
# buckets shows it (speculative buckets roll back and replay); TINY clips from the first bucket.
HUGE, LATE, TINY = 1e6, 1.0, 1e-2
# Speculate on every step; undo with snapshots, so a clipped step is replayed from exactly the
# state it started from (the default inverse rollback has its own stated error bound, tested by
# the engine's tests; the default config is tested below at the Trainer's max_grad_norm).
SPECULATE = {"host_kernel": "reference", "speculation": "on", "rollback": "snapshot"}


def make_args(tmp_path: Path, name: str, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, weight_decay=0.1, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, disable_tqdm=True, optim="adamw_torch", seed=0, data_seed=0,
        superoffload_config=SPECULATE,
    )
    values.update(overrides)
    superoffload = values.pop("superoffload", True)
    if not superoffload:
        values.pop("superoffload_config")
    return TrainingArguments(superoffload=superoffload, **values)


def train(args: TrainingArguments, trainer_cls=Trainer, callbacks=None, resume=None) -> Trainer:
    trainer = trainer_cls(model=tiny_llama(num_layers=2), args=args, train_dataset=TinyDataset(),
                          callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def train_logs(trainer: Trainer) -> list[dict]:
    return [record for record in trainer.state.log_history if "loss" in record]


class FinishedRun:
    """What a finished training run leaves to compare: its loss records and its final weights."""

    def __init__(self, trainer: Trainer):
        self.logs = train_logs(trainer)
        self.params = [(name, p.detach().clone()) for name, p in trainer.model.named_parameters()]


# Runs shared by several tests, trained once per test process: stock-Trainer references (they do
# not depend on device_mode: the stock Trainer never touches the simulated device) and the
# checkpointed runs of the resume tests (per device_mode). Keys hold every argument of the run.
_SHARED_RUNS: dict = {}


def stock_run(tmp_path: Path, **overrides) -> FinishedRun:
    key = ("stock", tuple(sorted(overrides.items())))
    if key not in _SHARED_RUNS:
        _SHARED_RUNS[key] = FinishedRun(train(make_args(tmp_path, "stock", superoffload=False, **overrides)))
    return _SHARED_RUNS[key]


def assert_same_training(stock: FinishedRun, offload: Trainer) -> None:
    stock_logs, offload_logs = stock.logs, train_logs(offload)
    assert len(stock_logs) == len(offload_logs) == STEPS
    for key in ("loss", "grad_norm", "learning_rate"):
        expected = torch.tensor([record[key] for record in stock_logs], dtype=torch.float64)
        actual = torch.tensor([record[key] for record in offload_logs], dtype=torch.float64)
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=f"logged {key}")
    state = offload.model.state_dict()  # the documented read (weight-flow: host copies of the flowing weights)
    for (name, expected), (actual_name, _) in zip(stock.params, offload.model.named_parameters()):
        torch.testing.assert_close(state[actual_name].detach(), expected, rtol=RTOL, atol=ATOL, msg=name)


def per_mesh_groups(model: torch.nn.Module) -> list[dict]:
    """Four param groups, as transformers >= 5.21's Trainer builds them for parameters on two device
    meshes: decay and no-decay, each split per mesh (here: the embeddings and block 0, and the rest)."""
    groups = {}
    for name, p in model.named_parameters():
        no_decay = "norm" in name or name.endswith(".bias")
        mesh = name.startswith(("model.embed_tokens.", "model.layers.0."))
        groups.setdefault((no_decay, mesh), {"params": [], "weight_decay": 0.0 if no_decay else 0.1})["params"].append(p)
    return list(groups.values())


def test_a_user_optimizer_with_more_than_two_param_groups_trains_to_the_stock_numbers(tmp_path):
    stock_model = tiny_llama(num_layers=2)
    stock = Trainer(model=stock_model, args=make_args(tmp_path, "stock4", superoffload=False, max_grad_norm=LATE),
                    train_dataset=TinyDataset(), optimizers=(torch.optim.AdamW(per_mesh_groups(stock_model), lr=1e-3), None))
    stock.train()
    model = tiny_llama(num_layers=2)
    groups = per_mesh_groups(model)
    assert len(groups) == 4, [len(g["params"]) for g in groups]
    optimizer = SuperOffloadAdamW(groups, lr=1e-3, max_grad_norm=LATE, config={**SPECULATE, "device_dtype": "fp32"},
                                  model=model)
    offload = Trainer(model=model, args=make_args(tmp_path, "offload4", max_grad_norm=LATE),
                      train_dataset=TinyDataset(), optimizers=(optimizer, None))
    offload.train()
    assert [g["weight_decay"] for g in unwrap_optimizer(offload.optimizer).param_groups] == [g["weight_decay"] for g in groups]
    assert_same_training(FinishedRun(stock), offload)


# ---- training matches the stock Trainer ----------------------------------------------------------


@pytest.mark.parametrize("max_grad_norm", [HUGE, LATE, TINY],
                         ids=["clipping_never", "clipping_found_late", "clipping_always"])
def test_superoffload_trainer_matches_stock_adamw(tmp_path, max_grad_norm):
    stock = stock_run(tmp_path, max_grad_norm=max_grad_norm)
    offload = train(make_args(tmp_path, "offload", max_grad_norm=max_grad_norm))
    assert isinstance(offload.optimizer, SuperOffloadAcceleratedOptimizer)
    assert_same_training(stock, offload)
    clipped = [record["grad_norm"] > max_grad_norm for record in train_logs(offload)]
    assert clipped == [max_grad_norm != HUGE] * STEPS
    counters = unwrap_optimizer(offload.optimizer).counters
    if max_grad_norm == HUGE:
        assert counters.speculative_steps >= 1 and counters.rollbacks == 0
    elif max_grad_norm == LATE:  # the buckets stepped before the norm crossed 1.0 roll back
        assert counters.rollbacks >= 1 and counters.replays == counters.rollbacks
    else:  # the first bucket already proves clipping: the engine stops speculating at once
        assert counters.rollbacks == counters.speculative_steps


def test_weight_flow_under_the_trainer_matches_stock_adamw(tmp_path):
    """`weights: flow` through `superoffload_config`: the Trainer hands the optimizer its model."""
    stock = stock_run(tmp_path, max_grad_norm=LATE)
    offload = train(make_args(tmp_path, "offload", max_grad_norm=LATE,
                              superoffload_config={**SPECULATE, "weights": "flow", "device_buckets": 0}))
    optimizer = unwrap_optimizer(offload.optimizer)
    assert "weights flow: 5 units" in optimizer.describe()
    assert_same_training(stock, offload)
    fetched, calls, fetch_weights = optimizer.counters.weight_fetches, [], optimizer.fetch_weights
    optimizer.fetch_weights = lambda: calls.append(1) or fetch_weights()
    offload.save_model(str(tmp_path / "saved"))  # every rank calls it (data parallel: gathers), then rank 0 writes
    # one process: the state dict holds the host copies, nothing is fetched onto the device
    assert calls == [1] and optimizer.counters.weight_fetches == fetched
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    masters = optimizer.state_dict()["state"]
    name_of = {id(p): name for name, p in offload.model.named_parameters()}
    for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        assert torch.equal(saved[name_of[id(p)]], masters[i]["master_param"]), name_of[id(p)]


@pytest.mark.slow
def test_a_compiled_model_trains_to_the_stock_eager_numbers(tmp_path):
    """torch_compile=True: the forward hooks return at once inside the compiled region; the
    compiled wrapper, which runs eagerly, waits for every bucket its model reads."""
    stock = stock_run(tmp_path, max_grad_norm=LATE)
    offload = train(make_args(tmp_path, "offload", max_grad_norm=LATE, torch_compile=True,
                              torch_compile_backend="eager"))
    assert_same_training(stock, offload)


def test_default_superoffload_config_matches_stock_adamw_at_the_default_max_grad_norm(tmp_path):
    stock = stock_run(tmp_path, max_grad_norm=1.0)
    offload = train(make_args(tmp_path, "offload", max_grad_norm=1.0,
                              superoffload_config={"host_kernel": "reference"}))
    assert_same_training(stock, offload)


def test_gradient_accumulation_matches_stock_adamw(tmp_path):
    overrides = dict(gradient_accumulation_steps=3, per_device_train_batch_size=2, max_grad_norm=0.5)
    stock = stock_run(tmp_path, **overrides)
    offload = train(make_args(tmp_path, "offload", **overrides))
    assert_same_training(stock, offload)
    assert unwrap_optimizer(offload.optimizer).counters.steps == STEPS


def test_engine_counters_appear_in_every_training_log_record(tmp_path):
    trainer = train(make_args(tmp_path, "offload", max_grad_norm=1.0))
    keys = {LOG_PREFIX + name for name in ("rollbacks", "replays", "skips", "speculative_steps",
                                            "host_step_s", "device_wait_s")}
    for record in train_logs(trainer):
        assert keys <= set(record), sorted(set(record))
    assert train_logs(trainer)[-1][LOG_PREFIX + "skips"] == 0
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert names.index("SuperOffloadCallback") == names.index("DefaultFlowCallback") + 1
    assert names.index("SuperOffloadCallback") < names.index("ShortPrinterCallback")


class RecordLogs(TrainerCallback):
    """A reporter's view: the `logs` every callback after ours gets."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


@pytest.mark.parametrize("disable_tqdm", [True, False], ids=["PrinterCallback", "ProgressCallback"])
def test_the_printed_log_line_is_short_while_records_and_reporters_keep_every_counter(tmp_path, capsys,
                                                                                      device_mode, disable_tqdm):
    from transformers import PrinterCallback, ProgressCallback

    reporter = RecordLogs()
    trainer = train(make_args(tmp_path, "offload", max_grad_norm=1.0, disable_tqdm=disable_tqdm),
                    callbacks=[reporter])
    printer = ProgressCallback if not disable_tqdm else PrinterCallback
    assert trainer.pop_callback(printer) is not None  # still found by its stock class
    lines = [line for line in capsys.readouterr().out.splitlines() if "'loss'" in line]
    assert len(lines) == STEPS
    for line, record, seen in zip(lines, train_logs(trainer), [r for r in reporter.logs if "loss" in r]):
        assert len(line) < 200 and LOG_PREFIX not in line, line
        assert f"'superoffload': 'host Adam {1e3 * record[LOG_PREFIX + 'host_step_s']:.3g} ms/step, " in line, line
        assert f"rollbacks {record[LOG_PREFIX + 'rollbacks']}, skips 0'" in line, line
        counters = {k: v for k, v in record.items() if k.startswith(LOG_PREFIX)}
        assert len(counters) >= 8 and counters == {k: v for k, v in seen.items() if k.startswith(LOG_PREFIX)}
        # On the CPU device host jobs run inline: nothing overlaps, so no overlap is reported.
        assert (LOG_PREFIX + "overlap" in record) == (device_mode == "sim")
        assert ("overlap " in line) == (device_mode == "sim")


class RecordSynchronize(TrainerCallback):
    """Records the global step of every optimizer.synchronize() and of every checkpoint save."""

    def __init__(self):
        self.events = []

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        inner = unwrap_optimizer(optimizer)
        synchronize = inner.synchronize
        inner.synchronize = lambda: self.events.append(("sync", state.global_step)) or synchronize()

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))


def test_weights_are_synchronized_before_each_checkpoint_and_when_training_ends(tmp_path):
    record = RecordSynchronize()
    train(make_args(tmp_path, "offload", max_steps=5, save_strategy="steps", save_steps=2),
          callbacks=[record])
    # Checkpoint saves read the weights outside a forward; other steps keep their overlap.
    assert [e for e in record.events if e[0] == "sync"][:2] == [("sync", 2), ("sync", 4)]
    assert record.events.index(("sync", 2)) < record.events.index(("save", 2))
    assert record.events[-1][0] == "sync" and record.events[-1][1] == 5
    assert ("sync", 1) not in record.events and ("sync", 3) not in record.events


class NonFiniteLossAt(Trainer):
    """Makes the loss (hence every gradient) NaN on one optimizer step."""

    poisoned_step = 2

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * float("nan") if self.state.global_step == self.poisoned_step else loss


def test_a_skipped_step_does_not_advance_the_lr_scheduler(tmp_path):
    args = make_args(tmp_path, "offload", lr_scheduler_type="linear")
    trainer = train(args, trainer_cls=NonFiniteLossAt)
    logs = train_logs(trainer)
    rates = [record["learning_rate"] for record in logs]
    assert rates[NonFiniteLossAt.poisoned_step + 1] == rates[NonFiniteLossAt.poisoned_step]
    assert trainer.lr_scheduler.last_epoch == STEPS - 1
    assert logs[-1][LOG_PREFIX + "skips"] == 1
    assert unwrap_optimizer(trainer.optimizer).counters.steps == STEPS - 1


def test_fp16_device_dtype_scales_the_loss_in_the_optimizer_not_a_grad_scaler(tmp_path):
    """fp16 on the CPU: the config's device_dtype (Accelerate refuses fp16=True without a GPU)."""
    stock = stock_run(tmp_path, max_steps=1)
    trainer = train(make_args(tmp_path, "fp16", max_steps=1,
                              superoffload_config={**SPECULATE, "device_dtype": "fp16"}))
    assert isinstance(trainer.accelerator.scaler, SuperOffloadLossScaler)
    assert next(trainer.model.parameters()).dtype == torch.float16
    (record,) = train_logs(trainer)
    assert record[LOG_PREFIX + "loss_scale"] == 2.0**16
    # Scaled by 2**16 for backward, unscaled once by the optimizer: the fp32 norm up to fp16 rounding.
    assert record["grad_norm"] == pytest.approx(stock.logs[0]["grad_norm"], rel=2e-2)


def test_trainer_without_superoffload_is_the_stock_trainer(tmp_path):
    trainer = train(make_args(tmp_path, "stock", superoffload=False, max_steps=1))
    assert trainer.superoffload is None
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW


# ---- checkpoint and resume -----------------------------------------------------------------------


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class CaptureOptimizerState(TrainerCallback):
    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        # a snapshot: state_dict() references the live state (as torch.optim's does)
        self.state_dict = copy.deepcopy(unwrap_optimizer(optimizer).state_dict())


def assert_nested_equal(actual, expected, where="state_dict"):
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for key in expected:
            assert_nested_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_nested_equal(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


RESUME_OVERRIDES = dict(max_steps=8, save_strategy="steps", save_steps=4, max_grad_norm=0.5)


@pytest.fixture
def straight_run(device_mode, tmp_path, tmp_path_factory) -> FinishedRun:
    """The uninterrupted 8-step run, and in tmp_path / "interrupted" the output of the same run
    stopped at step 4 (checkpoint-4). Both are trained once per device_mode; every test gets its
    own copy of the interrupted run's output_dir to resume from, or to damage."""
    key = ("resume", device_mode)
    if key not in _SHARED_RUNS:
        base = tmp_path_factory.mktemp(f"resume-{device_mode}")
        straight = FinishedRun(train(make_args(base, "straight", **RESUME_OVERRIDES)))
        train(make_args(base, "interrupted", **RESUME_OVERRIDES), callbacks=[StopAt(4)])
        _SHARED_RUNS[key] = (straight, base / "interrupted")
    straight, interrupted = _SHARED_RUNS[key]
    shutil.copytree(interrupted, tmp_path / "interrupted")
    return straight


def test_resume_from_checkpoint_continues_bit_identically(tmp_path, straight_run):
    overrides, uninterrupted = RESUME_OVERRIDES, straight_run
    checkpoint = tmp_path / "interrupted" / "checkpoint-4"
    capture = CaptureOptimizerState()
    resumed = train(make_args(tmp_path, "interrupted", **overrides), callbacks=[capture],
                    resume=str(checkpoint))
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert_nested_equal(capture.state_dict, saved)  # restored, not re-initialised
    for (name, expected), (_, actual) in zip(uninterrupted.params, resumed.model.named_parameters()):
        assert torch.equal(actual, expected), name
    assert train_logs(resumed)[-1]["loss"] == uninterrupted.logs[-1]["loss"]


def test_resume_without_the_optimizer_state_is_refused_unless_weights_only_is_asked_for(tmp_path, straight_run):
    """The stock Trainer would start a fresh optimizer and LR schedule at step 4 and say it resumed."""
    overrides, uninterrupted = RESUME_OVERRIDES, straight_run
    checkpoint = tmp_path / "interrupted" / "checkpoint-4"
    os.remove(checkpoint / "optimizer.pt")
    with pytest.raises(ResumeError, match=r"has no optimizer.pt.*resume_weights_only"):
        train(make_args(tmp_path, "interrupted", **overrides), resume=str(checkpoint))
    with pytest.raises(ResumeError, match=r"has no optimizer.pt"):  # `True` too: the newest complete one
        train(make_args(tmp_path, "interrupted", **overrides), resume=True)
    # From step 0 among the run's checkpoints (its saves would replace them): refused, naming a new directory.
    with pytest.raises(ResumeError, match=r"weights-only resume starts again at step 0.*output_dir=.*interrupted_2"):
        train(make_args(tmp_path, "interrupted", resume_weights_only=True, **overrides), resume=str(checkpoint))
    # Deliberately: the weights of step 4, then 8 fresh steps (the dropped state changes the result).
    resumed = train(make_args(tmp_path, "weights_only", resume_weights_only=True, **overrides), resume=str(checkpoint))
    assert resumed.state.global_step == 8 and train_logs(resumed)[0]["step"] == 1
    differs = [not torch.equal(a, b) for (_, a), b in zip(uninterrupted.params, resumed.model.parameters())]
    assert any(differs)


def test_a_stock_trainer_patched_by_the_launcher_refuses_missing_optimizer_state_too(tmp_path):
    import transformers

    from superoffload_hf.integrations.accelerate import SuperOffloadPlugin
    from superoffload_hf.integrations.trainer_hooks import SuperOffloadHooks

    write_checkpoint(tmp_path / "out" / "checkpoint-4", optimizer=False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, use_cpu=True,
                                          report_to="none", save_strategy="no", per_device_train_batch_size=4)
    trainer = transformers.Trainer(model=tiny_llama(num_layers=2), args=args, train_dataset=TinyDataset())
    SuperOffloadHooks(trainer, SuperOffloadPlugin(**SPECULATE)).bind_to_trainer()  # what autopatch does
    with pytest.raises(ResumeError, match=r"checkpoint-4': it has no optimizer.pt"):
        trainer.train(resume_from_checkpoint=True)


def test_a_run_from_step_0_into_a_directory_of_checkpoints_is_refused_before_it_trains(tmp_path):
    """Its checkpoint-2 would replace theirs, and save_total_limit rotate the rest away."""
    for step in (2, 4):
        write_checkpoint(tmp_path / "run" / f"checkpoint-{step}", step)
    before = {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()}
    args = make_args(tmp_path, "run", save_strategy="steps", save_steps=2, save_total_limit=1)
    with pytest.raises(ResumeError, match=r"^This run starts at step 0: .*\(checkpoint-4, checkpoint-2\)\. Resume that run"):
        train(args)
    assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == before


def test_a_stock_trainer_takes_resume_weights_only_from_the_superoffload_block(tmp_path, caplog, straight_run):
    """What a stock script under `superoffload launch` has: its parser knows no `--resume_weights_only`."""
    import transformers

    from superoffload_hf.integrations.accelerate import SuperOffloadPlugin
    from superoffload_hf.integrations.trainer_hooks import SuperOffloadHooks

    checkpoint = tmp_path / "interrupted" / "checkpoint-4"
    (checkpoint / "optimizer.pt").write_bytes(b"")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "weights_only"), max_steps=2, use_cpu=True,
                                          report_to="none", save_strategy="no", per_device_train_batch_size=4)
    trainer = transformers.Trainer(model=tiny_llama(num_layers=2), args=args, train_dataset=TinyDataset())
    SuperOffloadHooks(trainer, SuperOffloadPlugin(**SPECULATE, resume_weights_only=True)).bind_to_trainer()
    with caplog.at_level("INFO", logger="superoffload_hf"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert f"resuming from {checkpoint}: the model weights only" in caplog.text
    assert trainer.state.global_step == 2


def test_resume_true_skips_a_checkpoint_cut_short_by_a_crash(tmp_path, caplog, straight_run):
    overrides, uninterrupted = RESUME_OVERRIDES, straight_run
    crashed = tmp_path / "interrupted" / "checkpoint-6"  # killed while writing the optimizer state
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes((tmp_path / "interrupted" / "checkpoint-4" / "model.safetensors").read_bytes())
    (crashed / "optimizer.pt").write_bytes(b"")
    with caplog.at_level("INFO", logger="superoffload_hf"):
        resumed = train(make_args(tmp_path, "interrupted", **overrides), resume=True)
    assert f"skipped incomplete checkpoint {crashed}: it has no trainer_state.json" in caplog.text
    assert f"resuming from {tmp_path / 'interrupted' / 'checkpoint-4'}" in caplog.text
    # News, not a warning: `superoffload train` prints it itself, and a warning would print it twice.
    assert [r.levelname for r in caplog.records if "resuming from" in r.getMessage()] == ["INFO"]
    for (name, expected), (_, actual) in zip(uninterrupted.params, resumed.model.named_parameters()):
        assert torch.equal(actual, expected), name


def test_the_optimizer_users_hold_answers_the_superoffload_read_outs(tmp_path):
    trainer = train(make_args(tmp_path, "run", max_steps=2))
    wrapper = trainer.optimizer
    inner = wrapper.optimizer
    assert isinstance(wrapper, SuperOffloadAcceleratedOptimizer)
    assert wrapper.describe() == inner.describe() and "host Adam" in wrapper.describe()
    assert wrapper.summary() == inner.summary()
    assert wrapper.plan is inner.plan and wrapper.counters is inner.counters and wrapper.host_adam is inner.host_adam
    assert wrapper.counters.steps == 2
    assert wrapper.last_step_skipped is False and wrapper.last_grad_norm == inner.last_grad_norm is not None
    wrapper.synchronize()


# ---- arguments -------------------------------------------------------------------------------------


def parse(argv: list[str]) -> TrainingArguments:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    return args


def test_hf_argument_parser_parses_superoffload_flags(tmp_path):
    config = tmp_path / "so.yaml"
    config.write_text(yaml.safe_dump({"speculation": "off", "device_dtype": "fp32"}))
    args = parse(["--output_dir", str(tmp_path), "--superoffload", "--superoffload_config", str(config)])
    assert args.superoffload is True
    plugin = args.superoffload_plugin()
    assert plugin.explicit_fields() == {"speculation": "off", "device_dtype": "fp32"}
    assert plugin.to_config("no").speculation == "off"
    assert parse(["--output_dir", str(tmp_path)]).superoffload is False


def test_optim_superoffload_adamw_is_a_synonym_for_superoffload(tmp_path):
    args = parse(["--output_dir", str(tmp_path), "--optim", "superoffload_adamw"])
    assert args.superoffload is True
    assert args.optim.value == "adamw_torch"


def test_superoffload_config_alone_turns_superoffload_on_and_accepts_json(tmp_path):
    args = parse(["--output_dir", str(tmp_path), "--superoffload_config", '{"speculation": "on"}'])
    assert args.superoffload is True
    assert args.superoffload_config == {"speculation": "on"}
    json.dumps(args.to_dict())  # still serialisable for logs and checkpoints


def test_broken_json_in_superoffload_config_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"`superoffload_config` is '\{\"speculation\": off\}', which starts like JSON but is not valid JSON"):
        parse(["--output_dir", str(tmp_path), "--superoffload_config", '{"speculation": off}'])


def test_unknown_superoffload_key_fails_with_a_clear_message(tmp_path):
    config = tmp_path / "so.yaml"
    config.write_text(yaml.safe_dump({"speculaton": "off"}))
    with pytest.raises(ConfigError, match=r"speculaton.*valid keys are .*speculation"):
        parse(["--output_dir", str(tmp_path), "--superoffload", "--superoffload_config", str(config)])
    with pytest.raises(ConfigError, match="rollback"):
        TrainingArguments(output_dir=str(tmp_path), superoffload_config={"rollback": "undo"})


def test_state_precision_travels_from_training_arguments_and_compact_needs_bf16(tmp_path):
    args = parse(["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "--superoffload_config",
                  '{"state_precision": "compact"}'])
    assert args.superoffload_plugin().to_config("bf16").state_precision == "compact"
    with pytest.raises(ConfigError, match=r"`state_precision` is 'compact' but `device_dtype` is 'fp32'.*bf16 mixed precision"):
        TrainingArguments(output_dir=str(tmp_path), use_cpu=True, superoffload_config={"state_precision": "compact"})


@pytest.mark.parametrize("flag", [["--deepspeed", "ds.json"], ["--fsdp"], ["--optim", "adafactor"]])
def test_superoffload_refuses_what_it_cannot_combine_with(tmp_path, flag):
    with pytest.raises(ValueError, match="superoffload"):
        parse(["--output_dir", str(tmp_path), "--superoffload", *flag])


@pytest.mark.parametrize(
    "flags, device_dtype",
    [({}, "fp32"), ({"bf16": True}, "bf16"), ({"superoffload_config": {"device_dtype": "bf16"}}, "bf16"),
     ({"bf16": True, "superoffload_config": {"device_dtype": "fp32"}}, "fp32")],
    ids=["full_precision", "bf16_flag", "config_bf16", "config_fp32_under_bf16_autocast"],
)
def test_device_dtype_follows_the_precision_flags_unless_the_config_sets_it(tmp_path, flags, device_dtype):
    values = {"superoffload_config": {"host_kernel": "reference"}, **flags}
    values["superoffload_config"] = {"host_kernel": "reference", **values["superoffload_config"]}
    trainer = Trainer(model=tiny_llama(num_layers=1), args=TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **values))
    trainer.create_optimizer()
    assert unwrap_optimizer(trainer.optimizer).config.device_dtype == device_dtype


def test_conflicting_device_dtype_and_precision_flag_fail(tmp_path):
    with pytest.raises(ConfigError, match="device_dtype"):
        TrainingArguments(output_dir=str(tmp_path), bf16=True, superoffload_config={"device_dtype": "fp16"})


def test_a_user_optimizer_that_is_not_superoffload_is_refused(tmp_path):
    model = tiny_llama(num_layers=1)
    trainer = Trainer(model=model, args=make_args(tmp_path, "x"),
                      optimizers=(torch.optim.AdamW(model.parameters()), None))
    with pytest.raises(TypeError, match="SuperOffloadAdamW"):
        trainer.create_optimizer()


def test_missing_trainer_hook_points_fail_with_a_clear_message():
    class OldTrainer:
        def create_optimizer(self):
            pass

    with pytest.raises(RuntimeError, match=r"_clip_grad_norm.*_get_grad_norm.*transformers 5\.17"):
        check_hook_points(OldTrainer)


def test_importing_the_core_does_not_import_transformers_or_accelerate():
    # nor torch: `superoffload --help` and a bad recipe answer without it (~1.5-5 s on 2 cores)
    probe = "import sys, superoffload_hf; print([m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules])"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]"]
    from superoffload_hf import SuperOffloadCallback as callback_cls, SuperOffloadPlugin as plugin_cls
    from superoffload_hf import Trainer as trainer_cls, TrainingArguments as args_cls

    assert (trainer_cls, args_cls, callback_cls) == (Trainer, TrainingArguments, SuperOffloadCallback)
    assert plugin_cls.__module__ == "superoffload_hf.integrations.accelerate"
    from superoffload_hf import SuperOffloadAdamW as adamw_cls, patch_trainer as patch_fn
    from superoffload_hf.integrations.patch import patch_trainer
    from superoffload_hf.optimizer import SuperOffloadAdamW

    assert (adamw_cls, patch_fn) == (SuperOffloadAdamW, patch_trainer)


# ---- a dropped Trainer frees its optimizer ---------------------------------------------------


def _innermost(optimizer):
    while hasattr(optimizer, "optimizer") and not is_superoffload(optimizer):
        optimizer = optimizer.optimizer
    return optimizer


@pytest.mark.parametrize("kind", ["stock", "superoffload", "autopatched"])
def test_a_dropped_trainer_frees_its_optimizer_without_the_cyclic_collector(tmp_path, kind):
    """As with stock AdamW, the last reference to a Trainer is the last one to its optimizer:
    with gc disabled, dropping the Trainer frees the optimizer's host arenas at once."""
    import gc
    import weakref

    import transformers

    from superoffload_hf.integrations.accelerate import SuperOffloadPlugin
    from superoffload_hf.integrations.trainer_hooks import SuperOffloadHooks

    args = make_args(tmp_path, kind, max_steps=2, superoffload=kind == "superoffload")
    if kind == "autopatched":
        trainer = transformers.Trainer(model=tiny_llama(num_layers=2), args=args, train_dataset=TinyDataset())
        SuperOffloadHooks(trainer, SuperOffloadPlugin(**SPECULATE)).bind_to_trainer()  # what autopatch does
        trainer.train()
    else:
        trainer = train(args)
    optimizer = _innermost(trainer.optimizer)
    assert is_superoffload(optimizer) == (kind != "stock")
    ledger = parts(optimizer).buckets.ledger if kind != "stock" else None
    freed = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    gc.disable()
    try:
        del trainer
        assert freed() is None
        if ledger is not None:
            assert ledger.bytes() == 0, dict(ledger.live)
    finally:
        gc.enable()
