"""`superoffload launch`: block stripping, argument forwarding, the autopatch, and a real launch
of an unmodified stock-Trainer script (one CPU process)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from accelerate.commands.config import load_config_from_file

from superoffload_hf import device
from superoffload_hf.engine.dp.checkpoint import shard_files
from superoffload_hf.integrations import autopatch, launch_env, launcher
from superoffload_hf.integrations.accelerate import SuperOffloadAcceleratedOptimizer
from superoffload_hf.integrations.callback import LOG_PREFIX

from _dist import free_port
from _models import tiny_batch, tiny_llama
from _readme import from_anywhere, shown_commands

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIG = REPO / "recipes" / "accelerate" / "superoffload_cpu.yaml"
GPU_CONFIG = REPO / "recipes" / "accelerate" / "superoffload.yaml"
STOCK_SCRIPT = REPO / "examples" / "stock_trainer.py"

pytestmark = pytest.mark.timeout(300)


def write_config(tmp_path: Path, block, **accelerate_overrides) -> Path:
    config = yaml.safe_load(CPU_CONFIG.read_text())
    config.pop("superoffload")
    config.update(accelerate_overrides)
    if block is not None:
        config["superoffload"] = block
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python that can import superoffload_hf from this checkout."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return env


# ---- stripping and forwarding ---------------------------------------------------------------------


@pytest.mark.parametrize("config_flag", [["--config_file", "{path}"], ["--config-file={path}"]])
def test_plan_strips_the_block_and_forwards_every_other_argument(tmp_path, config_flag):
    path = write_config(tmp_path, {"speculation": "off", "host_threads": 4})
    argv = [arg.format(path=path) for arg in config_flag] + [
        "--num_processes", "1", "--mixed_precision", "no", "train.py",
        "--config_file", "script_own.yaml", "--learning_rate", "1e-3",
    ]
    plan = launcher.plan_launch(argv)
    assert plan.superoffload == {"speculation": "off", "host_threads": 4}
    assert plan.accelerate_args == ["--num_processes", "1", "--mixed_precision", "no"]
    assert plan.script_args == ["train.py", "--config_file", "script_own.yaml", "--learning_rate", "1e-3"]
    arguments = launcher.accelerate_arguments(plan, str(tmp_path))
    assert arguments[0] == "--config_file"
    stripped = arguments[1]
    assert arguments[2:] == plan.accelerate_args + plan.script_args
    expected = yaml.safe_load(path.read_text())
    del expected["superoffload"]
    assert yaml.safe_load(Path(stripped).read_text()) == expected
    load_config_from_file(stripped)  # Accelerate accepts the stripped config...
    with pytest.raises(ValueError, match="unknown keys.*superoffload"):
        load_config_from_file(str(path))  # ...and rejects the original


def test_shipped_accelerate_configs_carry_valid_superoffload_blocks():
    for path in (CPU_CONFIG, GPU_CONFIG):
        plan = launcher.plan_launch(["--config_file", str(path), "train.py"])
        assert plan.superoffload and "superoffload" not in plan.accelerate_config


def test_launch_environment_makes_torchs_openmp_workers_wait_passively_unless_the_user_chose():
    assert launcher.launch_environment({}, {})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert launcher.launch_environment({"OMP_WAIT_POLICY": "ACTIVE"}, {})["OMP_WAIT_POLICY"] == "ACTIVE"
    on_cpu = launcher.launch_environment({}, {}, on_cpu=True)  # torch's regions are the work there
    assert "OMP_WAIT_POLICY" not in on_cpu and on_cpu["GOMP_SPINCOUNT"] == "2000"  # a short spin
    assert launcher.launch_environment({"GOMP_SPINCOUNT": "0"}, {}, on_cpu=True)["GOMP_SPINCOUNT"] == "0"


def test_launch_environment_carries_the_block_and_puts_the_site_dir_first():
    env = launcher.launch_environment({"PYTHONPATH": "/elsewhere", "HOME": "/h"}, {"speculation": "off"})
    assert json.loads(env[autopatch.CONFIG_ENV_VAR]) == {"speculation": "off"}
    assert env["PYTHONPATH"].split(os.pathsep) == [str(launcher.SITE_DIR), "/elsewhere"]
    assert (launcher.SITE_DIR / "sitecustomize.py").is_file()


def test_unknown_superoffload_key_fails_before_launching(tmp_path, capsys):
    path = write_config(tmp_path, {"speculaton": "off"})
    assert launcher.main(["--config_file", str(path), "train.py"]) == 2
    message = capsys.readouterr().err
    assert "speculaton" in message and "valid keys are" in message


@pytest.mark.parametrize(
    "overrides, flags, refused",
    [({"distributed_type": "DEEPSPEED"}, [], "DEEPSPEED"), ({"distributed_type": "FSDP"}, [], "FSDP"),
     ({}, ["--use_fsdp"], "FSDP"), ({"mixed_precision": "fp8"}, [], "fp8")],
)
def test_launcher_refuses_what_superoffload_cannot_combine_with(tmp_path, capsys, overrides, flags, refused):
    path = write_config(tmp_path, {}, **overrides)
    assert launcher.main(["--config_file", str(path), *flags, "train.py"]) == 2
    assert refused in capsys.readouterr().err


def test_the_block_carries_state_precision_and_compact_is_refused_without_bf16(tmp_path, capsys):
    path = write_config(tmp_path, {"state_precision": "compact"}, mixed_precision="bf16")
    assert launcher.plan_launch(["--config_file", str(path), "train.py"]).superoffload == {"state_precision": "compact"}
    path = write_config(tmp_path, {"state_precision": "compact"}, mixed_precision="no")
    assert launcher.main(["--config_file", str(path), "train.py"]) == 2
    err = capsys.readouterr().err
    assert "`state_precision` is 'compact' but `device_dtype` is 'fp32'" in err, err


def test_launcher_accepts_several_processes_and_machines(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "accelerator_count", lambda: 8)  # GPUs: accelerate starts the processes itself
    path = write_config(tmp_path, {"speculation": "on"})
    plan = launcher.plan_launch(["--config_file", str(path), "--num_processes", "4", "--num_machines", "2",
                                 "--machine_rank", "1", "train.py"])
    assert plan.accelerate_args == ["--num_processes", "4", "--num_machines", "2", "--machine_rank", "1"]


@pytest.mark.parametrize("flag", [["--sequence_parallel_size", "2"], ["--sequence_parallel_size=2"]])
def test_sequence_parallel_size_flag_goes_into_the_block_and_must_divide_the_processes(tmp_path, monkeypatch, capsys,
                                                                                       flag):
    monkeypatch.setattr(device, "accelerator_count", lambda: 8)
    path = write_config(tmp_path, {"speculation": "on"})
    plan = launcher.plan_launch(["--config_file", str(path), *flag, "--num_processes", "4", "train.py",
                                 "--sequence_parallel_size", "9"])
    assert plan.superoffload == {"speculation": "on", "sequence_parallel_size": 2}
    assert plan.accelerate_args == ["--num_processes", "4"]
    assert plan.script_args == ["train.py", "--sequence_parallel_size", "9"]  # the script's own argument
    assert launcher.main(["--config_file", str(path), *flag, "--num_processes", "3", "train.py"]) == 2
    assert "`sequence_parallel_size` is 2 but the world has 3 processes" in capsys.readouterr().err
    assert launcher.main(["--config_file", str(path), "--sequence_parallel_size", "two", "train.py"]) == 2
    assert "`--sequence_parallel_size` is 'two'; expected an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("processes", [["--num_processes", "2"], ["--num_processes=2"]])
def test_several_processes_without_gpus_are_started_with_the_multi_process_launcher(tmp_path, monkeypatch, processes,
                                                                                   capsys):
    monkeypatch.setattr(device, "accelerator_count", lambda: 0)
    plan = launcher.plan_launch(["--config_file", str(CPU_CONFIG), *processes, "train.py"])
    assert plan.accelerate_args == [*processes, "--multi_gpu"]
    assert "starting 2 CPU processes" in capsys.readouterr().err
    assert launcher.plan_launch(["--config_file", str(CPU_CONFIG), "train.py"]).accelerate_args == []


def test_several_processes_with_cpu_flag_are_refused_with_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(device, "accelerator_count", lambda: 0)
    assert launcher.main(["--cpu", "--num_processes", "2", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "`--cpu` starts one process, but `--num_processes` is 2. Drop `--cpu`" in err and "superoffload_cpu.yaml" in err


# ---- the autopatch --------------------------------------------------------------------------------


class StockDataset(torch.utils.data.Dataset):
    def __init__(self):
        self.examples = [{k: v[0] for k, v in tiny_batch(batch=1, seed=i).items()} for i in range(8)]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


def test_autopatch_gives_a_stock_trainer_superoffload(tmp_path, monkeypatch):
    class StockTrainer(transformers.Trainer):  # a stand-in, so the real class stays unpatched
        pass

    monkeypatch.setattr(launch_env, "_launch_block", {"host_kernel": "reference", "speculation": "on"})
    autopatch.patch_trainer_class(StockTrainer)
    autopatch.patch_trainer_class(StockTrainer)  # idempotent
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                          logging_steps=1, report_to="none", use_cpu=True, save_strategy="no")
    trainer = StockTrainer(model=tiny_llama(num_layers=1), args=args, train_dataset=StockDataset())
    trainer.train()
    assert isinstance(trainer.optimizer, SuperOffloadAcceleratedOptimizer)
    assert trainer.optimizer.optimizer.config.speculation == "on"
    assert all(LOG_PREFIX + "skips" in r for r in trainer.state.log_history if "loss" in r)


def test_without_the_environment_variable_nothing_is_armed():
    before = list(sys.meta_path)
    assert autopatch.install_from_environment({}) is False
    assert sys.meta_path == before


def test_sitecustomize_arms_the_hook_and_still_runs_the_sitecustomize_it_shadows(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = '1'\n")
    probe = ("import os, sys; from superoffload_hf.integrations import autopatch; "
             "print(os.environ.get('SHADOWED_SITECUSTOMIZE_RAN'), autopatch.launch_plugin().speculation, "
             "any(type(f).__name__ == '_AfterImport' for f in sys.meta_path), 'transformers' in sys.modules)")
    env = child_env(**{autopatch.CONFIG_ENV_VAR: json.dumps({"speculation": "off"})})
    env["PYTHONPATH"] = os.pathsep.join([str(launcher.SITE_DIR), str(tmp_path), env["PYTHONPATH"]])
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "off", "True", "False"]


# ---- end to end -----------------------------------------------------------------------------------


def test_the_readme_launch_example_trains_an_unmodified_stock_trainer_script_with_superoffload(
        tmp_path, monkeypatch, capfd):
    """The README's `superoffload launch` command, as written, from a scratch directory."""
    (argv,) = [c for c in shown_commands("superoffload") if c[:1] == ["launch"]]
    assert from_anywhere(argv)[1:4] == ["--config_file", str(CPU_CONFIG), str(STOCK_SCRIPT)], argv
    output = tmp_path / "out" / "launch_example"
    for name, value in child_env(OMP_NUM_THREADS="1").items():
        monkeypatch.setenv(name, value)  # accelerate launch passes OMP_NUM_THREADS on to the script
    monkeypatch.chdir(tmp_path)
    code = launcher.main(from_anywhere(argv)[1:])
    streams = capfd.readouterr()
    assert code == 0, streams.out[-3000:] + streams.err[-3000:]
    records = [r for r in json.loads((output / "trainer_state.json").read_text())["log_history"] if "loss" in r]
    assert len(records) == 3
    for record in records:
        assert record["grad_norm"] > 0 and LOG_PREFIX + "rollbacks" in record
    # the shipped block's speculation: auto arrived (it never speculates on the CPU device, where
    # nothing overlaps; test_a_corrupt_checkpoint_... launches with "on")
    assert "speculation auto" in streams.err and records[-1][LOG_PREFIX + "speculative_steps"] == 0
    # The host Adam's pool follows the block's host_threads: 2, not OMP_NUM_THREADS=1.
    assert "reference/none x2 threads" in streams.err


