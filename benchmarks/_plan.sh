# The time plan of a prepared run (sourced by _stages.sh; gpu_check.sh and gpu_peers.sh check their
# plan, and the stages chosen to run (SELECTED), with it).
# A stage runs under `timeout -k KILL_GRACE LIMIT`: it may take up to LIMIT + KILL_GRACE seconds.
RESERVE=10     # seconds kept for writing the summary after the last stage
KILL_GRACE=5   # seconds between timeout's TERM and its KILL

# check_plan BUDGET [BUDGET_VAR SCRIPT]: print the plan (STAGE_ORDER, each stage's CAP) and whether
# it fits BUDGET seconds: every stage's cap and kill grace, and the reserve. Non-zero, naming the fix
# (SCRIPT's CAP or the BUDGET_VAR environment variable), if not.
check_plan() {
  local budget=$1 var=${2:-GPU_CHECK_BUDGET_S} script=${3:-benchmarks/gpu_check.sh} total=$RESERVE name line=""
  for name in "${STAGE_ORDER[@]}"; do
    total=$((total + CAP[$name] + KILL_GRACE))
    line+="${line:+ + }$name ${CAP[$name]}"
  done
  echo "plan: $line s, + ${KILL_GRACE} s kill grace per stage + ${RESERVE} s reserve = ${total} s of a ${budget} s budget"
  if [ "$total" -gt "$budget" ]; then
    echo "plan does not fit: ${total} s > ${budget} s; a stage after an overrun would be cut. Lower the caps" \
         "(CAP in $script) or raise the budget ($var)." >&2
    return 1
  fi
}

# check_selection: every name in SELECTED is a stage; non-zero naming the valid ones if not. Then
# drops the stages not selected from STAGE_ORDER (the plan checks only what runs).
check_selection() {
  local name kept=()
  [ -z "${SELECTED:-}" ] && return 0
  for name in ${SELECTED//,/ }; do
    if [[ " ${STAGE_ORDER[*]} " != *" $name "* ]]; then
      echo "unknown stage '$name' in ${SELECTED_VAR:-the stages to run}=$SELECTED; expected a comma-separated list of: ${STAGE_ORDER[*]}" >&2
      return 1
    fi
  done
  for name in "${STAGE_ORDER[@]}"; do
    if [[ ",$SELECTED," == *",$name,"* ]]; then kept+=("$name"); fi
  done
  STAGE_ORDER=("${kept[@]}")
}

selected() { [ -z "${SELECTED:-}" ] || [[ ",$SELECTED," == *",$1,"* ]]; }
