"""SuperOffloadPlugin and `prepare` in a custom Accelerate loop (CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.integrations.accelerate import (
    SuperOffloadAcceleratedOptimizer,
    SuperOffloadLossScaler,
    SuperOffloadPlugin,
    check_accelerator_supported,
    check_model_on_device,
    decay_param_groups,
    prepare,
    resolve_device_dtype,
    wrap_optimizer,
)

from _models import tiny_batch, tiny_llama
from superoffload_hf.testing.engine_parts import parts

pytestmark = pytest.mark.timeout(300)

RTOL, ATOL = 1e-5, 1e-6
NO_DECAY = ("bias", "norm")
PLUGIN = SuperOffloadPlugin(host_kernel="reference")


def loader(size: int = 12, batch: int = 2) -> torch.utils.data.DataLoader:
    examples = [{k: v[0] for k, v in tiny_batch(batch=1, seed=i).items()} for i in range(size)]
    return torch.utils.data.DataLoader(examples, batch_size=batch)


def make_accelerator(accumulation: int = 1, mixed_precision: str = "no") -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate's shared state, as its tests do
    return Accelerator(cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=accumulation)


def superoffload_setup(accelerator: Accelerator, max_grad_norm=0.5):
    model = tiny_llama(num_layers=2).to(accelerator.device)
    optimizer = PLUGIN.create_optimizer(accelerator, model, lr=1e-3, weight_decay=0.1,
                                        max_grad_norm=max_grad_norm, no_decay=NO_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 20)
    return prepare(accelerator, model, optimizer, loader(), scheduler)


def stock_setup(accelerator: Accelerator):
    model = tiny_llama(num_layers=2).to(accelerator.device)
    groups = decay_param_groups(model, lambda name: any(s in name for s in NO_DECAY), 0.1)
    optimizer = torch.optim.AdamW(groups, lr=1e-3, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 20)
    return accelerator.prepare(model, optimizer, loader(), scheduler)


def run_loop(accelerator, model, optimizer, batches, scheduler, clip=None, poison_at=None):
    for index, batch in enumerate(batches):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss * float("nan") if index == poison_at else loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return model


# ---- the custom loop ------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulation", [1, 3])
def test_custom_accelerate_loop_matches_adamw_with_clip_grad_norm(accumulation):
    expected = run_loop(*_with(make_accelerator(accumulation), stock_setup), clip=0.5)
    actual = run_loop(*_with(make_accelerator(accumulation), superoffload_setup))
    for (name, e), (_, a) in zip(expected.named_parameters(), actual.named_parameters()):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=RTOL, atol=ATOL, msg=name)


def _with(accelerator, setup):
    return (accelerator, *setup(accelerator))


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_the_optimizer_steps_once_per_accumulation_step():
    accelerator = make_accelerator(accumulation=3)
    model, optimizer, batches, scheduler = superoffload_setup(accelerator)
    inner, calls = optimizer.optimizer, []
    step = inner.step
    inner.step = lambda *a, **k: calls.append(1) or step(*a, **k)
    run_loop(accelerator, model, optimizer, batches, scheduler)
    assert len(calls) == len(batches) // 3


def test_a_skipped_step_is_reported_and_does_not_advance_the_scheduler():
    accelerator = make_accelerator()
    model, optimizer, batches, scheduler = superoffload_setup(accelerator)
    run_loop(accelerator, model, optimizer, batches, scheduler, poison_at=len(batches) - 1)
    assert accelerator.optimizer_step_was_skipped
    assert scheduler.scheduler.last_epoch == len(batches) - 1


def test_prepare_never_round_trips_the_optimizer_state_through_the_device():
    accelerator = make_accelerator()
    model = tiny_llama(num_layers=1)
    optimizer = PLUGIN.create_optimizer(accelerator, model, lr=1e-3)
    loads = []
    optimizer.load_state_dict = loads.append
    prepared_model, prepared = prepare(accelerator, model, optimizer)
    assert loads == []
    assert isinstance(prepared, SuperOffloadAcceleratedOptimizer) and prepared.optimizer is optimizer
    accelerator.prepare(tiny_llama(num_layers=1), optimizer)  # what stock preparation would do
    assert len(loads) == 1


def fp16_setup(accelerator: Accelerator, **config):
    model = tiny_llama(num_layers=2)
    plugin = SuperOffloadPlugin(host_kernel="reference", device_dtype="fp16", **config)
    optimizer = plugin.create_optimizer(accelerator, model, lr=1e-3, max_grad_norm=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 20)
    return prepare(accelerator, model, optimizer, loader(size=2), scheduler)


def test_fp16_loss_is_scaled_once_by_the_optimizer_instead_of_a_grad_scaler():
    stock = make_accelerator()
    model, optimizer, batches, scheduler = stock_setup(stock)
    batch = next(iter(batches))
    stock.backward(model(**batch).loss)
    expected_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))

    accelerator = make_accelerator()
    model, optimizer, batches, scheduler = fp16_setup(accelerator)
    assert isinstance(accelerator.scaler, SuperOffloadLossScaler) and accelerator.scaler.state_dict() == {}
    assert next(model.parameters()).dtype == torch.float16
    run_loop(accelerator, model, optimizer, batches, scheduler)
    inner = optimizer.optimizer
    assert inner.loss_scale == 2.0**16 and not inner.last_step_skipped
    # Scaled by 2**16 for backward and unscaled once: the fp32 norm, up to fp16 rounding.
    assert inner.last_grad_norm == pytest.approx(expected_norm, rel=2e-2)


def test_fp16_overflow_skips_the_step_backs_off_the_scale_and_holds_the_scheduler():
    accelerator = make_accelerator()
    model, optimizer, batches, scheduler = fp16_setup(accelerator, loss_scale_init=2.0**40)
    run_loop(accelerator, model, optimizer, batches, scheduler)
    inner = optimizer.optimizer
    assert inner.last_step_skipped and accelerator.optimizer_step_was_skipped
    assert inner.loss_scale == 2.0**39
    assert scheduler.scheduler.last_epoch == 0 and inner.counters.skips == 1


# ---- the plugin ------------------------------------------------------------------------------------


def test_plugin_fields_are_the_config_fields():
    assert [f for f in PLUGIN.__dataclass_fields__] == list(SuperOffloadConfig.field_names())
    assert SuperOffloadPlugin().to_config("bf16") == SuperOffloadConfig(device_dtype="bf16")


def test_plugin_unknown_key_fails_listing_the_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"bucket_size.*valid keys are"):
        SuperOffloadPlugin.from_dict({"bucket_size": 4})
    path = tmp_path / "so.yaml"
    path.write_text(yaml.safe_dump({"speculation": "sometimes"}))
    with pytest.raises(ConfigError, match="speculation"):
        SuperOffloadPlugin.from_value(str(path))


@pytest.mark.parametrize(
    "requested, mixed_precision, expected",
    [(None, "no", "fp32"), (None, "bf16", "bf16"), (None, "fp16", "fp16"), (None, None, "fp32"),
     ("bf16", "no", "bf16"), ("fp32", "bf16", "fp32"), ("fp16", "fp16", "fp16")],
)
def test_device_dtype_follows_mixed_precision_unless_requested(requested, mixed_precision, expected):
    assert resolve_device_dtype(requested, mixed_precision) == expected


@pytest.mark.parametrize("requested, mixed_precision", [("fp16", "bf16"), ("bf16", "fp16"), (None, "fp8")])
def test_incompatible_precisions_fail(requested, mixed_precision):
    with pytest.raises(ConfigError, match=str(mixed_precision)):
        resolve_device_dtype(requested, mixed_precision)


@pytest.mark.parametrize("kind", [DistributedType.DEEPSPEED, DistributedType.FSDP])
def test_deepspeed_and_fsdp_accelerators_are_refused(kind):
    accelerator = SimpleNamespace(distributed_type=kind, mixed_precision="no", num_processes=1)
    with pytest.raises(ValueError, match="cannot be combined with (DeepSpeed|FSDP)"):
        check_accelerator_supported(accelerator)


@pytest.mark.parametrize("kind", [DistributedType.MULTI_GPU, DistributedType.MULTI_CPU])
def test_data_parallel_accelerators_are_accepted_and_never_wrap_the_model_in_ddp(kind):
    from superoffload_hf.integrations.accelerate import keep_model_unwrapped

    calls = []
    accelerator = SimpleNamespace(distributed_type=kind, mixed_precision="no", num_processes=2,
                                  device=torch.device("cpu", 0),  # (as Accelerate's with several CPU processes)
                                  prepare_model=lambda model, device_placement=None, evaluation_mode=False:
                                  calls.append((device_placement, evaluation_mode)) or model)
    check_accelerator_supported(accelerator)
    keep_model_unwrapped(accelerator)
    keep_model_unwrapped(accelerator)  # idempotent
    model = torch.nn.Linear(2, 2)
    # evaluation_mode: no DDP wrap; already on the device ("cpu" is "cpu:0"): not placed again, since
    # `.to("cpu:0")` copies each CPU parameter, and a weight-flow parameter released (storage size
    # 0) crashes the copy
    assert accelerator.prepare_model(model) is model and calls == [(False, True)]
    elsewhere = torch.nn.Linear(2, 2, device="meta")
    assert accelerator.prepare_model(elsewhere, device_placement=True) is elsewhere and calls[1] == (True, True)


def test_a_model_not_on_the_accelerator_device_is_refused():
    model = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match=r"`weight` is on meta, expected cpu"):
        check_model_on_device(model, torch.device("cpu"))


def test_prepare_refuses_an_optimizer_that_is_not_superoffload():
    model = tiny_llama(num_layers=1)
    with pytest.raises(TypeError, match="SuperOffloadAdamW"):
        prepare(make_accelerator(), model, torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("kind", ["stock", "superoffload"])
def test_a_dropped_accelerator_frees_its_prepared_optimizer_without_the_cyclic_collector(kind):
    """As with stock AdamW: dropping the accelerator and what `prepare` returned frees the
    optimizer (and its host arenas) at once, with gc disabled."""
    import gc
    import weakref

    accelerator = make_accelerator()
    model, optimizer, data, scheduler = (superoffload_setup if kind == "superoffload" else stock_setup)(accelerator)
    run_loop(accelerator, model, optimizer, list(data)[:2], scheduler)
    inner = optimizer.optimizer
    ledger = parts(inner).buckets.ledger if kind == "superoffload" else None
    freed = weakref.ref(inner)
    del inner
    gc.collect()
    gc.disable()
    try:
        del accelerator, model, optimizer, data, scheduler
        assert freed() is None
        if ledger is not None:
            assert ledger.bytes() == 0, dict(ledger.live)
    finally:
        gc.enable()
        AcceleratorState._reset_state(reset_partial_state=True)
