#!/usr/bin/env bash
# Installs the system packages a build of the workspace needs besides a Rust toolchain:
# libclang (Debian libclang-dev), because nixl-sys (the cluster tier's NIXL binding, in
# umbp-pool's dependency tree) generates its bindings with bindgen at build time. NIXL
# itself is not needed to build or to run a pool without --cluster-* flags.
# As root with apt-get it installs what is missing; otherwise it says what to install.
set -euo pipefail
if ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang*.so.* 2>/dev/null | grep -q 'libclang[-.0-9]*\.so'; then
  exit 0
fi
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "setup-build-deps: installing libclang-dev (bindgen, for nixl-sys's build)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >/dev/null
else
  echo "setup-build-deps: libclang not found; install libclang-dev (as root: apt-get install libclang-dev)" >&2
  exit 1
fi
