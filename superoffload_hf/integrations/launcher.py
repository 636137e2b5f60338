"""`superoffload launch`: `accelerate launch` with a `superoffload:` block in the accelerate config.

    superoffload launch --config_file recipes/accelerate/superoffload.yaml train.py --bf16 ...

Takes the arguments of `accelerate launch`, plus `--sequence_parallel_size N` (before the
script; it sets the block's `sequence_parallel_size`: docs/sequence-parallel.md). Accelerate rejects unknown top-level keys in
its config, so the launcher:

1. reads the accelerate config (`--config_file`, or Accelerate's default config) and pops the
   `superoffload:` block; validates it as SuperOffloadConfig fields (unknown keys fail here);
2. refuses DeepSpeed / FSDP / Megatron-LM configs and fp8; several processes (`--num_processes
   N`, `--num_machines`, `--machine_rank`) run data parallel: the optimizer shards its state
   over the ranks and averages the gradients itself (Accelerate does not wrap the model in DDP);
   on a machine without an accelerator (`device.accelerator_count()`), N > 1 processes are started
   with `--multi_gpu` (accelerate would otherwise run one), and they train on the CPU over gloo;
3. writes the stripped config to a temporary file and runs `accelerate launch --config_file
   <stripped> <the other arguments>` in this process (a process of its own imported torch and
   accelerate again: ~2 s of every launch), the processes it starts with `SUPEROFFLOAD_CONFIG_JSON`
   (the block) set and `launch_site/` first on PYTHONPATH, so that the script's stock
   `transformers.Trainer` trains with superoffload (see autopatch.py);
4. returns the script's exit status (130 after Ctrl-C, without a traceback; 1 after a checkpoint
   that cannot be resumed, whose one-line message ends the output: see autopatch.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from superoffload_hf.integrations.autopatch import CONFIG_ENV_VAR
from superoffload_hf.integrations.launch_env import LAUNCH_COMMAND_ENV_VAR, LAUNCH_ERROR_FILE_ENV_VAR
from superoffload_hf.integrations.openmp_wait import set_openmp_waiting

SITE_DIR = Path(__file__).resolve().parent / "launch_site"
CONFIG_FLAGS = ("--config_file", "--config-file")
REFUSED_DISTRIBUTED_TYPES = ("DEEPSPEED", "FSDP", "MEGATRON_LM")
REFUSED_FLAGS = {"use_deepspeed": "DeepSpeed", "use_fsdp": "FSDP", "use_megatron_lm": "Megatron-LM"}


class LaunchError(ValueError):
    """The launch arguments or the accelerate config cannot be used with superoffload."""


@dataclass
class LaunchPlan:
    accelerate_args: list[str]       # launcher arguments, minus --config_file
    script_args: list[str]           # the training script and its own arguments
    accelerate_config: Optional[dict[str, Any]]  # the config without its superoffload block
    config_suffix: str               # ".yaml" or ".json", as the original config file
    superoffload: dict[str, Any]     # the superoffload block (SuperOffloadConfig fields)

    @property
    def on_cpu(self) -> bool:
        """The launched processes train on the CPU (accelerate's --cpu, use_cpu, MULTI_CPU)."""
        config = self.accelerate_config or {}
        return ("--cpu" in self.accelerate_args or bool(config.get("use_cpu"))
                or config.get("distributed_type") == "MULTI_CPU")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0].strip() + "\n\nThe arguments of `accelerate launch`:\n")
    try:
        plan = plan_launch(argv)
    except LaunchError as error:
        print(f"superoffload launch: error: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="superoffload_launch_") as tmp:
        arguments = accelerate_arguments(plan, tmp)
        env = launch_environment(os.environ, plan.superoffload, on_cpu=plan.on_cpu)
        env[LAUNCH_COMMAND_ENV_VAR] = shlex.join(["superoffload", "launch", *argv])
        env[LAUNCH_ERROR_FILE_ENV_VAR] = str(Path(tmp) / "errors.txt")
        return run_to_the_end(arguments, env)


def run_to_the_end(arguments: list[str], env: dict[str, str]) -> int:
    """`accelerate launch arguments` in this process, the processes it starts with `env`; the
    training script's exit status. Ctrl-C reaches the launched processes too (the terminal
    interrupts its whole foreground group): wait for them to stop cleanly and return 130 without a
    traceback; a second Ctrl-C stops waiting and terminates them. (With several processes, torch's
    elastic agent takes over SIGINT: it stops them on the first.)"""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parsed = launch_command_parser().parse_args(arguments)
    interrupted: list[bool] = []
    with _environment(env), _waiting_out_ctrl_c(interrupted):
        try:
            launch_command(parsed)
            status = 0
        except subprocess.CalledProcessError as error:  # the script failed: its own output said why
            status = exit_status(error.returncode)
        except SystemExit as error:  # accelerate's exit after Ctrl-C or SIGTERM (128 + N)
            status = error.code if isinstance(error.code, int) else int(error.code is not None)
        except ChildFailedError as error:  # a rank failed: its traceback is above; this is the summary
            print(error, file=sys.stderr, flush=True)
            _repeat_the_ranks_errors(env)  # after the summary: the output ends with what to do
            status = 1
    if interrupted or status == 128 + signal.SIGINT:
        print("superoffload launch: interrupted (Ctrl-C); the training script's last lines above say where it "
              "stopped and what to resume from", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    return status


def _repeat_the_ranks_errors(env: dict[str, str]) -> None:
    """The one-line errors the ranks recorded (autopatch.record_launch_error), each once."""
    path = env.get(LAUNCH_ERROR_FILE_ENV_VAR)
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as errors:
            for line in dict.fromkeys(line.rstrip("\n") for line in errors if line.strip()):
                print(line, file=sys.stderr, flush=True)


def plan_launch(argv: list[str]) -> LaunchPlan:
    """Split `argv` as `accelerate launch` would, and strip the superoffload block."""
    from accelerate.commands.launch import launch_command_parser

    sequence_parallel, argv = _sequence_parallel_option(argv)
    parsed = launch_command_parser().parse_args(argv)  # --help and bad arguments exit here
    script_at = len(argv) - len(parsed.training_script_args) - 1
    if argv[script_at] != parsed.training_script:
        raise LaunchError(f"cannot find the training script {parsed.training_script!r} in {argv}.")
    accelerate_args = _without_config_flag(argv[:script_at])
    config_path = _config_path(parsed)
    config = _read_config(config_path) if config_path is not None else None
    block = _pop_block(config, config_path)
    if sequence_parallel is not None:
        block = {**block, "sequence_parallel_size": sequence_parallel}
    _check_combination(parsed, config, block)
    _check_sequence_parallel(parsed, config, block)
    accelerate_args += cpu_processes_flag(parsed, config)
    suffix = Path(config_path).suffix if config_path is not None else ".yaml"
    return LaunchPlan(accelerate_args, argv[script_at:], config, suffix, block)


def cpu_processes_flag(parsed: Any, config: Optional[dict[str, Any]]) -> list[str]:
    """`["--multi_gpu"]` when N > 1 processes are asked for on a machine without GPUs and nothing
    else starts them: `accelerate launch` would run one process and say nothing. Its multi-process
    launcher (torchrun) runs the N ranks on the CPU too, where they talk over gloo."""
    from superoffload_hf.device import accelerator_count  # imports torch: only when a launch is planned

    config = config or {}
    processes = parsed.num_processes if parsed.num_processes is not None else config.get("num_processes", 1)
    distributed = str(config.get("distributed_type", "NO")).upper()
    if int(processes or 1) <= 1 or parsed.multi_gpu or distributed != "NO" or accelerator_count() > 0:
        return []
    if parsed.cpu:
        raise LaunchError(
            f"`--cpu` starts one process, but `--num_processes` is {processes}. Drop `--cpu` (on a machine "
            "without GPUs superoffload launch starts the processes with accelerate's `--multi_gpu` launcher, "
            "gloo between them), e.g. `superoffload launch --config_file recipes/accelerate/superoffload_cpu.yaml "
            f"--num_processes {processes} train.py ...`.")
    print(f"superoffload launch: no GPU here: starting {processes} CPU processes (accelerate `--multi_gpu`, "
          "gloo between them)", file=sys.stderr, flush=True)
    return ["--multi_gpu"]


def accelerate_arguments(plan: LaunchPlan, tmp_dir: str) -> list[str]:
    """The arguments of `accelerate launch`: the stripped config (written to `tmp_dir`), the
    launcher's other arguments, the script and its arguments."""
    arguments = []
    if plan.accelerate_config is not None:
        stripped = Path(tmp_dir) / f"accelerate_config{plan.config_suffix}"
        _write_config(plan.accelerate_config, stripped)
        arguments += ["--config_file", str(stripped)]
    return arguments + plan.accelerate_args + plan.script_args


def launch_environment(environ: dict[str, str], block: dict[str, Any], on_cpu: bool = False) -> dict[str, str]:
    env = dict(environ)
    env[CONFIG_ENV_VAR] = json.dumps(block)
    # how torch's OpenMP threads wait: read once, when libgomp loads, so only a launcher can set
    # it in time for the script (openmp_wait.py says what and why)
    set_openmp_waiting(env, on_cpu)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), environ.get("PYTHONPATH")) if p)
    return env


