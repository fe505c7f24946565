#!/usr/bin/env bash
# Issue #14, device staging experiment (`--gather staged`) on a GPU machine, in one call:
# the GPU checks (run-gpu-tests.sh gpucheck/check/kcheck/extpool), the cross-process
# checks on the staged path, the small-page and gpt-oss layouts with --gather staged
# against --gather auto in the same run, kv4k interference both ways, and staging chunk
# sizes. Run from a folder holding the binaries of scripts/device/build.sh (BIN, default
# .device-bin) and the scripts (REPO, default .). Text to $OUT/stage.log and
# $OUT/gpu-tests.log, JSON lines to $OUT/<name>.jsonl (7 files: the device tool returns 8).
#
#   STAGES="tests main kintf chunks" bash scripts/device/stage-path.sh
#   (quick: test-cuda_gather and the staged --check alone; KINTF_MODES="staged auto")
set -uo pipefail
bin=${BIN:-.device-bin}
repo=${REPO:-.}
out=${OUT:-/tmp}
stages=${STAGES:-tests main kintf chunks}
reps=${REPS:-5}
log=$out/stage.log
jsonl_strip=bench-
stage_timeout=200
source "$repo/scripts/device/stages.sh"
gpu_setup
b=(transfer --backend cuda)
if has quick; then  # the staged path's own checks only
  run tests-gather "$bin/test-cuda_gather" --nocapture --test-threads=1
  run check-staged "$bin/umbp-bench" "${b[@]}" --check --gather staged
fi
if has tests; then
  mkdir -p /tmp/gt
  echo "=== run-gpu-tests" | tee -a "$log"
  OUT=/tmp/gt BIN="$bin" STAGES="gpucheck check kcheck extpool" bash "$repo/scripts/device/run-gpu-tests.sh" > "$out/gpu-tests.log" 2>&1 || fail=1
  grep -E "=== |PASS|FAIL" "$out/gpu-tests.log" | tee -a "$log"
  run tests-gather "$bin/test-cuda_gather" --nocapture --test-threads=1
  run check-staged "$bin/umbp-bench" "${b[@]}" --check --gather staged
fi
if has main; then
  for g in staged auto; do
    run "bench-main-$g" "$bin/umbp-bench" "${b[@]}" --json --reps "$reps" --layouts gptoss,kv4k,kv8k,kv16k --gather "$g"
  done
fi
if has kintf; then
  for g in ${KINTF_MODES:-staged auto}; do
    run "bench-kintf-$g" "$bin/umbp-bench" "${b[@]}" --json --reps "$reps" --capacity 4GiB --layouts kv4k,interference --gather "$g" "${mm[@]}"
  done
fi
if has chunks; then
  : > "$out/chunks.jsonl"
  for m in 4 64; do
    echo "=== chunks $m MiB" | tee -a "$log"
    timeout -k 5 120 "$bin/umbp-bench" "${b[@]}" --json --reps "$reps" --layouts kv4k --gather staged --device-stage-mib "$m" 2>> "$log" \
      | sed "s/^{/{\"device_stage_mib\":$m,/" >> "$out/chunks.jsonl" || fail=1
  done
  grep -hE '"case"' "$out/chunks.jsonl" | cut -c1-200
fi
grep -hE "calibration|device staging|page copy kernel|byte-exact|stale|test result|panicked|FAIL|error" "$log" | cut -c1-400 | tail -n 60
echo "=== stage-path: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
