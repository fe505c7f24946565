"""Shared fixtures for the Python tests: the native module, the tiny model, `umbp-pool`
processes and vLLM engines in their own processes (`engine_driver.py`).

Skips: a test that needs something missing (the compiled `umbp._native`, the `umbp-pool`
binary, vLLM) is skipped locally, but *fails* when `CI` is set: in CI everything must run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
PY_DIR = REPO / "python"
TESTS_DIR = PY_DIR / "tests"
IN_CI = bool(os.environ.get("CI"))
MARK = "@@UMBP@@ "

sys.path.insert(0, str(TESTS_DIR))


def _umbp_needs_python_dir() -> bool:
    """True when `umbp.vllm` is importable only with <repo>/python on the path.

    With `maturin develop` (or an installed wheel) the package, binding included, is already
    importable; otherwise the pure-Python part comes from the source tree. Checked in a clean
    subprocess (cwd=/), since pytest's own sys.path entries would hide the answer.
    """
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('umbp.vllm') else 1)"
    try:
        r = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return r.returncode != 0


_ADD_PY_DIR = _umbp_needs_python_dir()
if _ADD_PY_DIR:
    sys.path.insert(0, str(PY_DIR))


def require(condition: bool, reason: str) -> None:
    """Skip locally, fail in CI."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{reason} (CI is set: required)", pytrace=False)
    pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: runs real vLLM engines in subprocesses (slow)")


# ---------------------------------------------------------------------------------------
# Native module, model, pool binary
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def native() -> Any:
    try:
        import umbp._native as n
    except ImportError as e:
        require(False, f"umbp._native is not built/importable: {e}")
        raise  # unreachable
    return n


@pytest.fixture(scope="session")
def vllm_ok() -> None:
    require(importlib.util.find_spec("vllm") is not None,
            "vLLM is not installed (run scripts/setup-python-env.sh)")


@pytest.fixture(scope="session")
def tiny_model(vllm_ok: None) -> str:
    from tiny_model import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="module")
def cfg_dir(tiny_model: str):
    """A config-only copy of the tiny model, enough to build vLLM's real Scheduler offline."""
    import shutil

    from sched_harness import config_only_model_dir

    d = config_only_model_dir(tiny_model)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def parse_options(extra: dict | None, default_socket_path: str | None = None):
    """`kv_connector_extra_config` parsed as the connector does (UMBPConnectorConfig)."""
    from umbp.vllm.config import UMBPConnectorConfig

    return UMBPConnectorConfig.from_extra_config(extra, default_socket_path)


def options_fail(extra: dict | None, *words: str, **kw) -> str:
    """Parsing `extra` fails with a ValueError whose message names each of `words`; returns
    the message."""
    with pytest.raises(ValueError) as ei:
        parse_options(extra, **kw)
    for w in words:
        assert w in str(ei.value), f"error does not name {w!r}: {ei.value}"
    return str(ei.value)


@pytest.fixture
def clean_connector_env(monkeypatch):
    """The connector's environment variables unset (they stand in for options)."""
    from umbp.vllm import config as C

    monkeypatch.delenv(C.ENV_STANDALONE_ADDRESS, raising=False)
    monkeypatch.delenv(C.ENV_DRAM_CAPACITY, raising=False)


def harness_factory(cfg_dir: str, extra: dict | None = None, harness: type | None = None):
    """Body of a fixture that makes scheduler harnesses (`harness`, by default
    sched_harness.Harness) on `cfg_dir` with `extra` connector options under each call's
    own, and closes them all at teardown: `yield from harness_factory(cfg_dir, {...})`."""
    if harness is None:
        from sched_harness import Harness as harness

    made = []

    def _make(**kw):
        if extra is not None:
            kw["extra"] = {**extra, **kw.pop("extra", {})}
        h = harness(cfg_dir, **kw)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.close()


@pytest.fixture(scope="session")
def tiny_object_bytes(tiny_model: str) -> int:
    """Bytes of one pool object (one block of all layers) for the tiny model on CPU."""
    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    block_size = 128  # vLLM CPU default
    bf16 = 2
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * block_size * 2 * head * bf16


