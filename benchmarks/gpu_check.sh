#!/usr/bin/env bash
# The GPU check: one prepared run for a machine with one CUDA GPU (H200 on PCIe, 16 host cores,
# python3 with torch / transformers / accelerate, no network), under one whole-script deadline
# (GPU_CHECK_BUDGET_S, default 480 s = 8 min, so that a rerun of the stages that failed still fits
# the 15 minutes a machine is lent). Stages, in order of value, each under `timeout` with what is
# left of the budget (and its own cap); every stage runs whatever the ones before it found. The
# caps (CAP below) are a plan that fits the 8 minutes: their sum, plus each stage's kill grace and
# the summary's reserve, is at most the GPU budget, so every stage gets its whole cap however long
# the ones before it took; the script checks that before it runs anything (`--plan` only prints
# the plan and its check):
#   env                  torch, CUDA, the device; the GraceAdam kernel built (a cold build: fails
#                        loudly, and every later stage runs with `host_kernel: cpp`, never the
#                        reference Adam) and named
#   gpu_tests            tests/engine/test_gpu.py (pytest -m gpu; run directly when pytest is absent)
#   train_llama          a ~1B Llama built from LlamaConfig (hidden 2048, 16 layers, intermediate
#                        5504, vocab 32000), bf16, seq 2048 x batch 1, speculation on/off at
#                        max_grad_norm 1.0 and 1e3: tokens/s, MFU (against the H200's 989 TFLOPS
#                        bf16 dense peak), device idle per step, peak device memory and host RSS
#                        against the dry run's figures, the step timeline (trace.json); each mode's
#                        results written when it ends, a refused or failed mode recorded as such
#   flow, activation_offload, tiling, compact, trainer
#                        benchmarks/gpu_features.py: weight-flow on a model made not to fit (the run
#                        sets a device budget), activation offload and the tiled loss and MLP at a
#                        long sequence, compact state, the Trainer with bf16 and gradient
#                        checkpointing; each against its CPU reference, with tokens/s, device idle
#                        and peak memory against the dry run's figures
#   sanitizer            four GPU tests of the engine's streams and the flow and activation_offload
#                        features' device runs (no CPU reference: the plain stages compare) under
#                        the CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1), every entry into its
#                        handler serialized (device/accelerator.py); the summary says what it covers
#                        and what it took against the plain stages
#   host_adam            benchmarks/adam.py at 32M elements (one size, 3 repetitions): the host
#                        Adam rate on every core against its targets (a miss: "missed target")
#   link                 superoffload probe: copy bandwidth host->device and device->host, and
#                        page-locking 1 GiB by cudaHostAlloc against cudaHostRegister (torch's
#                        pinned_use_cuda_host_register): which pins faster
#
# usage: [GPU_CHECK_STAGES=a,b] benchmarks/gpu_check.sh [--rehearse | --plan] [OUT_DIR]
#   OUT_DIR defaults to $OUT (the folder that comes back from the GPU machine), else
#   results/gpu_check. Exactly three files go there, rewritten after every stage: summary.md,
#   summary.json and evidence.tar.gz (every stage's log, gpu_tests.xml, train_llama/results.{json,md},
#   train_llama/timeline/, features/FEATURE.{json,md}, host_adam.json, link.json); the summary is also the last lines of stdout.
#   GPU_CHECK_STAGES: run only these stages (a rerun of the ones that failed; a fresh machine
#   rebuilds the kernel in env, so list env too), the plan checked for them alone.
#   --rehearse: the same stages with the CPU as the device, on the simulated asynchronous
#   device (SUPEROFFLOAD_SIM_DEVICE=1), tiny sizes, each stage's python3 forked from one that
#   imported torch once (benchmarks/_pyfork.py), in about a minute on 2 cores (the test-suite
#   runs it: tests/cli/test_gpu_check.py); it checks the plan too, but caps no stage below what is
#   left of its own budget (GPU_CHECK_BUDGET_S, default 240 there): a loaded CPU is no GPU.
# Exits non-zero when any stage fails, misses a target or runs out of time, listing each; later
# stages still run. GPU_CHECK_FAIL_STAGE=NAME replaces that stage's command by `false`, NAME:N by a
# command that prints a FAIL line and exits N (to test the verdicts: host_adam:2 is a missed target).
set -u -o pipefail

REHEARSE=0 PLAN_ONLY=0
if [ "${1:-}" = "--rehearse" ]; then REHEARSE=1; shift; fi
if [ "${1:-}" = "--plan" ]; then PLAN_ONLY=1; shift; fi

# The plan, in order of value: each stage's cap in seconds on the GPU machine (a cold kernel build
# in env; ten GPU tests; the ~1B Llama in four modes, each building its optimizer and pinning
# ~16 GB; each feature a few steps of a model of 0.1-0.5B parameters and its CPU reference; the
# sanitizer, which runs every op through Python and captures its stack: a first guess with room
# (four of the ten GPU tests and two features' device runs, without the CPU references that fill
# the plain stages' caps), its real cost is in the summary; one 32M-element Adam size (and the roofline's
# build); the link probe, 1 GiB pinned by each method).
STAGE_ORDER=(env gpu_tests train_llama flow activation_offload tiling compact trainer sanitizer host_adam link)
declare -A CAP=([env]=55 [gpu_tests]=50 [train_llama]=100 [flow]=30 [activation_offload]=25 [tiling]=20 [compact]=20
                [trainer]=30 [sanitizer]=35 [host_adam]=25 [link]=20)
