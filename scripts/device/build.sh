#!/usr/bin/env bash
# Builds the GPU checks of umbp-gpu here (x86_64, release, debug info stripped) into
# .device-bin/, to be carried to the GPU machine, which has no cargo. The binaries load
# libcuda at run time, so nothing CUDA is needed here; the GPU machine's glibc is newer,
# so binaries built against this one run there.
#
#   scripts/device/build.sh            # then, on the GPU machine:
#                                      #   scripts/device/run-gpu-tests.sh (all) or gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.device-bin
rm -rf "$out"
mkdir -p "$out"

cargo build --release -p umbp-gpu --example cuda_ipc_check
cp target/release/examples/cuda_ipc_check "$out/"

# The transfer benchmark and checks (workers are the same binary) and the pool daemon.
cargo build --release -p umbp-bench
cargo build --release -p umbp-pool-daemon   # alone: no fault-injection feature in the daemon
cp target/release/umbp-bench target/release/umbp-pool "$out/"

# Integration test binaries have hashed names; cargo's JSON messages say where they are.
cargo test --release -p umbp-gpu --test cuda --test cuda_gather --test hip --test host_process --test host_memfd \
    --no-run --message-format=json \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])
' \
  | while read -r name exe; do cp "$exe" "$out/test-$name"; done

strip --strip-debug "$out"/*
ls -la "$out"
du -sh "$out"
