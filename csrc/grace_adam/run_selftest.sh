#!/usr/bin/env bash
# Build and run the GraceAdam self-test (selftest.cpp, no torch): natively, then, when
# aarch64-linux-gnu-g++ and qemu-aarch64 exist, cross-compiled for aarch64 under qemu with SVE at
# 128 bits (Grace), 512 bits, and SVE off (the NEON-only dispatch). The runs go in parallel; each
# leaves BUILD_DIR/<label>.log (the driver's full report) and BUILD_DIR/<label>.rc.
#
#   run_selftest.sh [BUILD_DIR]            (default: a fresh temporary directory)
#
# Env: SELFTEST_SKIP_NATIVE=1 / SELFTEST_SKIP_AARCH64=1 skip a half; SELFTEST_REQUIRE_AARCH64=1
# makes missing cross tools an error instead of a skip; SELFTEST_CACHE_DIR=DIR keeps each built
# driver there, keyed by the compiler's --version, the architecture, the flags and every source
# and header, and copies it from there instead of building it again (~10 s of CPU a build).
# Exits non-zero if a build or any run fails.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${1:-$(mktemp -d -t grace_adam_selftest.XXXXXX)}"
mkdir -p "$BUILD"

FLAGS=(-O2 -ffp-contract=off -std=c++17 -Wall -Wextra)
COMMON=(adam_scalar.cpp dispatch.cpp selftest.cpp)
X86_SOURCES=("${COMMON[@]}" adam_avx2.cpp adam_avx512.cpp)
ARM_SOURCES=("${COMMON[@]}" adam_neon.cpp adam_sve.cpp)
# cpu:expected ISAs[:extra driver flags]. SVE at 512 bits emulates ~10x slower than at 128 (52 s
# of CPU, most of the suite's selftest time): at the large size it runs the 3 configurations
# that cover each output dtype; the vector-length edges are the small sizes, all run there.
QEMU_CPUS=("max,sve128=on:scalar,neon,sve" "max,sve512=on:scalar,neon,sve:--large-configs=3" "max,sve=off:scalar,neon")

failures=0

sources_for() {  # architecture name -> the per-ISA files its build lists (as the binding's build)
  case "$1" in
    x86_64) echo "${X86_SOURCES[@]}" ;;
    aarch64) echo "${ARM_SOURCES[@]}" ;;
    *) echo "${COMMON[@]}" ;;
  esac
}

build() {  # compiler, output, architecture, extra flags...
  local cxx="$1" out="$2" arch="$3"
  shift 3
  local srcs=() cached=""
  for f in $(sources_for "$arch"); do srcs+=("$HERE/$f"); done
  if [[ -n "${SELFTEST_CACHE_DIR:-}" ]] && command -v sha256sum >/dev/null; then
    local key
    key="$({ "$cxx" --version; echo "$arch ${FLAGS[*]} $*"; cat "${srcs[@]}" "$HERE"/*.h; } | sha256sum | cut -c1-16)"
    cached="$SELFTEST_CACHE_DIR/$(basename "$out")-$key"
    if [[ -x "$cached" ]]; then
      echo "== build $out: the cached $cached"
      cp "$cached" "$out"
      return
    fi
  fi
  echo "== build $out ($cxx, $arch)"
  "$cxx" "${FLAGS[@]}" "$@" -I"$HERE" "${srcs[@]}" -o "$out"
  if [[ -n "$cached" ]]; then  # a cache that cannot be written only costs the next run a build
    { mkdir -p "$SELFTEST_CACHE_DIR" && cp "$out" "$cached.$$" && mv "$cached.$$" "$cached"; } 2>/dev/null || true
  fi
}

start() {  # label, command...: runs in the background; output in BUILD/label.log, status in label.rc
  local label="$1"
  shift
  echo "== run $label: $*"
  ( set +e; "$@" >"$BUILD/$label.log" 2>&1; echo $? >"$BUILD/$label.rc" ) &
  labels+=("$label")
}

report() {  # label: after `wait`, prints the run's summary line (and its first failures)
  local label="$1" rc
  rc="$(cat "$BUILD/$label.rc" 2>/dev/null || echo missing)"
  if [[ "$rc" == 0 ]]; then
    echo "$label: $(tail -n 1 "$BUILD/$label.log")"
  else
    echo "$label: FAILED (exit $rc); first failures and summary:"
    grep -m 25 '^FAIL' "$BUILD/$label.log" || true
    tail -n 1 "$BUILD/$label.log"
    failures=$((failures + 1))
  fi
}

native=0 cross=0
[[ "${SELFTEST_SKIP_NATIVE:-0}" != 1 ]] && native=1
if [[ "${SELFTEST_SKIP_AARCH64:-0}" != 1 ]]; then
  missing=""
  command -v aarch64-linux-gnu-g++ >/dev/null || missing+=" aarch64-linux-gnu-g++"
  command -v qemu-aarch64 >/dev/null || missing+=" qemu-aarch64"
  if [[ -z "$missing" ]]; then
    cross=1
  else
    if [[ "${SELFTEST_REQUIRE_AARCH64:-0}" == 1 ]]; then
      echo "== aarch64: FAILED, SELFTEST_REQUIRE_AARCH64=1 but not installed:$missing"
      failures=$((failures + 1))
    else
      echo "== aarch64: SKIPPED, not installed:$missing"
    fi
  fi
fi

# Both builds (in parallel) before any run, so that a failing build leaves no run behind.
builds=()
if ((native)); then
  build "${CXX:-g++}" "$BUILD/selftest_native" "$(uname -m)" &
  builds+=($!)
fi
if ((cross)); then
  build aarch64-linux-gnu-g++ "$BUILD/selftest_aarch64" aarch64 -static &  # -static: qemu needs no sysroot
  builds+=($!)
fi
for pid in "${builds[@]}"; do
  wait "$pid" || { echo "GraceAdam selftest: a build FAILED (see the compiler output above)"; exit 1; }
done

labels=()
((native)) && start native "$BUILD/selftest_native"
if ((cross)); then
  for spec in "${QEMU_CPUS[@]}"; do
    IFS=: read -r cpu isas extra <<<"$spec"
    start "qemu_${cpu//[,=]/_}" qemu-aarch64 -cpu "$cpu" "$BUILD/selftest_aarch64" --quick --expect-isas="$isas" $extra
  done
fi
wait
for label in "${labels[@]}"; do report "$label"; done

if ((failures > 0)); then
  echo "GraceAdam selftest: $failures FAILED (logs in $BUILD)"
  exit 1
fi
if ((${#labels[@]} == 0)); then
  echo "GraceAdam selftest: nothing ran (no native build, no aarch64 tools)"
  exit 1
fi
echo "GraceAdam selftest: all runs passed (logs in $BUILD)"
