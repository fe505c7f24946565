#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .device-bin/ (made by
# scripts/device/build.sh) carried along. Runs the CUDA integration test (no skips
# expected there), the host backend tests, and the two-process IPC check with bandwidth.
# Results go to stdout and, when the device tool provides $OUT, to $OUT/gpu-check.log.
#
#   MIB=1024 bash scripts/device/gpu-check.sh      # BIN=<folder> for binaries elsewhere
set -uo pipefail
bin=${BIN:-.device-bin}
log=${OUT:-/tmp}/gpu-check.log
fail=0
{
  nvidia-smi -L 2>&1 || echo "nvidia-smi not found"
  nvidia-smi --query-gpu=driver_version,name,pci.bus_id --format=csv 2>&1 || true
  for t in cuda cuda_gather host_process host_memfd hip; do
    echo "=== test-$t"
    UMBP_REQUIRE_CUDA=1 "$bin/test-$t" --nocapture --test-threads=1 || fail=1
  done
  echo "=== cuda_ipc_check"
  "$bin/cuda_ipc_check" --mib "${MIB:-1024}" || fail=1
  echo "=== gpu-check: $([ $fail = 0 ] && echo PASS || echo FAIL)"
  exit $fail
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