GPU_BUDGET=480  # the whole-script deadline on the GPU machine: 8 minutes
if [ "$REHEARSE" = 0 ] && [ -n "${GPU_CHECK_BUDGET_S:-}" ]; then GPU_BUDGET=$GPU_CHECK_BUDGET_S; fi
SELECTED=${GPU_CHECK_STAGES:-} SELECTED_VAR=GPU_CHECK_STAGES

cd "$(dirname "$0")/.."
. benchmarks/_plan.sh
if ! check_selection; then exit 2; fi
if ! check_plan "$GPU_BUDGET"; then exit 2; fi
if [ "$PLAN_ONLY" = 1 ]; then exit 0; fi
if [ "$REHEARSE" = 1 ]; then  # it checks the script, not the GPU's timing: each stage gets what is left
  for name in "${STAGE_ORDER[@]}"; do CAP[$name]=${GPU_CHECK_BUDGET_S:-240}; done
fi

OUT_DIR=${1:-${OUT:-results/gpu_check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset SUPEROFFLOAD_FORCE_REFERENCE  # the kernel that runs is GraceAdam, or the stage fails:
export SUPEROFFLOAD_REQUIRE_KERNEL=1  # host_kernel "auto" (the GPU tests) raises instead of falling back
PY=python3  # the GPU machine's image has no `python`

if [ "$REHEARSE" = 1 ]; then
  BUDGET=${GPU_CHECK_BUDGET_S:-240}
  export SUPEROFFLOAD_SIM_DEVICE=1 SUPEROFFLOAD_GPU_TEST_DEVICE=cpu
  SANITIZER=(env -u TORCH_CUDA_SANITIZER)  # it needs CUDA (and any value, even 0, turns it on)
else
  BUDGET=${GPU_CHECK_BUDGET_S:-480}
  SANITIZER=(env TORCH_CUDA_SANITIZER=1)
fi
# The machine is a VM of 128 GiB whose memory grows as it is used: MemAvailable starts far below
# it, so the runs say what they may use (config `host_memory_budget`), 16 GiB left to the rest.
HOST_BUDGET=${GPU_CHECK_HOST_BUDGET:-112GiB}
MODE=$([ "$REHEARSE" = 1 ] && echo rehearse || echo gpu)
RUN_NAME=gpu_check
. benchmarks/_stages.sh
if [ "$REHEARSE" = 1 ]; then
  # every stage's python3 forks from one that imported torch, transformers and the package once
  # (benchmarks/_pyfork.py): seconds of CPU saved per stage on a shared CPU. The GPU run does not.
  PYFORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_pyfork.XXXXXX")
  $PY benchmarks/_pyfork.py serve "$PYFORK_DIR/socket" > "$PYFORK_DIR/serve.log" 2>&1 &
  PYFORK_PID=$!
  trap 'kill "$PYFORK_PID" 2> /dev/null; rm -rf "$WORK_DIR" "$PYFORK_DIR"' EXIT
  PY="$PY benchmarks/_pyfork.py run $PYFORK_DIR/socket"
fi

if [ "$REHEARSE" = 1 ]; then
  # the test logic on the simulated device, a few of its tests (the whole file is minutes on a CPU)
  TESTS=(tests/engine/test_gpu.py -k synchronizes)
  LLAMA=(--tiny --steps 2 --warmup 1)
  FEATURE=(--rehearse)
  SANITIZED_FEATURES=(activation_offload)  # (the rehearsal has no sanitizer: one feature checks the command;
  SANITIZED_TESTS=()                       # the tests it also runs on CUDA ran in gpu_tests)
  ADAM=(--sizes 1M --reps 2 --warmup 1 --threads 2 --no-targets --only grad)  # grad: no roofline build
  PROBE=(--device cpu --quick)
else
  TESTS=(tests/engine/test_gpu.py)
  LLAMA=(--hidden 2048 --intermediate 5504 --layers 16 --heads 16 --kv-heads 16 --vocab 32000
         --seq 2048 --batch 1 --steps 3 --warmup 1 --dtype bf16
         --host-memory-budget "$HOST_BUDGET")
  ADAM=(--sizes 32M --reps 3 --warmup 1 --threads "$(nproc)" --only adam)
  FEATURE=()
  SANITIZED_FEATURES=(flow activation_offload)
  # the engine's side streams, pinned copies, worker copy-backs, rollback and the steady step
  SANITIZED_TESTS=(tests/engine/test_gpu.py -k "side_streams or next_forward or snapshot_rollback or synchronizes")
  PROBE=()
fi

stage env "${CAP[env]}" $PY -c "
import torch
from superoffload_hf.host import kernel
print(f'torch {torch.__version__}, cuda {torch.version.cuda}, '
      + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'))
print(kernel.describe(kernel.get_host_adam('cpp')))"
if [ -f "$WORK_DIR/env.log" ]; then head -n 2 "$WORK_DIR/env.log" | sed 's/^/  /' >> "$summary_md"; fi

if { selected gpu_tests || selected sanitizer; } && $PY -c "import pytest" 2>/dev/null; then
  # addopts cleared: --strict-markers would reject the timeout marks when pytest-timeout is absent
  PYTEST=($PY -m pytest -o addopts="" -p no:cacheprovider -q -rs -m gpu)
  stage gpu_tests "${CAP[gpu_tests]}" "${PYTEST[@]}" --junitxml="$WORK_DIR/gpu_tests.xml" "${TESTS[@]}"
else
  PYTEST=($PY)
  TESTS=(tests/engine/test_gpu.py)
  if [ "$REHEARSE" = 0 ]; then SANITIZED_TESTS=(tests/engine/test_gpu.py); fi  # its small runner takes no -k
  stage gpu_tests "${CAP[gpu_tests]}" $PY tests/engine/test_gpu.py
fi
if [ -f "$WORK_DIR/gpu_tests.log" ]; then
  grep -E "passed|failed|error" "$WORK_DIR/gpu_tests.log" | tail -n 1 | sed 's/^/  /' >> "$summary_md"
fi

stage train_llama "${CAP[train_llama]}" $PY benchmarks/train_llama.py "${LLAMA[@]}" --max-grad-norm 1.0,1e3 \
  --host-kernel cpp --timeline-dir "$WORK_DIR/train_llama/timeline" --out "$WORK_DIR/train_llama"
summarize train_llama/results.md

for feature in flow activation_offload tiling compact trainer; do
  stage "$feature" "${CAP[$feature]}" $PY benchmarks/gpu_features.py "$feature" "${FEATURE[@]}" --out "$WORK_DIR/features"
  if [ -f "$WORK_DIR/features/$feature.md" ]; then sed 's/^- /  - /' "$WORK_DIR/features/$feature.md" >> "$summary_md"; fi
done

# the engine enters the sanitizer in its worker thread too, every entry into its handler under one
# lock (device/accelerator.py serialize_sanitizer)
SANITIZED=""
if [ "${#SANITIZED_TESTS[@]}" -gt 0 ]; then SANITIZED="${PYTEST[*]} ${SANITIZED_TESTS[*]@Q} && "; fi
for feature in "${SANITIZED_FEATURES[@]}"; do
  SANITIZED+="$PY benchmarks/gpu_features.py $feature ${FEATURE[*]} --no-reference --out $WORK_DIR/sanitizer && "
done
SANITIZED+="true"
stage sanitizer "${CAP[sanitizer]}" "${SANITIZER[@]}" bash -c "$SANITIZED"
if selected sanitizer; then
  plain=""
  for name in gpu_tests "${SANITIZED_FEATURES[@]}"; do
    if [ -n "${TOOK[$name]:-}" ]; then plain+="${plain:+, }$name ${TOOK[$name]}s"; fi
  done
  cat >> "$summary_md" <<EOF
  - the sanitizer ran on: $([ "$REHEARSE" = 0 ] && echo "${SANITIZED_TESTS[*]} and ")the features ${SANITIZED_FEATURES[*]} without their CPU references$([ "$REHEARSE" = 1 ] && echo " (rehearsal: without it, it needs CUDA; on CUDA also four tests of tests/engine/test_gpu.py)").
    It took ${TOOK[sanitizer]:-?}s of its ${LIMIT_S[sanitizer]:-?}s limit (cap ${CAP[sanitizer]}s; the plain stages, which run every GPU test and each feature with its CPU
    reference: ${plain:-not run}).
    It checks the CUDA ops dispatched through torch on the training thread, on autograd's device
    thread (torch hands it the caller's modes) and on the engine's worker thread (which enters
    its dispatch mode, device/accelerator.py), and every event record, wait and synchronisation,
    stream creation, allocation and free of any thread: every entry into its handler holds one lock,
    so the threads feed it one consistent state (tests/engine/test_sanitizer_threads.py). It does not see:
    two threads acting on one stream or buffer with no host hand-off between them (a kernel is
    queued before the handler records it, so such work may be recorded in either order; the engine
    hands every buffer between threads through the host: its job queue and waited events); host
    memory (pinned buffers are not CUDA tensors: a host write while a copy reads one is the
    simulator's check); record_stream (skipped) and the caching allocator's reuse across streams;
    the GraceAdam kernel and anything not dispatched through torch. A report is a race to fix; a
    clean run covers the paths these tests and features took.
EOF
fi

stage host_adam "${CAP[host_adam]}" --missed-rc 2 $PY benchmarks/adam.py "${ADAM[@]}" --json "$WORK_DIR/host_adam.json"
stage link "${CAP[link]}" $PY -m superoffload_hf.cli probe "${PROBE[@]}" --json "$WORK_DIR/link.json"
if [ -f "$WORK_DIR/link.log" ]; then grep "page-locking" "$WORK_DIR/link.log" | sed 's/^/  /' >> "$summary_md"; fi

finish
