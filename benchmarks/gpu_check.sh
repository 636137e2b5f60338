#!/usr/bin/env bash
# The GPU checks in one script, for a machine with one CUDA GPU and the torch, transformers and
# accelerate of its image (no network needed); under 8 minutes in all:
#   1. build (or load from the cache) the GraceAdam kernel and name the back end in use;
#   2. the GPU-marked tests (pytest -m gpu; tests/test_gpu.py run directly when pytest is absent),
#      then again under the CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1); test_gpu.py also
#      checks with torch.cuda.set_sync_debug_mode that the steady-state step never syncs;
#   3. benchmarks/train_llama.py: a randomly initialised ~1B Llama, bf16, seq 1024 x batch 4,
#      speculation on and off: step time, tokens/s, peak device memory, host wait.
#
# usage: benchmarks/gpu_check.sh OUT_DIR
# Writes OUT_DIR/{kernel,gpu_tests,train_llama}.log, OUT_DIR/train_llama/results.{json,md} and
# OUT_DIR/summary.md. Exits non-zero when any part fails or runs past its time limit.
set -uo pipefail

OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
status=0
summary="$OUT/summary.md"
echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$summary"
$PY -c "import torch; print(f'torch {torch.__version__}, cuda {torch.version.cuda}, ' + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO GPU'))" | tee -a "$summary"

# part NAME LIMIT_SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log, record the result.
part() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local verdict="ok"
  if [ "$rc" -ne 0 ]; then
    verdict="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ", time limit ${limit}s"))"
    status=1
  fi
  echo "- $name: $verdict in $((SECONDS - start)) s (log: $name.log)" | tee -a "$summary"
  tail -n 5 "$OUT/$name.log"
}

part kernel 120 $PY -c "
from superoffload_hf.host import kernel
adam = kernel.get_host_adam('cpp')
print(kernel.describe(adam))"

if $PY -c "import pytest" 2>/dev/null; then
  # addopts cleared: --strict-markers would reject the timeout marks when pytest-timeout is absent.
  part gpu_tests 150 $PY -m pytest -o addopts="" -p no:cacheprovider -q -rs -m gpu tests
  # The same tests under the CUDA stream sanitizer (the engine enters it in its worker thread too).
  part gpu_tests_sanitizer 200 env TORCH_CUDA_SANITIZER=1 $PY -m pytest -o addopts="" -p no:cacheprovider -q -rs -m gpu tests
else
  part gpu_tests 150 $PY tests/test_gpu.py
fi

part train_llama 240 $PY benchmarks/train_llama.py --max-grad-norm 1.0,1e3 --out "$OUT/train_llama"
if [ -f "$OUT/train_llama/results.md" ]; then
  { echo; cat "$OUT/train_llama/results.md"; } >> "$summary"
fi

echo "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED); results in $OUT"
exit $status
