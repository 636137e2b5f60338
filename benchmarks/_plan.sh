# The time plan of a prepared run (sourced by _stages.sh; gpu_check.sh checks its plan with it).
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
