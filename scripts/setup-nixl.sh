#!/usr/bin/env bash
# Installs what the cluster tier (docs/cluster.md) needs to build and to run its tests:
#   - libclang (Debian libclang-dev): nixl-sys generates its bindings with bindgen at build
#     time, for every build of the workspace (NIXL itself is not needed to build);
#   - the NIXL runtime: PyPI wheel nixl-cu12 (libnixl_capi.so, libnixl.so, the UCX plugin;
#     loads without CUDA), pip-installed with --no-deps into a venv of its own (its torch
#     dependency is only for NIXL's Python API, which the pool does not use).
# Prints the library path on the last line as `UMBP_NIXL_LIB=<dir>`; export it (and, for
# loopback tests without RDMA, UCX_TLS=tcp,self UCX_NET_DEVICES=lo) before running
# `cargo test -p umbp-cluster`, `umbp-bench cluster` or a pool with --cluster-* flags.
#
# Usage: scripts/setup-nixl.sh [VENV_DIR]   (default: .nixl-venv in the repository root)
# Environment: NIXL_WHEEL (default nixl-cu12; a version pin such as nixl-cu12==1.5.1 works).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-$PWD/.nixl-venv}
WHEEL=${NIXL_WHEEL:-nixl-cu12}

bash scripts/setup-build-deps.sh

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
LIBDIR=$("$VENV/bin/python" - <<'PY' 2>/dev/null || true
import glob, os, site
for sp in site.getsitepackages():
    for p in glob.glob(os.path.join(sp, ".nixl*.libs", "libnixl_capi.so")):
        print(os.path.dirname(p)); raise SystemExit
PY
)
if [ -z "$LIBDIR" ]; then
  echo "setup-nixl: pip install --no-deps $WHEEL into $VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "$WHEEL" >&2
  LIBDIR=$("$VENV/bin/python" - <<'PY'
import glob, os, site
for sp in site.getsitepackages():
    for p in glob.glob(os.path.join(sp, ".nixl*.libs", "libnixl_capi.so")):
        print(os.path.dirname(p)); raise SystemExit
raise SystemExit("libnixl_capi.so not found in the installed wheel")
PY
)
fi
test -f "$LIBDIR/libnixl_capi.so" && test -f "$LIBDIR/plugins/libplugin_UCX.so" || {
  echo "setup-nixl: $LIBDIR lacks libnixl_capi.so or plugins/libplugin_UCX.so" >&2; exit 1; }
echo "UMBP_NIXL_LIB=$LIBDIR"
