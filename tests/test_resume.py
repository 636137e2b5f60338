"""Resuming never loses state silently: which checkpoint `true` picks, and what is refused."""

from __future__ import annotations

import pytest

from superoffload_hf.integrations.resume import ResumeError, incomplete_reason, resolve_resume

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
    with pytest.raises(ResumeError, match=r"checkpoint-6': it has no trainer_state.json.*earlier checkpoint \(e.g. .*checkpoint-3\)"):
        resolve_resume(str(tmp_path / "checkpoint-6"), tmp_path)


@pytest.mark.parametrize("missing", ["optimizer", "scheduler"])
def test_missing_optimizer_or_scheduler_state_is_refused_with_the_weights_only_option(tmp_path, missing):
    write_checkpoint(tmp_path / "checkpoint-30", 30, **{missing: False})
    with pytest.raises(ResumeError, match=rf"has no {missing}.pt.*silently start a fresh optimizer.*resume_weights_only"):
        resolve_resume(True, tmp_path)
    plan = resolve_resume(True, tmp_path, weights_only=True)
    assert plan.weights_only and plan.checkpoint == tmp_path / "checkpoint-30"
    assert "the model weights only" in plan.describe()[-1]


@pytest.mark.parametrize("content, problem", [(b"", "the file is empty"), (None, "not a complete torch.save archive")])
def test_empty_or_truncated_optimizer_state_names_the_file_and_the_previous_checkpoint(tmp_path, content, problem):
    write_checkpoint(tmp_path / "checkpoint-2", 2)
    write_checkpoint(tmp_path / "checkpoint-4", 4)
    optimizer = tmp_path / "checkpoint-4" / "optimizer.pt"
    optimizer.write_bytes(content if content is not None else optimizer.read_bytes()[:-40])
    with pytest.raises(ResumeError, match=rf"{optimizer} is corrupt \(.*{problem}.*previous checkpoint \(e.g. .*checkpoint-2\)"):
        resolve_resume(str(tmp_path / "checkpoint-4"), tmp_path)


def test_no_resume_asked_loads_nothing(tmp_path):
    assert resolve_resume(None, tmp_path).checkpoint is None
    assert resolve_resume(False, tmp_path).checkpoint is None


def test_resuming_from_the_output_directory_itself_says_so_and_names_a_checkpoint(tmp_path):
    write_checkpoint(tmp_path / "checkpoint-10", 10)
    write_checkpoint(tmp_path / "checkpoint-20", 20)
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(tmp_path), tmp_path)
    message = str(error.value)
    assert "it is an output directory (it holds checkpoint-20, checkpoint-10), not a checkpoint" in message, message
    assert f"e.g. {tmp_path / 'checkpoint-20'}" in message and "interrupted" not in message
