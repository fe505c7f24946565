"""PEP 517 build backend for the `umbp` package: maturin, plus the two commands.

`pip install ./python` (and `pip wheel`, `pip install -e`) build the extension module with
maturin. The wheel also carries the `umbp-pool` and `ringtool` executables as scripts
(maturin's `data` directory `umbp.data/scripts`), so installing it puts both on PATH. A
source install therefore has to compile them too: before delegating to maturin, this
backend runs

    cargo build --release [--locked] -p umbp-pool-daemon --bin umbp-pool -p umbp-tools --bin ringtool

in the cargo workspace that contains this directory and copies the two executables into
`umbp.data/scripts`. Cargo's `--message-format=json` names the executables it built, so a
`CARGO_TARGET_DIR` or `build.target-dir` elsewhere is honoured.

`UMBP_BUILD_BINS=0` skips the commands (a wheel with the Python package and the binding
only); an `umbp.data/scripts` prepared beforehand (scripts/build-wheel.sh does that) is
then shipped as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import maturin as _maturin

HERE = Path(__file__).resolve().parent.parent  # the python/ directory (pyproject.toml)
DATA_SCRIPTS = HERE / "umbp.data" / "scripts"
# (cargo package, binary) pairs installed as commands.
BINARIES = (("umbp-pool-daemon", "umbp-pool"), ("umbp-tools", "ringtool"))


def _log(msg: str) -> None:
    print(f"umbp build: {msg}", file=sys.stderr, flush=True)


def _workspace_root() -> Path | None:
    for d in (HERE, *HERE.parents):
        toml = d / "Cargo.toml"
        if toml.is_file() and "[workspace]" in toml.read_text(errors="replace"):
            return d
    return None


def _build_binaries() -> None:
    """Compile umbp-pool and ringtool in release and put them in umbp.data/scripts."""
    DATA_SCRIPTS.mkdir(parents=True, exist_ok=True)
    if os.environ.get("UMBP_BUILD_BINS", "1").strip().lower() in ("0", "false", "no", "off"):
        _log("UMBP_BUILD_BINS=0: not building umbp-pool/ringtool "
             f"(shipping what is in {DATA_SCRIPTS}: {sorted(p.name for p in DATA_SCRIPTS.iterdir())})")
        return
    root = _workspace_root()
    if root is None:
        raise RuntimeError(
            f"umbp: no cargo workspace above {HERE}: build from a git checkout of UMBP-rs "
            "(pip install ./python), or set UMBP_BUILD_BINS=0 for a wheel without the "
            "umbp-pool/ringtool commands"
        )
    cargo = shutil.which("cargo")
    if cargo is None:
        raise RuntimeError("umbp: cargo not found on PATH: install a Rust toolchain (rustup) first")
    cmd = [cargo, "build", "--release", "--message-format=json-render-diagnostics"]
    if (root / "Cargo.lock").is_file():
        cmd.append("--locked")
    for pkg, binary in BINARIES:
        cmd += ["-p", pkg, "--bin", binary]
    _log(f"building the commands: {' '.join(cmd[1:])} (in {root})")
    proc = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"umbp: `{' '.join(cmd)}` failed with exit code {proc.returncode}")
    built: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") == "compiler-artifact" and msg.get("executable"):
            built[msg["target"]["name"]] = msg["executable"]
    for _, binary in BINARIES:
        src = built.get(binary)
        if src is None:
            raise RuntimeError(f"umbp: cargo did not report the executable {binary!r}")
        dst = DATA_SCRIPTS / binary
        shutil.copyfile(src, dst)
        dst.chmod(dst.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        _log(f"{binary}: {src} -> {dst}")


def _ensure_data_dir() -> None:
    # maturin refuses a configured `data` directory that does not exist.
    DATA_SCRIPTS.mkdir(parents=True, exist_ok=True)


# ---- PEP 517 / PEP 660 hooks ---------------------------------------------------------------
def get_requires_for_build_wheel(config_settings=None):
    return _maturin.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    return _maturin.get_requires_for_build_sdist(config_settings)


def get_requires_for_build_editable(config_settings=None):
    hook = getattr(_maturin, "get_requires_for_build_editable", _maturin.get_requires_for_build_wheel)
    return hook(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _ensure_data_dir()
    return _maturin.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _build_binaries()
    return _maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _build_binaries()
    return _maturin.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    _ensure_data_dir()
    return _maturin.build_sdist(sdist_directory, config_settings)
