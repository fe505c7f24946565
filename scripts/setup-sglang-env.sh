#!/usr/bin/env bash
# A venv with SGLang's real Python classes for umbp.sglang's tests and bench, cheap enough
# for CI (a 2-core VM, no GPU). SGLang is heavy and pins versions that clash with the
# project's vLLM venv, so it gets its own venv, layered on the project venv:
#   * the new venv sees the project venv's packages (torch, pytest, numpy, transformers...)
#     through a .pth file, so torch is not downloaded twice; its own packages take precedence;
#   * sglang itself goes in with --no-deps (its full dependency set pulls a second, CUDA
#     torch and sglang-kernel, several GB); then only the pure-Python modules that its
#     HiCache controller, storage, host pool and hash code import and the project venv
#     lacks (pinned), and torchvision matching the project's torch (--no-deps keeps torch).
# SGLang's page hash is a C++ extension built on first use with ninja + g++ + OpenSSL
# (libssl-dev, installed here when missing and we are root); this script builds it once
# (~1 min on 2 cores) into ~/.cache/torch_extensions.
#
# Idempotent: a stamp in the venv records what was installed; a second run with the same
# spec only re-checks the imports (a few seconds, no network). Exits non-zero on failure.
#
# Usage: scripts/setup-sglang-env.sh        (UMBP_SGLANG_VENV=<dir>, default <repo>/.venv-sglang;
#                                            UMBP_VENV=<project venv>, default <repo>/.venv)
# Then:  PATH=<dir>/bin:<project venv>/bin:$PATH PYTHONPATH=python <dir>/bin/python -m pytest python/tests/test_sglang_backend.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${UMBP_VENV:-$ROOT/.venv}"
VENV="${UMBP_SGLANG_VENV:-$ROOT/.venv-sglang}"
SGLANG_SPEC="${SGLANG_SPEC:-sglang==0.5.23}"
EXTRA=(orjson==3.13.0 ipython==9.18.1 gguf==0.19.0 ninja==1.13.2)
TORCHVISION=torchvision==0.28.0  # matches the project's torch 2.13
STAMP_TEXT="$SGLANG_SPEC ${EXTRA[*]} $TORCHVISION base=$BASE"
log() { printf '[setup-sglang-env] %s\n' "$*" >&2; }

[ -x "$BASE/bin/python" ] || { log "no project venv at $BASE: run scripts/setup-python-env.sh first"; exit 1; }

check() {
  PATH="$VENV/bin:$BASE/bin:$PATH" "$VENV/bin/python" -W ignore - <<'PY'
import torch, sglang
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: F401
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: F401
from sglang.srt.mem_cache.utils import get_hash_str
get_hash_str(list(range(16)), None, page_size=16)  # builds the native hash extension once
print(f"[setup-sglang-env] sglang {sglang.__version__} on torch {torch.__version__}: ok")
PY
}

if [ -f "$VENV/.umbp-sglang-stamp" ] && [ "$(cat "$VENV/.umbp-sglang-stamp")" = "$STAMP_TEXT" ]; then
  log "$VENV is set up ($SGLANG_SPEC); checking imports"
  if check; then exit 0; fi
  log "the import check failed: reinstalling"
fi

if [ ! -f /usr/include/openssl/sha.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing libssl-dev (SGLang's page hash extension links OpenSSL)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libssl-dev >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libssl-dev >/dev/null; }
  else
    log "missing /usr/include/openssl/sha.h: install libssl-dev"; exit 1
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY="$("$BASE/bin/python" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')"
  log "creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
rm -f "$VENV/.umbp-sglang-stamp"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE_SITE="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$BASE_SITE" > "$SITE/umbp_base_venv.pth"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q)
log "installing $SGLANG_SPEC (no deps)"
"${PIP[@]}" --no-deps "$SGLANG_SPEC"
log "installing ${EXTRA[*]} and $TORCHVISION (no deps)"
"${PIP[@]}" "${EXTRA[@]}"
"${PIP[@]}" --no-deps "$TORCHVISION"
log "checking imports"
check
echo "$STAMP_TEXT" > "$VENV/.umbp-sglang-stamp"
log "done: PATH=$VENV/bin:$BASE/bin:\$PATH $VENV/bin/python -m pytest python/tests/test_sglang_backend.py"
