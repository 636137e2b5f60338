"""Misuse raises clear errors: bad configs, clip_grad_norm_ on offloaded gradients, parameters
on two devices, empty parameter lists, and an exception in the host worker (which must surface
in the training loop instead of hanging it)."""

from __future__ import annotations

import threading

import pytest
import torch

from superoffload_hf import ConfigError, SuperOffloadAdam, SuperOffloadAdamW
from superoffload_hf.host.kernel import get_host_adam

from _models import engine_config, micro_batches, one_torch_thread, tiny_llama  # noqa: F401

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "device_mode"), pytest.mark.timeout(60)]


def small_model():
    return tiny_llama(2)


@pytest.mark.parametrize("optimizer_class", [SuperOffloadAdamW, SuperOffloadAdam])
def test_unknown_config_key_raises_naming_it_and_the_valid_keys(optimizer_class):
    with pytest.raises(ConfigError) as info:
        optimizer_class(small_model().parameters(), config={"bucket_sise_mb": 1})
    assert "bucket_sise_mb" in str(info.value) and "bucket_size_mb" in str(info.value)


@pytest.mark.parametrize("field, value", [("bucket_size_mb", -1), ("bucket_size_mb", 0),
                                          ("device_buckets", -1), ("host_threads", 0),
                                          ("gradient_accumulation_steps", 0)])
def test_negative_or_zero_sizes_raise_naming_the_field_and_value(field, value):
    with pytest.raises(ConfigError, match=f"`{field}` is {value}"):
        SuperOffloadAdamW(small_model().parameters(), config={field: value})


def test_bad_speculation_choice_raises_naming_field_value_and_choices():
    with pytest.raises(ConfigError) as info:
        SuperOffloadAdamW(small_model().parameters(), config={"speculation": "maybe"})
    message = str(info.value)
    assert "`speculation`" in message and "'maybe'" in message
    assert all(repr(choice) in message for choice in ("auto", "on", "off")), message


