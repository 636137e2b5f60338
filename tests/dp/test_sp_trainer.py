"""Sequence parallelism through the Trainer: an unmodified stock-Trainer script under
`superoffload launch` with `sequence_parallel_size: 2` on 2 processes (CPU, gloo) trains to the
numbers of one process on the same global batch (losses, grad norms, final weights), with
gradient accumulation and clipping; its checkpoint resumes on one process; torchrun with our
Trainer and `--sequence_parallel_size 2`; SP=2 x DP=2 on 4 processes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from test_dp_trainer import BLOCK, OUR_SCRIPT, free_port, launch, losses, run

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# eps 1e-6 as the plain-loop tests (_sp_train.EPS: why); clipping on (1.0 clips here), 2 micro-batches a step
ARGS = ["--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true",
        "--learning_rate", "1e-3", "--adam_epsilon", "1e-6", "--max_grad_norm", "0.5",
        "--lr_scheduler_type", "constant", "--save_strategy", "steps", "--save_steps", "2"]


def assert_close_curve(ours: list[dict], one: list[dict]) -> None:
    assert [r["step"] for r in ours] == [r["step"] for r in one] == [1, 2, 3, 4]
    for a, b in zip(ours, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (ours, one)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (ours, one)
    assert one[0]["grad_norm"] > 0.5  # clipping is on


def assert_close_weights(ours_dir, one_dir) -> None:
    ours, one = load_file(ours_dir / "model.safetensors"), load_file(one_dir / "model.safetensors")
    assert sorted(ours) == sorted(one)
    for name in one:
        torch.testing.assert_close(ours[name], one[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp_trainer")
    sp_block = {**BLOCK, "sequence_parallel_size": 2}
    return {"sp": launch(tmp, 2, True, tmp / "sp", train_args=tuple(ARGS), block=sp_block), "sp_dir": tmp / "sp",
            "one": launch(tmp, 1, True, tmp / "one", train_args=tuple(ARGS)), "one_dir": tmp / "one", "tmp": tmp}


def test_stock_trainer_script_with_sequence_parallel_2_under_launch_equals_one_process(runs):
    assert_close_curve(runs["sp"], runs["one"])
    assert_close_weights(runs["sp_dir"] / "checkpoint-4", runs["one_dir"] / "checkpoint-4")
    print("\nloss per step, SP=2 on 2 processes vs 1 process:")
    for a, b in zip(runs["sp"], runs["one"]):
        print(f"  step {a['step']}: {a['loss']:.7f} vs {b['loss']:.7f}")


def test_a_sequence_parallel_checkpoint_resumes_on_one_process_with_its_numbers(runs):
    tmp = runs["tmp"]
    resumed = launch(tmp, 1, True, tmp / "resumed", "--resume_from_checkpoint", str(runs["sp_dir"] / "checkpoint-2"),
                     train_args=tuple(ARGS))
    one = runs["one"]
    assert [r["step"] for r in resumed if r["step"] > 2] == [3, 4]
    for a, b in zip([r for r in resumed if r["step"] > 2], one[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (resumed, one)
    assert_close_weights(tmp / "resumed" / "checkpoint-4", runs["one_dir"] / "checkpoint-4")


def test_torchrun_with_our_trainer_and_training_arguments_sequence_parallel_size(runs, tmp_path):
    import json
    import sys

    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(OUR_SCRIPT), "--superoffload_config", json.dumps(BLOCK), "--sequence_parallel_size", "2",
         "--output_dir", str(tmp_path / "out"), *ARGS], tmp_path)
    assert_close_curve(losses(tmp_path / "out"), runs["one"])
    assert_close_weights(tmp_path / "out" / "checkpoint-4", runs["one_dir"] / "checkpoint-4")


def test_sequence_parallel_2_by_data_parallel_2_on_4_processes_equals_one_process(runs, tmp_path):
    """The loader shards by SP group: with 1 sample per device the 2 groups take the 2 halves of the
    one-process batch of 2."""
    block = {**BLOCK, "sequence_parallel_size": 2}
    sp = launch(tmp_path, 4, True, tmp_path / "sp", "--per_device_train_batch_size", "1",
                train_args=tuple(ARGS), block=block)
    assert_close_curve(sp, runs["one"])
    assert_close_weights(tmp_path / "sp" / "checkpoint-4", runs["one_dir"] / "checkpoint-4")
