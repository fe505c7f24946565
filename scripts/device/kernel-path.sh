#!/usr/bin/env bash
# Issue #14 on a GPU machine: the page copy kernel path's checks and measurements, in one
# call. Run from a folder holding the binaries of scripts/device/build.sh (BIN, default
# .device-bin) and with the repository's scripts/ at REPO (default: two folders up from
# BIN, or .). Everything but JSON goes to stdout and $OUT/kernel-path.log; JSON lines of
# each bench run to $OUT/<stage>.jsonl (at most 6 files: the device tool returns 8).
#
#   STAGES="tests check layout" bash scripts/device/kernel-path.sh
#
# Stages (default: all):
#   tests   test-cuda_gather (byte-exact 4/8/16 KiB pages both ways, fenced store after a
#           slow kernel, fenced load before a reading kernel, calibration printed), test-cuda
#   check   umbp-bench transfer --check --gather kernel: cross-process fences, worker
#           killed mid-transfer, all on the kernel path
#   layout  umbp-bench --layout-only with --gather auto / kernel / copy-engine
#   full    umbp-bench full run --gather auto (object table, bidir, interference)
#   kfull   umbp-bench full run --gather kernel (interference with the kernel active)
#   main    umbp-bench gptoss, kv4k/kv8k/kv16k, obj, bidir with the defaults (--gather auto)
#   kintf   kv4k_interference_pct and interference_pct, --gather auto and copy-engine
#   stage   the small-page layouts kv4k, kv8k with 16 MiB copy stages
#   obj     the single-object table alone (1/16/64 MiB, x1 and x8)
#   objnopoll  the same with the bench workers' completion-wait polling off
#           (UMBP_BENCH_WAIT_POLL_US=0: they sleep on the ring at once, as before)
set -uo pipefail
bin=${BIN:-.device-bin}
repo=${REPO:-.}
out=${OUT:-/tmp}
stages=${STAGES:-tests check layout full kfull}
reps=${REPS:-5}
extra=${EXTRA:-}
log=$out/kernel-path.log
source "$repo/scripts/device/stages.sh"
gpu_setup
has tests && run tests-gather "$bin/test-cuda_gather" --nocapture --test-threads=1
has tests && run tests-cuda "$bin/test-cuda" --test-threads=1
has check && run check-kernel "$bin/umbp-bench" transfer --backend cuda --check --gather kernel
if has layout; then
  for g in auto kernel copy-engine; do
    run "bench-layout-$g" "$bin/umbp-bench" transfer --backend cuda --json --layout-only --reps "$reps" --gather "$g" $extra
  done
fi
has full && run bench-full-auto "$bin/umbp-bench" transfer --backend cuda --json --reps "$reps" --gather auto "${mm[@]}" $extra
has kfull && run bench-full-kernel "$bin/umbp-bench" transfer --backend cuda --json --reps "$reps" --gather kernel "${mm[@]}" $extra
has main && run bench-main "$bin/umbp-bench" transfer --backend cuda --json --reps "$reps" --layouts gptoss,kv4k,kv8k,kv16k,obj,bidir $extra
if has kintf; then
  for g in auto copy-engine; do
    run "bench-kintf-$g" "$bin/umbp-bench" transfer --backend cuda --json --reps "$reps" --capacity 4GiB --layouts kv4k,interference --gather "$g" "${mm[@]}" $extra
  done
fi
has stage && run bench-stage16 "$bin/umbp-bench" transfer --backend cuda --json --reps "$reps" --layouts kv4k,kv8k --stage-mib 16 $extra
has obj && run bench-obj "$bin/umbp-bench" transfer --backend cuda --json --reps "$reps" --layouts obj $extra
has objnopoll && run bench-objnopoll env UMBP_BENCH_WAIT_POLL_US=0 "$bin/umbp-bench" transfer --backend cuda --json --reps "$reps" --layouts obj $extra
grep -hE "calibration|kernel used|page copy kernel|byte-exact|stale|test result|panicked|FAIL|error" "$log" | cut -c1-600 | tail -n 80
echo "=== kernel-path: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
