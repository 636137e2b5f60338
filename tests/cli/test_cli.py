"""The `superoffload` command: `train` on the tiny recipe end to end (checkpoint, summary,
resume), argument handling, bad inputs, and `launch` forwarding."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from superoffload_hf import cli
from superoffload_hf.cli import main
from superoffload_hf.train.run import TrainSummary, optimizer_counters

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_llama_cpu.yaml")
# Constant LR: a 3-step run resumed to 5 steps sees the same schedule as a 5-step run.
FAST = ["--training.logging_steps", "1", "--training.save_steps", "3", "--training.warmup_steps", "0",
        "--training.lr_scheduler_type", "constant"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m superoffload_hf.cli ARGS` offline, from the repository root."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "superoffload_hf.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def safetensors_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


@pytest.fixture(scope="module")
def three_step_run(tmp_path_factory):
    """The tiny recipe for 3 steps through the real entry point; returns (output_dir, process)."""
    out = tmp_path_factory.mktemp("tiny") / "out"
    proc = run_cli("train", TINY, "--training.max_steps", "3", "--training.output_dir", str(out),
                   "--timeline", str(out.parent / "timeline"), *FAST)
    return out, proc


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


# ---- train, end to end ------------------------------------------------------------------------


def test_train_runs_the_tiny_recipe_and_prints_the_summary(three_step_run):
    out, proc = three_step_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = proc.stdout[proc.stdout.index("superoffload train: done"):]
    assert re.search(r"steps\s+3 \(global step 3\), 3,072 tokens in", summary), summary
    assert re.search(r"tokens/s\s+[\d,]+\n", summary), summary
    assert re.search(r"final loss\s+\d+\.\d{4} at step 3 \(first logged \d+\.\d{4} at step 1\)", summary), summary
    assert re.search(r"rollbacks\s+\d+\n", summary), summary
    assert re.search(r"skipped steps\s+0\n", summary), summary
    assert re.search(r"host state\s+fp32 12\.\d{3} B/param\n", summary), summary
    assert f"checkpoint     {out / 'checkpoint-3'}" in summary


def test_train_with_timeline_writes_the_trace_and_the_picture_of_steps_2_and_3(three_step_run):
    out, proc = three_step_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = json.loads((out.parent / "timeline" / "trace.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e.get("ph") == "X" and re.fullmatch(r"step \d+", e["name"])} == {"step 2", "step 3"}
    assert any(e.get("ph") == "X" and e["name"].startswith(("step b", "speculative step b")) for e in events)
    pytest.importorskip("matplotlib")
    assert (out.parent / "timeline" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    timeline = out.parent / "timeline"  # the summary says where it went
    assert (f"  timeline       {timeline / 'trace.json'} (open in https://ui.perfetto.dev), "
            f"{timeline / 'timeline.png'}\n") in proc.stdout, proc.stdout[-1500:]


def test_train_prints_short_log_lines_and_keeps_every_counter_in_the_trainer_state(three_step_run):
    out, proc = three_step_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in re.split(r"[\r\n]", proc.stdout + proc.stderr) if "'loss'" in line]
    assert len(lines) == 3, lines
    for line in lines:  # the progress bar's line: the stock keys and one short superoffload entry
        line = line[line.index("{"):]
        assert len(line) < 200 and "superoffload/" not in line and "'superoffload': 'host Adam " in line, line
        assert "overlap" not in line  # the CPU is the device: nothing overlaps
    records = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    assert all("superoffload/host_step_s" in r and "superoffload/overlap" not in r for r in records if "loss" in r)


def test_timeline_flag_needs_a_directory(capsys):
    assert main(["train", TINY, "--timeline"]) == 2
    assert "`--timeline` needs a directory" in capsys.readouterr().err


def test_train_prints_what_it_built_before_training(three_step_run):
    _, proc = three_step_run
    assert re.search(r"model\s+llama, 1\.31M parameters, float32, random init", proc.stdout)
    assert re.search(r"data\s+[\d,]+ tokens in \d+ blocks of 128", proc.stdout)


def test_checkpoint_holds_safetensors_weights_and_the_tokenizer(three_step_run):
    out, proc = three_step_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    weights = safetensors_of(out / "checkpoint-3")
    assert weights["model.embed_tokens.weight"].shape == (2048, 128)
    assert weights["model.embed_tokens.weight"].dtype == torch.float32
    assert (out / "checkpoint-3" / "tokenizer.json").is_file()
    assert not (out / "checkpoint-3" / "pytorch_model.bin").exists()


def test_resumed_run_ends_where_an_uninterrupted_run_ends(three_step_run, tmp_path, capsys, offline):
    out, proc = three_step_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = main(["train", TINY, "--training.max_steps", "5", "--training.output_dir", str(out),
                    "--training.resume_from_checkpoint", "true", *FAST])
    printed = capsys.readouterr().out
    assert resumed == 0
    assert re.search(r"resumed from\s+step 3\n", printed), printed
    assert re.search(r"steps\s+2 \(global step 5\), 2,048 tokens", printed), printed

    straight = main(["train", TINY, "--training.max_steps", "5", "--training.output_dir", str(tmp_path), *FAST])
    assert straight == 0
    expected, got = safetensors_of(tmp_path / "checkpoint-5"), safetensors_of(out / "checkpoint-5")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(got["model.norm.weight"], safetensors_of(out / "checkpoint-3")["model.norm.weight"])


def test_stock_optimizer_recipe_trains_and_reports_no_offload_counters(tmp_path, capsys, offline):
    code = main(["train", str(REPO / "recipes" / "tiny_llama_cpu_stock.yaml"), "--training.max_steps", "2",
                 "--training.output_dir", str(tmp_path), *FAST])
    printed = capsys.readouterr().out
    assert code == 0
    assert re.search(r"optimizer\s+stock \(superoffload: false\)", printed)
    assert re.search(r"rollbacks\s+n/a \(stock optimizer\)", printed)
    assert (tmp_path / "checkpoint-2" / "model.safetensors").is_file()


def copy_of(out: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(out, tmp_path / "out", ignore=shutil.ignore_patterns("checkpoint-5")))


def test_resume_true_skips_a_checkpoint_cut_short_by_a_crash_and_says_so(three_step_run, tmp_path, capsys, offline):
    out = copy_of(three_step_run[0], tmp_path)
    crashed = out / "checkpoint-4"  # killed while torch.save wrote optimizer.pt
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes((out / "checkpoint-3" / "model.safetensors").read_bytes())
    (crashed / "optimizer.pt").write_bytes(b"")
    code = main(["train", TINY, "--training.max_steps", "5", "--training.output_dir", str(out),
                 "--training.resume_from_checkpoint", "true", *FAST])
    printed = capsys.readouterr().out
    assert code == 0
    assert f"skipped incomplete checkpoint {crashed}: it has no trainer_state.json" in printed
    assert f"resuming from {out / 'checkpoint-3'}: everything" in printed
    assert re.search(r"resumed from\s+step 3\n", printed), printed


def test_resume_without_optimizer_state_is_refused_before_loading_unless_weights_only(three_step_run, tmp_path, capsys,
                                                                                       monkeypatch, offline):
    out = copy_of(three_step_run[0], tmp_path)
    (out / "checkpoint-3" / "optimizer.pt").unlink()
    args = ["train", TINY, "--training.max_steps", "2", "--training.output_dir", str(out),
            "--training.resume_from_checkpoint", "true", *FAST]
    with monkeypatch.context() as patch:
        patch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
        assert main(args) == 2
    err = capsys.readouterr().err
    assert "checkpoint-3': it has no optimizer.pt" in err and "--training.resume_weights_only true" in err
    assert main([*args, "--training.resume_weights_only", "true"]) == 2  # from step 0 among its checkpoints
    assert "A weights-only resume starts again at step 0" in capsys.readouterr().err
    assert main([*args, "--training.resume_weights_only", "true", "--training.resume_from_checkpoint",
                 str(out / "checkpoint-3"), "--training.output_dir", str(tmp_path / "weights_only")]) == 0
    printed = capsys.readouterr().out
    assert "the model weights only (fresh optimizer and schedule, step 0)" in printed
    assert re.search(r"steps\s+2 \(global step 2\)", printed), printed


def test_damaged_optimizer_state_is_refused_naming_the_tensor(three_step_run, tmp_path, capsys, offline):
    out = copy_of(three_step_run[0], tmp_path)
    saved = torch.load(out / "checkpoint-3" / "optimizer.pt", weights_only=True)
    saved["state"][0]["exp_avg"].view(-1)[:1024] = 0.5  # 4 KB of finite garbage in a moment
    torch.save(saved, out / "checkpoint-3" / "optimizer.pt")
    code = main(["train", TINY, "--training.max_steps", "5", "--training.output_dir", str(out),
                 "--training.resume_from_checkpoint", "true", *FAST])
    err = capsys.readouterr().err
    assert code == 2
    assert "optimizer state is corrupt: state[0]['exp_avg'] does not match the checksum" in err


def test_the_cli_prints_which_host_adam_runs(three_step_run):
    _, proc = three_step_run
    assert re.search(r"engine\s+.*host Adam (cpp|reference)/\w+ ", proc.stdout), proc.stdout


# ---- arguments and bad inputs -----------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    (["--training.learning_rate", "-1"], "`training.learning_rate` is -1; expected a number >= 0."),
    (["--training.weight_decay", "-0.1"], "`training.weight_decay` is -0.1; expected a number >= 0."),
    (["--training.adam_beta1", "1.5"], "`training.adam_beta1` is 1.5; expected a number in [0, 1)."),
    (["--training.adam_epsilon", "-1"], "`training.adam_epsilon` is -1; expected a number >= 0."),
    (["--training.per_device_train_batch_size", "0"], "`training.per_device_train_batch_size` is 0; expected an integer >= 1."),
    (["--training.gradient_accumulation_steps", "0"], "`training.gradient_accumulation_steps` is 0; expected an integer >= 1."),
    (["--model.config.hidden_size", "130"], "`model.config.hidden_size` is 130, not divisible by `num_attention_heads` (4)"),
    (["--model.config.num_key_value_heads", "3"], "`model.config.num_key_value_heads` is 3; expected a divisor of `num_attention_heads` (4)"),
])
def test_values_that_would_fail_after_loading_are_refused_by_dry_run(override, message, capsys):
    assert main(["train", TINY, *override, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("superoffload train: error:") and message in err and err.count("\n") == 1, err


def test_a_data_file_that_is_not_utf8_text_is_refused_by_dry_run(tmp_path, capsys):
    data = tmp_path / "notes.txt"
    data.write_bytes("caf\u00e9 ok\n".encode() + b"\xff\xfe bad\n")
    assert main(["train", TINY, "--data.shipped_corpus", "false", "--data.files", f"[{data}]", "--dry-run"]) == 2
    assert f"`data.files` holds '{data}', which is not UTF-8 text (byte 9" in capsys.readouterr().err


def test_more_host_threads_than_cores_warns(capsys):
    assert main(["train", TINY, "--superoffload.host_threads", "1000", "--dry-run"]) == 0
    assert "warning: `superoffload.host_threads` is 1000 but this process may run on" in capsys.readouterr().err


def test_an_accelerate_config_given_to_train_points_to_launch(capsys):
    config = str(REPO / "recipes" / "accelerate" / "superoffload.yaml")
    assert main(["train", config, "--dry-run"]) == 2
    assert f"is an accelerate config (it has `compute_environment`), not a recipe. Start a training script with it: `superoffload launch --config_file {config}" in capsys.readouterr().err


def test_train_help_lists_the_recipe_sections_and_keys(capsys):
    assert main(["train", "--help"]) == 0
    printed = capsys.readouterr().out
    for line in ("  model:         config [None], name_or_path [None], dtype [auto]", "  data:          seq_len, shipped_corpus [False]",
                 "  tokenizer:     shipped [False]", "resume_weights_only", "  superoffload:  bucket_size_mb, device_buckets"):
        assert line in printed, printed



def test_train_help_points_to_docs_that_exist_and_explains_the_timeline(capsys):
    assert main(["train", "--help"]) == 0
    printed = capsys.readouterr().out
    assert "docs/config.md" in printed and "Config fields" not in printed, printed
    for doc in re.findall(r"docs/[\w.-]+\.md", printed):
        assert (REPO / doc).is_file(), doc
    explained = " ".join(printed[printed.index("`--timeline DIR`"):].split())
    assert explained.startswith("`--timeline DIR` (= `--superoffload.timeline_dir DIR`) writes what each stream "
                                "did in steps `superoffload.timeline_steps` [2, 3] to DIR: trace.json"), explained


def test_no_arguments_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "usage: superoffload train RECIPE.yaml" in capsys.readouterr().err


def test_help_prints_usage_and_succeeds(capsys):
    assert main(["--help"]) == 0
    assert main(["train", "--help"]) == 0
    assert capsys.readouterr().out.count("usage: superoffload train") == 2


def test_unknown_command_is_named(capsys):
    assert main(["fit", TINY]) == 2
    assert "unknown command 'fit'; expected `train` or `launch`" in capsys.readouterr().err


def test_train_without_a_recipe_prints_usage(capsys):
    assert main(["train", "--training.max_steps", "3"]) == 2
    assert "usage: superoffload train" in capsys.readouterr().err


def test_missing_recipe_file_exits_2_naming_it(capsys):
    assert main(["train", "recipes/nope.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("superoffload train: error:") and "'recipes/nope.yaml' does not exist" in err


def test_model_path_that_does_not_exist_exits_2_before_loading_anything(capsys, monkeypatch):
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran on a bad recipe"))
    code = main(["train", TINY, "--model.config", "null", "--model.name_or_path", "./checkpoints/llama"])
    assert code == 2
    assert "'./checkpoints/llama', which looks like a local path but does not exist" in capsys.readouterr().err


def test_wrong_type_on_the_command_line_exits_2_naming_the_key(capsys):
    assert main(["train", TINY, "--training.max_steps", "many", "--dry-run"]) == 2
    assert "`training.max_steps` is 'many' (str); expected an integer." in capsys.readouterr().err


def test_dry_run_prints_the_resolved_recipe_with_overrides(capsys):
    assert main(["train", TINY, "--dry-run", "--training.max_steps=3", "--superoffload.speculation", "off"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["training"]["max_steps"] == 3
    assert printed["superoffload"] == {"device_dtype": "fp32", "speculation": "off"}
    assert printed["model"]["config"]["hidden_size"] == 128


# A 67M-parameter variant of the tiny recipe planned for an accelerator (built on the meta
# device: nothing is allocated), so that the table's figures have digits to compare.
ACCELERATOR_VARIANT = ["--model.config.hidden_size", "1024", "--model.config.intermediate_size", "4096",
                       "--training.use_cpu", "false", "--superoffload.device_dtype", "bf16",
                       "--training.gradient_accumulation_steps", "4"]
TABLE_ROW = re.compile(r"^  (\S.*?)\s+(device|pinned|host)\s+([\d.]+)\s+([\d.]+)$", re.M)


def dry_run_memory(capsys, *args: str) -> tuple[str, dict[str, tuple[str, float, float]]]:
    """The printed memory (from its first line on) and its rows: buffer -> (place, GB, B/param)."""
    assert main(["train", TINY, "--dry-run", *ACCELERATOR_VARIANT, *args]) == 0
    out = capsys.readouterr().out
    memory = out[out.index("\nmemory: ") + 1:]
    return memory, {m[1]: (m[2], float(m[3]), float(m[4])) for m in TABLE_ROW.finditer(memory)}


def test_dry_run_prints_what_the_host_memory_check_compares(capsys):
    memory, rows = dry_run_memory(capsys)
    line = next(x for x in memory.splitlines() if x.startswith("  host memory checked before allocating "))
    need = float(line.split("allocating ")[1].split(" GB")[0])
    buffers = {what: gb for what, (place, gb, _) in rows.items()
               if place in ("pinned", "host") and not what.startswith("total")}
    assert sum(buffers.values()) - 0.002 <= need <= sum(buffers.values()) + max(buffers.values()) + 0.002, line
    assert "this machine may use" in line and "fits" in line, line


def test_dry_run_with_compact_state_prints_its_kinds_bytes_per_param_and_snapshot(capsys):
    fp32_memory, fp32 = dry_run_memory(capsys)
    memory, rows = dry_run_memory(capsys, "--superoffload.state_precision", "compact")
    assert "host state fp32 12.0" in fp32_memory and "master" in fp32 and "master_bf16" not in fp32
    assert "master" not in rows and "exp_avg" not in rows and "lowp" not in rows
    per_param = {"master_bf16": 2.0, "master_err": 1.0, "exp_avg_q": 1.0, "exp_avg_scale": 0.06,
                 "exp_avg_sq_q": 1.0, "exp_avg_sq_scale": 0.06}
    for kind, want in per_param.items():
        assert rows[kind][2] == pytest.approx(want, abs=0.011), (kind, rows[kind])
    assert rows["master_bf16"][0] == "pinned" and rows["master_err"][0] == "host"  # what crosses the link
    assert rows["snapshot"][2] == pytest.approx(5.125, abs=0.02)
    line = next(x for x in memory.splitlines() if x.startswith("  host state compact "))
    assert float(line.split()[3]) == pytest.approx(5.125, abs=0.02), line
    assert "snapshot of the compact bytes of speculated buckets" in line
    assert rows["copy-back staging"] == fp32["copy-back staging"]  # bf16 (master_bf16 as it is; cast host's lowp)
    _, off = dry_run_memory(capsys, "--superoffload.state_precision", "compact", "--superoffload.speculation", "off")
    assert "snapshot" not in off  # nothing is ever speculated: no pre-step bytes to keep


def test_dry_run_decides_the_snapshot_trade_against_the_host_memory_budget_as_the_engine_does(capsys):
    """Before: the dry run's trade read this machine's memory whatever `host_memory_budget` said."""
    compact = ("--superoffload.state_precision", "compact")
    memory, _ = dry_run_memory(capsys, *compact, "--superoffload.host_memory_budget", "100MB")
    line = next(x for x in memory.splitlines() if x.startswith("  speculation snapshot "))
    assert "speculates 0 of 10 host buckets (host memory: 0.000 GB left for snapshots" in line, line
    assert re.search(r"with `host_memory_budget` \(0\.09 GiB\) less this process's resident memory; after step 1",
                     line), line
    memory, _ = dry_run_memory(capsys, *compact, "--superoffload.host_memory_budget", "1TB")
    line = next(x for x in memory.splitlines() if x.startswith("  speculation snapshot "))
    assert "speculates 10 of 10 host buckets (the snapshots fit) with `host_memory_budget` (931.32 GiB)" in line, line


def test_dry_run_prints_which_units_flow_and_the_device_weights_with_and_without(capsys):
    memory, rows = dry_run_memory(capsys, "--superoffload.weights", "flow")
    line = next(x for x in memory.splitlines() if x.startswith("  weights flow; "))
    stationary = float(line.split("stationary ")[1].split(" GB")[0])
    flowing = float(line.split("with flow <= ")[1].split(" GB")[0])
    assert stationary == pytest.approx(rows["device params"][1], abs=0.0011), (line, rows["device params"])
    assert 0 < flowing < stationary and "units flow, prefetch depth 1 - model.layers.0" in line, line
    default, _ = dry_run_memory(capsys)
    assert "  weights stationary; device weights stationary" in default


def test_dry_run_with_num_processes_prints_a_rank_with_a_shard_of_the_host_state_and_a_host(capsys):
    alone, single = dry_run_memory(capsys)
    memory, rank = dry_run_memory(capsys, "--num_processes", "4")
    assert "per rank" not in alone and "per host" not in alone and "gradient ring (3 slots)" in single
    assert "memory per rank, data parallel over 4 processes" in memory
    for kind in ("master", "exp_avg", "exp_avg_sq", "grad staging"):  # sharded: 1/4 each (B/param)
        assert rank[kind][0] == single[kind][0] == "host"
        assert rank[kind][2] == pytest.approx(single[kind][2] / 4, abs=0.01), (kind, rank[kind], single[kind])
    assert rank["device params"] == single["device params"]  # every rank holds the whole model
    assert "gradient ring (3 slots)" not in rank and {"reduce-scatter shard", "grad buckets (all, fp32)"} <= set(rank)
    per_host = memory[memory.index("memory per host, 4 ranks on 1 machine"):]
    for place in ("pinned", "host"):
        per_rank = float(re.search(rf"^  total {place}\s+([\d.]+)\s", memory, re.M)[1])
        on_host = float(re.search(rf"^  total {place}\s+([\d.]+)$", per_host, re.M)[1])
        assert on_host == pytest.approx(4 * per_rank, abs=0.005), (place, per_rank, on_host)


def test_num_machines_divides_the_ranks_among_hosts(capsys):
    memory, _ = dry_run_memory(capsys, "--num_processes=16", "--num_machines=2")
    assert "memory per rank, data parallel over 16 processes" in memory
    assert "memory per host, 8 ranks on each of 2 machines" in memory


@pytest.mark.parametrize("args, message", [
    (["--num_processes", "0"], "`--num_processes` is '0'; expected an integer >= 1"),
    (["--num_processes", "-2"], "`--num_processes` is '-2'; expected an integer >= 1"),
    (["--num_processes", "2.5"], "`--num_processes` is '2.5'; expected an integer >= 1"),
    (["--num_processes=eight"], "`--num_processes` is 'eight'; expected an integer >= 1"),
    (["--num_processes"], "`--num_processes` needs a value: an integer >= 1, e.g. `--num_processes 8`"),
    (["--num_processes", "8", "--num_machines", "3"], "`--num_machines` is 3 but `--num_processes` is 8; "
                                                      "expected a divisor of 8"),
])
def test_a_bad_process_count_exits_2_naming_the_value_and_the_fix(args, message, capsys, monkeypatch):
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    assert main(["train", TINY, "--dry-run", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("superoffload train: error: ") and message in err and err.count("\n") == 1, err
    assert "e.g. `--num_" in err


def test_num_processes_without_dry_run_is_refused_before_anything_loads(capsys, monkeypatch):
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    assert main(["train", TINY, "--num_processes", "8"]) == 2
    err = capsys.readouterr().err
    assert "`--num_processes` sizes the memory that `--dry-run` prints" in err and "Add `--dry-run`" in err
    assert f"`torchrun --nproc_per_node N -m superoffload_hf.cli train {TINY} ...`" in err, err


def test_sequence_parallel_size_in_a_dry_run_prints_the_split_and_is_refused_in_one_process(capsys, monkeypatch):
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    memory, rank = dry_run_memory(capsys, "--num_processes", "4", "--sequence_parallel_size", "2")
    assert "parallelism: 4 processes = data parallel 2 x sequence parallel 2" in memory, memory
    _, dp = dry_run_memory(capsys, "--num_processes", "4")
    assert rank["master"] == dp["master"]  # the host state is sharded over the whole world either way
    assert main(["train", TINY, "--dry-run", "--num_processes", "4", "--sequence_parallel_size=3"]) == 2
    assert "`sequence_parallel_size` is 3 but the world has 4 processes" in capsys.readouterr().err
    assert main(["train", TINY, "--dry-run", "--sequence_parallel_size", "x"]) == 2
    assert "sequence_parallel_size" in capsys.readouterr().err
    assert main(["train", TINY, "--sequence_parallel_size", "2"]) == 2
    err = capsys.readouterr().err
    assert "`sequence_parallel_size` is 2: each sequence is split over 2 processes" in err, err
    assert f"torchrun --nproc_per_node 2 -m superoffload_hf.cli train {TINY} --sequence_parallel_size 2" in err, err


def test_python_dash_m_runs_the_cli():
    proc = run_cli("--help")
    assert proc.returncode == 0 and "usage: superoffload train" in proc.stdout


def test_console_script_is_the_cli_main():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["superoffload"] == "superoffload_hf.cli:main"


def test_corpus_is_declared_package_data():
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "train/corpus/*.txt" in package_data["superoffload_hf"]


def test_launch_forwards_every_argument_to_the_launcher(monkeypatch):
    seen = []
    fake = types.ModuleType("superoffload_hf.integrations.launcher")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "superoffload_hf.integrations.launcher", fake)
    argv = ["--config_file", "recipes/accelerate/superoffload.yaml", "train.py", "--bf16", "--train.x=1"]
    assert main(["launch", *argv]) == 7
    assert seen == [argv]


# ---- the summary ------------------------------------------------------------------------------


def test_summary_reports_tokens_per_second_and_the_counters():
    summary = TrainSummary(steps=10, global_step=13, tokens=40_960, seconds=4.0, first_loss=(4, 7.5),
                           final_loss=(13, 2.25), rollbacks=1, skipped_steps=2, checkpoint="out/checkpoint-13",
                           resumed_from_step=3, host_state="compact 5.184 B/param",
                           weight_fetches=(2_280, 1_234_000_000))
    text = summary.format()
    assert "host state     compact 5.184 B/param" in text, text
    assert "weight fetches 2,280 (1.234 GB host to device)" in text, text
    assert summary.tokens_per_second == 10_240.0
    for line in ("resumed from   step 3", "steps          10 (global step 13), 40,960 tokens in 4.0 s",
                 "tokens/s       10,240", "final loss     2.2500 at step 13 (first logged 7.5000 at step 4)",
                 "rollbacks      1", "skipped steps  2", "checkpoint     out/checkpoint-13"):
        assert line in text, text


def test_counters_are_read_through_the_accelerate_wrapper():
    counters = types.SimpleNamespace(rollbacks=3, skips=1)
    inner = types.SimpleNamespace(counters=counters)
    assert optimizer_counters(types.SimpleNamespace(optimizer=types.SimpleNamespace(optimizer=inner))) is counters
    assert optimizer_counters(types.SimpleNamespace(optimizer=inner)) is counters
    assert optimizer_counters(types.SimpleNamespace(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))) is None


def test_the_cli_sets_how_openmp_waits_before_torch_loads_passive_or_a_short_spin_on_the_cpu(tmp_path):
    gpu_recipe = REPO / "recipes" / "llama3.2-1b.yaml"
    code = ("import os, sys; os.environ.pop('OMP_WAIT_POLICY', None)\n"
            "import superoffload_hf.cli as cli\n"
            "assert 'torch' not in sys.modules, 'importing the CLI loaded torch: too late for the policy'\n"
            f"cli.main(['train', {str(TINY)!r}, '--dry-run'])\n"
            "assert 'OMP_WAIT_POLICY' not in os.environ  # the tiny recipe trains on the CPU: a short spin\n"
            "assert os.environ.pop('GOMP_SPINCOUNT') == '2000'\n"
            f"cli.main(['train', {str(gpu_recipe)!r}, '--dry-run'])\n"
            "assert os.environ['OMP_WAIT_POLICY'] == 'PASSIVE'\n"
            "os.environ['OMP_WAIT_POLICY'] = 'ACTIVE'\n"
            f"cli.main(['train', {str(gpu_recipe)!r}, '--dry-run'])\n"
            "assert os.environ['OMP_WAIT_POLICY'] == 'ACTIVE'  # a user's choice stays\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_recipe_trains_on_cpu_reads_the_yaml_and_the_override():
    from superoffload_hf.cli import recipe_trains_on_cpu

    assert recipe_trains_on_cpu([str(TINY)])
    assert not recipe_trains_on_cpu([str(TINY), "--training.use_cpu", "false"])
    assert not recipe_trains_on_cpu([str(REPO / "recipes" / "llama3.2-1b.yaml")])
    assert recipe_trains_on_cpu([str(REPO / "recipes" / "llama3.2-1b.yaml"), "--training.use_cpu=true"])


def test_weights_auto_counts_the_activation_estimate_of_the_recipe_unless_it_sets_the_bytes(capsys):
    """The recipe knows the batch, the sequence length and checkpointing: `weights: auto` (and
    flow) counts the activation estimate the dry run prints, in the dry run and in the config
    `superoffload train` builds; stationary, the CPU and a recipe that sets the bytes keep theirs."""
    from superoffload_hf.train.footprint import recipe_with_activation_bytes
    from superoffload_hf.train.recipe import load_recipe

    def counted(memory: str) -> float:
        peak = next(x for x in memory.splitlines() if x.startswith("    device peak "))
        return float(peak.split("(activations ")[1].split(" GB counted")[0])

    memory, _ = dry_run_memory(capsys, "--superoffload.weights", "auto")
    estimate = float(re.search(r"^  activations of .* ([\d.]+) GB at their peak", memory, re.M)[1])
    assert estimate > 0 and counted(memory) == estimate, memory
    memory, _ = dry_run_memory(capsys, "--superoffload.weights", "auto", "--superoffload.device_activation_bytes", "0")
    assert counted(memory) == 0.0
    memory, _ = dry_run_memory(capsys)  # stationary: nothing to decide
    assert counted(memory) == 0.0

    def bytes_of(*overrides: str):
        recipe, line = recipe_with_activation_bytes(load_recipe(TINY, [*ACCELERATOR_VARIANT, *overrides]))
        return recipe.superoffload.get("device_activation_bytes"), line

    value, line = bytes_of("--superoffload.weights", "auto")
    assert value == pytest.approx(estimate * 1e9, abs=5e5) and "counts" in line and "activations" in line, line
    assert bytes_of() == (None, None)  # stationary
    assert bytes_of("--superoffload.weights", "auto", "--superoffload.device_activation_bytes", "7") == (7, None)
    assert bytes_of("--superoffload.weights", "auto", "--training.use_cpu", "true") == (None, None)


def test_dry_run_prints_the_layout_and_what_weights_auto_decides_on_one_h200(capsys):
    memory, _ = dry_run_memory(capsys)
    lines = memory.splitlines()
    head = next(x for x in lines if x.startswith("  on one H200 (141 GB"))
    assert "weights auto flows 0 of" in head and "(every unit fits on the device)" in head, head
    assert any(x.startswith("    predicted exposed transfer 0.0 ms a step") for x in lines)
    assert any(x.startswith("    layout device cuda") for x in lines) and any(x == "    weights stationary" for x in lines)
    peak = next(x for x in lines if x.startswith("    device peak "))
    stationary = float(peak.split("device peak ")[1].split(" GB")[0])
    flowing = float(peak.split("stationary, ")[1].split(" GB")[0])
    # activations that leave room between the two: some units flow, within the device less the
    # margin weights auto keeps free (plan/flow.py device_margin: 5% of it)
    margin = 0.05 * 141
    activations = 141 * 10**9 - int(margin * 1e9) - int((stationary + flowing) / 2 * 1e9)
    memory, _ = dry_run_memory(capsys, "--superoffload.device_activation_bytes", str(activations))
    lines = memory.splitlines()
    head = next(x for x in lines if x.startswith("  on one H200 (141 GB"))
    flows, units = (int(v) for v in head.split("weights auto flows ")[1].split(" units")[0].split(" of "))
    assert 0 < flows < units, head
    peak = next(x for x in lines if x.startswith("    device peak "))
    chosen = float(peak.split(" GB with every unit flowing, ")[1].split(" GB")[0])
    assert chosen <= 141.0 - margin and float(peak.split("device peak ")[1].split(" GB")[0]) > 141.0 - margin, peak
    assert any(x.startswith(f"    weights flow, {flows} units (") for x in lines)
