"""Issue #31 item 4: a synchronous load the pool has started, whose pool is then stopped
(SIGSTOP), must not hold the engine step past `timeout_ms` + a small margin; its blocks
are reported failed and quarantined until the pool completes the load or dies
(docs/connection.md, "A started load that does not finish").

The connector's worker half (`WorkerSide`, its real wait/cancel/reap/get_finished code)
with the real binding against a real `umbp-pool` process, over 32 MiB blocks of host
memory in stages of at most 4 MiB, so that a load takes long enough to be stopped in the
middle. Whether the stop landed after the load's first stage is read from the pool's own
answer to `cancel` ("started"); a run where it never did is skipped, never passed.

Before the fix the wait looped without bound ("its blocks stay in use until the pool
finishes it or dies"): the step returned only after the pool was resumed.
"""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.timeout(120)

BLOCK = 32 << 20
BLOCKS = 6
TIMEOUT_MS = 300
MARGIN_S = 0.25


def _worker_side(native, w, recompute: bool):
    """A WorkerSide on the native worker `w`, without a vLLM engine around it."""
    from umbp.vllm.stats import UMBPConnectorStats
    from umbp.vllm.worker_side import WorkerSide

    ws = WorkerSide.__new__(WorkerSide)
    ws.c = SimpleNamespace(_stats=UMBPConnectorStats(), _recompute_failures=recompute, _events_enabled=False)
    ws.cfg = SimpleNamespace(timeout_ms=TIMEOUT_MS)
    ws.n = native
    ws.w = w
    ws.object_bytes = BLOCK
    ws.group_object_bytes = {0: BLOCK}
    ws._registered = True
    ws._async_loads = {}
    ws.totals = {"stored_blocks": 0, "stored_bytes": 0, "loaded_blocks": 0}
    ws._jobs = {}
    ws._sync_loads = []
    ws._req_stores = {}
    ws._finishing = set()
    ws._store_done = {}
    ws._finished_recving = set()
    ws._load_errors = set()
    ws._quarantined = {}
    ws._stored_hashes = {}
    ws._ops_done = {}
    return ws


@pytest.fixture
def setup(native, pool_factory, monkeypatch):
    # Stages of at most 4 MiB: a 32 MiB object is copied in several of them.
    monkeypatch.setenv("UMBP_COPY_STAGE_SIZE", "4MiB")
    monkeypatch.setenv("UMBP_COPY_THREADS", "1")
    pool = pool_factory(capacity="512MiB")
    buf = ctypes.create_string_buffer(BLOCK * BLOCKS)
    for i in range(BLOCKS):  # block i holds byte i + 1: a wrong or missing byte shows
        ctypes.memset(ctypes.addressof(buf) + i * BLOCK, i + 1, BLOCK)
    w = native.Worker(str(pool.socket_path), native.namespace_digest("bound"), timeout_ms=TIMEOUT_MS)
    alloc = w.register_host_memory(ctypes.addressof(buf), BLOCK * BLOCKS)
    w.register_layout(0, [(alloc, 0, BLOCK, BLOCK, BLOCKS)])
    keys = [bytes([i + 1]) * 16 for i in range(BLOCKS)]
    tid = w.store(0, keys, list(range(BLOCKS)))
    assert w.wait(tid, 20_000) is not None
    yield pool, w, keys, buf
    pool.resume()
    w.close()


def _timed_with_rescue(call, pool, rescue_after_s: float) -> float:
    """Seconds `call()` took; the stopped `pool` is resumed after `rescue_after_s` so that
    a call that waits for it (the behaviour a test rules out) ends instead of hanging."""
    rescue = threading.Timer(rescue_after_s, pool.resume)
    rescue.start()
    t0 = time.monotonic()
    try:
        call()
    finally:
        took = time.monotonic() - t0
        rescue.cancel()
    return took


def _stopped_mid_load(pool, w, keys, delays):
    """Submits a load of every block and stops the pool `delay` after it; returns the
    transfer id once the pool had started the load when it stopped (cancel says
    "started"), else None for every delay tried. The load is not cancelled by the probe:
    `cancel` of a started load only abandons its later stages."""
    for delay in delays:
        tid = w.load(0, keys, list(range(BLOCKS)))
        end = time.perf_counter() + delay
        while time.perf_counter() < end:
            pass
        pool.pause()
        time.sleep(0.02)  # the stop takes effect
        if w.wait(tid, 0) is None and w.cancel(tid) == "started":
            return tid
        pool.resume()
        w.wait(tid, 20_000)
    return None


