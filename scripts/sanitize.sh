#!/usr/bin/env bash
# Runs the pool under AddressSanitizer+LeakSanitizer or valgrind memcheck: a chaos soak
# (umbp-bench soak) and the multi-process tests, every pool process under the tool.
#
# Pass/fail is the tool's error EXIT CODE, never its log: an ASAN error aborts the pool
# with exit code 86 (LSAN at exit: 87); a memcheck error exits valgrind with 99 at once
# (--exit-on-first-error, so that a pool the soak later SIGKILLs cannot hide it) and
# leaks definitely lost fail the final exit with 99. The soak counts a pool that exits
# on its own, or with a non-zero status at its final SIGTERM stop, as `pool_crashes` and
# fails; the tests' PoolProcess fails a test whose wrapped pool does not exit 0.
# Logs (for reading what failed) go to target/sanitize/<tool>/.
#
# Usage: scripts/sanitize.sh asan|valgrind [SOAK_SECS]
#   asan:     nightly toolchain, target/asan build of umbp-pool (std not instrumented)
#   valgrind: valgrind >= 3.14; the soak uses memfd worker memory (valgrind lacks
#             pidfd_open, so host-process registration is refused under it)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
tool="${1:-}"
secs="${2:-60}"
out="$ROOT/target/sanitize/$tool"
step() { printf '\n==> %s\n' "$*" >&2; }

case "$tool" in
  asan|valgrind) ;;
  *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac

# First: umbp-bench, the test workers and (for valgrind) umbp-pool itself. Built together
# so that no later build of one package rebuilds another's binary with other features.
step "workspace binaries (umbp-pool, umbp-bench, test workers)"
cargo build --workspace --bins

case "$tool" in
  asan)
    step "ASAN build of umbp-pool (nightly, target/asan)"
    RUSTFLAGS="-Zsanitizer=address" cargo +nightly build -p umbp-pool-daemon \
      --target x86_64-unknown-linux-gnu --target-dir "$ROOT/target/asan"
    bin="$ROOT/target/asan/x86_64-unknown-linux-gnu/debug/umbp-pool"
    mkdir -p "$out"
    wrapper="$out/pool.sh"
    cat > "$wrapper" <<EOF
#!/bin/sh
export ASAN_OPTIONS="exitcode=86:detect_leaks=1:halt_on_error=1:log_path=$out/asan"
export LSAN_OPTIONS="exitcode=87"
# UMBP_POOL_WRAPPER passes the test's own pool binary first: run this build instead.
case "\$1" in -*) ;; *) [ -x "\$1" ] && shift ;; esac
exec "$bin" "\$@"
EOF
    soak_args=(--timeout-ms 2000)
    ;;
  valgrind)
    command -v valgrind >/dev/null || { echo "valgrind not found" >&2; exit 1; }
    bin="$ROOT/target/debug/umbp-pool"
    mkdir -p "$out"
    wrapper="$out/pool.sh"
    cat > "$wrapper" <<EOF
#!/bin/sh
# UMBP_POOL_WRAPPER passes the test's own pool binary first; the soak passes flags only.
bin="$bin"
case "\$1" in -*) ;; *) [ -x "\$1" ] && { bin="\$1"; shift; } ;; esac
exec valgrind --tool=memcheck --error-exitcode=99 --exit-on-first-error=yes \\
  --leak-check=full --errors-for-leak-kinds=definite --log-file="$out/vg-%p.log" "\$bin" "\$@"
EOF
    soak_args=(--timeout-ms 5000 --memory memfd --workers 2)
    ;;
esac
chmod +x "$wrapper"

failed=0
step "chaos soak, $secs s, every pool under $tool"
if ! "$ROOT/target/debug/umbp-bench" soak --seconds "$secs" --pool-bin "$wrapper" "${soak_args[@]}"; then
  echo "sanitize.sh: the soak under $tool FAILED (see the failures above; logs in $out)" >&2
  failed=1
fi

step "multi-process tests, every pool under $tool (UMBP_POOL_WRAPPER)"
if ! UMBP_POOL_WRAPPER="$wrapper" cargo test -p umbp-pool --test bad_peers --test limits --test isolation; then
  echo "sanitize.sh: pool tests under $tool FAILED (logs in $out)" >&2
  failed=1
fi
if [ "$tool" = asan ]; then
  # Their workers register host-process memory, which needs pidfd_open (not in valgrind).
  if ! UMBP_POOL_WRAPPER="$wrapper" cargo test -p umbp-integration-tests \
       --test failures --test eviction --test cross_process --test flood; then
    echo "sanitize.sh: integration tests under $tool FAILED (logs in $out)" >&2
    failed=1
  fi
fi
exit "$failed"