# ---- helpers -----------------------------------------------------------------------------------

# the handlers accelerate's launchers and torch's elastic agent replace (the agent does not restore them)
_LAUNCH_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                        if hasattr(signal, name))


def exit_status(returncode: int) -> int:
    """A subprocess return code as a shell reports it (a negative code: killed by that signal)."""
    return 128 - returncode if returncode < 0 else returncode


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ is `env` inside (accelerate hands os.environ to the processes it starts)."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


@contextlib.contextmanager
def _waiting_out_ctrl_c(interrupted: list) -> Iterator[None]:
    """The first Ctrl-C is noted in `interrupted` and waited out (the script hears it too and stops
    by itself, printing where); a second raises KeyboardInterrupt, on which accelerate terminates
    the script. A Python handler, not SIG_IGN: an ignored SIGINT would be inherited by the script,
    which then could not be interrupted; a handler is reset to the default in a child. Signal
    handlers exist in the main thread only: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_ctrl_c(signum, frame) -> None:
        if interrupted:
            raise KeyboardInterrupt
        interrupted.append(True)

    previous = {signum: signal.getsignal(signum) for signum in _LAUNCH_SIGNALS}
    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

SEQUENCE_PARALLEL_FLAG = "--sequence_parallel_size"


def _sequence_parallel_option(argv: list[str]) -> tuple[Optional[int], list[str]]:
    """`--sequence_parallel_size N` (or `=N`) among the launcher's own arguments (before the
    script, the first `.py` argument: the script's own arguments are left to it)."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):
            break
        name, eq, text = arg.partition("=")
        if name != SEQUENCE_PARALLEL_FLAG:
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise LaunchError(f"`{SEQUENCE_PARALLEL_FLAG}` needs a value, e.g. `{SEQUENCE_PARALLEL_FLAG} 2`.")
            text, rest = argv[i + 1], argv[:i] + argv[i + 2:]
        else:
            rest = argv[:i] + argv[i + 1:]
        if not text.isdigit() or int(text) < 1:
            raise LaunchError(f"`{SEQUENCE_PARALLEL_FLAG}` is {text!r}; expected an integer >= 1 that divides "
                              f"`--num_processes`, e.g. `{SEQUENCE_PARALLEL_FLAG} 2`.")
        return int(text), rest
    return None, argv


