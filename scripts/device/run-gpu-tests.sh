#!/usr/bin/env bash
# Everything the GPU data path needs checked and measured on a GPU machine, in one call
# (device time is scarce). Runs from the repository root with .device-bin/ (made by
# scripts/device/build.sh) carried along. Each stage logs to $OUT (or /tmp) and the
# script goes on after a failure; the exit status is non-zero if any stage failed.
#
#   STAGES="check bench" bash scripts/device/run-gpu-tests.sh
#
# Stages (default: all):
#   gpucheck  scripts/device/gpu-check.sh: umbp-gpu's CUDA tests, host tests, IPC check
#   check     umbp-bench transfer --check: two workers store/load each other's blocks
#             byte-exact; fenced store after a slow kernel; fenced load before a reading
#             kernel; worker killed mid-transfer (in-process pool, mapping counts)
#   kcheck    the same checks with the page copy kernel forced (--gather kernel): fences
#             and a killed worker on the kernel path (issue #14)
#   scheck    the same with device staging forced (--gather staged); `check` stages only
#             where the calibration chose it
#   extpool   the cross-worker checks again against a real umbp-pool process
#   pinning   the same against a pool still registering its DRAM with the driver
#             (--capacity $PIN_CAPACITY, default 64GiB: about 40 s of pinning on an H100
#             host): the checks must finish before the pinning does (issue #33 item 4)
#   bench     umbp-bench transfer --backend cuda --json --sweep (+ interference with
#             scripts/device/matmul_loop.py when torch is there)
#   host      umbp-bench transfer --backend host --json (this machine's CPU figures)
#   multigpu  with 2+ GPUs: nvidia-smi topo -m, then umbp-bench transfer --backend cuda
#             --multi-gpu --json (TP2 store/restore byte-exact with per-rank keys, lookups
#             needing every rank, GB/s of each GPU alone and of all at once)
#
# Without a GPU (CI, laptops) every GPU stage prints why it is skipped and passes.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
bin=${BIN:-.device-bin}
out=${OUT:-/tmp}
stages=${STAGES:-gpucheck check kcheck scheck extpool pinning bench host multigpu}
fail=0
has() { [[ " $stages " == *" $1 "* ]]; }
run() { # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout -k 5 "${STAGE_TIMEOUT:-300}" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [ $rc = 0 ] || fail=1
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIPPED GPU stages: no NVIDIA GPU visible (nvidia-smi absent or sees no device)"
  gpu=0
else
  gpu=1
  nvidia-smi --query-gpu=name,driver_version,pci.bus_id,memory.total,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
fi

if [ $gpu = 1 ]; then
  has gpucheck && run gpucheck env MIB=${MIB:-1024} BIN="$bin" bash "$here/gpu-check.sh"
  has check && run check "$bin/umbp-bench" transfer --backend cuda --check
  has kcheck && run kcheck "$bin/umbp-bench" transfer --backend cuda --check --gather kernel
  has scheck && run scheck "$bin/umbp-bench" transfer --backend cuda --check --gather staged
  if has extpool; then
    sock=/tmp/umbp-extpool-$$.sock
    RUST_LOG=${RUST_LOG:-info} "$bin/umbp-pool" --socket "$sock" --capacity 4GiB > "$out/extpool-pool.log" 2>&1 &
    pool=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    run extpool "$bin/umbp-bench" transfer --backend cuda --check --pool-socket "$sock"
    kill "$pool" 2>/dev/null; wait "$pool" 2>/dev/null
    tail -5 "$out/extpool-pool.log"
  fi
  if has pinning; then
    sock=/tmp/umbp-pinning-$$.sock
    RUST_LOG=info "$bin/umbp-pool" --socket "$sock" --capacity "${PIN_CAPACITY:-64GiB}" > "$out/pinning-pool.log" 2>&1 &
    pool=$!
    for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
    run pinning "$bin/umbp-bench" transfer --backend cuda --check --pool-socket "$sock"
    # The first CUDA registration must come before the pinning ends (it waited for all
    # of it before: 39.6 s on an H100 host at 64 GiB).
    python3 - "$out/pinning-pool.log" <<'PY' || fail=1
import re, sys
from datetime import datetime
def ts(line):
    return datetime.fromisoformat(line.split()[0].replace("Z", "+00:00"))
lines = [re.sub(r"\x1b\[[0-9;]*m", "", l) for l in open(sys.argv[1]).read().splitlines()]
attach = next((ts(l) for l in lines if "attached attachment" in l), None)
regs = [ts(l) for l in lines if "memory registered" in l and "kind=Cuda" in l]
reg = regs[0] if regs else None
done = next((ts(l) for l in lines if "DRAM registration done" in l), None)
if attach is None or reg is None:
    print("=== pinning: FAIL: no worker attached or registered CUDA memory"); sys.exit(1)
wait = (reg - attach).total_seconds()
print(f"=== pinning: {len(regs)} CUDA registrations, the first {wait:.3f} s after attach, the last {(regs[-1] - attach).total_seconds():.3f} s; pinning "
      + (f"ended {(done - reg).total_seconds():.1f} s after it" if done else "still running at the end"))
if done is not None and done <= reg:
    print("=== pinning: FAIL: the registration waited for the pool's DRAM registration"); sys.exit(1)
PY
    kill "$pool" 2>/dev/null; wait "$pool" 2>/dev/null
    sed 's/\x1b\[[0-9;]*m//g' "$out/pinning-pool.log" | grep -E "registering DRAM|registration (progress|done)|memory registered" | sed -n '1,3p;$p'
  fi
  if has bench; then
    mm=()
    if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
      mm=(--matmul "python3 scripts/device/matmul_loop.py")
    else
      echo "interference_pct will be skipped: python3 with CUDA torch not found"
    fi
    run bench "$bin/umbp-bench" transfer --backend cuda --json --sweep --reps ${REPS:-5} "${mm[@]}"
  fi
fi
has host && run host "$bin/umbp-bench" transfer --backend host --json --reps 3
if has multigpu; then
  n=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU')
  if [ "$n" -ge 2 ]; then
    nvidia-smi topo -m
    run multigpu "$bin/umbp-bench" transfer --backend cuda --multi-gpu --json --reps ${REPS:-5}
  else
    echo "SKIPPED multigpu: $n GPU(s) visible, it needs 2"
  fi
fi
echo "=== run-gpu-tests: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
