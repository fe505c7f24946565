#!/usr/bin/env bash
# Opt-in: a venv with SGLang for umbp.sglang's tests and bench (CI's venv has no SGLang,
# and those tests skip there). SGLang is heavy and pins versions that clash with the
# project's vLLM venv, so it gets its own venv, layered on the project venv:
#   * the new venv sees the project venv's packages (torch, pytest, numpy, ...) through a
#     .pth file, so torch is not downloaded twice; its own packages take precedence;
#   * sglang itself goes in with --no-deps (its full dependency set pulls a second torch
#     with CUDA libraries, ~5 GB); then only the modules that the HiCache storage, host
#     pool and hash code import and that the project venv lacks.
# SGLang's page hash is a C++ extension built on first use with ninja + g++ + OpenSSL
# (libssl-dev); the first test run compiles it (~1 min) into ~/.cache/torch_extensions.
#
# Usage: scripts/setup-sglang-env.sh        (UMBP_SGLANG_VENV=<dir>, default <repo>/.venv-sglang;
#                                            UMBP_VENV=<project venv>, default <repo>/.venv)
# Then:  PATH=<dir>/bin:<project venv>/bin:$PATH PYTHONPATH=python <dir>/bin/python -m pytest python/tests/test_sglang_backend.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${UMBP_VENV:-$ROOT/.venv}"
VENV="${UMBP_SGLANG_VENV:-$ROOT/.venv-sglang}"
SGLANG_SPEC="${SGLANG_SPEC:-sglang==0.5.23}"
# torchvision matching the project's torch 2.13 (sglang imports it); --no-deps keeps torch.
EXTRA=(orjson ipython gguf ninja)
log() { printf '[setup-sglang-env] %s\n' "$*" >&2; }

[ -x "$BASE/bin/python" ] || { log "no project venv at $BASE: run scripts/setup-python-env.sh first"; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3.11 -m venv "$VENV"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE_SITE="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$BASE_SITE" > "$SITE/umbp_base_venv.pth"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
log "installing $SGLANG_SPEC (no deps)"
"${PIP[@]}" --no-deps "$SGLANG_SPEC"
log "installing ${EXTRA[*]} and torchvision==0.28.0 (no deps)"
"${PIP[@]}" "${EXTRA[@]}"
"${PIP[@]}" --no-deps torchvision==0.28.0
log "checking imports"
PATH="$VENV/bin:$BASE/bin:$PATH" "$VENV/bin/python" -W ignore - <<'PY'
import torch, sglang
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.utils import get_hash_str
get_hash_str(list(range(16)), None, page_size=16)  # builds the native hash extension once
print(f"[setup-sglang-env] sglang {sglang.__version__} on torch {torch.__version__}: ok")
PY
log "done: PATH=$VENV/bin:$BASE/bin:\$PATH $VENV/bin/python -m pytest python/tests/test_sglang_backend.py"
