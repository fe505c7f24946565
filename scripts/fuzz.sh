#!/usr/bin/env bash
# Coverage-guided fuzzing of everything a peer can send the pool (fuzz/, docs/reliability.md):
#   handshake  MessageHeader framing over a socket, Hello checks, RegisterMemory/RegisterLayout
#   sqe        SQE + arena validation against a registered layout, in-flight admission
#   index      the index reader over arbitrary memory (attach, lookup, match_prefix, probe_histogram)
#   ring       ring consumer and producer over a corrupted header
#   control    the control plane's per-peer state machine: arbitrary bytes, fds, EOFs,
#              clock jumps, replies and partial writes against a framing model
#
# Usage:
#   scripts/fuzz.sh --ci            every target for UMBP_FUZZ_SECS (default 10) seconds from
#                                   the committed corpus; the corpus is not modified
#   scripts/fuzz.sh TARGET [SECS]   one target for SECS (default 600) seconds, growing
#                                   fuzz/corpus/TARGET; then `scripts/fuzz.sh --cmin TARGET`
#   scripts/fuzz.sh --cmin TARGET   minimise fuzz/corpus/TARGET in place
#
# Needs a nightly toolchain (libFuzzer with AddressSanitizer) and cargo-fuzz; both are
# installed when missing. A crash leaves its input in fuzz/artifacts/TARGET/ and fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT/fuzz"
TARGETS=(handshake sqe index ring control)

ensure_tools() {
  if ! rustup toolchain list | grep -q '^nightly'; then
    rustup toolchain install nightly --profile minimal
  fi
  if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
  fi
}

run_target() { # target seconds corpus-dir [seed-dir]
  local t=$1 secs=$2 corpus=$3 seeds=${4:-}
  # -rss_limit_mb: the handshake target keeps socket buffers; 2 GiB is far above need.
  cargo +nightly fuzz run "$t" "$corpus" $seeds -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 2>&1 |
    tee "$LOGDIR/$t.log" | grep -E '^(#[0-9]+ +DONE|Done|SUMMARY|==[0-9]+==|thread .* panicked)|stat::number_of_executed_units' || true
  if grep -q 'SUMMARY: libFuzzer' "$LOGDIR/$t.log"; then
    echo "fuzz target $t crashed; input in fuzz/artifacts/$t/ (log: $LOGDIR/$t.log)" >&2
    return 1
  fi
}

if ! ensure_tools; then
  # A machine that cannot fetch a nightly toolchain still runs every other test; say so
  # plainly rather than fail the whole suite.
  if [ "${1:-}" = "--ci" ]; then
    echo "fuzz: SKIPPED: no nightly toolchain or cargo-fuzz could be installed on this machine" >&2
    exit 0
  fi
  exit 1
fi
LOGDIR=$(mktemp -d)
case "${1:-}" in
  --ci)
    secs=${UMBP_FUZZ_SECS:-10}
    cargo +nightly fuzz build
    scratch=$(mktemp -d)
    for t in "${TARGETS[@]}"; do
      mkdir -p "$scratch/$t"
      # New inputs go to the scratch dir; the committed corpus only seeds the run.
      run_target "$t" "$secs" "$scratch/$t" "corpus/$t"
    done
    rm -rf "$scratch"
    ;;
  --cmin)
    t=${2:?usage: scripts/fuzz.sh --cmin TARGET}
    cargo +nightly fuzz cmin "$t" "corpus/$t"
    ;;
  ""|-h|--help)
    sed -n '2,16p' "${BASH_SOURCE[0]}"
    ;;
  *)
    t=$1
    secs=${2:-600}
    mkdir -p "corpus/$t"
    run_target "$t" "$secs" "corpus/$t"
    ;;
esac
