"""Ctrl-C: `superoffload train` (and `superoffload launch`) print where the run stopped, its last
complete checkpoint and the exact command that resumes it, without a traceback, and exit 130."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from superoffload_hf.engine.step.worker import InlineWorker, Pending
from superoffload_hf.integrations.resume import incomplete_reason, last_complete_checkpoint

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_llama_cpu.yaml")
SMALL = ["--model.config.num_hidden_layers", "1", "--data.seq_len", "32", "--training.per_device_train_batch_size", "2",
         "--training.logging_steps", "1", "--training.warmup_steps", "0", "--training.max_steps", "100000",
         "--training.save_steps", "2"]


def offline_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def default_ctrl_c() -> None:
    """In the child before it starts: SIGINT's default action, which Python turns into
    KeyboardInterrupt. A shell starts background jobs with SIGINT ignored and children inherit
    that: a suite started that way would otherwise hang here (the child ignores the Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition, proc: subprocess.Popen, seconds: float = 300, describe=None) -> None:
    """Poll `condition` while `proc` runs; `describe()`: the child's output so far (default: its pipe)."""
    deadline = time.monotonic() + seconds
    while not condition():
        output = describe if describe is not None else lambda: proc.communicate()[1][-3000:]
        assert proc.poll() is None, f"exited {proc.returncode} early: {output()}"
        assert time.monotonic() < deadline, f"timed out: {describe() if describe is not None else ''}"
        time.sleep(0.2)


def test_ctrl_c_after_a_checkpoint_prints_the_step_the_checkpoint_and_the_resume_command_and_exits_130(tmp_path):
    out = tmp_path / "out"
    args = ["train", TINY, *SMALL, "--training.output_dir", str(out)]
    # The child's output goes to files: it logs every step (~500 KB a minute), and an undrained pipe
    # would stop it in a write. Any complete checkpoint will do: the recipe keeps the newest 2, so
    # checkpoint-2 is rotated away at step 6, a fraction of a second later on a quiet machine (a
    # wait for it alone could miss it and time out).
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "superoffload_hf.cli", *args], cwd=REPO, env=offline_env(),
                                stdout=stdout, stderr=stderr, text=True, preexec_fn=default_ctrl_c)
        try:
            wait_for(lambda: last_complete_checkpoint(out)[0] is not None, proc,
                     describe=lambda: (tmp_path / "stderr").read_text()[-3000:])
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
        finally:
            proc.kill()
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-5000:]
    report = err[err.index("superoffload train: interrupted at step "):].splitlines()
    step = int(report[0].split("at step ")[1].split()[0])
    assert step >= 2, report
    checkpoint = Path(report[1].split("last complete checkpoint")[1].strip())
    assert checkpoint.parent == out and incomplete_reason(checkpoint) is None, report
    assert int(checkpoint.name.split("-")[1]) <= step
    resume = report[2].split("resume with")[1].strip()
    assert shlex.split(resume) == ["superoffload", "train", TINY, *SMALL, "--training.output_dir", str(out),
                                   "--training.resume_from_checkpoint", "true"], resume


def test_the_resume_command_replaces_a_resume_or_an_overwrite_of_the_interrupted_run():
    from superoffload_hf.cli import resume_arguments

    assert resume_arguments(["r.yaml", "--overwrite_output_dir", "--training.resume_from_checkpoint", "out/c-2",
                             "--training.max_steps=9"]) == [
        "r.yaml", "--training.max_steps=9", "--training.resume_from_checkpoint", "true"]
    assert resume_arguments(["r.yaml", "--training.resume_from_checkpoint=true"]) == [
        "r.yaml", "--training.resume_from_checkpoint", "true"]


def test_ctrl_c_in_superoffload_launch_reports_the_checkpoint_and_the_resume_command_and_exits_130(tmp_path):
    out = tmp_path / "out"
    argv = ["launch", "--config_file", str(REPO / "recipes" / "accelerate" / "superoffload_cpu.yaml"),
            "--num_processes", "1", str(REPO / "examples" / "stock_trainer.py"),
            "--output_dir", str(out), "--max_steps", "100000", "--save_steps", "2", "--per_device_train_batch_size", "2",
            "--report_to", "none", "--use_cpu", "--disable_tqdm", "true"]
    # Its own process group, interrupted as a whole: what Ctrl-C in a terminal does.
    proc = subprocess.Popen([sys.executable, "-m", "superoffload_hf.cli", *argv], cwd=tmp_path, env=offline_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=default_ctrl_c)
    try:
        wait_for(lambda: incomplete_reason(out / "checkpoint-2") is None, proc)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-5000:]
    report = next(line for line in err.splitlines() if "superoffload: interrupted at step " in line)
    checkpoint = Path(report.split("last complete checkpoint ")[1].split(";")[0])
    assert checkpoint.parent == out and incomplete_reason(checkpoint) is None, report
    resume = shlex.split(report.split("resume with: ")[1])
    assert resume == ["superoffload", *argv, "--resume_from_checkpoint", str(checkpoint)], report
    assert err.rstrip().endswith("superoffload launch: interrupted (Ctrl-C); the training script's last lines above "
                                 "say where it stopped and what to resume from"), err[-2000:]


def test_ctrl_c_inside_an_inline_host_job_reaches_the_caller_as_a_keyboard_interrupt():
    # On the CPU the host jobs run inline on the training thread, where the SIGINT lands.
    worker, pending = InlineWorker(), Pending()

    def interrupted_job():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        worker.submit(interrupted_job, pending)
    assert pending.idle.is_set()
    with pytest.raises(RuntimeError, match="host worker failed: KeyboardInterrupt"):
        worker.submit(lambda: None, Pending())  # the optimizer is not used on after a half-run job


def test_a_ctrl_c_that_lands_in_a_finalizer_is_raised_at_the_end_of_the_step_instead_of_lost():
    """Python raises KeyboardInterrupt wherever the main thread is; inside a weakref.finalize
    callback (a step frees many buffers) it is printed and ignored, and the run went on training.
    The handler of `superoffload train` (integrations/ctrl_c.py) records it and the step-end
    callback raises it."""
    import gc
    import weakref

    from superoffload_hf.integrations.ctrl_c import CtrlC, in_finalizer

    class Buffer:
        pass

    def sigint_in_finalizer() -> None:
        signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the finalizer
        sum(range(10))  # a few bytecodes: where Python checks for the signal

    def free_a_buffer() -> None:
        buffer = Buffer()
        weakref.finalize(buffer, sigint_in_finalizer)
        del buffer  # the finalizer runs now, in this thread
        gc.collect()

    # the premise: with Python's own handler the interrupt raised in the finalizer is lost
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        free_a_buffer()  # no KeyboardInterrupt escapes (Python prints "Exception ignored")
    finally:
        signal.signal(signal.SIGINT, previous)
    ctrl_c = CtrlC()
    with ctrl_c.installed():
        free_a_buffer()
        assert ctrl_c.pending
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.raise_if_pending()
        ctrl_c.pending = False
        with pytest.raises(KeyboardInterrupt):  # anywhere else: at once, as Python's own
            signal.raise_signal(signal.SIGINT)
            sum(range(10))
    assert signal.getsignal(signal.SIGINT) is previous
    frames = []
    holder = Buffer()
    weakref.finalize(holder, lambda: frames.append(sys._getframe()))
    del holder
    assert in_finalizer(frames[0]) and not in_finalizer(sys._getframe())