def test_launch_with_two_processes_on_a_machine_without_gpus_trains_two_data_parallel_ranks(tmp_path, monkeypatch,
                                                                                           capfd):
    if device.accelerator_count() > 0:
        pytest.skip("a machine with GPUs: accelerate starts the processes itself")
    output = tmp_path / "out"
    for name, value in child_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    environ, handlers = dict(os.environ), [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    code = launcher.main([
        "--config_file", str(CPU_CONFIG), "--num_processes", "2", "--main_process_port", str(free_port()),
        str(STOCK_SCRIPT), "--output_dir", str(output),
        "--max_steps", "2", "--save_steps", "2", "--per_device_train_batch_size", "2", "--report_to", "none",
        "--use_cpu", "--disable_tqdm", "true"])
    streams = capfd.readouterr()
    assert code == 0, streams.out[-3000:] + streams.err[-3000:]
    # accelerate ran in this process: its environment and signal handlers (torch's elastic agent
    # replaces SIGINT's and SIGTERM's) are the caller's again
    assert dict(os.environ) == environ
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert [Path(f).name for f in shard_files(str(output / "checkpoint-2"))] == [
        "optimizer.shard-00000-of-00002.pt", "optimizer.shard-00001-of-00002.pt"]
    assert "data parallel rank 1/2" in streams.err


def test_the_shipped_cpu_config_does_not_speculate_always():
    """With `speculation: on`, run_clm.py on the CPU rolled back 29 of its 30 steps (each clipped)."""
    assert launcher.plan_launch(["--config_file", str(CPU_CONFIG), "train.py"]).superoffload["speculation"] == "auto"


def files_under(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def train_stock_checkpoints(out: Path, monkeypatch) -> None:
    """checkpoint-2 and checkpoint-4 of the stock script's model, trained here by its own main()."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stock_trainer_script", STOCK_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", [str(STOCK_SCRIPT), "--output_dir", str(out), "--max_steps", "4", "--save_steps",
                                      "2", "--per_device_train_batch_size", "2", "--report_to", "none", "--use_cpu",
                                      "--disable_tqdm", "true"])
    script.main()


def test_a_corrupt_checkpoint_under_launch_ends_the_output_with_one_line_whose_fix_works_with_a_stock_script(
        tmp_path, monkeypatch, capfd):
    """The launcher route printed 120 lines ending in a traceback, and named `--resume_weights_only`,
    which a stock script's argument parser refuses. The fix it names now is a field of the
    `superoffload:` block plus the script's own flags; it trains from the weights, into a new directory."""
    out = tmp_path / "out"
    train_stock_checkpoints(out, monkeypatch)
    checkpoint, optimizer = out / "checkpoint-4", out / "checkpoint-4" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:-40])
    before = files_under(out)
    for name, value in child_env(OMP_NUM_THREADS="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    block = {"host_kernel": "reference", "host_threads": 2, "speculation": "on"}
    script = [str(STOCK_SCRIPT), "--max_steps", "3", "--save_steps", "3", "--per_device_train_batch_size", "2",
              "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true"]
    capfd.readouterr()

    code = launcher.main(["--config_file", str(write_config(tmp_path, block)), *script, "--output_dir", str(out),
                          "--resume_from_checkpoint", str(checkpoint)])
    streams = capfd.readouterr()
    assert code == 1, streams.err[-3000:]
    assert "Traceback" not in streams.out + streams.err, streams.err[-5000:]
    last = streams.err.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"superoffload launch: error: Cannot resume from '{checkpoint}': {optimizer} is corrupt"), last
    assert "--resume_weights_only" not in last and "`resume_weights_only: true` in the `superoffload:` block" in last
    fix = re.search(r"give the script `([^`]*)`", last).group(1).split()

    code = launcher.main(["--config_file", str(write_config(tmp_path, {**block, "resume_weights_only": True})),
                          *script, *fix])
    streams = capfd.readouterr()
    assert code == 0, streams.err[-3000:]
    assert f"resuming from {checkpoint}: the model weights only (fresh optimizer and schedule, step 0)" in streams.err
    new_dir = Path(fix[fix.index("--output_dir") + 1])
    records = [r for r in json.loads((new_dir / "trainer_state.json").read_text())["log_history"] if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1][LOG_PREFIX + "speculative_steps"] >= 1  # the block's speculation: "on" arrived
    assert files_under(out) == before