def _check_sequence_parallel(parsed: Any, config: Optional[dict[str, Any]], block: dict[str, Any]) -> None:
    from superoffload_hf.config import ConfigError, check_sequence_parallel_size

    size = block.get("sequence_parallel_size", 1)
    processes = parsed.num_processes if parsed.num_processes is not None else (config or {}).get("num_processes", 1)
    try:
        check_sequence_parallel_size(size, int(processes or 1))  # accelerate's num_processes: the whole world
    except ConfigError as error:
        raise LaunchError(f"{error} (`--num_processes` is the world size)") from error



def _without_config_flag(args: list[str]) -> list[str]:
    kept, skip_next = [], False
    for arg in args:
        if skip_next:
            skip_next = False
        elif arg in CONFIG_FLAGS:
            skip_next = True
        elif not arg.startswith(tuple(flag + "=" for flag in CONFIG_FLAGS)):
            kept.append(arg)
    return kept


def _config_path(parsed: Any) -> Optional[str]:
    """The config accelerate launch would read: --config_file, else its default config file."""
    if parsed.config_file is not None:
        return parsed.config_file
    from accelerate.commands.config import default_config_file

    return default_config_file if os.path.isfile(default_config_file) and not parsed.cpu else None


def _read_config(path: str) -> dict[str, Any]:
    import yaml

    from superoffload_hf.yaml12 import load_yaml

    if not os.path.isfile(path):
        raise LaunchError(f"accelerate config file {path!r} does not exist.")
    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}  # YAML is a superset of JSON; Accelerate reads it this way
    if not isinstance(data, dict):
        raise LaunchError(f"accelerate config file {path!r} must hold a mapping, got {type(data).__name__}.")
    if "superoffload" in data:  # our block with YAML 1.2 scalars: `speculation: off` is a string
        data["superoffload"] = load_yaml(text).get("superoffload")
    return data


def _write_config(config: dict[str, Any], path: Path) -> None:
    import yaml

    text = json.dumps(config, indent=2) if path.suffix == ".json" else yaml.safe_dump(config, sort_keys=False)
    path.write_text(text)


def _pop_block(config: Optional[dict[str, Any]], path: Optional[str]) -> dict[str, Any]:
    block = config.pop("superoffload", None) if config is not None else None
    if block is None:
        return {}  # no block: SuperOffloadConfig defaults
    if not isinstance(block, dict):
        raise LaunchError(
            f"The `superoffload:` block in {path!r} must be a mapping of SuperOffloadConfig fields, "
            f"got {type(block).__name__}."
        )
    return block


def _check_combination(parsed: Any, config: Optional[dict[str, Any]], block: dict[str, Any]) -> None:
    from superoffload_hf.config import ConfigError
    from superoffload_hf.integrations.accelerate import SuperOffloadPlugin

    distributed = str((config or {}).get("distributed_type", "NO")).upper()
    refused = [name for flag, name in REFUSED_FLAGS.items() if getattr(parsed, flag, False)]
    refused += [distributed] if distributed in REFUSED_DISTRIBUTED_TYPES else []
    if refused:
        raise LaunchError(
            f"superoffload cannot be combined with {refused[0]}: both own the optimizer state. Use a "
            "config with distributed_type NO, or launch with `accelerate launch` without superoffload."
        )
    mixed_precision = parsed.mixed_precision or (config or {}).get("mixed_precision") or "no"
    try:
        SuperOffloadPlugin.from_dict(block).to_config(mixed_precision)
    except ConfigError as error:
        raise LaunchError(f"superoffload block: {error}") from error
    except ValueError as error:
        raise LaunchError(str(error)) from error


if __name__ == "__main__":
    sys.exit(main())
