#!/usr/bin/env bash
# Profiles one `umbp-bench transfer` run under Nsight Systems (CUDA trace) on the GPU
# machine and summarizes where the copy calls left the DMA idle (scripts/device/timeline.py).
# Prints "skipped" (exit 0) where nsys is not installed: nothing was observed.
#
#   scripts/device/profile-copy.sh OUT_DIR NAME -- <umbp-bench transfer arguments>
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$1 name=$2
shift 2
[ "${1:-}" = "--" ] && shift
B=${B:-.device-bin}
nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys /usr/local/cuda*/nsight-systems*/bin/nsys 2>/dev/null | head -1 || true)
if [ -z "$nsys" ]; then
    echo "profile $name: skipped (no nsys on this machine)"
    exit 0
fi
mkdir -p "$out"
"$nsys" profile -t cuda --cuda-event-trace=false -o "$out/$name" --force-overwrite true \
    "$B/umbp-bench" transfer "$@" > "$out/$name.jsonl" 2> "$out/$name.err" || \
  "$nsys" profile -t cuda -o "$out/$name" --force-overwrite true \
    "$B/umbp-bench" transfer "$@" > "$out/$name.jsonl" 2> "$out/$name.err"
"$nsys" stats -r cuda_gpu_trace -r cuda_api_trace -f csv -o "$out/$name" "$out/$name.nsys-rep" > "$out/$name.stats.log" 2>&1
python3 scripts/device/timeline.py "$out/${name}_cuda_gpu_trace.csv" "$out/${name}_cuda_api_trace.csv" > "$out/$name.timeline.jsonl"
echo "profile $name: $(wc -l < "$out/$name.timeline.jsonl") copy calls summarized"
