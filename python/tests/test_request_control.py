"""Per-request control and the prefill/decode handoff (issue #38), at the contract level:
vLLM's real `Scheduler` and worker-side calls (sched_harness.py) with the real binding and
real pools. Each request's `kv_transfer_params` go in as vLLM puts them (through
`SamplingParams.extra_args`), the outcome is counted from the pool's own report.

P/D: two engines (a `kv_producer` prefill engine and a `kv_consumer` decode engine) on one
standalone pool; the handoff the prefill engine returns from `request_finished` is given to
the decode engine's request as a proxy would.
"""

from __future__ import annotations

import time

import pytest

from conftest import harness_factory

pytestmark = pytest.mark.timeout(300)

BLOCK = 128


def T(seed, n=300):
    from sched_harness import tokens

    return tokens(seed, n)


@pytest.fixture
def make(cfg_dir, native):
    yield from harness_factory(cfg_dir, {"capacity_bytes": "16MiB", "key_namespace": "reqctl"})


@pytest.fixture
def make_standalone(cfg_dir, native):
    yield from harness_factory(cfg_dir, {"mode": "standalone", "key_namespace": "reqctl"})


def objects(h) -> int:
    return h.pool_report()["pool"]["objects"]


# -- per-request control ------------------------------------------------------------------


@pytest.mark.parametrize("key", ["umbp.skip_save", "lmcache.skip_save"])
def test_skip_save_stores_nothing_of_that_request(make, key):
    h = make()
    h.add("skip", T(1), kv_params={key: True})
    h.run()
    assert objects(h) == 0
    h.add("keep", T(2))
    h.run()
    assert objects(h) == 2
    # The skipped prompt is a miss later, the kept one a hit.
    h.reset_local_cache()
    assert h.conn.get_num_new_matched_tokens(h.request("a", T(1)), 0) == (0, False)
    assert h.conn.get_num_new_matched_tokens(h.request("b", T(2)), 0) == (2 * BLOCK, True)


def test_max_store_tokens_stores_only_the_leading_blocks(make):
    h = make()
    h.add("a", T(3), kv_params={"umbp.max_store_tokens": 200})  # one whole block
    h.run()
    assert objects(h) == 1
    h.reset_local_cache()
    assert h.conn.get_num_new_matched_tokens(h.request("b", T(3)), 0) == (BLOCK, True)


def test_max_load_tokens_caps_the_restore(make):
    h = make()
    h.add("a", T(4))
    h.run()
    h.reset_local_cache()
    b = h.request("b", T(4), kv_params={"umbp.max_load_tokens": 130})
    assert h.conn.get_num_new_matched_tokens(b, 0) == (BLOCK, True)
    h.sched.add_request(b)
    h.run()
    assert h.external_tokens("b") == BLOCK
    c = h.request("c", T(4), kv_params={"umbp.max_load_tokens": 0})
    assert h.conn.get_num_new_matched_tokens(c, 0) == (0, False)


def test_bad_values_are_ignored_and_name_the_key(make, caplog):
    h = make()
    with caplog.at_level("WARNING"):
        h.add("a", T(5), kv_params={"umbp.max_store_tokens": "lots", "umbp.skip_save": "perhaps"})
        h.run()
    assert objects(h) == 2  # both ignored: stored as without them
    text = caplog.text
    assert "umbp.max_store_tokens" in text and "'lots'" in text
    assert "umbp.skip_save" in text and "'perhaps'" in text


# -- prefill/decode through the pool --------------------------------------------------------


@pytest.fixture
def pd(make_standalone, pool_factory):
    pool = pool_factory("pd")
    ep = {"endpoint": str(pool.socket_path)}
    prefill = make_standalone(kv_role="kv_producer", extra=ep)
    decode = make_standalone(kv_role="kv_consumer", extra=ep)
    return pool, prefill, decode


def _prefill(prefill, rid, tokens):
    prefill.add(rid, tokens, kv_params={"do_remote_decode": True})
    prefill.run()
    _, params = prefill.finished_returns[rid]
    return params


