#!/usr/bin/env bash
# Issue #14, eighth and ninth passes (docs/history/benchmarks-2026-11.md "Wake-ups"): the device checks
# on these binaries, then the same transfer cases with each --idle-poll-us of POLLS
# (default "50 1000000": a 50 µs poll, and one that keeps the pool awake between the
# bench's transfers), alternating in separate processes (A B A B), then the index's cold
# lookups on this machine's CPU (INDEX=0 skips them). BENCHES="umbp-bench-old umbp-bench"
# alternates two builds as well (the tenth pass: a build before a change against one after). Raw output under $OUT. Run from the
# repository root with the binaries of scripts/device/build.sh in BIN (default .device-bin):
#
#   OUT=/tmp/poll bash scripts/device/idle-poll.sh
#
# About 6 minutes of an H200. Exit status non-zero if a check or a bench failed.
set -uo pipefail
bin=${BIN:-.device-bin}
out=${OUT:-/tmp}
layouts=${LAYOUTS:-kv4k,kv8k,gptoss,obj}
# ROUNDS: A B pairs (default 2); CHECKS: run-gpu-tests.sh stages ("" for none).
fail=0
echo "=== checks: ${CHECKS-gpucheck check kcheck scheck extpool}"
if [ -n "${CHECKS-gpucheck check kcheck scheck extpool}" ]; then
  BIN=$bin OUT=$out STAGES="${CHECKS-gpucheck check kcheck scheck extpool}" STAGE_TIMEOUT=150 \
    bash scripts/device/run-gpu-tests.sh > "$out/gpu-tests.log" 2>&1 || fail=1
  grep "=== .*rc=" "$out/gpu-tests.log"
fi
# BENCHES: bench binaries in $bin to alternate as well (A/B of two builds), default the one.
for round in $(seq 1 "${ROUNDS:-2}"); do
  for bench in ${BENCHES:-umbp-bench}; do
    for poll in ${POLLS:-50 1000000}; do
      name=poll$poll-$round
      [ "$bench" = umbp-bench ] || name=$bench-$name
      echo "=== $name: $bench transfer --backend cuda --json --reps 3 --layouts $layouts --idle-poll-us $poll"
      timeout -k 5 200 "$bin/$bench" transfer --backend cuda --json --reps 3 --layouts "$layouts" \
        --idle-poll-us "$poll" > "$out/$name.jsonl" 2> "$out/$name.err" || fail=1
      grep -hoE '"case":"[a-z0-9_]+","value":[0-9.]+' "$out/$name.jsonl" | sed 's/"case"://; s/,"value"//' | tr '\n' ' '
      echo
    done
  done
done
if [ "${INDEX:-1}" != 0 ]; then
  echo "=== index: index --json --keys 625 --iterations 2000"
  timeout -k 5 120 "$bin/umbp-bench" index --json --keys 625 --iterations 2000 > "$out/index.jsonl" 2> "$out/index.err" || fail=1
  grep -h cold "$out/index.jsonl" | cut -c1-200
fi
echo "=== fail=$fail"
exit $fail
