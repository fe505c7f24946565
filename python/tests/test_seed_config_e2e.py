"""The seed guide's configurations verbatim on real vLLM CPU engines (issue #33 items 1-3):
`"kv_connector": "UMBPStoreConnector"` with no `kv_connector_module_path` (vLLM finds
the connector through the umbp wheel's `vllm.general_plugins` entry point), a standalone
`umbp-pool` started with `UMBP_STANDALONE_ADDRESS=unix:///...` and the engine given the
same `unix://` endpoint, and embedded mode with `lookup_instance`.

Each engine runs the test prompt, forgets its own prefix cache, and runs it again: the
full blocks (256 tokens) must come back from the pool with the reference output.
Needs the installed wheel (its entry point): CI installs it (scripts/test.sh)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import _connectable, require
from engine_driver import PROMPT_LEN

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

FULL_BLOCK_TOKENS = (PROMPT_LEN // 128) * 128  # 256


@pytest.fixture(scope="module", autouse=True)
def plugin_installed() -> None:
    eps = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    require(eps.get("umbp") == "umbp._vllm_plugin:register",
            "the umbp wheel (with its vllm.general_plugins entry point) is not installed "
            "(scripts/build-wheel.sh --install)")


def restores(eng, reference_tokens) -> None:
    cold = eng.run("cold")
    assert cold["num_cached_tokens"] == 0 and cold["tokens"] == reference_tokens
    eng.reset()  # only the pool can supply the prefix now
    warm = eng.run("warm")
    assert warm["num_cached_tokens"] == FULL_BLOCK_TOKENS, warm
    assert warm["tokens"] == reference_tokens
    assert eng.close() == 0


def test_standalone_seed_config(pool_bin, short_tmp, engine_factory, reference_tokens):
    sock = short_tmp / "node.sock"
    log = short_tmp / "pool.log"
    env = dict(os.environ, UMBP_STANDALONE_ADDRESS=f"unix://{sock}", UMBP_DRAM_CAPACITY="256MiB")
    with open(log, "wb") as f:
        pool = subprocess.Popen([str(pool_bin)], env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(short_tmp))
    try:
        deadline = time.monotonic() + 20
        while not (sock.exists() and _connectable(sock)):
            assert pool.poll() is None, f"umbp-pool exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"umbp-pool not listening at {sock}:\n{log.read_text()[-3000:]}"
            time.sleep(0.05)
        eng = engine_factory("--no-module-path", "--mode", "standalone", "--endpoint", f"unix://{sock}",
                             name="seed-standalone")
        restores(eng, reference_tokens)
    finally:
        pool.kill()
        pool.wait()


def test_embedded_seed_config_with_lookup_instance(short_tmp, engine_factory, reference_tokens):
    from umbp.vllm.endpoints import embedded_socket_path

    lookup_dir = short_tmp / "lk"
    extra = '{"lookup_instance": "seed-engine-a", "lookup_dir": "%s"}' % lookup_dir
    eng = engine_factory("--no-module-path", "--mode", "embedded", "--engine-id", "seed-e2e",
                         "--extra", extra, name="seed-embedded")
    # The worker's pool listens where the instance puts it (the scheduler found it there).
    want = embedded_socket_path("/unused.sock", "seed-e2e", 0, 0, lookup_dir=str(lookup_dir),
                                instance="seed-engine-a")
    assert Path(want).exists(), sorted(p.name for p in lookup_dir.iterdir())
    restores(eng, reference_tokens)