def test_decode_engine_restores_what_the_prefill_engine_handed_off(pd):
    pool, prefill, decode = pd
    params = _prefill(prefill, "p", T(6))
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    handoff = params["umbp.handoff"]
    assert handoff["blocks"] == 2 and handoff["namespace"] == prefill.conn._sched.namespace.hex()
    assert pool.report()["pool"]["objects"] == 2
    # The decode engine: the prompt plus the handoff, as the proxy sends it.
    decode.add("d", T(6), max_tokens=3, kv_params=params)
    decode.run()
    assert decode.external_tokens("d") == 2 * BLOCK  # no prefill of the handed-off prefix
    assert len(decode.outputs["d"]) >= 1 and "d" not in decode.sched.requests  # decoded, finished
    stats = decode.connector_stats()
    assert stats["pd_handoffs_received"] == 1 and stats["pd_handoff_timeouts"] == 0
    assert prefill.connector_stats()["pd_handoffs_sent"] == 1
    # A decode engine stores nothing (kv_consumer): still 2 objects.
    assert pool.report()["pool"]["objects"] == 2


def test_decode_waits_for_blocks_still_arriving_without_blocking_the_scheduler(pd):
    pool, prefill, decode = pd
    params = _prefill(prefill, "p", T(7))
    # The same handoff for a prompt whose blocks are not in the pool yet (the prefill
    # engine's stores still in flight): the lookup defers the request (None), the
    # scheduler goes on with other requests, and the hit comes once they arrive.
    late = T(8)
    r = decode.request("d", late, kv_params=params)
    assert decode.conn.get_num_new_matched_tokens(r, 0) == (None, False)
    decode.sched.add_request(r)
    other = decode.add("other", T(9))
    for _ in range(3):
        decode.step()
    assert "other" in decode.outputs, "the scheduler went on with another request"
    assert decode.sched.requests["d"].num_computed_tokens == 0  # still waiting
    # The prefill engine stores the late prompt now; the waiting request then hits.
    prefill.add("p2", late)
    prefill.run()
    decode.run()
    assert decode.external_tokens("d") == 2 * BLOCK
    stats = decode.connector_stats()
    assert stats["pd_handoff_waits"] >= 3 and stats["pd_handoffs_received"] == 1
    del other


def test_a_handoff_whose_blocks_never_come_is_recomputed_after_its_bound(pd):
    pool, prefill, decode = pd
    params = _prefill(prefill, "p", T(10))
    params["umbp.handoff"]["wait_ms"] = 200
    r = decode.add("d", T(11), kv_params=params)  # blocks that will never be stored
    t0 = time.monotonic()
    decode.run(timeout=10)
    took = time.monotonic() - t0
    assert decode.external_tokens("d") == 0  # recomputed
    assert 0.2 <= took < 5, took
    assert decode.connector_stats()["pd_handoff_timeouts"] == 1
    del r


def test_a_stopped_pool_turns_a_handoff_into_a_recompute_not_a_hang(pd):
    pool, prefill, decode = pd
    params = _prefill(prefill, "p", T(12))
    params["umbp.handoff"]["wait_ms"] = 300
    pool.pause()
    try:
        decode.add("d", T(12), kv_params=params)
        t0 = time.monotonic()
        decode.run(timeout=15)
        assert time.monotonic() - t0 < 10
    finally:
        pool.resume()
    assert decode.external_tokens("d") == 0


def test_a_handoff_from_another_namespace_is_a_plain_lookup(make_standalone, pool_factory):
    pool = pool_factory("pd-ns")
    ep = {"endpoint": str(pool.socket_path)}
    prefill = make_standalone(kv_role="kv_producer", extra=ep)
    other = make_standalone(kv_role="kv_consumer", extra={**ep, "key_namespace": "another-model"})
    params = _prefill(prefill, "p", T(13))
    r = other.request("d", T(13), kv_params=params)
    assert other.conn.get_num_new_matched_tokens(r, 0) == (0, False)  # no wait, no foreign KV
    assert other.conn._stats.data.get("pd_handoff_mismatches", 0) == 1
