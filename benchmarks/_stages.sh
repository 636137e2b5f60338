# The stages of a prepared run (sourced by gpu_check.sh and gpu_peers.sh). Before sourcing, set
# OUT_DIR, BUDGET (seconds for the whole run) and MODE; `stage` runs one stage under the deadline,
# `finish` prints the verdict and gives the exit status.
. benchmarks/_plan.sh  # RESERVE, KILL_GRACE
START=$SECONDS
status=0
STAGES_JSON=()
summary_md="$OUT_DIR/summary.md"
summary_json="$OUT_DIR/summary.json"
echo "# $RUN_NAME ($MODE) $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s" > "$summary_md"

json_str() {  # a JSON string literal of $1
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/\\t}
  printf '"%s"' "$s"
}

write_json() {
  local joined
  joined=$(IFS=,; echo "${STAGES_JSON[*]:-}")
  printf '{"mode": "%s", "budget_s": %d, "elapsed_s": %d, "passed": %s, "stages": [%s]}\n' \
    "$MODE" "$BUDGET" "$((SECONDS - START))" "$([ "$status" -eq 0 ] && echo true || echo false)" "$joined" \
    > "$summary_json"
}

# stage NAME CAP_SECONDS COMMAND...: run under timeout (the smaller of CAP and what the budget has
# left), tee to OUT/NAME.log, append its verdict to summary.md and summary.json.
stage() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START) - RESERVE))
  local limit=$((cap < left ? cap : left))
  local t0=$SECONDS rc verdict
  if [ "${GPU_CHECK_FAIL_STAGE:-}" = "$name" ]; then set -- false; fi
  echo "=== $name (limit ${limit}s): $*"
  if [ "$limit" -lt 5 ]; then
    rc=124
    echo "not run: the budget is spent" > "$OUT_DIR/$name.log"
  else
    timeout -k "$KILL_GRACE" "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
  fi
  if [ "$rc" -eq 0 ]; then
    verdict=ok
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="timeout"; status=1
  else
    verdict="failed"; status=1
  fi
  local took=$((SECONDS - t0))
  echo "- $name: $verdict (exit $rc) in ${took}s of ${limit}s (log: $name.log)" | tee -a "$summary_md"
  STAGES_JSON+=("{\"stage\": \"$name\", \"status\": \"$verdict\", \"rc\": $rc, \"seconds\": $took, \"limit_s\": $limit, \"log\": \"$name.log\", \"command\": $(json_str "$*")}")
  write_json
}


finish() {
  write_json
  echo "$RUN_NAME ($MODE): $([ $status -eq 0 ] && echo PASSED || echo FAILED) in $((SECONDS - START))s; results in $OUT_DIR" \
    | tee -a "$summary_md"
  return $status
}
