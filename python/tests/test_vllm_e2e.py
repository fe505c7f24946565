"""End-to-end: real vLLM CPU engines (tiny Qwen2) with UMBPStoreConnector.

Each engine runs in its own process (`engine_driver.py`); standalone tests start real
`umbp-pool` processes. The prompt is 300 tokens = 2 full 128-token blocks + a partial one, so
a full restore means `num_cached_tokens == 256` after vLLM's own prefix cache was reset.

Identical tokens alone do not prove the restored KV was used, so one test stores corrupted
KV under the prompt's keys in a fresh pool first (first writer wins) and checks the output
changes.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from engine_driver import PROMPT_LEN, block_hashes, prompt_token_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BLOCK = 128
FULL_BLOCK_TOKENS = (PROMPT_LEN // BLOCK) * BLOCK  # 256
NAMESPACE = "umbp-e2e-tests"  # key_namespace, so the test process can compute keys


def prompt_keys(native: Any) -> list[bytes]:
    ns = native.namespace_digest(NAMESPACE)
    return [native.object_key(ns, 0, 0, h) for h in block_hashes(prompt_token_ids())]


class TestWorker:
    """The test process attached to a pool as a worker with its own host buffer."""

    __test__ = False  # not a test class

    def __init__(self, native: Any, endpoint: str, object_bytes: int, nblocks: int):
        import torch

        self.n = native
        self.w = native.Worker(endpoint, native.namespace_digest(NAMESPACE), tp_rank=0, tp_size=1)
        self.buf = torch.zeros(nblocks * object_bytes, dtype=torch.uint8)
        aid = self.w.register_host_memory(self.buf.data_ptr(), self.buf.numel())
        # One segment of whole objects: the pool treats an object as opaque bytes, so this
        # layout reads/writes the same object as the engine's two per-layer pages.
        got = self.w.register_layout(0, [(aid, 0, object_bytes, object_bytes, nblocks)])
        assert int(got) == object_bytes
        self.object_bytes = object_bytes

    def load(self, keys: list[bytes]) -> list[int]:
        res = self.w.wait(self.w.load(0, keys, list(range(len(keys)))), 10_000)
        assert res is not None, "load timed out"
        return list(res)

    def store(self, keys: list[bytes]) -> list[int]:
        res = self.w.wait(self.w.store(0, keys, list(range(len(keys)))), 10_000)
        assert res is not None, "store timed out"
        return list(res)

    def block(self, i: int):
        return self.buf[i * self.object_bytes : (i + 1) * self.object_bytes]

    def close(self) -> None:
        self.w.close()


# ---------------------------------------------------------------------------------------
# Embedded mode
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("load_async", [1, 0], ids=["async-load", "sync-load"])
def test_embedded_restore_after_reset(native, engine_factory, reference_tokens, load_async):
    eng = engine_factory("--mode", "embedded", "--load-async", str(load_async), name="emb")
    cold = eng.run("cold")
    assert cold["num_cached_tokens"] == 0
    assert cold["tokens"] == reference_tokens, "the connector changed a cold run's output"
    eng.reset()  # only the pool can supply the prefix now
    warm = eng.run("warm")
    assert warm["num_cached_tokens"] == FULL_BLOCK_TOKENS
    assert warm["tokens"] == reference_tokens
    m = eng.cmd("metrics")["metrics"]
    assert m.get("vllm:external_prefix_cache_hits", 0) >= FULL_BLOCK_TOKENS
    assert eng.close() == 0


def test_embedded_engine_publishes_the_connectors_kv_events(native, engine_factory, short_tmp):
    """Issue #33 item 5 on a real engine: vLLM's own zmq publisher carries the connector's
    events. After a prompt, its full blocks are announced `BlockStored` with medium CPU (the
    pool's DRAM; vLLM's own cache announces them with GPU), once each, with their tokens;
    after a reset that drops the engine's objects from the pool, `BlockRemoved` with medium
    CPU for each."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    endpoint = f"ipc://{short_tmp}/kv-events"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)  # zmq connects to an ipc endpoint bound later
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list = []

    def collect(until, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            if sub.poll(100):
                _topic, _seq, payload = sub.recv_multipart()
                events.extend(decoder.decode(payload).events)

    def ours(kind: str) -> list:
        return [e for e in events if type(e).__name__ == kind and getattr(e, "medium", None) == "CPU"]

    try:
        eng = engine_factory("--mode", "embedded", "--kv-events", endpoint, name="events")
        want = [maybe_convert_block_hash(bytes.fromhex(h)) for h in eng.cmd("hashes")["hashes"]]
        want = want[: FULL_BLOCK_TOKENS // BLOCK]
        tokens = prompt_token_ids()
        eng.run("cold")
        eng.run("again")  # one-process engine: the stores' confirmations ride on later steps
        collect(lambda: len(ours("BlockStored")) >= len(want))
        stored = ours("BlockStored")
        assert [e.block_hashes for e in stored] == [[h] for h in want], (stored, want)
        for i, e in enumerate(stored):
            assert e.token_ids == tokens[i * BLOCK : (i + 1) * BLOCK] and e.block_size == BLOCK
            assert e.parent_block_hash == (want[i - 1] if i else None)
        assert any(getattr(e, "medium", None) == "GPU" for e in events), "vLLM's own cache events"
        eng.cmd("reset_all")
        eng.run("after-reset")
        collect(lambda: len(ours("BlockRemoved")) >= len(want))
        removed = ours("BlockRemoved")
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(want), removed
        assert eng.close() == 0
    finally:
        sub.close(0)
        ctx.term()


# ---------------------------------------------------------------------------------------
# Standalone mode (umbp-pool processes)
# ---------------------------------------------------------------------------------------


def standalone_args(pool: Any, **kw: str) -> list[str]:
    args = ["--mode", "standalone", "--endpoint", str(pool.socket_path), "--key-namespace", NAMESPACE]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", v]
    return args


def test_standalone_second_engine_restores(native, pool_factory, engine_factory, reference_tokens):
    pool = pool_factory()
    a = engine_factory(*standalone_args(pool), name="A")
    ra = a.run("A")
    assert ra["tokens"] == reference_tokens
    assert a.close() == 0  # engine A is gone; its KV stays in the pool

    b = engine_factory(*standalone_args(pool), name="B")
    rb = b.run("B")
    assert rb["num_cached_tokens"] == FULL_BLOCK_TOKENS
    assert rb["tokens"] == reference_tokens
    assert b.close() == 0


def test_standalone_corrupted_kv_changes_output(
    native, pool_factory, engine_factory, reference_tokens, tiny_object_bytes
):
    import torch

    keys = prompt_keys(native)
    assert len(keys) == PROMPT_LEN // BLOCK

    # 1. Engine A fills pool 1 with the prompt's real KV.
    pool1 = pool_factory("pool1")
    a = engine_factory(*standalone_args(pool1), name="A")
    assert a.run("A")["tokens"] == reference_tokens
    assert a.close() == 0

    # 2. The test reads those objects back: they exist and are not zero.
    tw = TestWorker(native, str(pool1.socket_path), tiny_object_bytes, len(keys))
    assert tw.load(keys) == [native.STATUS_LOADED] * len(keys)
    for i in range(len(keys)):
        assert tw.block(i).any(), f"stored block {i} is all zeros"
    # 3. Corrupt them (negate K and V, add noise).
    gen = torch.Generator().manual_seed(0)
    vals = tw.buf.view(torch.bfloat16)
    noise = torch.randn(vals.shape, generator=gen, dtype=torch.float32)
    vals.copy_((-vals.float() + noise).to(torch.bfloat16))
    tw.close()
    pool1.stop()

    # 4. A fresh pool gets the corrupted objects first (first writer wins).
    pool2 = pool_factory("pool2")
    tw2 = TestWorker(native, str(pool2.socket_path), tiny_object_bytes, len(keys))
    tw2.buf.copy_(tw.buf)
    assert tw2.store(keys) == [native.STATUS_STORED] * len(keys)
    tw2.close()

    # 5. Engine B restores the corrupted KV: the prefix is "hit", and the output changes.
    b = engine_factory(*standalone_args(pool2), name="B")
    rb = b.run("B")
    assert rb["num_cached_tokens"] == FULL_BLOCK_TOKENS
    assert rb["tokens"] != reference_tokens, "corrupted KV did not change the output"
    assert b.close() == 0


def test_standalone_pool_killed_then_restarted(native, pool_factory, engine_factory, reference_tokens):
    pool = pool_factory()
    a = engine_factory(*standalone_args(pool), name="A")
    assert a.run("A")["tokens"] == reference_tokens
    assert a.close() == 0

    b = engine_factory(*standalone_args(pool), name="B")
    pool.kill()  # pool dies while engine B runs
    rb = b.run("after-kill")
    assert rb["tokens"] == reference_tokens, "pool death changed the output"
    assert rb["num_cached_tokens"] == 0, "nothing can be restored from a dead pool"

    pool.start()  # same socket, empty pool: B must re-attach by itself
    # ... while idle (issue #33 item 8): before its next request, so that request's stores
    # land in the new pool instead of failing on the dead attachment.
    t0 = time.monotonic()
    while not any(a["role"] == "worker" for a in pool.report()["attachments"]):
        assert time.monotonic() - t0 < 10, "idle engine B did not re-attach to the restarted pool within 10 s"
        time.sleep(0.1)
    reattach_s = time.monotonic() - t0
    assert reattach_s < 3.0, f"idle engine B re-attached only after {reattach_s:.1f} s"
    deadline = time.monotonic() + 60
    hits = 0
    while time.monotonic() < deadline:
        b.reset()
        r = b.run("after-restart")
        assert r["tokens"] == reference_tokens
        hits = r["num_cached_tokens"]
        if hits == FULL_BLOCK_TOKENS:
            break
        time.sleep(1.0)  # first runs re-store into the new pool once re-attached
    assert hits == FULL_BLOCK_TOKENS, "engine did not re-attach to the restarted pool"
    assert b.close() == 0


def _published(pool: Any, want: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        n = pool.report()["pool"]["published_objects"]
        if n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


def test_standalone_reset_cache_empties_the_pool(native, pool_factory, engine_factory, reference_tokens):
    """vLLM's reset_prefix_cache(reset_connector=True) drops the engine's objects from the
    pool, so nothing stale survives a weight update, not even for the next engine."""
    pool = pool_factory()
    a = engine_factory(*standalone_args(pool), name="A")
    assert a.run("A")["tokens"] == reference_tokens
    assert _published(pool, 2) == 2
    rec = a.cmd("reset_all")
    assert rec["ok"], rec
    assert _published(pool, 0) == 0, "the pool still holds the engine's objects"
    ra = a.run("A-after-reset")
    assert ra["num_cached_tokens"] == 0 and ra["tokens"] == reference_tokens
    assert a.close() == 0

    b = engine_factory(*standalone_args(pool), name="B")
    rb = b.run("B")
    assert rb["num_cached_tokens"] == 0, "a new engine found objects that were reset"
    assert rb["tokens"] == reference_tokens
    assert b.close() == 0


def test_standalone_unreachable_pool_fails_startup(native, engine_factory, short_tmp):
    missing = short_tmp / "nobody-listens.sock"
    eng = engine_factory("--mode", "standalone", "--endpoint", str(missing), name="nopool", wait=False)
    rec = eng.next_record(timeout=240)
    assert rec.get("event") == "error" and rec.get("phase") == "startup", rec
    assert str(missing) in rec["error"] + rec.get("traceback", ""), rec
    assert eng.close() == 1