def test_a_ranks_one_line_error_ends_a_multi_process_launchs_output_after_torchruns_report(tmp_path, monkeypatch,
                                                                                           capfd):
    """With several processes, torchrun printed its failure report after the ranks' one-line errors:
    the output ended with the report. Each rank now records its line, and the launcher repeats it,
    once, after the report. (accelerate's launch is replaced here: the ranks' side is autopatch's
    hook, called as an uncaught ResumeError would call it.)"""
    import accelerate.commands.launch as accelerate_launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from superoffload_hf.integrations.resume import ResumeError

    message = "Cannot resume from 'out/checkpoint-4': out/checkpoint-4/optimizer.pt is corrupt; the fix"

    def ranks_fail(parsed):
        monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
        autopatch._install_interrupt_hook()
        for _ in range(2):  # both ranks hit the same checkpoint
            sys.excepthook(ResumeError, ResumeError(message), None)
        failure = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(tmp_path / "none.json"))
        raise ChildFailedError(str(STOCK_SCRIPT), {1: failure})

    monkeypatch.setattr(accelerate_launch, "launch_command", ranks_fail)
    monkeypatch.setattr(device, "accelerator_count", lambda: 0)
    code = launcher.main(["--config_file", str(CPU_CONFIG), "--num_processes", "2", str(STOCK_SCRIPT)])
    err = capfd.readouterr().err.rstrip("\n").splitlines()
    assert code == 1
    assert err[-1] == f"superoffload launch: error: {message}", err[-12:]
    assert f"{STOCK_SCRIPT} FAILED" in "\n".join(err[:-1])  # torchrun's report stays, before it
    assert err.count(err[-1]) == 3  # each rank's own line, and the launcher's once
    assert launch_env.LAUNCH_ERROR_FILE_ENV_VAR not in os.environ  # the caller's environment is back
