#!/usr/bin/env bash
# Builds the `umbp` wheel (PyO3 abi3 extension + pure-Python vLLM connector) with the
# release umbp-pool and ringtool binaries inside, so `pip install` also installs the
# commands. Usage: scripts/build-wheel.sh [--install]   (needs maturin: .venv has it)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup-build-deps.sh   # libclang, for nixl-sys's bindgen
# The daemon alone: built together with umbp-bench it would link the pool library with
# the benchmarks' fault-injection feature (cargo unifies features per build).
cargo build --release --locked -p umbp-pool-daemon
cargo build --release --locked -p umbp-tools --bin ringtool
scripts_dir=python/umbp.data/scripts
rm -rf python/umbp.data && mkdir -p "$scripts_dir"
for b in umbp-pool ringtool; do
  if [ -x "target/release/$b" ]; then cp "target/release/$b" "$scripts_dir/"; fi
done
rm -rf target/wheels
maturin build --release --locked -m python/Cargo.toml --out target/wheels >&2
wheel=$(ls target/wheels/umbp-*.whl)
echo "$wheel"
if [ "${1:-}" = "--install" ]; then
  python -m pip install --force-reinstall --no-deps "$wheel" >&2
fi
