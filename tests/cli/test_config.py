"""SuperOffloadConfig: loading (dict, YAML, JSON, coerce), validation messages, immutability."""

import dataclasses
import json
from pathlib import Path

import pytest

from superoffload_hf import ConfigError, SuperOffloadConfig
from superoffload_hf.config import (
    CAST_CHOICES,
    DEVICE_DTYPE_CHOICES,
    HOST_KERNEL_CHOICES,
    ROLLBACK_CHOICES,
    SPECULATION_CHOICES,
    STATE_PRECISION_CHOICES,
)


def test_defaults_are_valid_and_documented_values():
    config = SuperOffloadConfig()
    assert config.bucket_size_mb == "auto"
    assert config.device_buckets == "auto"
    assert config.speculation == "auto"
    assert config.rollback == "inverse"
    assert config.device_dtype == "bf16"
    assert config.gradient_accumulation_steps == 1
    assert config.loss_scale_init == 2.0**16


def test_from_dict_sets_the_given_fields_and_keeps_the_other_defaults():
    config = SuperOffloadConfig.from_dict({"bucket_size_mb": 4, "speculation": "off", "device_buckets": 0})
    assert (config.bucket_size_mb, config.speculation, config.device_buckets) == (4, "off", 0)
    assert config.rollback == SuperOffloadConfig().rollback


def test_from_dict_of_none_or_empty_gives_the_defaults():
    assert SuperOffloadConfig.from_dict(None) == SuperOffloadConfig()
    assert SuperOffloadConfig.from_dict({}) == SuperOffloadConfig()


def test_unknown_key_raises_and_lists_the_valid_keys():
    with pytest.raises(ConfigError) as info:
        SuperOffloadConfig.from_dict({"bucket_sise_mb": 4})
    message = str(info.value)
    assert "bucket_sise_mb" in message
    for name in SuperOffloadConfig.field_names():
        assert name in message, f"valid key {name!r} missing from: {message}"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("field, value", [
    ("bucket_size_mb", -1),
    ("bucket_size_mb", 0),
    ("bucket_size_mb", "big"),
    ("bucket_size_mb", True),
    ("device_buckets", -1),
    ("device_buckets", 1.5),
    ("host_threads", 0),
    ("host_threads", -2),
    ("gradient_accumulation_steps", 0),
    ("gradient_accumulation_steps", 2.0),
    ("speculation_window", 0),
    ("speculation_max_rollback_rate", 1.5),
    ("speculation_max_rollback_rate", -0.1),
    ("loss_scale_init", 0.0),
    ("loss_scale_growth_factor", 1.0),
    ("loss_scale_backoff_factor", 1.0),
    ("loss_scale_backoff_factor", 0.0),
    ("loss_scale_growth_interval", 0),
    ("pin_memory", "yes"),
])
def test_bad_value_raises_naming_the_field_and_the_value(field, value):
    with pytest.raises(ConfigError) as info:
        SuperOffloadConfig.from_dict({field: value})
    message = str(info.value)
    assert f"`{field}`" in message, message
    assert repr(value) in message, message


@pytest.mark.parametrize("field, choices", [
    ("speculation", SPECULATION_CHOICES),
    ("rollback", ROLLBACK_CHOICES),
    ("cast", CAST_CHOICES),
    ("device_dtype", DEVICE_DTYPE_CHOICES),
    ("host_kernel", HOST_KERNEL_CHOICES),
    ("state_precision", STATE_PRECISION_CHOICES),
])
def test_bad_choice_raises_naming_field_value_and_every_choice(field, choices):
    with pytest.raises(ConfigError) as info:
        SuperOffloadConfig(**{field: "sometimes"})
    message = str(info.value)
    assert f"`{field}`" in message and "'sometimes'" in message, message
    for choice in choices:
        assert repr(choice) in message, f"choice {choice!r} missing from: {message}"


def test_choice_lists_match_the_issue():
    assert set(SPECULATION_CHOICES) == {"auto", "on", "off"}
    assert set(ROLLBACK_CHOICES) == {"inverse", "snapshot"}
    assert set(DEVICE_DTYPE_CHOICES) == {"bf16", "fp16", "fp32"}


@pytest.mark.parametrize("field, value", [
    ("bucket_size_mb", 0.5),
    ("bucket_size_mb", 64),
    ("device_buckets", 0),
    ("host_threads", 1),
    ("pin_memory", False),
    ("pin_memory", True),
    ("speculation_max_rollback_rate", 0.0),
    ("speculation_max_rollback_rate", 1.0),
])
def test_edge_values_that_are_valid_are_accepted(field, value):
    assert getattr(SuperOffloadConfig(**{field: value}), field) == value


def test_config_is_frozen():
    config = SuperOffloadConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bucket_size_mb = 1  # type: ignore[misc]


def test_replace_returns_a_validated_copy():
    config = SuperOffloadConfig()
    changed = config.replace(speculation="off")
    assert changed.speculation == "off" and config.speculation == "auto"
    with pytest.raises(ConfigError):
        config.replace(speculation="never")