def test_a_started_sync_load_of_a_stopped_pool_returns_within_timeout_and_is_quarantined(native, setup):
    pool, w, keys, _buf = setup
    ws = _worker_side(native, w, recompute=False)
    tid = _stopped_mid_load(pool, w, keys, [0.002, 0.005, 0.001, 0.01, 0.0005, 0.02])
    if tid is None:
        pytest.skip("the pool was never stopped in the middle of a load: nothing was tested")
    from umbp.vllm.worker_side import Job

    job = Job("load", "req-a", [b""] * BLOCKS, list(range(100, 100 + BLOCKS)), time.perf_counter_ns(), sync=True)
    ws._jobs[tid] = job
    ws._sync_loads.append(tid)
    # A step that waits for the pool (the old behaviour) ends when it resumes, not never.
    took = _timed_with_rescue(ws.wait_for_sync_loads, pool, 5.0)
    assert took < TIMEOUT_MS / 1000 + MARGIN_S, f"the step waited {took:.3f} s on a stopped pool"
    # Reported failed (vLLM fails the request) and held: not given back.
    assert ws.take_load_errors() == set(job.block_ids)
    assert tid in ws._quarantined
    assert ws.c._stats.data["quarantined_loads"] == 1
    # The scheduler delayed the failed request's free; the worker does not release it
    # while the stopped pool may still write its blocks.
    ws._finishing.add("req-a")
    sending, _ = ws.get_finished(set())
    assert not sending, "a quarantined load's blocks were released while its pool lives"
    pool.resume()
    deadline = time.monotonic() + 20
    released = None
    while time.monotonic() < deadline and not released:
        released, _ = ws.get_finished(set())
        time.sleep(0.01)
    assert released == {"req-a"}, "the quarantine never ended after the pool completed the load"
    assert not ws._quarantined


def test_under_recompute_a_started_sync_load_is_waited_for(native, setup):
    """With kv_load_failure_policy "recompute" vLLM would recompute into the same blocks:
    a synchronous load there (which the connector never plans: it loads asynchronously
    under "recompute") is waited for until it completes, never handed back early."""
    pool, w, keys, _buf = setup
    ws = _worker_side(native, w, recompute=True)
    tid = _stopped_mid_load(pool, w, keys, [0.002, 0.005, 0.001, 0.01, 0.0005, 0.02])
    if tid is None:
        pytest.skip("the pool was never stopped in the middle of a load: nothing was tested")
    from umbp.vllm.worker_side import Job

    ws._jobs[tid] = Job("load", "req-b", [b""] * BLOCKS, list(range(BLOCKS)), time.perf_counter_ns(), sync=True)
    ws._sync_loads.append(tid)
    resumer = threading.Timer(1.0, pool.resume)
    resumer.start()
    t0 = time.monotonic()
    try:
        ws.wait_for_sync_loads()
    finally:
        resumer.cancel()
    assert time.monotonic() - t0 >= 0.9, "returned before the started load completed"
    assert not ws._quarantined


def test_under_recompute_a_started_async_load_holds_only_its_request(native, setup):
    """Issue #31 item 4 under "recompute": the connector loads asynchronously there
    (test_connector_contract: load_async=false is ignored), so a load the pool started and
    then stalled on holds its own request, never the step: each step's get_finished
    returns at once, the request is not reported received (its blocks stay the pool's) and
    no error is reported (vLLM would recompute into those blocks). Once the pool resumes,
    the request is received with exactly the stored bytes."""
    pool, w, keys, buf = setup
    ws = _worker_side(native, w, recompute=True)
    ctypes.memset(ctypes.addressof(buf), 0xEE, BLOCK * BLOCKS)  # stale KV in the blocks
    tid = _stopped_mid_load(pool, w, keys, [0.002, 0.005, 0.001, 0.01, 0.0005, 0.02])
    if tid is None:
        pytest.skip("the pool was never stopped in the middle of a load: nothing was tested")
    from umbp.vllm.worker_side import Job

    # Submitted more than timeout_ms ago: overdue at the first step.
    old = time.perf_counter_ns() - 2 * TIMEOUT_MS * 1_000_000
    ws._jobs[tid] = Job("load", "req-c", [b""] * BLOCKS, list(range(BLOCKS)), old, sync=False)
    ws._async_loads["req-c"] = 1
    try:
        for _ in range(5):
            t0 = time.monotonic()
            ws.wait_for_sync_loads()
            sending, recving = ws.get_finished(set())
            took = time.monotonic() - t0
            assert took < MARGIN_S, f"a step waited {took:.3f} s on a stopped pool"
            assert not recving, "reported received while the stopped pool may still write its blocks"
            assert not ws.take_load_errors(), "an error would make vLLM recompute into blocks the pool writes"
            time.sleep(TIMEOUT_MS / 1000 / 2)
    finally:
        pool.resume()
    deadline = time.monotonic() + 20
    received = None
    while time.monotonic() < deadline and not received:
        _, received = ws.get_finished(set())
        time.sleep(0.01)
    assert received == {"req-c"}, "the request was never received after the pool resumed"
    assert not ws.take_load_errors()
    for i in range(BLOCKS):
        got = ctypes.string_at(ctypes.addressof(buf) + i * BLOCK, BLOCK)
        assert got == bytes([i + 1]) * BLOCK, f"block {i} does not hold its stored bytes"


