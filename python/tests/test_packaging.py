"""`pip install ./python` from a fresh clone: the PEP 517 backend named in pyproject.toml
exists, has every hook pip calls, and builds the commands the wheel ships. (The full check —
fresh clone, fresh venv, a release build — is scripts/check-source-install.sh; it takes
minutes to tens of minutes, so it is not run here.)"""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path

PY_DIR = Path(__file__).resolve().parents[1]
REPO = PY_DIR.parent


def backend():
    meta = tomllib.loads((PY_DIR / "pyproject.toml").read_text())["build-system"]
    paths = [str(PY_DIR / p) for p in meta.get("backend-path", [])]
    sys.path[:0] = paths
    try:
        return importlib.import_module(meta["build-backend"]), meta
    finally:
        for p in paths:
            sys.path.remove(p)


def test_backend_has_the_pep517_hooks():
    mod, meta = backend()
    assert any(r.startswith("maturin") for r in meta["requires"])
    for hook in ("build_wheel", "build_sdist", "get_requires_for_build_wheel",
                 "prepare_metadata_for_build_wheel", "build_editable"):
        assert callable(getattr(mod, hook, None)), f"backend lacks {hook}"


def test_backend_builds_the_binaries_the_wheel_ships():
    mod, _ = backend()
    cfg = tomllib.loads((PY_DIR / "pyproject.toml").read_text())["tool"]["maturin"]
    assert Path(mod.DATA_SCRIPTS) == PY_DIR / cfg["data"] / "scripts"
    bins = {}
    for toml in [*REPO.glob("*/Cargo.toml"), *REPO.glob("*/*/Cargo.toml")]:
        text = toml.read_text()
        pkg = re.search(r'^name\s*=\s*"([^"]+)"', text, re.M)
        for b in re.findall(r'\[\[bin\]\]\s*name\s*=\s*"([^"]+)"', text):
            bins[b] = pkg.group(1) if pkg else None
    assert {b for _, b in mod.BINARIES} == {"umbp-pool", "ringtool"}
    for pkg, b in mod.BINARIES:
        assert bins.get(b) == pkg, f"{b} is not a binary of cargo package {pkg}"
    assert mod._workspace_root() == REPO


def test_skipping_the_binaries_still_leaves_a_data_dir(monkeypatch):
    """maturin refuses a configured data directory that does not exist (the original
    'No such data directory python/umbp.data' failure)."""
    mod, _ = backend()
    monkeypatch.setenv("UMBP_BUILD_BINS", "0")
    mod._build_binaries()
    assert Path(mod.DATA_SCRIPTS).is_dir()
