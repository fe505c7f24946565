#!/usr/bin/env bash
# Checks the standard source install the way a new user does it: a fresh clone of this
# checkout's HEAD, a fresh venv, `pip install ./python`, then the binding imports and the
# umbp-pool and ringtool commands are on the venv's PATH and run.
# Compiles the whole workspace in release from scratch: ~30 min on 2 busy cores, a few
# minutes on a build machine; so scripts/test.sh does not run it.
# Usage: scripts/check-source-install.sh [WORKDIR]   (default: a new temp dir, removed after)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d /tmp/umbp-srcinst-XXXXXX)}"
[ $# -ge 1 ] || trap 'rm -rf "$WORK"' EXIT
PY="${PYTHON:-python3}"
git clone -q "$ROOT" "$WORK/src"
git -C "$WORK/src" checkout -q "$(git -C "$ROOT" rev-parse HEAD)"
"$PY" -m venv "$WORK/venv"
start=$(date +%s)
(cd "$WORK/src" && "$WORK/venv/bin/pip" install ./python)
echo "pip install ./python: $(( $(date +%s) - start )) s" >&2
PATH="$WORK/venv/bin:$PATH"
command -v umbp-pool ringtool
umbp-pool --help >/dev/null
ringtool --help >/dev/null
(cd / && "$WORK/venv/bin/python" -c "import umbp._native as n; print('umbp._native protocol', n.PROTOCOL_VERSION)")
echo "source install OK" >&2