def test_missing_config_file_raises_naming_the_path(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml"):
        SuperOffloadAdamW(small_model().parameters(), config=str(tmp_path / "missing.yaml"))


def test_config_from_a_yaml_path_is_used(tmp_path):
    path = tmp_path / "so.yaml"
    path.write_text('device_dtype: fp32\nbucket_size_mb: 0.02\ndevice_buckets: 0\nspeculation: "off"\n')
    opt = SuperOffloadAdamW(small_model().parameters(), config=path)
    try:
        assert (opt.config.device_dtype, opt.config.bucket_size_mb, opt.config.speculation) == ("fp32", 0.02, "off")
        assert opt.plan.num_device_buckets == 0
        model_loss_step(opt)  # no backward: nothing to step
        assert opt.counters.steps == 0 and opt.counters.speculative_steps == 0
    finally:
        opt.close()


def test_a_step_without_any_gradient_counts_nothing_and_keeps_the_fp16_loss_scale():
    model = small_model()
    opt = SuperOffloadAdamW(model.parameters(), config=engine_config(device_dtype="fp16",
                                                                     loss_scale_growth_interval=1))
    try:
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        for _ in range(3):
            opt.step()
        assert opt.counters.steps == 0 and opt.counters.skips == 0
        assert opt.loss_scale == 2.0**16 and not opt.last_step_skipped
        assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
        opt.scale_loss(model(**micro_batches(0)[0]).loss).backward()
        opt.step()
        assert opt.counters.steps == 1 and opt.loss_scale == 2.0**17  # a real step still grows it
    finally:
        opt.close()


def test_a_ddp_wrapped_model_is_refused_with_what_to_do(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = small_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        with pytest.raises(RuntimeError, match="remove the DDP wrapper"):
            SuperOffloadAdamW(ddp.parameters(), config=engine_config())
    finally:
        dist.destroy_process_group()


def model_loss_step(opt, model=None):
    if model is not None:
        model(**micro_batches(0)[0]).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("kwargs", [{"lr": -1e-3}, {"betas": (1.0, 0.999)}, {"betas": (0.9, -0.1)},
                                    {"eps": -1e-8}, {"weight_decay": -0.1}, {"max_grad_norm": -1.0}])
def test_bad_hyperparameters_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SuperOffloadAdamW(small_model().parameters(), config=engine_config(), **kwargs)


@pytest.mark.parametrize("device_buckets, weights", [(0, "stationary"), (1, "stationary"), (0, "flow")])
def test_clip_grad_norm_on_offloaded_gradients_raises_pointing_to_max_grad_norm(device_buckets, weights):
    model = small_model()
    opt = SuperOffloadAdamW(model.parameters(), model=model,
                            config=engine_config(device_buckets=device_buckets, weights=weights))
    try:
        model(**micro_batches(0)[0]).loss.backward()
        with pytest.raises(RuntimeError, match="max_grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    finally:
        opt.close()


def test_parameters_on_two_devices_raise_naming_both_devices():
    model = small_model()
    params = list(model.parameters())
    stray = torch.nn.Parameter(torch.zeros(4, 4, device="meta"))
    with pytest.raises((ValueError, RuntimeError)) as info:
        SuperOffloadAdamW(params + [stray], config=engine_config())
    message = str(info.value)
    assert "meta" in message and "cpu" in message, message


def test_parameters_on_two_devices_across_groups_raise():
    model = small_model()
    stray = torch.nn.Parameter(torch.zeros(4, 4, device="meta"))
    with pytest.raises((ValueError, RuntimeError), match="meta"):
        SuperOffloadAdamW([{"params": list(model.parameters())}, {"params": [stray], "lr": 1e-4}],
                          config=engine_config())


def test_empty_parameter_list_raises():
    with pytest.raises(ValueError):
        SuperOffloadAdamW([], config=engine_config())


def test_a_parameter_in_two_groups_raises():
    params = list(small_model().parameters())
    with pytest.raises(ValueError):
        SuperOffloadAdamW([{"params": params}, {"params": params[:1]}], config=engine_config())


def _raise_injected(*args, **kwargs):
    raise RuntimeError("injected host Adam failure")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weights", ["stationary", "flow"])
@pytest.mark.parametrize("speculation", ["on", "off"])
def test_an_exception_in_the_host_step_surfaces_in_the_training_loop(monkeypatch, speculation, weights):
    backend_class = type(get_host_adam(mode="reference"))
    monkeypatch.setattr(backend_class, "adam_step_", _raise_injected)
    model = small_model()
    opt = SuperOffloadAdamW(model.parameters(), model=model,
                            config=engine_config(speculation=speculation, host_kernel="reference",
                                                 device_buckets=0, weights=weights))
    try:
        with pytest.raises(Exception, match="injected host Adam failure"):
            for step in range(3):  # it may surface in backward (speculative) or in step()
                model(**micro_batches(step)[0]).loss.backward()
                opt.step()
                opt.zero_grad()
    finally:
        monkeypatch.undo()
        close_within(opt, seconds=20)
    if weights == "flow":  # the units away from the device come back from the host copies, not empty
        for name, p in model.named_parameters():
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name
            assert torch.isfinite(p).all(), name


def close_within(opt, seconds: float) -> None:
    """close() must neither hang nor raise again after the worker failure was reported (it
    also runs at garbage collection and in `finally:` blocks, where it would mask the error)."""
    errors: list[BaseException] = []

    def close() -> None:
        try:
            opt.close()
        except BaseException as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(seconds)
    assert not closer.is_alive(), "opt.close() hung after a host worker exception"
    assert not errors, f"opt.close() raised after the failure had been reported: {errors[0]!r}"


@pytest.mark.parametrize("weights", ["stationary", "flow"])
def test_close_is_idempotent_and_stops_the_worker(weights):
    model = small_model()
    opt = SuperOffloadAdamW(model.parameters(), model=model,
                            config=engine_config(speculation="on", device_buckets=0, weights=weights))
    model(**micro_batches(0)[0]).loss.backward()
    opt.step()
    before = threading.active_count()
    opt.close()
    opt.close()
    assert threading.active_count() <= before


def test_garbage_collected_optimizers_do_not_leak_threads():
    import gc

    start = threading.active_count()
    for _ in range(5):
        model = small_model()
        opt = SuperOffloadAdamW(model.parameters(), config=engine_config(speculation="on"))
        model(**micro_batches(0)[0]).loss.backward()
        opt.step()
        del opt, model
        gc.collect()
    assert threading.active_count() <= start + 1, "worker threads outlive their optimizers"