def test_to_dict_round_trips():
    config = SuperOffloadConfig(bucket_size_mb=2, rollback="snapshot", device_dtype="fp16")
    assert SuperOffloadConfig.from_dict(config.to_dict()) == config
    assert sorted(config.to_dict()) == sorted(SuperOffloadConfig.field_names())


def test_from_file_reads_yaml(tmp_path: Path):
    path = tmp_path / "superoffload.yaml"
    path.write_text("bucket_size_mb: 8\nspeculation: \"on\"\nrollback: snapshot\ndevice_buckets: 2\n")
    config = SuperOffloadConfig.from_file(path)
    assert (config.bucket_size_mb, config.speculation, config.rollback, config.device_buckets) == (
        8, "on", "snapshot", 2)


def test_from_file_reads_yml_suffix_and_an_empty_file(tmp_path: Path):
    path = tmp_path / "empty.yml"
    path.write_text("")
    assert SuperOffloadConfig.from_file(path) == SuperOffloadConfig()


def test_from_file_reads_json(tmp_path: Path):
    path = tmp_path / "superoffload.json"
    path.write_text(json.dumps({"device_dtype": "fp32", "host_threads": 3, "pin_memory": False}))
    config = SuperOffloadConfig.from_file(str(path))
    assert (config.device_dtype, config.host_threads, config.pin_memory) == ("fp32", 3, False)


def test_from_file_with_unknown_key_raises_listing_the_valid_keys(tmp_path: Path):
    path = tmp_path / "typo.yaml"
    path.write_text("speculaton: on\n")
    with pytest.raises(ConfigError, match="speculaton") as info:
        SuperOffloadConfig.from_file(path)
    assert "speculation" in str(info.value)


def test_from_file_with_a_bad_value_raises_naming_the_field(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"bucket_size_mb": -4}))
    with pytest.raises(ConfigError, match="`bucket_size_mb` is -4"):
        SuperOffloadConfig.from_file(path)


def test_yaml_bare_on_and_off_read_as_speculation_choices(tmp_path: Path):
    # Config files are read with YAML 1.2 scalars: a bare `on`/`off` is the string, and `1e1` a number
    # (PyYAML's YAML 1.1 would give True/False and the string "1e1").
    path = tmp_path / "bare.yaml"
    path.write_text("speculation: off\nbucket_size_mb: 1e1\n")
    config = SuperOffloadConfig.from_file(path)
    assert (config.speculation, config.bucket_size_mb) == ("off", 10.0)
    path.write_text("speculation: on\n")
    assert SuperOffloadConfig.from_file(path).speculation == "on"


def test_a_boolean_speculation_value_is_rejected_not_turned_into_a_mode():
    with pytest.raises(ConfigError, match="`speculation` is True"):
        SuperOffloadConfig.from_dict({"speculation": True})


def test_from_file_missing_path_raises_naming_the_path(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        SuperOffloadConfig.from_file(missing)


def test_from_file_with_an_unknown_suffix_raises(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text("bucket_size_mb = 1\n")
    with pytest.raises(ConfigError, match=r"\.toml"):
        SuperOffloadConfig.from_file(path)


def test_from_file_holding_a_list_raises(tmp_path: Path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        SuperOffloadConfig.from_file(path)


def test_coerce_accepts_none_dict_path_string_and_config(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("speculation: \"off\"\n")
    assert SuperOffloadConfig.coerce(None) == SuperOffloadConfig()
    assert SuperOffloadConfig.coerce({"speculation": "off"}).speculation == "off"
    assert SuperOffloadConfig.coerce(path).speculation == "off"
    assert SuperOffloadConfig.coerce(str(path)).speculation == "off"
    config = SuperOffloadConfig(rollback="snapshot")
    assert SuperOffloadConfig.coerce(config) is config


def test_coerce_rejects_other_types():
    with pytest.raises(ConfigError, match="int"):
        SuperOffloadConfig.coerce(3)  # type: ignore[arg-type]


def test_coerce_of_a_dict_with_an_unknown_key_raises():
    with pytest.raises(ConfigError, match="not_a_field"):
        SuperOffloadConfig.coerce({"not_a_field": 1})


def test_state_precision_defaults_to_fp32_and_takes_the_compact_choices():
    assert SuperOffloadConfig().state_precision == "fp32"
    assert set(STATE_PRECISION_CHOICES) == {"fp32", "compact", "compact32"}
    for precision in ("compact", "compact32"):
        assert SuperOffloadConfig(state_precision=precision).state_precision == precision


@pytest.mark.parametrize("device_dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("precision", ["compact", "compact32"])
def test_compact_state_without_bf16_device_dtype_raises_naming_both_and_the_fix(precision, device_dtype):
    with pytest.raises(ConfigError) as info:
        SuperOffloadConfig(state_precision=precision, device_dtype=device_dtype)
    message = str(info.value)
    for part in ("`state_precision`", repr(precision), "`device_dtype`", repr(device_dtype),
                 "device_dtype: bf16", "bf16 weight the device computes with"):
        assert part in message, message