@pytest.fixture(scope="session")
def pool_bin() -> Path:
    p = Path(os.environ.get("UMBP_POOL_BIN") or REPO / "target" / "release" / "umbp-pool")
    require(p.is_file() and os.access(p, os.X_OK),
            f"umbp-pool binary not found at {p} (cargo build --release, or set UMBP_POOL_BIN)")
    return p


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir (unix socket paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="umbp-t-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# umbp-pool processes
# ---------------------------------------------------------------------------------------


def _connectable(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.5)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


class PoolProc:
    """One `umbp-pool` process on a given socket, configured through its environment."""

    def __init__(self, binary: Path, socket_path: Path, capacity: str, log: Path):
        self.binary, self.socket_path, self.capacity, self.log = binary, socket_path, capacity, log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> "PoolProc":
        env = dict(os.environ)
        env.update(UMBP_STANDALONE_ADDRESS=str(self.socket_path), UMBP_DRAM_CAPACITY=self.capacity)
        env.setdefault("RUST_LOG", "info")
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen([str(self.binary)], env=env, stdout=logf,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"umbp-pool exited with {self.proc.returncode}:\n{self.tail()}")
            if self.socket_path.exists() and _connectable(self.socket_path):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"umbp-pool not listening on {self.socket_path}:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL (a crash, not a clean shutdown) and wait for it."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.resume()  # a stopped process does not handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def pause(self) -> None:
        """SIGSTOP: a stalled pool (alive, socket open, answering nothing)."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> "PoolProc":
        self.kill()
        return self.start()

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def report(self) -> dict:
        """The pool's state report (`ringtool dump --json`, built next to umbp-pool)."""
        ringtool = self.binary.parent / "ringtool"
        require(ringtool.is_file(), f"ringtool not found next to {self.binary}")
        out = subprocess.run([str(ringtool), "dump", "--json", "--socket", str(self.socket_path)],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return json.loads(out)


@pytest.fixture
def pool_factory(pool_bin: Path, short_tmp: Path) -> Iterator[Any]:
    pools: list[PoolProc] = []

    def make(name: str = "pool", capacity: str = "256MiB", start: bool = True) -> PoolProc:
        p = PoolProc(pool_bin, short_tmp / f"{name}.sock", capacity, short_tmp / f"{name}.log")
        pools.append(p)
        return p.start() if start else p

    yield make
    for p in pools:
        p.stop()


# ---------------------------------------------------------------------------------------
# Engines (engine_driver.py subprocesses)
# ---------------------------------------------------------------------------------------


class Engine:
    """A vLLM engine in its own process, driven through stdin; records come back as JSON."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]):
        self.log = log
        self._records: queue.Queue = queue.Queue()
        self._logf = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(TESTS_DIR / "engine_driver.py"), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, env=env, cwd=str(REPO),
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._logf.write(line)
            self._logf.flush()
            if line.startswith(MARK):
                self._records.put(json.loads(line[len(MARK):]))
        self._records.put(None)  # EOF

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def next_record(self, timeout: float) -> dict:
        try:
            rec = self._records.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"engine gave no answer in {timeout}s; log tail:\n{self.tail()}")
        if rec is None:
            raise AssertionError(f"engine exited ({self.proc.poll()}); log tail:\n{self.tail()}")
        return rec

    def wait_ready(self, timeout: float = 180) -> dict:
        rec = self.next_record(timeout)
        assert rec.get("event") == "ready", f"engine failed to start: {rec}\n{self.tail()}"
        return rec

    def cmd(self, line: str, timeout: float = 120) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        rec = self.next_record(timeout)
        assert rec.get("event") != "error", f"engine error on {line!r}: {rec}\n{self.tail()}"
        return rec

    def run(self, tag: str = "") -> dict:
        return self.cmd(f"run {tag}".strip())

    def reset(self) -> None:
        rec = self.cmd("reset")
        assert rec["ok"], f"reset_prefix_cache kept failing: {rec}"

    def close(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        self._logf.close()
        return self.proc.returncode


def start_engine(model: str, logdir: Path, *args: str, name: str = "engine",
                 env: dict[str, str] | None = None, wait: bool = True) -> Engine:
    """Start `engine_driver.py --model MODEL ARGS...` (one-process vLLM) in its own process."""
    e = dict(os.environ)
    e.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    path = [str(TESTS_DIR)] + ([str(PY_DIR)] if _ADD_PY_DIR else [])
    if e.get("PYTHONPATH"):
        path.append(e["PYTHONPATH"])
    e["PYTHONPATH"] = os.pathsep.join(path)
    e.update(env or {})
    eng = Engine(["--model", model, *args], logdir / f"{name}.log", e)
    if wait:
        eng.wait_ready()
    return eng


@pytest.fixture
def engine_factory(tiny_model: str, short_tmp: Path) -> Iterator[Any]:
    engines: list[Engine] = []

    def make(*args: str, name: str = "engine", env: dict[str, str] | None = None,
             wait: bool = True) -> Engine:
        eng = start_engine(tiny_model, short_tmp, *args, name=name, env=env, wait=False)
        engines.append(eng)
        if wait:
            eng.wait_ready()
        return eng

    yield make
    for eng in engines:
        eng.close()


@pytest.fixture(scope="session")
def reference_tokens(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """Output of plain vLLM (no connector) for the driver's test prompt."""
    eng = start_engine(tiny_model, tmp_path_factory.mktemp("reference"), "--no-connector",
                       name="reference")
    try:
        rec = eng.run("reference")
    finally:
        eng.close()
    assert rec["num_cached_tokens"] == 0
    return rec["tokens"]
