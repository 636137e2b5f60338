"""Resuming never loses state silently: which checkpoint `true` picks, and what is refused."""

from __future__ import annotations

import pytest

from superoffload_hf.integrations import launch_env
from superoffload_hf.integrations.resume import ResumeError, check_new_run_output, incomplete_reason, resolve_resume

from _checkpoints import write_checkpoint


def test_true_takes_the_newest_complete_checkpoint_and_reports_the_incomplete_ones(tmp_path):
    write_checkpoint(tmp_path / "checkpoint-10", 10)
    write_checkpoint(tmp_path / "checkpoint-20", 20, trainer_state=False, optimizer=b"", scheduler=False)  # killed in torch.save
    (tmp_path / "checkpoint-30").mkdir()  # killed before anything was written
    write_checkpoint(tmp_path / "checkpoint-9", 9)
    plan = resolve_resume(True, tmp_path)
    assert plan.checkpoint == tmp_path / "checkpoint-10" and not plan.weights_only
    assert [p.name for p, _ in plan.skipped] == ["checkpoint-30", "checkpoint-20"]
    lines = plan.describe()
    assert "skipped incomplete checkpoint" in lines[0] and "present: nothing" in lines[0]
    assert "present: ['model.safetensors', 'optimizer.pt']" in lines[1]
    assert lines[-1] == f"resuming from {tmp_path / 'checkpoint-10'}: everything"


def test_a_truncated_trainer_state_marks_the_checkpoint_incomplete(tmp_path):
    write_checkpoint(tmp_path / "checkpoint-1", trainer_state=b'{"global_st')
    assert "truncated or not JSON" in incomplete_reason(tmp_path / "checkpoint-1")


def test_an_explicit_incomplete_checkpoint_is_an_error_naming_what_is_missing(tmp_path):
    write_checkpoint(tmp_path / "checkpoint-3", 3)
    write_checkpoint(tmp_path / "checkpoint-6", 6, trainer_state=False)
    with pytest.raises(ResumeError, match=r"^Can't find a valid checkpoint at .*checkpoint-6: it has no trainer_state.json.*"
                                          r"earlier checkpoint \(e.g. .*checkpoint-3\)"):
        resolve_resume(str(tmp_path / "checkpoint-6"), tmp_path)


@pytest.mark.parametrize("missing", ["optimizer", "scheduler"])
def test_missing_optimizer_or_scheduler_state_is_refused_with_the_weights_only_option(tmp_path, missing):
    write_checkpoint(tmp_path / "checkpoint-30", 30, **{missing: False})
    with pytest.raises(ResumeError, match=rf"has no {missing}.pt.*silently start a fresh optimizer.*resume_weights_only"):
        resolve_resume(True, tmp_path)
    plan = resolve_resume(tmp_path / "checkpoint-30", tmp_path / "new_run", weights_only=True)
    assert plan.weights_only and plan.checkpoint == tmp_path / "checkpoint-30"
    assert "the model weights only" in plan.describe()[-1]


def test_a_weights_only_resume_into_a_directory_of_checkpoints_is_refused_naming_a_new_directory(tmp_path):
    """It starts at step 0: its checkpoint-N would overwrite theirs and save_total_limit rotate them away."""
    for step in (10, 20):
        write_checkpoint(tmp_path / "out" / f"checkpoint-{step}", step)
    (tmp_path / "out_2").mkdir()
    for resume in (True, tmp_path / "out" / "checkpoint-20"):
        with pytest.raises(ResumeError) as error:
            resolve_resume(resume, tmp_path / "out", weights_only=True)
        message = str(error.value)
        assert message.startswith("A weights-only resume starts again at step 0: its checkpoint-N saves would "
                                  f"overwrite, and `save_total_limit` would rotate away, the checkpoints already in "
                                  f"output_dir '{tmp_path / 'out'}' (checkpoint-20, checkpoint-10)"), message
        assert (f"`--training.resume_from_checkpoint {tmp_path / 'out' / 'checkpoint-20'} --training.resume_weights_only "
                f"true --training.output_dir {tmp_path / 'out_3'}`") in message, message


