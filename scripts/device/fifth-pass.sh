#!/usr/bin/env bash
# Issue #14, fifth pass (docs/history/benchmarks-2026-11.md "CPU work per page and per operation"): the
# device checks on these binaries, then the transfer figures, raw JSON lines under $OUT.
# Run from the repository root (the scripts of scripts/device/ are used from there) with
# the binaries of scripts/device/build.sh in BIN:
#
#   BIN=.device-bin/h-gpu5 bash .device-bin/h-gpu5/fifth-pass.sh
#
# Needs about 8-10 minutes of an H200. Exit status non-zero if a check or the bench failed.
set -uo pipefail
bin=${BIN:-.device-bin}
out=${OUT:-/tmp}
fail=0
echo "=== checks: run-gpu-tests.sh gpucheck check kcheck"
BIN=$bin OUT=$out STAGES="gpucheck check kcheck" STAGE_TIMEOUT=${STAGE_TIMEOUT:-150} \
  bash scripts/device/run-gpu-tests.sh > "$out/gpu-tests.log" 2>&1 || fail=1
grep "=== .*rc=" "$out/gpu-tests.log"
echo "=== bench: transfer --backend cuda --json --reps 3 --layouts obj,kv4k,kv8k,kv16k,gptoss,bidir"
timeout -k 5 330 "$bin/umbp-bench" transfer --backend cuda --json --reps 3 \
  --layouts obj,kv4k,kv8k,kv16k,gptoss,bidir > "$out/main.jsonl" 2> "$out/main.err" || fail=1
tail -3 "$out/main.err"
echo "=== fail=$fail"
exit $fail
