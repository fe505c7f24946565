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
fail=0
has() { [[ " $stages " == *" $1 "* ]]; }
log=$out/stage.log
run() { # name, command... (JSON lines of bench-* to $out/name.jsonl)
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$log"
  local t0=$SECONDS rc
  if [[ $name == bench-* ]]; then
    timeout -k 5 "${STAGE_TIMEOUT:-200}" "$@" > "$out/${name#bench-}.jsonl" 2>> "$log"; rc=$?
    grep -hE '"case"' "$out/${name#bench-}.jsonl" | cut -c1-220
  else
    timeout -k 5 "${STAGE_TIMEOUT:-200}" "$@" >> "$log" 2>&1; rc=$?
  fi
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
  [ $rc = 0 ] || fail=1
}
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,memory.total,clocks.sm,clocks.mem --format=csv || exit 1
mm=()
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  mm=(--matmul "python3 $repo/scripts/device/matmul_loop.py")
else
  echo "interference_pct will be skipped: python3 with CUDA torch not found"
fi
export UMBP_REQUIRE_CUDA=1 RUST_LOG=${RUST_LOG:-warn,umbp_gpu=info}
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