def test_a_run_from_step_0_into_a_directory_of_checkpoints_is_refused_with_the_choices(tmp_path):
    write_checkpoint(tmp_path / "checkpoint-10", 10)
    with pytest.raises(ResumeError, match=r"^This run starts at step 0: its checkpoint-N saves would overwrite.*"
                                          r"\(checkpoint-10\)\. Resume that run .* write into a new output_dir"):
        check_new_run_output(tmp_path)
    check_new_run_output(tmp_path / "elsewhere")  # nothing there: nothing to refuse


def test_under_superoffload_launch_the_weights_only_fix_is_the_block_field_and_the_scripts_own_flags(
        tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "out" / "checkpoint-2", 2)
    write_checkpoint(tmp_path / "out" / "checkpoint-4", 4, optimizer=b"")
    monkeypatch.setattr(launch_env, "_launch_command", "superoffload launch --config_file a.yaml run_clm.py")
    with pytest.raises(ResumeError) as error:
        resolve_resume(True, tmp_path / "out")
    message = str(error.value)
    assert ("set `resume_weights_only: true` in the `superoffload:` block of the accelerate config and give the "
            f"script `--resume_from_checkpoint {tmp_path / 'out' / 'checkpoint-4'} --output_dir {tmp_path / 'out_2'}`"
            ) in message, message
    assert "--training." not in message and "\n" not in message
    with pytest.raises(ResumeError) as error:  # a stock script would pass `--resume_from_checkpoint true` as a path
        resolve_resume(str(tmp_path / "out" / "checkpoint-6"), tmp_path / "out")
    assert "resume_from_checkpoint: true" not in str(error.value), error.value
    assert str(error.value).endswith(f"Resume from an earlier checkpoint (e.g. {tmp_path / 'out' / 'checkpoint-4'}).")


@pytest.mark.parametrize("content, problem", [(b"", "the file is empty"), (None, "not a complete torch.save archive")])
def test_empty_or_truncated_optimizer_state_names_the_file_and_the_previous_checkpoint(tmp_path, content, problem):
    write_checkpoint(tmp_path / "checkpoint-2", 2)
    write_checkpoint(tmp_path / "checkpoint-4", 4)
    optimizer = tmp_path / "checkpoint-4" / "optimizer.pt"
    optimizer.write_bytes(content if content is not None else optimizer.read_bytes()[:-40])
    with pytest.raises(ResumeError, match=rf"{optimizer} is corrupt \(.*{problem}.*previous checkpoint \(e.g. .*checkpoint-2\)"):
        resolve_resume(str(tmp_path / "checkpoint-4"), tmp_path)


def test_resume_true_without_a_checkpoint_keeps_the_trainers_words(tmp_path):
    with pytest.raises(ResumeError, match=rf"^No valid checkpoint found in output directory \({tmp_path}\): "):
        resolve_resume(True, tmp_path)


def test_no_resume_asked_loads_nothing(tmp_path):
    assert resolve_resume(None, tmp_path).checkpoint is None
    assert resolve_resume(False, tmp_path).checkpoint is None


def test_resuming_from_the_output_directory_itself_says_so_and_names_a_checkpoint(tmp_path):
    write_checkpoint(tmp_path / "checkpoint-10", 10)
    write_checkpoint(tmp_path / "checkpoint-20", 20)
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(tmp_path), tmp_path)
    message = str(error.value)
    assert message.startswith(f"Can't find a valid checkpoint at {tmp_path}: it is an output directory"), message
    assert "it is an output directory (it holds checkpoint-20, checkpoint-10), not a checkpoint" in message, message
    assert f"e.g. {tmp_path / 'checkpoint-20'}" in message and "interrupted" not in message


def test_the_weights_only_fix_keeps_an_output_dir_that_holds_no_checkpoints(tmp_path):
    write_checkpoint(tmp_path / "old" / "checkpoint-4", 4, optimizer=False)
    with pytest.raises(ResumeError) as error:
        resolve_resume(tmp_path / "old" / "checkpoint-4", tmp_path / "new run")
    message = str(error.value)
    assert (f"`--training.resume_from_checkpoint {tmp_path / 'old' / 'checkpoint-4'} --training.resume_weights_only "
            f"true --training.output_dir '{tmp_path / 'new run'}'` (superoffload train), or "
            f"`TrainingArguments(output_dir='{tmp_path / 'new run'}', resume_weights_only=True)`") in message, message
