"""Recipe schema: loading, `base:` derivation, command-line overrides, and errors that say what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from superoffload_hf.train.recipe import (
    Recipe,
    RecipeError,
    apply_overrides,
    checkpointing_on,
    load_recipe,
    merge_recipes,
    parse_overrides,
    parse_yaml,
    read_recipe_yaml,
    recipe_from_dict,
)

from _checkpoints import write_checkpoint

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def minimal_recipe(**changes) -> dict:
    """A valid recipe dict (tiny random-init model, shipped tokenizer and corpus)."""
    raw = {
        "model": {"config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 64}},
        "tokenizer": {"shipped": True},
        "data": {"shipped_corpus": True, "seq_len": 32},
        "training": {"output_dir": "out/test", "max_steps": 2, "use_cpu": True},
        "superoffload": {"device_dtype": "fp32"},
    }
    return merge_recipes(raw, changes)


def write_recipe(tmp_path: Path, raw: dict, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


# ---- the shipped recipes ----------------------------------------------------------------------


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_loads_and_validates_without_downloading(path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = load_recipe(path)
    assert set(recipe.to_dict()) == {"model", "tokenizer", "data", "training", "superoffload"}
    assert recipe.training["output_dir"]


def test_a_dict_training_value_validates_after_hf_argument_parser_rewrote_the_field_types():
    """transformers' HfArgumentParser sets a dict-or-str field's Field.type to str in place (a
    user's script parses its arguments, then loads a recipe): the check reads the annotations."""
    import dataclasses

    from transformers import HfArgumentParser

    from superoffload_hf.integrations.trainer import TrainingArguments

    types = {f.name: f.type for f in dataclasses.fields(TrainingArguments)}
    try:
        HfArgumentParser(TrainingArguments)
        assert {f.name: f.type for f in dataclasses.fields(TrainingArguments)}["gradient_checkpointing_kwargs"] is str
        recipe = recipe_from_dict(minimal_recipe(training={"gradient_checkpointing_kwargs": {"use_reentrant": False}}))
        installed = "activation_checkpointing_kwargs" if "activation_checkpointing_kwargs" in types else "gradient_checkpointing_kwargs"
        assert recipe.training[installed] == {"use_reentrant": False}  # (the name transformers reads: checkpointing_keys)
    finally:
        for f in dataclasses.fields(TrainingArguments):
            f.type = types[f.name]


def test_recipes_folder_holds_the_tiny_and_the_one_gpu_recipes():
    names = {p.name for p in RECIPES}
    assert {"tiny_llama_cpu.yaml", "llama3.2-1b.yaml", "llama3.1-8b.yaml", "llama-13b.yaml"} <= names


def test_tiny_recipe_trains_on_the_cpu_in_fp32_from_the_shipped_corpus():
    recipe = load_recipe(REPO / "recipes" / "tiny_llama_cpu.yaml")
    assert recipe.training["use_cpu"] is True
    assert recipe.model_dtype == "float32"
    assert recipe.tokenizer.shipped and recipe.data.shipped_corpus


def test_gpu_recipes_create_the_model_in_bf16():
    for name in ("llama3.2-1b.yaml", "llama3.1-8b.yaml", "llama-13b.yaml"):
        assert load_recipe(REPO / "recipes" / name).model_dtype == "bfloat16", name


def test_13b_recipe_derives_from_the_8b_recipe_and_changes_only_a_few_fields():
    parent = load_recipe(REPO / "recipes" / "llama3.1-8b.yaml").to_dict()
    child = load_recipe(REPO / "recipes" / "llama-13b.yaml").to_dict()
    assert child["model"]["name_or_path"] == "meta-llama/Llama-2-13b-hf"
    assert child["data"]["seq_len"] == parent["data"]["seq_len"] == 4096
    assert child["superoffload"] == parent["superoffload"]
    changed = {k for k in parent["training"] if parent["training"][k] != child["training"].get(k)}
    assert changed == {"output_dir", "gradient_accumulation_steps", "learning_rate", "save_steps"}


# ---- YAML and overrides -----------------------------------------------------------------------


def test_yaml_reads_on_off_as_strings_and_exponents_as_floats():
    assert parse_yaml("a: off\nb: on\nc: yes\nd: 1e-3\ne: true\nf: 3") == {
        "a": "off", "b": "on", "c": "yes", "d": 1e-3, "e": True, "f": 3}


def test_yaml_1_2_loader_leaves_yaml_safe_load_as_it_was():
    assert yaml.safe_load("a: off\nb: 1e-3") == {"a": False, "b": "1e-3"}


def test_overrides_accept_space_and_equals_forms_and_bare_flags():
    tokens = ["--training.max_steps", "5", "--training.learning_rate=1e-3", "--training.bf16",
              "--superoffload.speculation", "off", "--training.warmup_steps", "-1"]
    assert parse_overrides(tokens) == [
        ("training.max_steps", 5), ("training.learning_rate", 1e-3), ("training.bf16", True),
        ("superoffload.speculation", "off"), ("training.warmup_steps", -1)]


@pytest.mark.parametrize("token", ["training.max_steps", "-x", "--", "--training..max_steps", "--=3"])
def test_override_that_is_not_a_dotted_key_says_how_overrides_look(token):
    with pytest.raises(RecipeError, match=r"--training.max_steps 5"):
        parse_overrides([token])


def test_apply_overrides_sets_nested_keys_without_touching_the_input():
    raw = {"training": {"max_steps": 10}}
    result = apply_overrides(raw, [("training.max_steps", 3), ("model.config.hidden_size", 64)])
    assert result == {"training": {"max_steps": 3}, "model": {"config": {"hidden_size": 64}}}
    assert raw == {"training": {"max_steps": 10}}


def test_override_below_a_scalar_says_to_set_the_whole_section():
    with pytest.raises(RecipeError, match=r"`superoffload` is False, not a mapping"):
        apply_overrides({"superoffload": False}, [("superoffload.speculation", "on")])


def test_command_line_overrides_replace_yaml_values(tmp_path):
    path = write_recipe(tmp_path, minimal_recipe())
    recipe = load_recipe(path, ["--training.max_steps", "7", "--data.seq_len=16", "--superoffload.speculation", "off"])
    assert recipe.training["max_steps"] == 7
    assert recipe.data.seq_len == 16
    assert recipe.superoffload == {"device_dtype": "fp32", "speculation": "off"}


# ---- base: derivation -------------------------------------------------------------------------


def test_derived_recipe_merges_mappings_replaces_values_and_null_removes(tmp_path):
    write_recipe(tmp_path, minimal_recipe(training={"logging_steps": 5}), "parent.yaml")
    child = {"base": "parent.yaml", "training": {"max_steps": 9, "logging_steps": None},
             "superoffload": False}
    recipe = load_recipe(write_recipe(tmp_path, child, "child.yaml"))
    assert recipe.training == {"output_dir": "out/test", "max_steps": 9, "use_cpu": True}
    assert recipe.superoffload is None
    assert recipe.model.config["hidden_size"] == 32


def test_recipe_that_derives_from_itself_names_the_cycle(tmp_path):
    write_recipe(tmp_path, {"base": "b.yaml"}, "a.yaml")
    write_recipe(tmp_path, {"base": "a.yaml"}, "b.yaml")
    with pytest.raises(RecipeError, match="derives from itself"):
        load_recipe(tmp_path / "a.yaml")


# ---- errors that say what to fix --------------------------------------------------------------


def test_missing_recipe_file_names_the_path():
    with pytest.raises(RecipeError, match=r"'nope.yaml' does not exist"):
        load_recipe("nope.yaml")


@pytest.mark.parametrize("section", ["model", "data", "training"])
def test_missing_section_names_it(section):
    raw = minimal_recipe()
    del raw[section]
    with pytest.raises(RecipeError, match=rf"Missing section `{section}:`"):
        recipe_from_dict(raw)


def test_missing_seq_len_says_what_to_set():
    raw = minimal_recipe()
    del raw["data"]["seq_len"]
    with pytest.raises(RecipeError, match=r"Missing key `data.seq_len`.*seq_len: 128"):
        recipe_from_dict(raw)


def test_missing_output_dir_says_what_it_is_for():
    raw = minimal_recipe()
    del raw["training"]["output_dir"]
    with pytest.raises(RecipeError, match=r"Missing key `training.output_dir`: where checkpoints are saved"):
        recipe_from_dict(raw)


def test_unknown_top_level_key_suggests_the_close_section():
    raw = minimal_recipe()
    raw["trainig"] = raw.pop("training")
    with pytest.raises(RecipeError, match=r"Unknown key `<top level>.trainig`. Did you mean \['training'\]"):
        recipe_from_dict(raw)


def test_unknown_training_key_lists_close_matches():
    with pytest.raises(RecipeError, match=r"Unknown key `training.learning_rat`. Did you mean \['learning_rate'"):
        recipe_from_dict(minimal_recipe(training={"learning_rat": 1e-3}))


def test_unknown_model_config_key_lists_close_matches():
    with pytest.raises(RecipeError, match=r"Unknown key `model.config.hiden_size`. Did you mean \['hidden_size'"):
        recipe_from_dict(minimal_recipe(model={"config": {"hiden_size": 64}}))


def test_unknown_superoffload_key_lists_the_valid_ones():
    with pytest.raises(RecipeError, match=r"`superoffload:` section: Unknown SuperOffloadConfig key\(s\) \['bucket_mb'\].*bucket_size_mb"):
        recipe_from_dict(minimal_recipe(superoffload={"bucket_mb": 8}))


def test_bad_superoffload_value_names_the_field_and_choices():
    with pytest.raises(RecipeError, match=r"`superoffload:` section: `speculation` is 'maybe'; valid choices are"):
        recipe_from_dict(minimal_recipe(superoffload={"speculation": "maybe"}))


@pytest.mark.parametrize("changes, message", [
    ({"training": {"max_steps": "five"}}, r"`training.max_steps` is 'five' \(str\); expected an integer"),
    ({"training": {"learning_rate": "fast"}}, r"`training.learning_rate` is 'fast' \(str\); expected a number"),
    ({"training": {"bf16": "yes"}}, r"`training.bf16` is 'yes' \(str\); expected true or false"),
    ({"data": {"seq_len": 12.5}}, r"`data.seq_len` is 12.5 \(float\); expected an integer"),
    ({"model": {"config": {"num_hidden_layers": "4"}}}, r"`model.config.num_hidden_layers` is '4' \(str\); expected an integer"),
    ({"tokenizer": {"shipped": "true"}}, r"`tokenizer.shipped` is 'true' \(str\); expected true or false"),
    ({"data": {"files": "a.txt", "shipped_corpus": False}}, r"`data.files` is 'a.txt' \(str\); expected a list or null"),
])
def test_wrong_type_names_the_key_the_value_and_the_expected_type(changes, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(minimal_recipe(**changes))


def test_numeric_string_for_a_float_field_becomes_a_float():
    recipe = recipe_from_dict(minimal_recipe(training={"learning_rate": "1e-3"}))
    assert recipe.training["learning_rate"] == 1e-3 and isinstance(recipe.training["learning_rate"], float)


def test_model_with_both_config_and_name_or_path_is_rejected():
    with pytest.raises(RecipeError, match=r"exactly one of `config`.*got both.*--model.config null"):
        recipe_from_dict(minimal_recipe(model={"name_or_path": "meta-llama/Llama-3.2-1B"}))


def test_command_line_can_switch_a_random_init_recipe_to_pretrained_weights(tmp_path):
    path = write_recipe(tmp_path, minimal_recipe())
    recipe = load_recipe(path, ["--model.name_or_path", "meta-llama/Llama-3.2-1B", "--model.config", "null"])
    assert recipe.model.config is None and recipe.model.name_or_path == "meta-llama/Llama-3.2-1B"


def test_model_with_neither_config_nor_name_or_path_is_rejected():
    raw = minimal_recipe()
    raw["model"] = {"dtype": "float32"}
    with pytest.raises(RecipeError, match=r"exactly one of `config`.*got neither"):
        recipe_from_dict(raw)


@pytest.mark.parametrize("location", ["./models/llama", "/no/such/model", "models/llama/1b", "~/nope/"])
def test_model_path_that_does_not_exist_says_it_looks_like_a_path(location):
    raw = minimal_recipe()
    raw["model"] = {"name_or_path": location}
    with pytest.raises(RecipeError, match=r"looks like a local path but does not exist.*hub id"):
        recipe_from_dict(raw)


def test_model_name_that_is_neither_path_nor_hub_id_is_rejected():
    raw = minimal_recipe()
    raw["model"] = {"name_or_path": "meta llama: 1B"}
    with pytest.raises(RecipeError, match=r"neither an existing directory nor a hub id"):
        recipe_from_dict(raw)


def test_model_path_that_is_a_file_asks_for_its_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    raw = minimal_recipe()
    raw["model"] = {"name_or_path": str(tmp_path / "config.json")}
    with pytest.raises(RecipeError, match=r"a file; expected a directory written by save_pretrained"):
        recipe_from_dict(raw)


def test_hub_id_and_existing_directory_are_accepted_without_download(tmp_path):
    for location in ("meta-llama/Llama-3.2-1B", "gpt2", str(tmp_path)):
        raw = minimal_recipe()
        raw["model"] = {"name_or_path": location}
        raw["tokenizer"] = {}
        recipe = recipe_from_dict(raw)
        assert recipe.tokenizer_name_or_path == location


def test_random_init_model_without_a_tokenizer_says_which_to_set():
    raw = minimal_recipe()
    del raw["tokenizer"]
    with pytest.raises(RecipeError, match=r"tokenizer: \{shipped: true\}"):
        recipe_from_dict(raw)


def test_data_needs_exactly_one_source():
    with pytest.raises(RecipeError, match=r"exactly one source.*got \['shipped_corpus', 'name'\]"):
        recipe_from_dict(minimal_recipe(data={"name": "HuggingFaceFW/fineweb-edu"}))


def test_data_file_that_does_not_exist_is_named(tmp_path):
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(RecipeError, match=r"missing.txt', which does not exist"):
        recipe_from_dict(minimal_recipe(data={"shipped_corpus": False, "files": [missing]}))


def test_data_file_with_an_unknown_suffix_lists_the_known_ones(tmp_path):
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(RecipeError, match=r"suffix '.csv'; expected one of \['.txt', '.md', '.json', '.jsonl'\]"):
        recipe_from_dict(minimal_recipe(data={"shipped_corpus": False, "files": [str(tmp_path / "a.csv")]}))


def test_seq_len_beyond_max_position_embeddings_says_which_to_change():
    with pytest.raises(RecipeError, match=r"`data.seq_len` is 128 but `model.config.max_position_embeddings` is 64"):
        recipe_from_dict(minimal_recipe(data={"seq_len": 128}))


def test_superoffload_keys_in_training_are_moved_to_their_section():
    with pytest.raises(RecipeError, match=r"`training.superoffload` is set by `superoffload train`"):
        recipe_from_dict(minimal_recipe(training={"superoffload": True}))


def test_resume_from_a_directory_that_does_not_exist_says_what_to_give(tmp_path):
    with pytest.raises(RecipeError, match=r"not a directory; give a checkpoint directory"):
        recipe_from_dict(minimal_recipe(training={"resume_from_checkpoint": str(tmp_path / "checkpoint-3")}))


def test_resume_true_without_a_complete_checkpoint_in_output_dir_says_to_run_first(tmp_path):
    with pytest.raises(RecipeError, match=r"holds no complete checkpoint \(no checkpoint-N directory at all\). Run without resuming"):
        recipe_from_dict(minimal_recipe(training={"output_dir": str(tmp_path), "resume_from_checkpoint": True}))
    (tmp_path / "checkpoint-4").mkdir()  # what a run killed while saving leaves
    with pytest.raises(RecipeError, match=r"checkpoint-4: it has no trainer_state.json"):
        recipe_from_dict(minimal_recipe(training={"output_dir": str(tmp_path), "resume_from_checkpoint": True}))
    write_checkpoint(tmp_path / "checkpoint-4")
    assert recipe_from_dict(minimal_recipe(training={"output_dir": str(tmp_path), "resume_from_checkpoint": True}))


def test_superoffload_false_selects_the_stock_optimizer_and_empty_mapping_the_defaults():
    assert recipe_from_dict(minimal_recipe(superoffload=False)).superoffload is None
    raw = minimal_recipe()
    raw["superoffload"] = {}
    assert recipe_from_dict(raw).superoffload == {}


@pytest.mark.parametrize("superoffload, training, dtype", [
    ({"device_dtype": "fp16"}, {"bf16": True}, "float16"),
    ({}, {"bf16": True}, "bfloat16"),
    ({}, {"fp16": True}, "float16"),
    ({}, {}, "float32"),
    (False, {"bf16": True}, "float32"),
])
def test_auto_model_dtype_follows_the_device_dtype(superoffload, training, dtype):
    raw = minimal_recipe(training=training)
    raw["superoffload"] = superoffload
    assert recipe_from_dict(raw).model_dtype == dtype


def test_resolved_recipe_round_trips_through_to_dict():
    recipe = recipe_from_dict(minimal_recipe())
    again = recipe_from_dict(recipe.to_dict())
    assert isinstance(again, Recipe) and again.to_dict() == recipe.to_dict()


def test_weights_travel_in_the_superoffload_section_and_a_bad_value_names_the_choices():
    recipe = recipe_from_dict(minimal_recipe(superoffload={"weights": "flow", "device_buckets": 0}))
    assert recipe.superoffload["weights"] == "flow"
    overridden = apply_overrides(minimal_recipe(), parse_overrides(["--superoffload.weights", "auto"]))
    assert recipe_from_dict(overridden).superoffload["weights"] == "auto"
    with pytest.raises(RecipeError, match=r"`weights` is 'streamed'.*'stationary', 'flow', 'auto'"):
        recipe_from_dict(minimal_recipe(superoffload={"weights": "streamed"}))


def test_state_precision_travels_in_the_superoffload_section_and_needs_bf16():
    recipe = recipe_from_dict(minimal_recipe(superoffload={"state_precision": "compact", "device_dtype": "bf16"}))
    assert recipe.superoffload["state_precision"] == "compact" and recipe.model_dtype == "bfloat16"
    overridden = apply_overrides(minimal_recipe(superoffload={"device_dtype": "bf16"}),
                                 parse_overrides(["--superoffload.state_precision", "compact32"]))
    assert recipe_from_dict(overridden).superoffload["state_precision"] == "compact32"
    with pytest.raises(RecipeError, match=r"In the `superoffload:` section: `state_precision` is 'compact' but "
                                          r"`device_dtype` is 'fp32'.*`device_dtype: bf16`"):
        recipe_from_dict(minimal_recipe(superoffload={"state_precision": "compact", "device_dtype": "fp32"}))


# ---- gradient (activation) checkpointing: one recipe key for transformers 5.17 to 5.25 ---------------


def checkpointing_arguments(training: dict, tmp_path) -> "transformers.TrainingArguments":
    """TrainingArguments from a validated `training:` section's checkpointing keys, with any
    deprecation warning an error."""
    import warnings

    import transformers

    keys = {k: v for k, v in training.items() if "checkpointing" in k}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **keys)


@pytest.mark.parametrize("name", ["llama3.2-1b", "llama3.1-8b", "llama-13b"])
def test_the_shipped_recipes_turn_checkpointing_on_without_a_deprecation_warning(name, tmp_path):
    """transformers 5.24 renamed gradient_checkpointing* to activation_checkpointing* and warns on
    the old name; 5.17 knows only the old one. .ci/run runs this on both."""
    raw = read_recipe_yaml(REPO / "recipes" / f"{name}.yaml")["training"]
    assert raw["activation_checkpointing"] is True, raw  # the current name, in the file
    args = checkpointing_arguments(load_recipe(REPO / "recipes" / f"{name}.yaml").training, tmp_path)
    assert args.gradient_checkpointing is True  # 5.24+ mirrors the new name here
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}


@pytest.mark.parametrize("keys", [
    {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}},
    {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}},
])
def test_either_checkpointing_name_reaches_the_installed_transformers_without_a_warning(keys, tmp_path):
    recipe = recipe_from_dict(minimal_recipe(training=keys))
    assert checkpointing_on(recipe.training)
    args = checkpointing_arguments(recipe.training, tmp_path)
    assert args.gradient_checkpointing is True and args.gradient_checkpointing_kwargs == {"use_reentrant": False}


def test_both_checkpointing_names_at_once_are_refused():
    with pytest.raises(RecipeError, match="`training.activation_checkpointing` and `training.gradient_checkpointing` "
                                          "are one setting"):
        recipe_from_dict(minimal_recipe(training={"activation_checkpointing": True, "gradient_checkpointing": True}))