# -- the scheduler half: a request failed by a load error keeps its blocks until the -----
# -- workers say its loads are over (a real vLLM Scheduler, sched_harness.py) -------------


@pytest.fixture
def make(cfg_dir, native):
    from conftest import harness_factory

    yield from harness_factory(cfg_dir, {"capacity_bytes": "16MiB", "key_namespace": "bound"})


def test_a_request_failed_by_a_load_error_is_freed_only_after_the_workers_report_it(make, native):
    """With kv_load_failure_policy "fail", vLLM fails a request whose load failed and frees
    its blocks at once; a started load of a stopped pool may still write them. The
    connector delays that free until every worker reports the request's loads over.
    Before: request_finished returned (False, None) and the blocks went back at once."""
    from sched_harness import tokens

    h = make(failure_policy="fail", extra={"load_async": False})
    h.store_and_forget("a", tokens(4, 300))
    free0 = h.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    h.add("b", tokens(4, 300), max_tokens=2)

    def drop_objects(so):
        # Between the lookup and the load: the index said "hit", the objects are gone.
        w = native.Worker(h.worker._worker.endpoint, native.namespace_digest("bound"))
        assert w.reset_namespace() == 2
        w.close()

    h.step(before_worker=drop_objects)
    assert h.finished_returns["b"] == (True, None), "the failed request's blocks were freed at once"
    assert "b" in h.sched.requests
    h.step_until(lambda: "b" not in h.sched.requests)
    assert h.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0


def test_shutdown_under_a_stopped_pool_returns_within_timeout(native, setup):
    """Issue #33 item 10: an engine shut down while its pool is stopped, with a store in
    flight and a load the pool had started, returns within `timeout_ms` + 1 s (the seed's
    promise), never hangs. Before, the store wait took `timeout_ms` and then the worker's
    drop waited another `timeout_ms` for the started load: 2 x 1.5 s here."""
    pool, _w, keys, _buf = setup
    timeout_ms = 1500
    buf = ctypes.create_string_buffer(BLOCK * (BLOCKS + 1))
    w = native.Worker(str(pool.socket_path), native.namespace_digest("bound"), timeout_ms=timeout_ms)
    alloc = w.register_host_memory(ctypes.addressof(buf), BLOCK * (BLOCKS + 1))
    w.register_layout(0, [(alloc, 0, BLOCK, BLOCK, BLOCKS + 1)])
    ws = _worker_side(native, w, recompute=False)
    ws.cfg = SimpleNamespace(timeout_ms=timeout_ms)
    tid = _stopped_mid_load(pool, w, keys, [0.002, 0.005, 0.001, 0.01, 0.0005, 0.02])
    if tid is None:
        w.close()
        pytest.skip("the pool was never stopped in the middle of a load: nothing was tested")
    from umbp.vllm.worker_side import Job

    sid = w.store(0, [b"\xee" * 16], [BLOCKS])
    ws._jobs[sid] = Job("store", "req-s", [b""], [BLOCKS], time.perf_counter_ns())
    ws._req_stores["req-s"] = {sid}
    try:
        took = _timed_with_rescue(ws.shutdown, pool, 10.0)
    finally:
        pool.resume()
        time.sleep(0.5)  # the resumed pool may still finish the load into `buf`: keep it
    assert took < timeout_ms / 1000 + 1.0, f"shutdown took {took:.2f} s under a stopped pool (timeout_ms {timeout_ms})"
