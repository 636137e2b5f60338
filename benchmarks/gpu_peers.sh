#!/usr/bin/env bash
# The peers, side by side in one prepared run: benchmarks/e2e.py's table (ours, torch AdamW on the
# device, torchao CPUOffloadOptimizer, DeepSpeed ZeRO-2/3 offload, DeepSpeed SuperOffload) on the
# GPU machine, with the peers installed from a folder of wheels carried in the working tree
# (default wheels/, or $WHEELS; at most 64 MiB; benchmarks/README.md says how to fill it), under
# one whole-script deadline (GPU_PEERS_BUDGET_S, default 540 s). The stage caps (CAP below) are a
# plan that fits it with each stage's kill grace and the summary's reserve, checked before anything
# runs (`--plan` only prints the plan and its check), so a slow install cannot cut the table. Stages:
#   install  pip install --no-index --no-deps --no-build-isolation --target $PEERS_DIR of every
#            file in the folder (torch stays the machine's; DeepSpeed, an sdist, builds here
#            without network: its ops JIT-build with ninja at first use)
#   peers    which peers import, and their versions
#   e2e      benchmarks/e2e.py --gpu: the table, every row measured or saying why not
#
# usage: [GPU_PEERS_STAGES=a,b] benchmarks/gpu_peers.sh [--rehearse | --plan] [OUT_DIR]
#   OUT_DIR defaults to $OUT, else results/gpu_peers: summary.{md,json} and evidence.tar.gz (each
#   stage's log, e2e.json); the summary is also the last lines of stdout. GPU_PEERS_STAGES: run
#   only these stages.
#   --rehearse: the CPU, the simulated device, e2e.py --smoke, and no install (unless
#   GPU_PEERS_INSTALL=1): whichever peers already import run. Exits non-zero when a stage fails.
set -u -o pipefail

REHEARSE=0 PLAN_ONLY=0
if [ "${1:-}" = "--rehearse" ]; then REHEARSE=1; shift; fi
if [ "${1:-}" = "--plan" ]; then PLAN_ONLY=1; shift; fi

# The plan: each stage's cap in seconds on the GPU machine (pip from local files, DeepSpeed's sdist
# built without isolation; two imports; e2e.py's rows, each a fresh optimizer on a ~1B model).
STAGE_ORDER=(install peers e2e)
declare -A CAP=([install]=120 [peers]=30 [e2e]=355)
GPU_BUDGET=540  # the whole-script deadline on the GPU machine: 9 minutes
if [ "$REHEARSE" = 0 ] && [ -n "${GPU_PEERS_BUDGET_S:-}" ]; then GPU_BUDGET=$GPU_PEERS_BUDGET_S; fi
SELECTED=${GPU_PEERS_STAGES:-} SELECTED_VAR=GPU_PEERS_STAGES

cd "$(dirname "$0")/.."
. benchmarks/_plan.sh
if ! check_selection; then exit 2; fi
if ! check_plan "$GPU_BUDGET" "GPU_PEERS_BUDGET_S" "benchmarks/gpu_peers.sh"; then exit 2; fi
if [ "$PLAN_ONLY" = 1 ]; then exit 0; fi
if [ "$REHEARSE" = 1 ]; then  # it checks the script, not the GPU's timing: each stage gets what is left
  for name in "${STAGE_ORDER[@]}"; do CAP[$name]=${GPU_PEERS_BUDGET_S:-180}; done
fi

OUT_DIR=${1:-${OUT:-results/gpu_peers}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WHEELS=${WHEELS:-wheels}
PEERS_DIR=${PEERS_DIR:-/tmp/superoffload_peers}
export PYTHONPATH="$PWD:$PEERS_DIR${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=python3  # the GPU machine's image has no `python`
MODE=$([ "$REHEARSE" = 1 ] && echo rehearse || echo gpu)
RUN_NAME=gpu_peers
if [ "$REHEARSE" = 1 ]; then
  BUDGET=${GPU_PEERS_BUDGET_S:-180}
  export SUPEROFFLOAD_SIM_DEVICE=1
  E2E=(--smoke)
  INSTALL=${GPU_PEERS_INSTALL:-0}
else
  BUDGET=${GPU_PEERS_BUDGET_S:-540}
  E2E=(--gpu)
  INSTALL=1
fi
. benchmarks/_stages.sh

if [ "$INSTALL" = 1 ]; then
  if compgen -G "$WHEELS/*" > /dev/null; then
    stage install "${CAP[install]}" $PY -m pip install --no-index --no-deps --no-build-isolation --target "$PEERS_DIR" \
      "$WHEELS"/*
  else
    stage install 5 sh -c "echo 'no wheels in $WHEELS: see benchmarks/README.md'; false"
  fi
fi
stage peers "${CAP[peers]}" $PY -c "
import importlib
for name in ('deepspeed', 'torchao'):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # a peer that does not import keeps its row, with the reason
        print(name, 'not importable:', type(exc).__name__, exc)"
stage e2e "${CAP[e2e]}" $PY benchmarks/e2e.py "${E2E[@]}" --json "$WORK_DIR/e2e.json"
if [ -f "$WORK_DIR/e2e.log" ]; then grep -E "^\|" "$WORK_DIR/e2e.log" >> "$summary_md"; fi
finish
