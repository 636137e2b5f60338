# The stages of a prepared run (sourced by gpu_check.sh and gpu_peers.sh). Before sourcing, set
# OUT_DIR, BUDGET (seconds for the whole run), MODE, RUN_NAME, STAGE_ORDER and SELECTED (the stages
# to run, comma-separated; empty: all); `stage` runs one stage under the deadline, `finish` prints
# the verdict, the summary last, and gives the exit status.
#
# What comes back from the GPU machine is at most 8 files, so OUT_DIR gets exactly three, each
# rewritten after every stage (a run cut short keeps what it measured): summary.md, summary.json and
# evidence.tar.gz, the archive of WORK_DIR (every stage's log, JSON, XML and timeline). Stages
# write their files to WORK_DIR, never to OUT_DIR.
. benchmarks/_plan.sh  # RESERVE, KILL_GRACE
START=$SECONDS
status=0
STAGES_JSON=()
PROBLEMS=()  # "stage: what", for the verdict: each failed stage and each missed target
declare -A TOOK=() LIMIT_S=()  # each stage that ran: the seconds it took, and its limit
summary_md="$OUT_DIR/summary.md"
summary_json="$OUT_DIR/summary.json"
ARCHIVE=evidence.tar.gz
WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/${RUN_NAME}.XXXXXX")
trap 'rm -rf "$WORK_DIR"' EXIT
echo "# $RUN_NAME ($MODE) $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s${SELECTED:+, stages $SELECTED}" > "$summary_md"
echo "Every log, JSON and timeline named here is in $ARCHIVE (tar -xzf $ARCHIVE)." >> "$summary_md"

json_str() {  # a JSON string literal of $1
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/\\t}
  printf '"%s"' "$s"
}

json_list() {  # a JSON list of string literals of "$@"
  local out="" item
  for item in "$@"; do out+="${out:+, }$(json_str "$item")"; done
  printf '[%s]' "$out"
}

write_json() {
  local joined
  joined=$(IFS=,; echo "${STAGES_JSON[*]:-}")
  printf '{"mode": "%s", "budget_s": %d, "elapsed_s": %d, "passed": %s, "selected": %s, "archive": "%s", "problems": %s, "stages": [%s]}\n' \
    "$MODE" "$BUDGET" "$((SECONDS - START))" "$([ "$status" -eq 0 ] && echo true || echo false)" \
    "$(json_str "${SELECTED:-all}")" "$ARCHIVE" "$(json_list "${PROBLEMS[@]}")" "$joined" > "$summary_json"
}

write_archive() {  # atomically, so that a run killed while archiving still leaves the previous archive
  tar -czf "$OUT_DIR/.$ARCHIVE.part" -C "$WORK_DIR" . && mv "$OUT_DIR/.$ARCHIVE.part" "$OUT_DIR/$ARCHIVE"
}

# stage NAME CAP_SECONDS [--missed-rc N] COMMAND...: run under timeout (the smaller of CAP and what
# the budget has left) whatever the stages before found, tee to WORK_DIR/NAME.log, append its
# verdict to summary.md and summary.json, rewrite the archive. Exit N (--missed-rc) means the stage
# ran and measured but missed a target; the log's "FAIL:" lines say which. A stage not in
# SELECTED does not run and is not reported.
stage() {
  local name=$1 cap=$2 missed_rc=""
  shift 2
  if [ "${1:-}" = "--missed-rc" ]; then missed_rc=$2; shift 2; fi
  selected "$name" || return 0
  local left=$((BUDGET - (SECONDS - START) - RESERVE))
  local limit=$((cap < left ? cap : left))
  local t0=$SECONDS rc verdict log="$WORK_DIR/$name.log"
  local forced=${GPU_CHECK_FAIL_STAGE:-}  # NAME or NAME:EXIT_STATUS (to test the verdicts)
  if [ "${forced%%:*}" = "$name" ]; then
    set -- sh -c "echo 'FAIL: forced by GPU_CHECK_FAIL_STAGE=$forced'; exit ${forced#*:}"
    [ "$forced" = "$name" ] && set -- false
  fi
  echo "=== $name (limit ${limit}s): $*"
  if [ "$limit" -lt 5 ]; then
    rc=124
    echo "not run: the budget is spent" > "$log"
  else
    timeout -k "$KILL_GRACE" "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
  fi
  local fails
  fails=$(grep -E "^FAIL: " "$log" | head -n 5)
  if [ "$rc" -eq 0 ]; then
    verdict=ok
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="timeout"; status=1; PROBLEMS+=("$name: timed out after ${limit}s")
  elif [ -n "$missed_rc" ] && [ "$rc" -eq "$missed_rc" ]; then
    verdict="missed target"; status=1; PROBLEMS+=("$name: missed target: ${fails:-see $name.log}")
  else
    verdict="failed"; status=1; PROBLEMS+=("$name: failed (exit $rc)${fails:+: $fails}")
  fi
  local took=$((SECONDS - t0))
  TOOK[$name]=$took LIMIT_S[$name]=$limit
  echo "- $name: $verdict (exit $rc) in ${took}s of ${limit}s (log: $name.log)" | tee -a "$summary_md"
  if [ -n "$fails" ]; then sed 's/^/  - /' <<< "$fails" >> "$summary_md"; fi
  STAGES_JSON+=("{\"stage\": \"$name\", \"status\": \"$verdict\", \"rc\": $rc, \"seconds\": $took, \"limit_s\": $limit, \"log\": \"$name.log\", \"fails\": $(json_str "$fails"), \"command\": $(json_str "$*")}")
  write_json
  write_archive
}

# summarize FILE: append FILE (under WORK_DIR) to summary.md, if the stage wrote it.
summarize() {
  if [ -f "$WORK_DIR/$1" ]; then { echo; cat "$WORK_DIR/$1"; echo; } >> "$summary_md"; fi
}

finish() {
  local problem bytes
  write_archive
  bytes=$(stat -c %s "$OUT_DIR/$ARCHIVE")
  if [ "$bytes" -gt $((16 << 20)) ]; then  # the largest file that comes back
    status=1; PROBLEMS+=("$ARCHIVE is $bytes bytes, over the 16 MiB that come back: it will be missing")
  fi
  if [ "$status" -ne 0 ]; then
    echo >> "$summary_md"
    echo "Failed stages and missed targets:" >> "$summary_md"
    for problem in "${PROBLEMS[@]}"; do echo "- $problem" >> "$summary_md"; done
  fi
  echo "$RUN_NAME ($MODE): $([ $status -eq 0 ] && echo PASSED || echo FAILED) in $((SECONDS - START))s; results in $OUT_DIR" \
    >> "$summary_md"
  write_json
  write_archive
  echo "=== summary ($summary_md)"
  cat "$summary_md"  # the last lines of stdout: what comes back even when the files do not
  return $status
}
