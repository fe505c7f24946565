# Shared by the device scripts that run named stages (kernel-path.sh, stage-path.sh):
# sourced, not run. The caller sets `out` (output folder), `log` (text log), `stages`
# (names to run), and may set `stage_timeout` (seconds, default 300) and `jsonl_strip`
# (a prefix cut from bench-* stage names for their JSON file, default none).

fail=0
has() { [[ " $stages " == *" $1 "* ]]; }

# run NAME COMMAND...: a stage under a timeout. Stages named bench-* write their stdout
# (JSON lines) to $out/<NAME less $jsonl_strip>.jsonl and print its cases; the rest log.
run() {
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$log"
  local t0=$SECONDS rc limit=${STAGE_TIMEOUT:-${stage_timeout:-300}}
  if [[ $name == bench-* ]]; then
    local jsonl=$out/${name#"${jsonl_strip:-}"}.jsonl
    timeout -k 5 "$limit" "$@" > "$jsonl" 2>> "$log"; rc=$?
    grep -hE '"case"' "$jsonl" | cut -c1-400
  else
    timeout -k 5 "$limit" "$@" >> "$log" 2>&1; rc=$?
  fi
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
  [ $rc = 0 ] || fail=1
}

# The GPU (or exit), the matmul command of the interference cases in `mm` (empty, and
# said so, without CUDA torch), and the environment of the GPU checks.
gpu_setup() {
  nvidia-smi --query-gpu=name,driver_version,pci.bus_id,memory.total,clocks.sm,clocks.mem --format=csv || exit 1
  mm=()
  if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    mm=(--matmul "python3 $repo/scripts/device/matmul_loop.py")
  else
    echo "interference_pct will be skipped: python3 with CUDA torch not found"
  fi
  export UMBP_REQUIRE_CUDA=1 RUST_LOG=${RUST_LOG:-warn,umbp_gpu=info}
}
